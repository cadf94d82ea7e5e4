"""The server's dispatcher (runtime/server/dispatch.py) and Engine.run_many's fall-backs, without HTTP.

The README claims: requests about one state that arrive within ``--batch-window-ms`` share one
packed pass (through the real dispatcher, with the real engine); a merged pass too large for the
engine's limits falls back to one pass per request; an engine fault reaches every request that
waits on it, as its own answer, never a hang.
"""

import asyncio
import time
from pathlib import Path

import pytest

from onepass import Choice, Noul, Score
from onepass.runtime.server.dispatch import Dispatcher

TICKET = (Path(__file__).parent / "data" / "ticket.txt").read_text()
QUESTIONS = [{"refund": Noul("Does the customer request a refund?")},
             {"team": Choice("Which team?", {"billing": None, "technical": None})},
             {"mood": Score("How frustrated?", ["Calm", "Frustrated", "Very angry"])},
             {"urgent": Noul("Is it urgent?")}]
PROB_TOL = 1e-4  # merged vs alone: packed == separate


def _probs(answer) -> dict:
    return getattr(answer, "probabilities", None) or {"yes": answer.noul}


def _submit_all(dispatcher: Dispatcher, requests: list, gap_s: float = 0.0) -> list:
    """Submit (state, questions) requests from one event loop, ``gap_s`` apart; their results in order."""
    async def main():
        futures = []
        for state, questions in requests:
            futures.append(dispatcher.submit(state, questions, time.monotonic() + 120))
            if gap_s:
                await asyncio.sleep(gap_s)
        return await asyncio.wait_for(asyncio.gather(*futures), 120)
    return asyncio.run(main())


class _Spy:
    """Counts the engine's score passes (one packed forward each) and run_many's groups."""

    def __init__(self, engine, monkeypatch):
        self.passes, self.batches = 0, []
        real_score, real_many = engine.backend.score_all, engine.run_many

        def score_all(kv, batch):
            self.passes += 1
            return real_score(kv, batch)

        def run_many(requests, readout=None):
            self.batches.append(len(requests))
            return real_many(requests, readout)

        monkeypatch.setattr(engine.backend, "score_all", score_all)
        monkeypatch.setattr(engine, "run_many", run_many)
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


def test_a_merge_too_large_for_the_limits_falls_back_to_one_pass_each(engine, monkeypatch):
    """Each request fits the request's packed-token limit alone, the four together do not: run_many answers each
    with its own pass (equal to alone) instead of failing them all. Control: with the engine's own limit, one pass."""
    sizes = [engine.pack(engine.state(TICKET), engine.encode_questions(q)).num_tokens for q in QUESTIONS]
    small = engine.with_limits(max_request_tokens=max(sizes) + 1)
    assert sum(sizes) > max(sizes) + 1
    spy = _Spy(small, monkeypatch)
    results = small.run_many([(TICKET, q) for q in QUESTIONS])
    assert spy.passes == len(QUESTIONS)  # the merge is refused before any pass (counted on the trie), then 4
    for q, got in zip(QUESTIONS, results):
        want = engine.run(TICKET, q)
        for qid, a in want.answers.items():
            assert _probs(got.answers[qid]) == pytest.approx(_probs(a), abs=PROB_TOL)
    engine_spy = _Spy(engine, monkeypatch)
    engine.run_many([(TICKET, q) for q in QUESTIONS])
    assert engine_spy.passes == 1


class _FaultyEngine:
    """An engine whose passes fail (a device fault): run_many raises for the whole batch."""

    def __init__(self):
        self.calls = 0

    def run_many(self, requests, readout=None):
        self.calls += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_an_engine_fault_reaches_every_waiting_request():
    """Every request of a failing batch gets the fault as its answer (no hang, no lost request), and the
    dispatcher keeps serving: a later batch is tried again."""
    engine = _FaultyEngine()
    dispatcher = Dispatcher(engine, max_queue=64, window_s=0.3, max_batch=16)
    try:
        results = _submit_all(dispatcher, [("state one", {"q": Noul("a?")}), ("state one", {"q": Noul("b?")}),
                                           ("state two", {"q": Noul("c?")})])
        later = _submit_all(dispatcher, [("state three", {"q": Noul("d?")})])
    finally:
        dispatcher.close()
    assert all(isinstance(r, RuntimeError) and "illegal memory access" in str(r) for r in results + later)
    assert engine.calls == 3 and dispatcher.depth == 0  # two states in the first batch, then one
