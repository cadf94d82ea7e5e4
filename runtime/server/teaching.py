"""A server's teacher (`onepass serve --teacher URL`): shadow mode, gate mode, and the rows they record.

* **Shadow**: a share (``shadow_rate``) of answered requests is handed, after the local answer is made, to
  the teacher client's event loop, which asks the teacher the same questions on the shadow connections. At
  most ``max_pending`` shadow calls wait: beyond them a shadow call is dropped (counted), never the request.
  The local answer is never changed or delayed by the teacher.
* **Gate**: the questions answered below the gate's threshold (``--min-confidence``, or the thresholds a
  distilled engine's manifest carries) are asked of the teacher, and its answers replace the local ones. The
  call is ended at a cut-off before the request's deadline whatever the teacher is doing (a response head
  trickled a byte at a time included): the local answers stand then, and the call's connection is free at
  that moment. A call beyond the gate connections is skipped.
* **A teacher that is down** is not asked again for a while (:class:`Breaker`): after a call finds it
  unavailable, gate calls skip it (outcome ``circuit_open``, the local answers standing at once) for a cool-down
  that starts at 0.5 s and doubles while it stays down (at most 30 s); then one call tries it again. Shadow calls
  wait for the cool-down instead: a queued call is asked when the teacher is back. A call the request's deadline
  cut (``late``) counts as unavailable when it reached the teacher (a teacher that hangs is skipped, not waited on
  by every request until its cut-off), and as nothing when it never could (every connection busy).
* **Records** (``--record DIR``): every teacher answer, shadow or gate, becomes an `onepass tune` row
  (state, question, probabilities) in rotating JSONL files with a byte cap (:mod:`onepass.runtime.server.records`).
  Nothing is recorded unless asked: the state text is user data.

Metrics: teacher calls by mode and outcome, their latency, questions answered locally and by the teacher,
shadowed questions and the local answers that agree with the teacher's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass

import numpy as np
from starlette.concurrency import run_in_threadpool

from ..core.cascade import Gate
from ..core.errors import OnepassError
from .records import Records
from ..teacher.client import (Teacher, TeacherBadAnswer, TeacherError, TeacherLate, TeacherRefused, TeacherUnavailable,
                             answer_distribution, dumps, row)

log = logging.getLogger("onepass.teacher")
GATE_RESERVE_S = 0.05  # at least this much of a request's time is kept for its response after a gate call
GATE_GRACE_S = 0.1  # a gate call ends at its cut-off by itself; past it by this much, it is cancelled from outside
COOL_DOWN_S, MAX_COOL_DOWN_S = 0.5, 30.0  # a teacher found unavailable is skipped this long, doubling while it stays so


def _outcome(err: Exception) -> str:
    if isinstance(err, TeacherUnavailable):
        return "unavailable"
    if isinstance(err, TeacherRefused):
        return "refused"
    if isinstance(err, TeacherBadAnswer):
        return "bad_answer"
    return "error"


def agrees(question, local, teacher: np.ndarray) -> bool:
    """Whether a local answer picks the teacher's most probable option."""
    return int(np.argmax(answer_distribution(question, local))) == int(np.argmax(teacher))


def check_shadow_rate(rate) -> None:
    """A share of requests: a number within 0..1 (`--shadow-rate`)."""
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0.0 <= rate <= 1.0):
        raise OnepassError(f"--shadow-rate must be within 0..1, got {rate!r}")


@dataclass(frozen=True)
class TeacherSetup:
    """What `onepass serve --teacher` asks for: the client, the share shadowed, the records, the gate."""

    teacher: Teacher
    shadow_rate: float = 0.0
    records: Records | None = None
    gate: Gate | None = None  # None: shadow mode only
    max_pending: int = 256  # shadow calls waiting or under way; beyond them a shadow call is dropped (counted)

    def __post_init__(self):
        check_shadow_rate(self.shadow_rate)
        if self.shadow_rate == 0 and self.gate is None:
            raise OnepassError("--teacher is never asked: give --shadow-rate R (a share of requests shadowed), "
                               "--min-confidence (gate mode), or serve an engine from `onepass distill` (its gate)")
        if not 1 <= self.max_pending <= 100_000:
            raise OnepassError(f"max_pending must be 1..100000, got {self.max_pending}")


class Breaker:
    """Skips a teacher found unavailable: open for a cool-down (0.5 s, doubling while it stays down, at most 30 s),
    then one probe call at a time until one answers. Concurrent failures of one wave open it once."""

    def __init__(self, clock=time.monotonic):
        self._clock, self._lock = clock, threading.Lock()
        self._down, self._open_until, self._epoch, self._probing = 0, 0.0, 0, False

    def admit(self) -> int | None:
        """The epoch a call runs in, or None: skip the teacher now."""
        with self._lock:
            if self._down == 0:
                return self._epoch
            if self._clock() < self._open_until or self._probing:
                return None
            self._probing = True  # the cool-down is over: this call alone tries the teacher
            return self._epoch

    def remaining(self) -> float:
        return max(0.0, self._open_until - self._clock())

    def result(self, epoch: int, available: bool | None) -> None:
        """A call admitted in ``epoch`` found the teacher available or not (None: it cannot tell, e.g. the caller's
        time ran out first; a probe's turn passes to the next call)."""
        with self._lock:
            if available is None:
                if epoch == self._epoch:  # the probe's turn passes on (an older call's says nothing of it)
                    self._probing = False
            elif available:
                self._down, self._open_until, self._probing = 0, 0.0, False
            elif epoch == self._epoch:  # the first failure of this wave (or the probe's): open, cool down longer
                self._down += 1
                self._epoch += 1
                self._open_until = self._clock() + min(MAX_COOL_DOWN_S, COOL_DOWN_S * 2 ** (self._down - 1))
                self._probing = False


class TeacherLink:
    """The teacher as the server uses it; ``close()`` ends its calls and connections.

    Every call runs on the teacher client's own event loop and is bounded as a whole by its deadline (the gate's
    cut-off, or ``timeout_s`` per attempt for a shadow call), so a teacher that trickles holds nothing past it. The
    teacher's connections (``max_concurrency``) are shared out: with both modes, shadow calls take half (at least
    one) and gate calls the rest (at least one); a gate call beyond its share is not queued but skipped (the local
    answers stand at once). Each call is counted once, with one outcome."""

    def __init__(self, setup: TeacherSetup, metrics, clock=time.monotonic):
        teacher, shadow_rate, gate = setup.teacher, setup.shadow_rate, setup.gate
        self.teacher, self.metrics, self.records, self.gate = teacher, metrics, setup.records, gate
        self.shadow_rate, self.max_pending = shadow_rate, setup.max_pending
        self._lock = threading.Lock()
        self.breaker = Breaker(clock)
        self._clock = clock
        connections = teacher.config.max_concurrency
        self.shadow_slots = (max(1, connections // 2) if gate is not None else connections) if shadow_rate else 0
        self.gate_slots = max(1, connections - self.shadow_slots) if gate is not None else 0
        self._gate_calls = 0  # gate calls under way, at most gate_slots
        self._pending = 0  # shadow calls waiting or under way, at most max_pending
        self._shadow_turns: asyncio.Semaphore | None = None  # made on the teacher's loop

    def shadow(self, state, questions: dict, answers: dict) -> None:
        """Maybe (``shadow_rate``) queue the teacher's answers to questions answered locally. Never blocks; a call
        beyond ``max_pending`` waiting ones is dropped (counted)."""
        if not self.shadow_slots or not questions or random.random() >= self.shadow_rate:
            return
        with self._lock:
            if self._pending >= self.max_pending:
                self.metrics.teacher_calls.labels("shadow", "dropped").inc()
                return
            self._pending += 1
        try:
            call = self.teacher.spawn(self._shadow(state, questions, answers))
        except TeacherUnavailable:  # the client is closed (the server stops): nothing to shadow
            self._shadow_done(None)
            return
        call.add_done_callback(self._shadow_done)

    def _shadow_done(self, call) -> None:
        with self._lock:
            self._pending -= 1
        if call is not None and call.cancelled():  # the server stopped with it queued or under way
            self.metrics.teacher_calls.labels("shadow", "cancelled").inc()

    async def _shadow(self, state, questions: dict, answers: dict) -> None:
        """One shadow call on the teacher's loop: waits for a shadow connection, and while the breaker is open
        waits for its cool-down (a call that was queued is asked when the teacher is back, never thrown away)."""
        if self._shadow_turns is None:
            self._shadow_turns = asyncio.Semaphore(self.shadow_slots)
        async with self._shadow_turns:
            try:
                probs = await self._call("shadow", state, questions, None, patient=True)
            except TeacherError:  # counted in _call
                return
        agreed = sum(agrees(questions[q], answers[q], p) for q, p in probs.items())
        self.metrics.shadowed.inc(len(probs))
        self.metrics.agreed.inc(agreed)

    async def _call(self, mode: str, state, questions: dict, deadline: float | None, patient: bool = False) -> dict:
        """The teacher's distributions (recorded when asked), its outcome and latency counted, on the teacher's loop.
        ``patient``: wait while the breaker is open instead of skipping the teacher."""
        epoch = self.breaker.admit()
        while epoch is None and patient:
            await asyncio.sleep(max(0.05, self.breaker.remaining()))
            epoch = self.breaker.admit()
        if epoch is None:
            self.metrics.teacher_calls.labels(mode, "circuit_open").inc()
            raise TeacherUnavailable(f"{self.teacher.name} was unavailable: not asked again for "
                                     f"{self.breaker.remaining():.1f} s")
        start = self._clock()
        try:
            probs = await self.teacher.aprobabilities(state, questions, deadline=deadline)
        except asyncio.CancelledError:
            self.breaker.result(epoch, None)  # counted by whoever cancelled it
            raise
        except Exception as err:
            late = isinstance(err, TeacherLate)
            # too slow for the time given counts as unavailable (a teacher that hangs is skipped, not waited on by
            # every request until its cut-off); a call that never reached the teacher says nothing of it
            self.breaker.result(epoch, None if late and not err.asked else not isinstance(err, TeacherUnavailable))
            self.metrics.teacher_calls.labels(mode, "late" if late else _outcome(err)).inc()
            if not isinstance(err, TeacherError):
                log.exception("teacher call failed unexpectedly")
            else:
                log.warning("teacher %s call failed: %s", mode, err)
            raise
        self.breaker.result(epoch, True)
        self.metrics.teacher_calls.labels(mode, "ok").inc()
        self.metrics.teacher_latency.labels(mode).observe(self._clock() - start)
        if self.records is not None:  # a file write: off the teacher's loop, which other calls share
            await asyncio.get_running_loop().run_in_executor(None, self._record, state, questions, probs)
        return probs

    def _record(self, state, questions: dict, probs: dict) -> None:
        for qid, p in probs.items():
            if self.records.write(dumps(row(state, questions[qid], p, self.teacher.name))):
                self.metrics.recorded.inc()
            else:
                self.metrics.record_failures.inc()

    def _gate_done(self, call) -> None:
        """A gate call ended (by its cut-off at the latest): its connection's slot is free. One cancelled before
        _call counted it (the server stopping, or a stuck teacher loop) is counted here."""
        with self._lock:
            self._gate_calls -= 1
        if call.cancelled():
            self.metrics.teacher_calls.labels("gate", "cancelled" if self.teacher.closed else "late").inc()

    async def forward(self, engine, state, questions: dict, answers: dict, deadline: float) -> tuple[dict, set]:
        """(answers, ids answered by the teacher): the questions below the gate asked of the teacher, its call
        ended at a cut-off before ``deadline`` (a tenth of the time left, at least 50 ms, is kept for the
        response) whatever the teacher is doing; where it fails, is busy or late, the local answers stand."""
        from ..core.readout import answer

        gate = self.gate
        if gate.per_key:  # a key per question (5000 at most: some 20 ms): off the event loop
            gate = await run_in_threadpool(gate.for_questions, engine, questions)
        _, review = gate.split(answers)
        if not review:
            return answers, set()
        left = deadline - self._clock()
        until = deadline - max(GATE_RESERVE_S, 0.1 * left)
        if until <= self._clock():
            self.metrics.teacher_calls.labels("gate", "late").inc()
            return answers, set()
        with self._lock:
            if self._gate_calls >= self.gate_slots:  # every gate connection busy: no waiting in line
                self.metrics.teacher_calls.labels("gate", "skipped").inc()
                return answers, set()
            self._gate_calls += 1
        doubtful = {q: questions[q] for q in review}
        try:
            call = self.teacher.spawn(self._call("gate", state, doubtful, until))
        except TeacherUnavailable:  # the client is closed (the server stops)
            with self._lock:
                self._gate_calls -= 1
            return answers, set()
        call.add_done_callback(self._gate_done)
        # the call ends by `until` on its own; the grace only guards against a teacher loop that is stuck
        waiting = asyncio.wrap_future(call)
        done, _ = await asyncio.wait({waiting}, timeout=max(0.0, until - self._clock()) + GATE_GRACE_S)
        if not done:
            call.cancel()  # counted in _gate_done, unless _call counted it first
            return answers, set()
        if waiting.cancelled() or waiting.exception() is not None:  # counted and logged in _call; local answers
            return answers, set()
        probs = waiting.result()
        return {**answers, **{q: answer(questions[q], p) for q, p in probs.items()}}, set(probs)

    def close(self) -> None:
        """End the teacher's calls (queued shadow calls are cancelled, counted) and connections, then the records
        (a call ended so records nothing after them)."""
        self.teacher.close()
        if self.records is not None:
            self.records.close()
