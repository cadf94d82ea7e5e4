"""The engine queue shared fairly between clients: virtual-time fair queueing over a client key.

Each client (the peer address, or a configured header such as an API key) has its own queue. A request's *start
tag* is the later of the queue's virtual time and the finish tag of its client's previous request; its *finish tag*
adds its cost (its predicted seconds). The engine thread takes the request with the smallest finish tag, and the
virtual time moves to that request's start tag. So a quiet client's small request, which starts at the virtual
time and finishes a moment later, is taken right after the pass in service, ahead of the heavy requests other
clients keep queued (first come first served let eight clients with one 300-word request each hold a ninth
client's one-question request behind eight passes: 41 of 46 refused); heavy clients share the engine's time in
turn, each by the work it asks for; and a client that just ran heavy work keeps its finish tag until the virtual
time passes it: it cannot jump ahead by going quiet for a moment.

A client the fair order keeps behind newcomers (a stream of one-shot clients starts at the virtual time, ahead of
a heavy request's finish tag) is served by its deadline: a request that would otherwise start after its latest
start (its deadline less its predicted seconds) is taken first. Requests about one state are still answered
together: ``take`` returns the request taken and every queued request about the same state whose finish tag is not
past any other state's (up to a batch), whichever clients sent them, waiting up to the batch window for more.
Touched from the event loop (``put``, ``ahead``) and the engine thread (``take``), under one lock.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from dataclasses import dataclass, field

MAX_IDLE = 1024  # finish tags kept of clients with nothing queued


@dataclass(order=True)
class _Entry:
    finish: float
    seq: int
    start: float = field(compare=False)
    cost: float = field(compare=False)
    item: object = field(compare=False)
    latest: float = field(default=math.inf, compare=False)  # monotonic time by which it must start to end in time


class FairQueue:
    """Items of several clients in fair order (the smallest virtual finish tag first, an item about to miss its
    latest start before it); ``key(item)`` groups items that run together."""

    def __init__(self, key=lambda item: item):
        self._key = key
        self._queues: dict = {}  # client -> deque of _Entry
        self._finish: dict = {}  # client -> the finish tag of its last request
        self._virtual = 0.0
        self._taking = 0.0  # the cost of the items the last take popped, until ``release``: counted as ahead
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def put(self, client, item, cost: float, latest: float = math.inf) -> None:
        """Queue ``item`` of ``client`` weighing ``cost`` (its predicted seconds), to start by ``latest`` (monotonic
        seconds: its deadline less its cost)."""
        with self._cond:
            start = max(self._virtual, self._finish.get(client, 0.0))
            finish = self._finish[client] = start + max(cost, 0.0)
            self._queues.setdefault(client, collections.deque()).append(
                _Entry(finish, next(self._seq), start, cost, item, latest))
            self._cond.notify_all()

    def ahead(self, client, cost: float) -> float:
        """The cost queued ahead of a new item of ``client`` weighing ``cost``: every queued item whose finish tag is
        not above the one it would get (they are taken first)."""
        with self._cond:
            finish = max(self._virtual, self._finish.get(client, 0.0)) + max(cost, 0.0)
            return self._taking + sum(e.cost for q in self._queues.values() for e in q if e.finish <= finish)

    def release(self) -> None:
        """The items the last ``take`` popped are counted elsewhere now (the engine thread's pass in service): no
        longer ahead in the queue."""
        with self._cond:
            self._taking = 0.0

    def close(self) -> None:
        """Wake every ``take``: once the queue is empty it returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take(self, limit: int, window_s: float) -> list | None:
        """The item taken next (``_next``) and the queued items with the same key (any client, in tag order), at most
        ``limit`` in all, waiting up to ``window_s`` for more of that key; None once closed and empty. Blocks until an
        item is queued. Their cost stays ahead of new items until ``release``."""
        with self._cond:
            while not self._queues:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._pop(self._next())
            taken, until = [first.item], time.monotonic() + window_s
            self._taking = first.cost  # while the window waits, ahead of any request admitted meanwhile
            key = self._key(first.item)
            while len(taken) < limit:
                taken += self._matching(key, limit - len(taken))
                left = until - time.monotonic()
                if len(taken) >= limit or left <= 0 or self._closed:
                    break
                self._cond.wait(left)  # until another item is queued, or the window ends
            self._forget_idle()
            return taken

    def _next(self):
        """The client whose oldest item is taken now: the smallest finish tag, unless taking it first would make
        another client's oldest item start after its latest start while it still can make it (a client the fair
        order keeps behind new arrivals is then served by its deadline, never starved)."""
        now = time.monotonic()
        fair = min(self._queues, key=lambda c: self._queues[c][0])
        urgent = min(self._queues, key=lambda c: self._queues[c][0].latest)
        late = self._queues[urgent][0].latest
        return urgent if urgent != fair and now <= late < now + self._queues[fair][0].cost else fair

    def _pop(self, client) -> _Entry:
        entry = self._queues[client].popleft()
        if not self._queues[client]:
            del self._queues[client]
        self._virtual = max(self._virtual, entry.start)
        return entry

    def _matching(self, key, limit: int) -> list:
        """Queued items with ``key`` (removed), in tag order, at most ``limit``: those whose finish tag is not past
        any item about another state (they would run before it anyway); a heavier one waits for its own turn
        instead of riding ahead of the others with a light one."""
        others = min((e.finish for q in self._queues.values() for e in q if self._key(e.item) != key),
                     default=math.inf)
        found = sorted((e, c) for c, q in self._queues.items() for e in q
                       if self._key(e.item) == key and e.finish <= others)[:limit]
        self._taking += sum(e.cost for e, _ in found)
        for entry, client in found:
            self._queues[client].remove(entry)
            if not self._queues[client]:
                del self._queues[client]
        return [e.item for e, _ in found]

    def _forget_idle(self) -> None:
        """Drop the finish tags of clients with nothing queued that the virtual time has reached (they start at it
        anyway), and past ``MAX_IDLE`` of them the smallest (whose clients then start at the virtual time a little
        early): the memory stays bounded whatever the number of clients."""
        if len(self._finish) <= len(self._queues) + MAX_IDLE:
            return
        idle = sorted((f, c) for c, f in self._finish.items() if c not in self._queues and f > self._virtual)
        keep = {c for _, c in idle[-(MAX_IDLE // 2):]} | set(self._queues)  # half: pruned once per MAX_IDLE / 2
        self._finish = {c: f for c, f in self._finish.items() if c in keep}
