"""The engine's work queue: a bounded, deadline-aware queue in front of one worker thread, fair between clients.

The HTTP layer never runs inference on the event loop: it submits a request and awaits a future. Requests queue per
client (the peer address, or a configured header such as an API key) and the worker takes them in start-time fair
order (:mod:`onepass.runtime.server.fairness`): a quiet client's request waits for about the pass in service, not
behind the heavy requests other clients keep queued. With a request it takes every queued request about the same
state (the same digest of the state's token ids, any client's, waiting up to the batch window for more) and hands
them to ``Engine.run_group``: they share one packed pass, each as its own subtrees, and a failing request fails only
itself.

Every request carries a deadline (monotonic seconds). Admission weighs a request's work against it with a cost
model fitted on the passes measured (:mod:`onepass.runtime.server.cost`: a fixed cost per pass plus a cost per
token-equivalent, and the spread of its errors): a request whose own work surely exceeds its whole budget is
NeverFits (413: no retry can help); one that would likely not finish in time behind the work queued ahead of it is
QueueFull (429, retryable); the worker drops a queued request whose deadline would surely pass before its pass could
end. A request arrives prepared (``Engine.prepare``, off the event loop), so its work is exact in token-equivalents
(``Planner.work``): the packed tokens of its own passes, a long question's trunk prefill and its state's tokens, each
with its attention entries at their FLOP cost. So one request of 5000 questions ahead makes a short-deadline request
of the same client behind it a 429 at once instead of a late 503, while another client's is served after it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass

from ..core.engine import Engine
from ..core.planner import Prepared
from .cost import CostModel
from .errors import DeadlineExceeded, EngineStopped, NeverFits, QueueFull
from .fairness import FairQueue

__all__ = ["DeadlineExceeded", "Dispatcher", "EngineStopped", "NeverFits", "QueueFull"]

RECENT_STATES = 256  # states answered lately (the engine's state cache likely holds them: no prefill counted)
STUCK_S = 5.0  # past its deadline a request is answered by the engine thread; past this, by its waiter (a dead thread)

log = logging.getLogger("onepass.dispatch")


@dataclass
class _Item:
    prepared: Prepared
    deadline: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    tokens: float = 0.0  # tokens of work (token-equivalents): its own, plus the state's prefill if not answered lately
    client: object = None  # whose request it is (the fair queue's key)

    @property
    def key(self) -> bytes:  # requests with equal keys (a digest of the state's token ids) share a pass
        return self.prepared.key


class Dispatcher:
    """A fair, bounded queue + one inference thread. ``submit`` is called from the event loop."""

    def __init__(self, engine: Engine, max_queue: int, window_s: float, max_batch: int, on_batch=None,
                 on_drop=None, on_idle=None):
        self.engine = engine
        self.max_queue, self.window_s, self.max_batch = max_queue, window_s, max_batch
        self.on_batch = on_batch or (lambda size: None)
        self.on_drop = on_drop or (lambda: None)
        self.on_idle = on_idle or (lambda: None)  # on the engine thread, once a batch is answered and none waits
        self.cost = CostModel()  # seconds of a group of passes: measured, refitted after every group
        self._queue = FairQueue(key=lambda item: item.key)
        self._busy_until = 0.0  # monotonic: when the group in service is expected to end (0: none in service)
        self._recent: collections.OrderedDict = collections.OrderedDict()  # state keys answered lately
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

    def observe(self, passes: float, work: float, seconds: float, warm_up: bool = False) -> None:
        """One group's measured time (``passes`` passes, ``work`` token-equivalents) into the cost model: the
        engine thread's own groups, and the server's warm-up passes of several sizes (``warm_up``: kept in every
        fit, their errors not counted)."""
        (self.cost.seed if warm_up else self.cost.measured)(passes, work, seconds)

    def work_tokens(self, prepared: Prepared) -> float:
        """A request's tokens of work (token-equivalents, ``Planner.work``: attention included): its passes'; its
        state's prefill unless the state was given prefilled, was answered lately, or is queued already; and its
        long questions' trunk prefill unless the engine's cache holds them (call under the lock)."""
        key = prepared.key
        fresh = prepared.state is None and key not in self._recent and key not in self._states
        cache = getattr(self.engine, "cache", None)
        cached = bool(prepared.trunks) and cache is not None and all(cache.holds(t) for t in prepared.trunks)
        return prepared.work + (prepared.state_work if fresh else 0.0) + (0.0 if cached else prepared.trunk_work)

    def submit(self, prepared: Prepared, deadline: float, budget: float | None = None, client=None) -> asyncio.Future:
        """Queue one prepared request of ``client``; the future resolves to a Result, an exception, or
        DeadlineExceeded. ``budget``: the request's whole time allowance (its deadline minus its arrival; default: the
        time left now). A request whose own work surely exceeds its budget is NeverFits (no retry can help); one
        that would likely not end before its deadline behind what is queued ahead of it (or that spent its time
        arriving) is QueueFull, retryable."""
        if self._closed or not self._thread.is_alive():
            raise EngineStopped("the engine thread is stopped (closed, or it failed): nothing can be answered")
        with self._lock:
            tokens = self.work_tokens(prepared)
            own = self._admit(prepared, tokens, deadline, budget, client)
            self._depth += 1
            self._states[prepared.key] += 1
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(client, _Item(prepared, deadline, loop, future, tokens, client), own,
                        latest=deadline - self.cost.pessimistic(prepared.passes, tokens))
        return future

    def _admit(self, prepared: Prepared, tokens: float, deadline: float, budget: float | None, client) -> float:
        """Refuse (NeverFits, QueueFull) a request that cannot or likely would not end before its deadline; else
        its predicted seconds (its weight in the fair order)."""
        now = time.monotonic()
        left = deadline - now
        allowance = left if budget is None else budget
        surely, alone = self.cost.optimistic(prepared.passes, tokens), self.cost.pessimistic(prepared.passes, tokens)
        if surely > allowance:
            raise NeverFits(f"this request is {tokens:.0f} tokens of work, at least {surely:.3g} s here, more than "
                            f"the {max(0.0, allowance):.3g} s its deadline allows")
        if alone > left:
            raise QueueFull(f"about {alone:.2f} s of work and {max(0.0, left):.2f} s left before the request's "
                            "deadline (it arrived slowly)", alone - left)
        if self._depth >= self.max_queue:
            raise QueueFull(f"{self._depth} requests are waiting (limit {self.max_queue})", alone)
        own = self.cost.seconds(prepared.passes, tokens) or tokens * 1e-9  # its weight in the fair order
        ahead = self.cost.spread() * self._queue.ahead(client, own) + max(0.0, self._busy_until - now)
        if ahead + alone > left:
            raise QueueFull(f"about {ahead:.2f} s of work is queued ahead of this request, which needs about "
                            f"{alone:.2f} s of its own ({tokens:.0f} tokens): more than the {max(0.0, left):.2f} s "
                            "left before its deadline", ahead + alone - left)
        return own

    def close(self) -> None:
        """Stop the worker after the work already queued; later submits raise EngineStopped."""
        self._closed = True
        self._queue.close()
        self._thread.join(timeout=30)

    def _drop_late(self, group: list) -> list:
        """Answer DeadlineExceeded to requests that surely could not be answered in time; keep the rest."""
        passes = max(item.prepared.passes for item in group)
        finish = time.monotonic() + self.cost.optimistic(passes, sum(item.tokens for item in group))
        keep = []
        for item in group:
            if item.deadline < finish:
                _answer(item, DeadlineExceeded("the request's deadline would pass before the engine could answer "
                                               "it"))
                self.on_drop()
            else:
                keep.append(item)
        return keep

    def _run(self, group: list) -> None:
        """Answer one group (one state's requests): every future resolved first, then the measurements."""
        start = time.monotonic()
        passes, work = max(item.prepared.passes for item in group), sum(item.tokens for item in group)
        try:
            # grouped once, by the queue: the engine answers the group about its one state without grouping again
            results = self.engine.run_group([item.prepared for item in group],
                                            deadline=max(item.deadline for item in group))
        except Exception as err:  # noqa: BLE001 - run_group isolates requests; this is a last guard
            results = [err] * len(group)
        seconds = time.monotonic() - start
        for item, result in zip(group, results):
            _answer(item, result)
        stopped = sum(isinstance(result, DeadlineExceeded) for result in results)  # between passes or prefill chunks
        if not stopped:  # a group cut short did less than its work: its time would lower the estimate
            self.observe(passes, work, seconds)
        self.on_batch(len(group))
        for _ in range(stopped):  # dropped for their deadline too, if later
            self.on_drop()

    def _serve(self, group: list) -> bool:
        """Drop the group's hopeless requests and run the rest (whether any ran); a fault of this thread's own (not
        the engine's) answers every request of the group not answered yet with it, and the thread goes on."""
        try:
            kept = self._drop_late(group)  # one state's requests: one pass
            if kept:
                self._run(kept)
            return bool(kept)
        except Exception as err:  # noqa: BLE001 - a waiting request is answered, whatever failed here
            log.exception("the engine thread failed on a group of %d requests", len(group))
            for item in group:
                _answer(item, err)
            return False

    def _work(self) -> None:
        while (group := self._queue.take(self.max_batch, self.window_s)) is not None:
            passes, work = max(item.prepared.passes for item in group), sum(item.tokens for item in group)
            self._busy_until = time.monotonic() + self.cost.pessimistic(passes, work)  # ahead of new requests now ...
            self._queue.release()  # ... and no longer in the queue's count
            kept = self._serve(group)
            self._busy_until = 0.0
            with self._lock:
                self._depth -= len(group)
                for item in group:
                    self._states[item.key] -= 1
                    if self._states[item.key] <= 0:
                        del self._states[item.key]
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


def _answer(item: _Item, result) -> None:
    """``result`` to the request's waiter, on its event loop. A loop already closed (its caller stopped waiting, e.g.
    a fault path answering again after the answer went out) has no one to answer: never an error of the engine
    thread, which would die of it and leave every later request unanswered."""
    try:
        item.loop.call_soon_threadsafe(_resolve, item.future, result)
    except RuntimeError:  # the event loop is closed
        pass


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)
