"""The engine's work queue: a bounded, deadline-aware queue in front of one worker thread.

The HTTP layer never runs inference on the event loop: it submits a request and awaits
a future. The worker takes the first waiting request, waits up to the batch window for
more, groups them by their state's text (once: the engine does not group them again) and hands
each group to ``Engine.run_group`` — requests about the same state share one packed pass, each as
its own subtrees, and a failing request fails only itself.

Every request carries a deadline (monotonic seconds). Admission refuses a request whose
deadline cannot be met given the work ahead of it, and the worker drops a queued request
whose deadline would pass before its pass could end: no work is spent on answers nobody
waits for. The work ahead is counted in passes and in tokens, not requests: queued requests
about one state share a pass (up to ``max_batch`` of them), and a pass costs at least the
measured seconds per pass, more when its questions (and the state's prefill, unless the
state was answered recently) hold many tokens. A request arrives prepared
(``Engine.prepare``, off the event loop), so its work is exact in token-equivalents
(``Planner.work``): the packed tokens of its own passes, a long question's trunk prefill and its
state's tokens, each with its attention entries at their FLOP cost; seconds per token-equivalent
are measured on the passes themselves.
So one request of 5000 questions ahead makes a short-deadline request behind it a 429 at once
instead of a late 503.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass

from ..core.engine import Engine
from ..core.planner import Prepared
from .errors import DeadlinePassed, EngineStopped, NeverFits, QueueFull

__all__ = ["DeadlinePassed", "Dispatcher", "EngineStopped", "NeverFits", "QueueFull"]

EWMA = 0.2  # weight of the newest measurement in the seconds-per-pass and seconds-per-token estimates
RECENT_STATES = 256  # states answered lately (the engine's state cache likely holds them: no prefill counted)

log = logging.getLogger("onepass.dispatch")


@dataclass
class _Item:
    prepared: Prepared
    deadline: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    tokens: float = 0.0  # tokens of work (token-equivalents): its own, plus the state's prefill if not answered lately

    @property
    def key(self) -> bytes:  # requests with equal keys (a digest of the state's token ids) share a pass
        return self.prepared.key


class Dispatcher:
    """Bounded queue + one inference thread. ``submit`` is called from the event loop."""

    def __init__(self, engine: Engine, max_queue: int, window_s: float, max_batch: int, on_batch=None,
                 on_drop=None, on_idle=None):
        self.engine = engine
        self.max_queue, self.window_s, self.max_batch = max_queue, window_s, max_batch
        self.on_batch = on_batch or (lambda size: None)
        self.on_drop = on_drop or (lambda: None)
        self.on_idle = on_idle or (lambda: None)  # on the engine thread, once a batch is answered and none waits
        self.seconds_per_pass = 0.0  # measured; 0 until the first pass (the warm-up seeds it)
        self.seconds_per_token = 0.0  # measured per token; 0 until a pass of enough tokens
        self._tokens: collections.Counter = collections.Counter()  # queued tokens of work per state key
        self._recent: collections.OrderedDict = collections.OrderedDict()  # state keys answered lately
        self._queue: queue.Queue = queue.Queue()
        self._depth = 0
        self._states: collections.Counter = collections.Counter()  # queued requests per state key
        self._lock = threading.Lock()
        self._closed = False
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

    def measured(self, seconds: float, tokens: float = 0.0) -> None:
        """Fold one pass's time (one state's group of requests, ``tokens`` tokens of work) into the estimates:
        seconds per pass, and seconds per token from passes large enough for tokens to dominate."""
        self.seconds_per_pass = seconds if self.seconds_per_pass == 0 else (
            (1 - EWMA) * self.seconds_per_pass + EWMA * seconds)
        if tokens >= 64:
            rate = seconds / tokens
            self.seconds_per_token = rate if self.seconds_per_token == 0 else (
                (1 - EWMA) * self.seconds_per_token + EWMA * rate)

    def calibrate(self, seconds: float, tokens: float) -> None:
        """Seed the seconds per token from one pass of ``tokens`` (the server's warm-up), where no pass has
        measured it yet."""
        if self.seconds_per_token == 0 and tokens > 0:
            self.seconds_per_token = seconds / tokens

    def work_tokens(self, prepared: Prepared) -> float:
        """A request's tokens of work (token-equivalents, ``Planner.work``: attention included): its passes'; its
        state's prefill unless the state was given prefilled, was answered lately, or is queued already; and its
        long questions' trunk prefill unless the engine's cache holds them (call under the lock)."""
        key = prepared.key
        fresh = prepared.state is None and key not in self._recent and key not in self._states
        cache = getattr(self.engine, "cache", None)
        cached = bool(prepared.trunks) and cache is not None and all(cache.holds(t) for t in prepared.trunks)
        return prepared.work + (prepared.state_work if fresh else 0.0) + (0.0 if cached else prepared.trunk_work)

    def wait_with(self, key, tokens: float) -> tuple[int, float]:
        """(passes, seconds of work) the queue holds once one more request about state ``key`` of ``tokens``
        tokens joins it (call under the lock)."""
        counts, work = self._states.copy(), self._tokens.copy()
        counts[key] += 1
        work[key] += tokens
        passes = {k: -(-n // self.max_batch) for k, n in counts.items()}
        return sum(passes.values()), sum(self.pass_seconds(passes[k], work[k]) for k in counts)

    def pass_seconds(self, passes: int, tokens: float) -> float:
        """Seconds for ``passes`` passes holding ``tokens`` tokens (estimate)."""
        return max(passes * self.seconds_per_pass, tokens * self.seconds_per_token)

    def submit(self, prepared: Prepared, deadline: float, budget: float | None = None) -> asyncio.Future:
        """Queue one prepared request; the future resolves to a Result, an exception, or DeadlinePassed. ``budget``:
        the request's whole time allowance (its deadline minus its arrival; default: the time left now). A request
        whose own work exceeds its budget is NeverFits (no retry can help); one that exceeds only what is left (it
        spent its time arriving) is QueueFull, retryable."""
        if self._closed or not self._thread.is_alive():
            raise EngineStopped("the engine thread is stopped (closed, or it failed): nothing can be answered")
        key = prepared.key
        with self._lock:
            tokens = self.work_tokens(prepared)
            alone, left = self.pass_seconds(prepared.passes, tokens), deadline - time.monotonic()
            allowance = left if budget is None else budget
            if alone > allowance:
                raise NeverFits(f"this request is {tokens:.0f} tokens of work, about {alone:.3g} s here, more than the "
                                f"{max(0.0, allowance):.3g} s its deadline allows")
            if alone > left:
                raise QueueFull(f"about {alone:.1f} s of work and {max(0.0, left):.1f} s left before the request's "
                                "deadline (it arrived slowly)", alone - left)
            passes, wait = self.wait_with(key, tokens)
            if self._depth >= self.max_queue:
                raise QueueFull(f"{self._depth} requests are waiting (limit {self.max_queue})", wait)
            if wait > left:
                queued = sum(self._tokens.values())
                ahead = (f"{self._depth} requests ({passes} passes and {queued + tokens:.0f} tokens with this "
                         "one) are queued: " if self._depth else "nothing else is queued, but this request needs ")
                raise QueueFull(f"{ahead}about {wait:.2f} s of work, more than the {max(0.0, left):.2f} s left before "
                                "this request's deadline", wait - left)
            self._depth += 1
            self._states[key] += 1
            self._tokens[key] += tokens
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Item(prepared, deadline, loop, future, tokens))
        return future

    def close(self) -> None:
        """Stop the worker after the work already queued; later submits raise EngineStopped."""
        self._closed = True
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
        finish = time.monotonic() + self.pass_seconds(1, sum(item.tokens for item in group))
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
            # grouped once, here: the engine answers the group about its one state without grouping again
            results = self.engine.run_group([item.prepared for item in group],
                                            deadline=max(item.deadline for item in group))
        except Exception as err:  # noqa: BLE001 - run_group isolates requests; this is a last guard
            results = [err] * len(group)
        stopped = sum(isinstance(result, DeadlinePassed) for result in results)  # between passes or prefill chunks
        if not stopped:  # a group cut short did less than its work: its time would lower the rate
            self.measured(time.monotonic() - start, sum(item.tokens for item in group))
        self.on_batch(len(group))
        for _ in range(stopped):  # dropped for their deadline too, if later
            self.on_drop()
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
                        self._tokens[item.key] -= item.tokens
                        if self._states[item.key] <= 0:
                            del self._states[item.key], self._tokens[item.key]
                    if kept:
                        self._recent[group[0].key] = None
                        self._recent.move_to_end(group[0].key)
                        while len(self._recent) > RECENT_STATES:
                            self._recent.popitem(last=False)
            if self._depth == 0:  # every answer is out and nobody waits: housekeeping delays no one
                try:
                    self.on_idle()
                except Exception:  # noqa: BLE001 - housekeeping never stops the engine thread
                    log.exception("the engine thread's idle housekeeping failed")


def _by_state(batch: list) -> list:
    """The batch's requests grouped by their state (first-come order): each group is one packed pass."""
    groups: dict = {}
    for item in batch:
        groups.setdefault(item.key, []).append(item)
    return list(groups.values())


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)
