"""The server's dispatcher (runtime/server/dispatch.py) and Engine.run_many's fall-backs, without HTTP.

The README claims: requests about one state that arrive within ``--batch-window-ms`` share one
packed pass (through the real dispatcher, with the real engine); a merged pass too large for the
engine's limits falls back to one pass per request; an engine fault reaches every request that
waits on it, as its own answer, never a hang.
"""

import asyncio
import threading
import time
from pathlib import Path

import pytest

from onepass import Choice, Noul, Score
from onepass.runtime.server.dispatch import Dispatcher
from fake_engine import FakeEngine

TICKET = (Path(__file__).parent / "data" / "ticket.txt").read_text()
QUESTIONS = [{"refund": Noul("Does the customer request a refund?")},
             {"team": Choice("Which team?", {"billing": None, "technical": None})},
             {"mood": Score("How frustrated?", ["Calm", "Frustrated", "Very angry"])},
             {"urgent": Noul("Is it urgent?")}]
PROB_TOL = 1e-4  # merged vs alone: packed == separate


def _probs(answer) -> dict:
    return getattr(answer, "probabilities", None) or {"yes": answer.noul}


def _submit_all(dispatcher: Dispatcher, requests: list, gap_s: float = 0.0) -> list:
    """Submit (state, questions) requests, prepared by the dispatcher's engine, from one event loop, ``gap_s``
    apart; their results in order."""
    async def main():
        futures = []
        for state, questions in requests:
            futures.append(dispatcher.submit(dispatcher.engine.prepare(state, questions), time.monotonic() + 120))
            if gap_s:
                await asyncio.sleep(gap_s)
        return await asyncio.wait_for(asyncio.gather(*futures), 120)
    return asyncio.run(main())


class _Spy:
    """Counts the engine's score passes (one packed forward each) and the groups the dispatcher hands it."""

    def __init__(self, engine, monkeypatch):
        self.passes, self.batches = 0, []
        real_score, real_group = engine.backend.score_all, engine.run_group

        def score_all(kv, batch):
            self.passes += 1
            return real_score(kv, batch)

        def run_group(prepared, readout=None, **options):
            self.batches.append(len(prepared))
            return real_group(prepared, readout, **options)

        monkeypatch.setattr(engine.backend, "score_all", score_all)
        monkeypatch.setattr(engine, "run_group", run_group)
        # one block as large as a pass may be, so that a merge that fits is ONE pass (how a merge is split into
        # blocks of whole questions when it is larger is tests/test_blocks.py's subject)
        monkeypatch.setattr(engine.backend, "block_tokens", None, raising=False)


@pytest.mark.parametrize("window_s, gap_s, batches", [(0.5, 0.0, [4]), (0.0, 0.3, [1, 1, 1, 1])],
                         ids=["in-window", "control-spaced"])
def test_requests_in_the_batch_window_share_one_pass(engine, monkeypatch, window_s, gap_s, batches):
    """Four requests about the ticket, submitted together within a 500 ms window: one run_many batch and ONE
    score pass, each answer equal to the request alone. Control: a 0 ms window and requests 300 ms apart give
    four batches and four passes."""
    engine.state(TICKET)  # prefilled and cached: only score passes are counted below
    alone = [engine.run(TICKET, q) for q in QUESTIONS]
    spy = _Spy(engine, monkeypatch)
    dispatcher = Dispatcher(engine, max_queue=64, window_s=window_s, max_batch=16)
    try:
        results = _submit_all(dispatcher, [(TICKET, q) for q in QUESTIONS], gap_s)
    finally:
        dispatcher.close()
    assert spy.batches == batches and spy.passes == len(batches)
    for want, got in zip(alone, results):
        for qid, a in want.answers.items():
            for k, p in _probs(a).items():
                assert abs(_probs(got.answers[qid])[k] - p) <= PROB_TOL, (qid, k)


def test_a_merge_is_bounded_by_the_pass_not_by_one_requests_limit(engine, monkeypatch):
    """Each request fits the request's packed-token limit alone, the four together do not: the limit is one
    request's, so run_many still joins their compiled passes side by side into ONE pass (they fit one pass of
    max_packed_tokens), each answer equal to the request alone. Control: with blocks smaller than their sum, the
    joined passes split (one per request here: each is larger than half the block)."""
    sizes = [engine.pack(engine.state(TICKET), engine.encode_questions(q)).num_tokens for q in QUESTIONS]
    small = engine.with_limits(max_request_tokens=max(sizes) + 1)
    assert sum(sizes) > max(sizes) + 1
    spy = _Spy(small, monkeypatch)
    results = small.run_many([(TICKET, q) for q in QUESTIONS])
    assert spy.passes == 1
    for q, got in zip(QUESTIONS, results):
        want = engine.run(TICKET, q)
        for qid, a in want.answers.items():
            assert _probs(got.answers[qid]) == pytest.approx(_probs(a), abs=PROB_TOL)
    spy.passes = 0
    monkeypatch.setattr(small.backend, "block_tokens", max(sizes) + 1, raising=False)
    assert all(not isinstance(r, Exception) for r in small.run_many([(TICKET, q) for q in QUESTIONS]))
    assert spy.passes == len(QUESTIONS)


def test_stage_clocks_name_the_pack_apart_from_the_pass(engine, monkeypatch):
    """Result.timings: tokenize, prefill, pack, score, readout in that order. ``pack`` is the time spent building
    the questions' compiled passes after the state (Planner.place; compiling them too, the first time) and ``score``
    the backend's passes: a placement slowed by 50 ms shows up in pack, a
    backend slowed by 500 ms in score and not in pack (pack is ~1 ms here; the bound leaves 250x room). The
    requests of a merged pass share its score time."""
    alone = engine.run(TICKET, QUESTIONS[0]).timings
    assert list(alone) == ["tokenize", "prefill", "pack", "score", "readout"] and alone["pack"] > 0
    real_place, real_score = engine.planner.place, engine.backend.score_all

    def slow_place(qs, past):
        time.sleep(0.05)
        return real_place(qs, past)

    def slow_score(kv, batch):
        time.sleep(0.5)
        return real_score(kv, batch)

    monkeypatch.setattr(engine.planner, "place", slow_place)
    assert engine.run(TICKET, QUESTIONS[0]).timings["pack"] >= 50
    monkeypatch.setattr(engine.planner, "place", real_place)
    monkeypatch.setattr(engine.backend, "score_all", slow_score)
    slowed = engine.run(TICKET, QUESTIONS[0]).timings
    assert slowed["score"] >= 500 and slowed["pack"] < 250  # control: the pass is not counted as packing
    merged = engine.run_many([(TICKET, q) for q in QUESTIONS[:2]])
    clocks = [r.timings for r in merged]
    assert all(list(c) == ["tokenize", "prefill", "pack", "score", "readout"] for c in clocks)
    assert clocks[0]["score"] == clocks[1]["score"] >= 500  # one merged pass, counted for each request


def test_a_request_split_into_blocks_stops_between_blocks_once_every_deadline_passed(tiny_engine_dir, monkeypatch):
    """A pass already running when every waiter's deadline passes may not hold the engine for the rest: a request
    split into many blocks stops before the next block, answers DeadlineExceeded (503), and nothing is re-run
    request by request. The control: with no deadline every block runs."""
    from onepass import Engine
    from onepass.runtime.core.errors import DeadlineExceeded

    engine = Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False)
    monkeypatch.setattr(engine.backend, "block_tokens", 32, raising=False)  # a block of a question or two
    many = {f"q{i}": Noul(f"Is point {i} about billing?") for i in range(12)}
    passes, real = [], engine.backend.score_all

    def slow(kv, batch):
        passes.append(batch.num_tokens)
        time.sleep(0.2)
        return real(kv, batch)

    monkeypatch.setattr(engine.backend, "score_all", slow)
    (full,) = engine.run_many([(TICKET, many)])
    blocks = len(passes)
    assert not isinstance(full, Exception) and blocks >= 6
    passes.clear()
    (late,) = engine.run_many([(TICKET, many)], deadline=time.monotonic() + 0.3)
    assert isinstance(late, DeadlineExceeded) and "were not run" in str(late)
    assert 1 <= len(passes) <= 3 < blocks  # stopped between blocks, and not retried alone


class _AnsweringEngine(FakeEngine):
    """An engine that answers every request at once (the request's own state as its answer)."""


def test_idle_housekeeping_runs_after_the_answers_are_out_and_only_when_nobody_waits():
    """``on_idle`` (where the server gives back a backend's working memory, about a second of CPU) runs on the
    engine thread once a batch is answered and the queue is empty: a slow one delays no answer, and it does not
    run between the groups of a batch that still has requests waiting."""
    engine, idle, depths = _AnsweringEngine(), threading.Event(), []
    release = threading.Event()

    def on_idle():
        depths.append(dispatcher.depth)
        idle.set()
        release.wait(30)  # held: the answers must already be out

    dispatcher = Dispatcher(engine, max_queue=64, window_s=0.2, max_batch=16, on_idle=on_idle)
    try:
        results = _submit_all(dispatcher, [("state one", {"q": Noul("a?")}), ("state two", {"q": Noul("b?")})])
        assert results == ["state one", "state two"] and idle.wait(30)
        assert len(engine.calls) == 2 and depths == [0]  # two groups (two states), one idle call after both
        idle.clear()
        release.set()
        _submit_all(dispatcher, [("state three", {"q": Noul("c?")})])
        assert idle.wait(30) and depths == [0, 0]  # idle again after the next batch
    finally:
        release.set()
        dispatcher.close()


def test_a_failing_idle_housekeeping_never_stops_the_engine_thread():
    def on_idle():
        raise RuntimeError("housekeeping fault")

    dispatcher = Dispatcher(_AnsweringEngine(), max_queue=64, window_s=0.0, max_batch=16, on_idle=on_idle)
    try:
        assert _submit_all(dispatcher, [("state one", {"q": Noul("a?")})]) == ["state one"]
        assert _submit_all(dispatcher, [("state two", {"q": Noul("b?")})]) == ["state two"]
        assert dispatcher.alive
    finally:
        dispatcher.close()
