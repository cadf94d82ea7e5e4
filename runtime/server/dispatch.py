"""The engine's work queue: a bounded, deadline-aware queue in front of one worker thread.

The HTTP layer never runs inference on the event loop: it submits a request and awaits
a future. The worker takes the first waiting request, waits up to the batch window for
more, and hands them to ``Engine.run_many`` — requests about the same state share one
packed pass, each as its own subtrees, and a failing request fails only itself.

Every request carries a deadline (monotonic seconds). Admission refuses a request whose
deadline cannot be met given the work ahead of it, and the worker drops a queued request
whose deadline would pass before its pass could end: no work is spent on answers nobody
waits for. The work ahead is counted in passes, not requests: queued requests about one
state share a pass (up to ``max_batch`` of them), so the estimate is the number of passes
the queue holds once this request joins it times the measured seconds per pass.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from dataclasses import dataclass

from ..engine import Engine
from ..questions import as_text

EWMA = 0.2  # weight of the newest measurement in the seconds-per-pass estimate


class QueueFull(Exception):
    """The bounded queue is full, or the deadline cannot be met: answer 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlinePassed(Exception):
    """A queued request's deadline passed (or would pass) before its pass: answer 503 with Retry-After."""


@dataclass
class _Item:
    state: object
    questions: object
    deadline: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    key: object = None  # the state's key (requests with equal keys share a pass)


class Dispatcher:
    """Bounded queue + one inference thread. ``submit`` is called from the event loop."""

    def __init__(self, engine: Engine, max_queue: int, window_s: float, max_batch: int, on_batch=None,
                 on_drop=None):
        self.engine = engine
        self.max_queue, self.window_s, self.max_batch = max_queue, window_s, max_batch
        self.on_batch = on_batch or (lambda size: None)
        self.on_drop = on_drop or (lambda: None)
        self.seconds_per_pass = 0.0  # measured; 0 until the first pass (the warm-up seeds it)
        self._queue: queue.Queue = queue.Queue()
        self._depth = 0
        self._states: collections.Counter = collections.Counter()  # queued requests per state key
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="onepass-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests submitted and not yet answered."""
        return self._depth

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running (health checks)."""
        return self._thread.is_alive()

    def measured(self, seconds: float) -> None:
        """Fold one pass's time (one state's group of requests) into the seconds-per-pass estimate."""
        self.seconds_per_pass = seconds if self.seconds_per_pass == 0 else (
            (1 - EWMA) * self.seconds_per_pass + EWMA * seconds)

    def passes_with(self, key) -> int:
        """Passes the queue holds once one more request about state ``key`` joins it (call under the lock)."""
        counts = self._states.copy()
        counts[key] += 1
        return sum(-(-n // self.max_batch) for n in counts.values())

    def expected_wait(self, passes: int) -> float:
        """Seconds until ``passes`` passes are done (estimate)."""
        return passes * self.seconds_per_pass

    def submit(self, state, questions, deadline: float) -> asyncio.Future:
        """Queue one parsed request; the future resolves to a Result, an exception, or DeadlinePassed."""
        key = _state_key(state)
        with self._lock:
            passes = self.passes_with(key)
            wait = self.expected_wait(passes)
            if self._depth >= self.max_queue:
                raise QueueFull(f"{self._depth} requests are waiting (limit {self.max_queue})", wait)
            left = deadline - time.monotonic()
            if wait > left:
                raise QueueFull(f"{self._depth} requests ({passes} passes with this one) are queued: about "
                                f"{wait:.2f} s of work, more than the {max(0.0, left):.2f} s left before this "
                                "request's deadline", wait - left)
            self._depth += 1
            self._states[key] += 1
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Item(state, questions, deadline, loop, future, key))
        return future

    def close(self) -> None:
        """Stop the worker after the work already queued."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _take_batch(self):
        first = self._queue.get()
        if first is None:
            return None
        batch, until = [first], time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            remaining = until - time.monotonic()
            try:
                item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            batch.append(item)
        return batch

    def _drop_late(self, group: list) -> list:
        """Answer DeadlinePassed to requests that could not be answered in time; keep the rest."""
        finish = time.monotonic() + self.seconds_per_pass
        keep = []
        for item in group:
            if item.deadline < finish:
                item.loop.call_soon_threadsafe(_resolve, item.future, DeadlinePassed(
                    "the request's deadline would pass before the engine could answer it"))
                self.on_drop()
            else:
                keep.append(item)
        return keep

    def _run(self, group: list) -> None:
        start = time.monotonic()
        try:
            results = self.engine.run_many([(item.state, item.questions) for item in group])
        except Exception as err:  # noqa: BLE001 - run_many isolates requests; this is a last guard
            results = [err] * len(group)
        self.measured(time.monotonic() - start)
        self.on_batch(len(group))
        for item, result in zip(group, results):
            item.loop.call_soon_threadsafe(_resolve, item.future, result)

    def _work(self) -> None:
        while (batch := self._take_batch()) is not None:
            for group in _by_state(batch):  # one pass per state; deadlines checked before each
                kept = self._drop_late(group)
                if kept:
                    self._run(kept)
                with self._lock:
                    self._depth -= len(group)
                    for item in group:
                        self._states[item.key] -= 1
                        if self._states[item.key] <= 0:
                            del self._states[item.key]


def _state_key(state):
    """Requests with equal keys are about the same state (and share a pass): the state's text as the engine
    reads it."""
    try:
        return as_text(state)
    except (TypeError, ValueError, RecursionError):
        return object()  # unkeyable: its own pass


def _by_state(batch: list) -> list:
    """The batch's requests grouped by their state (first-come order): each group is one packed pass."""
    groups: dict = {}
    for item in batch:
        groups.setdefault(item.key, []).append(item)
    return list(groups.values())


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)
