"""The engine queue is fair between clients (``runtime/server/fairness.py``, virtual-time fair queueing) and the
dispatcher serves and admits by it.

* A quiet client's request is taken right after the one in service, however many heavy requests other clients keep
  queued; the control, the same requests first come first served, would take it last.
* A client that just ran heavy work keeps its place behind the others: going quiet a moment buys nothing.
* Requests about one state are taken together whichever clients sent them, and the batch window waits for more.
* Admission counts only the work queued ahead of the client: a ninth client is admitted where eight heavy requests
  queued ahead of it would have made it a 429.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fake_engine import FakeEngine

from onepass import Noul
from onepass.runtime.server.fairness import FairQueue

pytest.importorskip("fastapi")


def _items(queue: FairQueue) -> list:
    out = []
    while len(queue):
        out += queue.take(1, 0.0)
    return out


def test_a_quiet_clients_request_is_taken_after_the_one_in_service():
    queue = FairQueue(key=lambda item: item)
    for i in range(5):
        queue.put("heavy", f"heavy {i}", cost=1.0)
    assert queue.take(1, 0.0) == ["heavy 0"]  # in service
    queue.put("quiet", "quiet 0", cost=0.01)
    assert _items(queue) == ["quiet 0", "heavy 1", "heavy 2", "heavy 3", "heavy 4"]


def test_first_come_first_served_is_the_control():
    """The same requests with one client key (what the queue was before it had clients): the quiet one is last."""
    queue = FairQueue(key=lambda item: item)
    for i in range(5):
        queue.put("everyone", f"heavy {i}", cost=1.0)
    queue.take(1, 0.0)
    queue.put("everyone", "quiet 0", cost=0.01)
    assert _items(queue)[-1] == "quiet 0"


def test_clients_alternate_by_their_costs_and_a_heavy_client_cannot_jump_ahead_by_pausing():
    queue = FairQueue(key=lambda item: item)
    for i in range(3):
        queue.put("a", f"a{i}", cost=1.0)
        queue.put("b", f"b{i}", cost=1.0)
    assert _items(queue) == ["a0", "b0", "a1", "b1", "a2", "b2"]
    queue.put("big", "big0", cost=10.0)  # runs at once (nothing queued) ...
    assert queue.take(1, 0.0) == ["big0"]
    queue.put("big", "big1", cost=1.0)  # ... and its next request waits its turn behind the others' queued work
    for i in range(3):
        queue.put("small", f"small{i}", cost=1.0)
    assert _items(queue) == ["small0", "small1", "small2", "big1"]


def test_requests_about_one_state_are_taken_together_and_the_window_waits_for_more():
    queue = FairQueue(key=lambda item: item[0])
    queue.put("a", ("state 1", "a"), 1.0)
    queue.put("b", ("state 2", "b"), 1.0)
    queue.put("c", ("state 1", "c"), 1.0)
    assert queue.take(8, 0.0) == [("state 1", "a"), ("state 1", "c")]  # b's state waits for its own turn
    late = threading.Timer(0.05, lambda: queue.put("d", ("state 2", "d"), 1.0))
    late.start()
    assert queue.take(8, 2.0) == [("state 2", "b"), ("state 2", "d")]  # d arrived within b's window
    queue.close()
    assert queue.take(1, 0.0) is None


def test_ahead_counts_what_is_taken_before_a_new_request_of_that_client():
    queue = FairQueue(key=lambda item: item)
    queue.put("heavy", "h0", 5.0)
    queue.put("heavy", "h1", 5.0)
    assert queue.ahead("heavy", 1.0) == 10.0  # behind its own two
    assert queue.ahead("quiet", 1.0) == 0.0  # it would finish first
    assert queue.ahead("quiet", 7.0) == 5.0  # a larger one after the first (it finishes before it)


def test_the_finish_tags_of_idle_clients_are_bounded():
    from onepass.runtime.server.fairness import MAX_IDLE

    queue = FairQueue(key=lambda item: item)
    for i in range(3 * MAX_IDLE):
        queue.put(f"client {i}", i, 0.001)
        queue.take(1, 0.0)
    assert MAX_IDLE // 2 <= len(queue._finish) <= MAX_IDLE + 1


class _Recording(FakeEngine):
    """Runs a group when released, recording the order of the states."""

    def __init__(self):
        super().__init__()
        self.release, self.order = threading.Event(), []

    def run_group(self, prepared, readout=None, deadline=None):
        self.order.append(self.text(prepared[0]))
        self.release.wait(30)
        return [self.text(p) for p in prepared]


def test_the_dispatcher_admits_and_serves_a_ninth_client_after_the_pass_in_service():
    """Eight clients each keep a heavy request queued (2 s of work each by the cost model; 10 s deadlines), a ninth
    sends a one-question request with a 3 s deadline: admitted (16 s of work is queued, but not ahead of it) and run
    right after the pass in service. The control: the same request from one of the heavy clients is a 429."""
    from onepass.runtime.server.dispatch import Dispatcher, QueueFull

    engine = _Recording()
    dispatcher = Dispatcher(engine, max_queue=64, window_s=0.0, max_batch=16)
    for i in range(40):  # an exact model: 1 ms per token-equivalent, 0.01 s a pass
        dispatcher.observe(1, 1000.0 * (1 + i % 2), 0.01 + 0.001 * 1000.0 * (1 + i % 2))
    heavy = " ".join(f"word{i}" for i in range(2000))
    loop = asyncio.new_event_loop()

    async def main():
        futures = [dispatcher.submit(engine.prepare(f"{heavy} client {c}", {"q": Noul("Is it?")}),
                                     time.monotonic() + 60, client=f"heavy {c}") for c in range(8)]
        while not engine.order:
            await asyncio.sleep(0.01)
        with pytest.raises(QueueFull, match="queued ahead"):
            dispatcher.submit(engine.prepare("a quiet question", {"q": Noul("Is it?")}), time.monotonic() + 3,
                              client="heavy 3")
        futures.append(dispatcher.submit(engine.prepare("a quiet question", {"q": Noul("Is it?")}),
                                         time.monotonic() + 3, client="quiet"))
        engine.release.set()
        return await asyncio.wait_for(asyncio.gather(*futures), 60)

    try:
        answers = loop.run_until_complete(main())
    finally:
        engine.release.set()
        dispatcher.close()
        loop.close()
    assert answers[-1] == "a quiet question"
    assert engine.order[1] == "a quiet question"  # right after the pass that was in service


def test_a_heavy_request_about_the_same_state_does_not_ride_ahead_with_a_light_one():
    """A queued a light and a heavy request about one state, B a light one about another: the first take is A's
    light one alone (the heavy one's finish tag is past B's), then B's, then A's heavy one; ``ahead`` says the same
    (B's request has only A's light one before it)."""
    queue = FairQueue(key=lambda item: item[0])
    queue.put("a", ("state 1", "a light"), 0.01)
    queue.put("a", ("state 1", "a heavy"), 5.0)
    assert queue.ahead("b", 0.01) == pytest.approx(0.01)
    queue.put("b", ("state 2", "b light"), 0.01)
    assert [queue.take(8, 0.0) for _ in range(3)] == [[("state 1", "a light")], [("state 2", "b light")],
                                                        [("state 1", "a heavy")]]


def test_a_request_the_fair_order_keeps_waiting_is_taken_by_its_latest_start():
    """One-shot clients start at the virtual time, so a stream of them finishes before a heavy request forever; a
    request that would start after its latest start (its deadline less its cost) if the next fair one went first is
    taken first. Control: without a deadline, the newcomer goes first."""
    for latest, first in ((time.monotonic() + 1.0, "heavy"), (float("inf"), "newcomer")):
        queue = FairQueue(key=lambda item: item)
        queue.put("h", "heavy", 5.0, latest=latest)
        queue.put("n", "newcomer", 2.0)
        assert queue.take(1, 0.0) == [first]


def test_a_request_taken_but_still_in_its_batch_window_is_counted_ahead():
    """While ``take`` waits its batch window for more requests about the state it took, that request is neither
    queued nor in service: its cost is still ahead of a request admitted meanwhile (one admitted in those 2 ms was
    told nothing was ahead, and waited behind a 37 s pass). ``release`` hands the count to the engine thread."""
    queue = FairQueue(key=lambda item: item)
    queue.put("a", "big", 40.0)
    taken: list = []
    worker = threading.Thread(target=lambda: taken.extend(queue.take(4, 0.5)))
    worker.start()
    time.sleep(0.1)  # the big one is popped; the window is still open
    assert queue.ahead("b", 0.3) == pytest.approx(40.0)
    worker.join(5)
    assert taken == ["big"] and queue.ahead("b", 0.3) == pytest.approx(40.0)
    queue.release()
    assert queue.ahead("b", 0.3) == 0.0
