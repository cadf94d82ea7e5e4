"""A server's teacher (`onepass serve --teacher URL`): shadow mode, gate mode, and the rows they record.

* **Shadow**: a share (``shadow_rate``) of answered requests is handed, after the local answer is made, to
  background threads that ask the teacher the same questions. Handing over is a put on a bounded queue: a
  full queue drops the shadow call (counted), never the request. The local answer is never changed or
  delayed by the teacher.
* **Gate**: the questions answered below the gate's threshold (``--min-confidence``, or the thresholds a
  distilled engine's manifest carries) are asked of the teacher within the request's deadline, and its
  answers replace the local ones. Gate calls run on an executor of their own with one thread per gate
  connection; a call beyond them is skipped, and where the teacher fails or the deadline comes first, the
  local answers stand (counted by outcome).
* **A teacher that is down** is not asked again for a while (:class:`Breaker`): after a call finds it
  unavailable, calls skip it (outcome ``circuit_open``, the local answers standing at once) for a cool-down that
  starts at 0.5 s and doubles while it stays down (at most 30 s); then one call tries it again.
* **Records** (``--record DIR``): every teacher answer, shadow or gate, becomes an `onepass tune` row
  (state, question, probabilities) in rotating JSONL files with a byte cap (:mod:`onepass.runtime.server.records`).
  Nothing is recorded unless asked: the state text is user data.

Metrics: teacher calls by mode and outcome, their latency, questions answered locally and by the teacher,
shadowed questions and the local answers that agree with the teacher's.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from starlette.concurrency import run_in_threadpool

from ..core.cascade import Gate
from ..core.errors import OnepassError
from .records import Records
from ..tools.teacher import (Teacher, TeacherBadAnswer, TeacherRefused, TeacherUnavailable, answer_distribution, dumps,
                             row)

log = logging.getLogger("onepass.teacher")
GATE_RESERVE_S = 0.05  # at least this much of a request's time is kept for its response after a gate call
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
    max_pending: int = 256  # shadow calls waiting for a thread; beyond them a shadow call is dropped (counted)

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

    def result(self, epoch: int, available: bool) -> None:
        """A call admitted in ``epoch`` found the teacher available or not."""
        with self._lock:
            if available:
                self._down, self._open_until, self._probing = 0, 0.0, False
            elif epoch == self._epoch:  # the first failure of this wave (or the probe's): open, cool down longer
                self._down += 1
                self._epoch += 1
                self._open_until = self._clock() + min(MAX_COOL_DOWN_S, COOL_DOWN_S * 2 ** (self._down - 1))
                self._probing = False


class TeacherLink:
    """The teacher as the server uses it; ``close()`` stops its threads and the teacher's connections.

    The teacher's connections (``max_concurrency``) are shared out: with both modes, shadow threads take half
    (at least one) and gate calls the rest (at least one); a gate call beyond its share is not queued but
    skipped (the local answers stand at once), and runs on an executor of its own, never on the server's
    thread pool, so a hanging teacher cannot hold up requests it has no part in."""

    def __init__(self, setup: TeacherSetup, metrics, clock=time.monotonic):
        teacher, shadow_rate, gate = setup.teacher, setup.shadow_rate, setup.gate
        self.teacher, self.metrics, self.records, self.gate = teacher, metrics, setup.records, gate
        self.shadow_rate = shadow_rate
        self._queue: queue.Queue = queue.Queue(maxsize=setup.max_pending)
        self._lock = threading.Lock()
        self.breaker = Breaker(clock)
        self._clock = clock
        connections = teacher.config.max_concurrency
        shadow = (max(1, connections // 2) if gate is not None else connections) if shadow_rate else 0
        self.gate_slots = max(1, connections - shadow) if gate is not None else 0
        self._gate_calls = 0  # gate calls running (on the gate executor), at most gate_slots
        self._gate_pool = (ThreadPoolExecutor(self.gate_slots, thread_name_prefix="onepass-gate")
                           if gate is not None else None)
        self._threads = [threading.Thread(target=self._work, name=f"onepass-shadow-{i}", daemon=True)
                         for i in range(shadow)]
        for t in self._threads:
            t.start()

    def shadow(self, state, questions: dict, answers: dict) -> None:
        """Maybe (``shadow_rate``) queue the teacher's answers to questions answered locally. Never blocks."""
        if not self._threads or not questions or random.random() >= self.shadow_rate:
            return
        try:
            self._queue.put_nowait((state, questions, answers))
        except queue.Full:
            self.metrics.teacher_calls.labels("shadow", "dropped").inc()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            state, questions, answers = item
            try:
                probs = self._call("shadow", state, questions, None)
            except Exception:  # noqa: BLE001 - counted in _call; a shadow call never stops its thread
                continue
            agreed = sum(agrees(questions[q], answers[q], p) for q, p in probs.items())
            self.metrics.shadowed.inc(len(probs))
            self.metrics.agreed.inc(agreed)

    def _call(self, mode: str, state, questions: dict, deadline: float | None) -> dict:
        """The teacher's distributions (recorded when asked), its outcome and latency counted."""
        epoch = self.breaker.admit()
        if epoch is None:
            self.metrics.teacher_calls.labels(mode, "circuit_open").inc()
            raise TeacherUnavailable(f"{self.teacher.name} was unavailable: not asked again for "
                                     f"{self.breaker.remaining():.1f} s")
        start = self._clock()
        try:
            probs = self.teacher.probabilities(state, questions, deadline=deadline)
        except Exception as err:
            self.breaker.result(epoch, not isinstance(err, TeacherUnavailable))
            self.metrics.teacher_calls.labels(mode, _outcome(err)).inc()
            if not isinstance(err, (TeacherUnavailable, TeacherRefused, TeacherBadAnswer)):
                log.exception("teacher call failed unexpectedly")
            else:
                log.warning("teacher %s call failed: %s", mode, err)
            raise
        self.breaker.result(epoch, True)
        self.metrics.teacher_calls.labels(mode, "ok").inc()
        self.metrics.teacher_latency.labels(mode).observe(self._clock() - start)
        if self.records is not None:
            for qid, p in probs.items():
                if self.records.write(dumps(row(state, questions[qid], p, self.teacher.name))):
                    self.metrics.recorded.inc()
                else:
                    self.metrics.record_failures.inc()
        return probs

    def _gate_call(self, state, questions: dict, until: float) -> dict:
        try:
            return self._call("gate", state, questions, until)
        finally:
            with self._lock:
                self._gate_calls -= 1

    async def forward(self, engine, state, questions: dict, answers: dict, deadline: float) -> tuple[dict, set]:
        """(answers, ids answered by the teacher): the questions below the gate asked of the teacher, its call
        ending before ``deadline`` (a tenth of the time left, at least 50 ms, is kept for the response); where it
        fails, is busy or late, the local answers stand."""
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
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(self._gate_pool, self._gate_call, state, doubtful, until)
        try:  # the call ends by `until` (the client's deadline); this bound only guards against a client bug
            probs = await asyncio.wait_for(asyncio.shield(call), timeout=max(0.0, until - self._clock()) + 0.5)
        except asyncio.TimeoutError:
            self.metrics.teacher_calls.labels("gate", "late").inc()
            return answers, set()
        except Exception:  # noqa: BLE001 - counted and logged in _call; the local answers stand
            return answers, set()
        return {**answers, **{q: answer(questions[q], p) for q, p in probs.items()}}, set(probs)

    def close(self) -> None:
        """Stop the shadow threads (queued shadow calls are dropped) and the gate executor, then the teacher's
        connections and the records (a call still running then records nothing)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            try:
                self._queue.put(None, timeout=1)
            except queue.Full:  # a shadow call was queued meanwhile: the threads are daemons
                break
        deadline = time.monotonic() + 5
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._gate_pool is not None:
            self._gate_pool.shutdown(wait=False, cancel_futures=True)
        if self.records is not None:
            self.records.close()
        self.teacher.close()
