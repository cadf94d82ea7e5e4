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


class _FaultyEngine(FakeEngine):
    """An engine whose passes fail (a device fault): run_group raises for the whole group."""

    def run_group(self, prepared, readout=None, deadline=None):
        self.calls.append(len(prepared))
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
    assert len(engine.calls) == 3 and dispatcher.depth == 0  # two states in the first batch, then one


class _HeldEngine(FakeEngine):
    """An engine whose passes wait until released: what is queued stays queued while a test submits."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def run_group(self, prepared, readout=None, deadline=None):
        self.calls.append(len(prepared))
        self.release.wait(30)
        return [RuntimeError("not answered: the test only checks admission")] * len(prepared)


def _admitted(dispatcher: Dispatcher, loop, requests: list, futures: list, client=None) -> list:
    """Submit (state, questions, seconds to the deadline) requests of ``client`` on ``loop``: for each, "ok" when it
    was queued (its future appended to ``futures``) or the QueueFull message."""
    from onepass.runtime.server.dispatch import QueueFull

    async def main():
        out = []
        for state, questions, left in requests:
            try:
                futures.append(dispatcher.submit(dispatcher.engine.prepare(state, questions),
                                                 time.monotonic() + left, client=client))
                out.append("ok")
            except QueueFull as err:
                out.append(str(err))
        return out
    return loop.run_until_complete(main())


def _exact(dispatcher: Dispatcher, per_pass: float, per_work: float) -> None:
    """The dispatcher's cost model fitted on groups that cost exactly ``per_pass`` a pass and ``per_work`` a
    token-equivalent, enough of them that its spread is 1 (every prediction was right)."""
    for i in range(40):
        work = 1000.0 * (1 + i % 2)
        dispatcher.observe(1, work, per_pass + per_work * work)
    assert dispatcher.cost.spread() == pytest.approx(1.0)
    assert (dispatcher.cost.per_pass, dispatcher.cost.per_work) == pytest.approx((per_pass, per_work))


def _many(n: int) -> dict:
    return {f"q{i}": Noul(f"Does the ticket mention product number {i} or anything about its delivery date?")
            for i in range(n)}


@pytest.mark.parametrize("ahead, client, refused", [(2000, None, True), (1, None, False), (2000, "other", False)],
                         ids=["2000-questions-ahead", "control-1", "another-client"])
def test_admission_counts_the_work_ahead_of_the_client(ahead, client, refused):
    """With 2 ms per pass and 0.1 ms per token measured, a 2000-question request ahead of the same client (one pass,
    ~60k tokens, ~6 s) makes a request with a 1 s deadline a 429 at once; the pass count alone (2 passes, 4 ms)
    would admit it. Controls: the same request behind a one-question request is admitted, and so is another
    client's, which is served before the 2000 questions (fair turns)."""
    engine, loop, futures = _HeldEngine(), asyncio.new_event_loop(), []
    dispatcher = Dispatcher(engine, max_queue=64, window_s=0.0, max_batch=16)
    _exact(dispatcher, 0.002, 0.0001)
    try:
        first = _admitted(dispatcher, loop, [("another state", _many(1), 60)], futures)  # taken by the worker
        deadline = time.monotonic() + 10
        while not engine.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        got = _admitted(dispatcher, loop, [("a state", _many(ahead), 60)], futures)
        got += _admitted(dispatcher, loop, [("a third state", _many(1), 1.0)], futures, client)
    finally:
        engine.release.set()
        loop.run_until_complete(asyncio.wait_for(asyncio.gather(*futures), 60))  # every queued request answered
        dispatcher.close()
        loop.close()
    assert first == ["ok"] and got[0] == "ok"
    if refused:
        assert "tokens" in got[1] and "s of work" in got[1], got[1]
    else:
        assert got[1] == "ok"


def test_the_cost_model_is_fitted_per_pass_and_per_work_and_large_requests_cannot_inflate_a_small_one():
    """Groups of several sizes costing 20 ms a pass and 0.4 ms a token-equivalent (with +-10% noise): the fit finds
    both, and its error is small. Four large groups measured 30% slow (4.8 s each) move a 12-token request's
    pessimistic estimate by a few milliseconds; the control, an average of whole group times (what admission used
    before), puts it at over a second: past a 1 s deadline."""
    import random

    from onepass.runtime.server.cost import CostModel

    rng, cost, times = random.Random(0), CostModel(), []
    for _ in range(40):
        work = rng.choice([20, 300, 3000, 9000])
        seconds = (0.02 + 0.0004 * work) * rng.uniform(0.9, 1.1)
        cost.measured(1, work, seconds)
        times.append(seconds)
    assert cost.per_pass == pytest.approx(0.02, rel=0.15) and cost.per_work == pytest.approx(0.0004, rel=0.05)
    assert cost.error_p90() < 0.12 and 1.0 < cost.spread() < 1.15
    before = cost.pessimistic(1, 12)
    for _ in range(4):
        cost.measured(1, 9000, 4.8)
        times.append(4.8)
    assert cost.pessimistic(1, 12) < before + 0.01 < 0.1
    assert sum(times[-8:]) / 8 > 1.0  # the control: the recent average of whole pass times


def test_the_cost_model_keeps_both_costs_non_negative_and_fits_one_alone():
    """Groups whose time is a fixed cost only (every size 50 ms) fit no cost per work, and the reverse; a fit never
    goes negative (noise that an unconstrained fit would follow below zero)."""
    from onepass.runtime.server.cost import CostModel

    fixed, per_work = CostModel(), CostModel()
    for work in (10, 100, 1000, 10000) * 5:
        fixed.measured(1, work, 0.05)
        per_work.measured(1, work, 0.001 * work)
    assert fixed.per_pass == pytest.approx(0.05) and fixed.per_work == pytest.approx(0.0, abs=1e-12)
    assert per_work.per_pass == pytest.approx(0.0, abs=1e-12) and per_work.per_work == pytest.approx(0.001)
    skewed = CostModel()
    for work, seconds in ((10, 0.001), (1000, 0.5), (2000, 1.3), (20, 0.0005)):
        skewed.measured(1, work, seconds)
    assert skewed.per_pass >= 0 and skewed.per_work >= 0


def test_admission_counts_exact_tokens_and_a_request_that_cannot_fit_is_refused_at_once():
    """A request arrives prepared, its size exact: its packed tokens, plus its state's unless the state was answered
    lately or is queued already. A request that alone cannot finish before its deadline is refused at admission
    (NeverFits: 413), before any queue or pass; one that fits its budget but not what is left of it is QueueFull."""
    from onepass.runtime.server.dispatch import NeverFits, QueueFull

    engine, loop = _HeldEngine(), asyncio.new_event_loop()
    dispatcher = Dispatcher(engine, max_queue=4, window_s=0.0, max_batch=4)
    try:
        q = {"q": Noul("Is it?")}
        short = engine.prepare("a short state", q)
        assert dispatcher.work_tokens(short) == short.packed_tokens + 3 == 6 + 3  # 2 words, 2 options; 3 words
        _exact(dispatcher, 0.1, 0.001)  # 0.1 s a pass, 1 ms per token
        with pytest.raises(NeverFits, match="5506 tokens of work.*its deadline allows"):
            dispatcher.submit(engine.prepare("word " * 5500, q), time.monotonic() + 2.0)  # 5.5 s of work, 2 s to go
        with pytest.raises(QueueFull, match="arrived slowly"):  # fits its 3 s budget, not the 0.1 s left of it
            dispatcher.submit(engine.prepare("word " * 400, q), time.monotonic() + 0.1, budget=3.0)
        assert dispatcher.depth == 0
        futures = _admitted(dispatcher, loop, [("a short state", q, 60), ("a short state", q, 60)], [])
        assert futures == ["ok", "ok"]
        assert dispatcher.work_tokens(short) == short.packed_tokens  # its state is queued: prefilled once
    finally:
        engine.release.set()
        dispatcher.close()
        loop.close()


def test_admission_weighs_attention_and_a_long_questions_trunk(tiny_engine_dir):
    """A request's work is tokens plus attention entries at their FLOP cost (Planner.work): a 4,228-token state
    with a 10 s deadline was admitted by its tokens (~8.9 s at the measured rate) and answered 503 after 12.6 s, and
    a 1000-option choice, whose listed options (~5,900 tokens) are prefilled as its trunk, was counted without them.
    The state's work is checked against the entries of every prefill chunk's dense [k, start + k] block counted
    here; a long choice's work holds its trunk; and a state whose tokens fit the deadline but whose work does not
    is refused at once (NeverFits), where the control (the same request counted by tokens) was admitted."""
    import dataclasses

    import numpy as np

    from onepass import Engine
    from onepass.runtime.core.planner import entries_per_token
    from onepass.runtime.server.dispatch import NeverFits

    engine = Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False)
    chunk, per = engine.manifest.limits.prefill_chunk, entries_per_token(engine.manifest.model.hidden_size)
    q = {"q": Noul("Is it?")}
    p = engine.prepare("word " * 1500, q)
    n, packed = p.state_tokens, p.packed_tokens
    assert n > 2 * chunk  # several chunks
    blocks = [np.ones((min(chunk, n - s), s + min(chunk, n - s)), bool) for s in range(0, n, chunk)]
    assert p.state_work == pytest.approx(n + sum(b.size for b in blocks) / per)
    assert p.work == pytest.approx(packed + packed * (n + packed) / per)  # one pass over the state
    long_choice = Choice("Which?", [f"option number {i}" for i in range(300)])
    trunk = len(engine.encoder.question(long_choice).trunk) - 1
    long = engine.prepare("a short state", {"q": long_choice})
    assert long.passes > 1 and long.trunk_work > trunk  # its trunk is prefilled onto the state: counted
    assert long.trunks == (long.ids + engine.encoder.question(long_choice).trunk[:-1],)

    dispatcher = Dispatcher(engine, max_queue=4, window_s=0.0, max_batch=4)
    try:
        _exact(dispatcher, 0.0, 0.001)  # 1 ms per token-equivalent
        budget = 1.2 * (n + packed) / 1000  # the tokens alone fit it, with 20% to spare
        assert (p.work + p.state_work) / 1000 > budget
        with pytest.raises(NeverFits, match="tokens of work.*its deadline allows"):
            dispatcher.submit(p, time.monotonic() + budget)
        with_trunk = dispatcher.work_tokens(long)
        assert with_trunk == pytest.approx(long.work + long.state_work + long.trunk_work)
        engine.cache.put(long.trunks[0], object(), 1)  # once its trunk is cached, asking again does not prefill it
        assert dispatcher.work_tokens(long) == pytest.approx(with_trunk - long.trunk_work)
        by_tokens = dataclasses.replace(p, work=None, state_work=None)  # the control: counted by tokens
        assert dispatcher.work_tokens(by_tokens) == n + packed
        loop = asyncio.new_event_loop()
        try:
            async def admitted():
                future = dispatcher.submit(by_tokens, time.monotonic() + budget)
                return not future.done(), await future

            queued, answer = loop.run_until_complete(admitted())
            assert queued and answer is not None  # queued, not refused (then answered by the tiny engine)
        finally:
            loop.close()
    finally:
        dispatcher.close()


def test_a_prefill_past_its_deadline_stops_between_chunks(tiny_engine_dir, monkeypatch):
    """A state prefilled for requests whose deadline passes stops before its next chunk (DeadlineExceeded) instead
    of running to its end: a 4,228-token state was prefilled 2.6 s past its deadline, holding the engine. Each chunk
    is slowed to 0.6 s with a 0.3 s deadline: at most one chunk of the several runs. Control: without a deadline
    every chunk runs and the request is answered."""
    from onepass import Engine
    from onepass.runtime.core.errors import DeadlineExceeded

    engine = Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False)
    prepared = engine.prepare("word " * 1500, {"q": Noul("Is it?")})
    chunks = -(-prepared.state_tokens // engine.manifest.limits.prefill_chunk)
    assert chunks >= 3
    runs, real = [], engine.backend._run

    def slow(batch, kv):
        runs.append(batch.num_tokens)
        time.sleep(0.6)
        return real(batch, kv)

    monkeypatch.setattr(engine.backend, "_run", slow)
    (result,) = engine.run_group([prepared], deadline=time.monotonic() + 0.3)
    assert isinstance(result, DeadlineExceeded) and "while the state was being prefilled" in str(result)
    assert len(runs) <= 1
    runs.clear()
    (answered,) = engine.run_group([prepared])
    assert not isinstance(answered, BaseException) and len(runs) == chunks + 1  # every chunk, then the pass


def test_a_question_asked_many_times_is_packed_and_counted_once(tiny_engine_dir):
    """400 copies of one yes/no question were refused 413 ("about 17 s") by a character estimate for a 0.2 s pass:
    the prepared size is the trie's, where the copies are one question. Control: 400 distinct questions."""
    from onepass import Engine

    engine = Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False)
    one = engine.prepare(TICKET, {"q": Noul("Does the customer ask for a refund?")})
    copies = engine.prepare(TICKET, {f"q{i}": Noul("Does the customer ask for a refund?") for i in range(400)})
    distinct = engine.prepare(TICKET, {f"q{i}": Noul(f"Is point {i} about a refund?") for i in range(40)})
    assert copies.packed_tokens == one.packed_tokens and copies.passes == 1
    assert distinct.packed_tokens > 20 * one.packed_tokens // 2


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


def test_a_fault_of_the_engine_thread_s_own_answers_its_group_and_the_thread_goes_on(monkeypatch):
    """Every waiting request gets an answer whatever fails on the engine thread: the answers are sent before the
    measurements and metrics (an on_batch that raises loses none), and a fault before the pass (here in the check
    that drops hopeless requests) answers the group with it; the thread keeps serving. Control: the engine thread is
    alive after."""
    from fake_engine import FakeEngine

    def broken(size):
        raise RuntimeError("a metrics backend fault")

    dispatcher = Dispatcher(FakeEngine(), max_queue=8, window_s=0.0, max_batch=4, on_batch=broken)
    try:
        first = _submit_all(dispatcher, [("state one", {"q": Noul("a?")})])
        monkeypatch.setattr(dispatcher, "_drop_late", lambda group: (_ for _ in ()).throw(RuntimeError("model")))
        second = _submit_all(dispatcher, [("state two", {"q": Noul("b?")})])
        monkeypatch.undo()
        third = _submit_all(dispatcher, [("state three", {"q": Noul("c?")})])
    finally:
        alive = dispatcher.alive
        dispatcher.close()
    assert first == ["state one"] and third == ["state three"] and alive
    assert isinstance(second[0], RuntimeError) and "model" in str(second[0])


def test_a_fault_after_the_answer_to_a_caller_gone_leaves_the_engine_thread_alive():
    """The answer goes out, the caller's event loop closes, and then a fault of the engine thread's own (a metrics
    callback) answers the group again: that second answer has no loop to go to, and must not kill the thread (it did:
    every later request then waited forever). Control: the fault itself is seen (logged once per group)."""
    import threading

    from fake_engine import FakeEngine

    gone, faults = threading.Event(), []

    def broken(size):
        gone.wait(30)  # the caller's loop is closed by now
        faults.append(size)
        raise RuntimeError("a metrics backend fault")

    dispatcher = Dispatcher(FakeEngine(), max_queue=8, window_s=0.0, max_batch=4, on_batch=broken)
    try:
        first = _submit_all(dispatcher, [("state one", {"q": Noul("a?")})])  # asyncio.run closes its loop
        gone.set()
        deadline = time.monotonic() + 30
        while len(faults) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the fault path has run
        assert dispatcher.alive
        second = _submit_all(dispatcher, [("state two", {"q": Noul("b?")})])
    finally:
        gone.set()
        dispatcher.close()
    assert first == ["state one"] and second == ["state two"] and len(faults) == 2


def test_the_warm_up_s_sizes_keep_both_costs_known_when_every_later_group_has_one_size():
    """Seeded at warm-up with groups of several sizes, then 70 groups of one size (the window holds nothing else):
    the cost per token-equivalent is still known, so a 20,000-token request is predicted near its true 0.4 s. The
    control, the same groups without the warm-up's: the window alone cannot tell the two costs apart and gives the
    work no cost (a 0.004 s prediction)."""
    from onepass.runtime.server.cost import CostModel

    seeded, bare = CostModel(), CostModel()
    for work in (20, 300, 3000):
        seeded.seed(1, work, 0.002 + 0.00002 * work)
    for model in (seeded, bare):
        for _ in range(70):
            model.measured(1, 100, 0.002 + 0.00002 * 100)
    assert seeded.seconds(1, 20000) == pytest.approx(0.402, rel=0.01)
    assert bare.seconds(1, 20000) < 0.01
    assert seeded.spread() == pytest.approx(1.0, abs=1e-6)  # the warm-up's own errors are not counted
