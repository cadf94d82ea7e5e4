"""The engine's work queue: a bounded queue in front of one worker thread.

The HTTP layer never runs inference on the event loop: it submits a request and awaits
a future. The worker takes the first waiting request, waits up to the batch window for
more, and hands them to ``Engine.run_many`` — requests about the same state share one
packed pass, each as its own subtrees.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

from ..engine import Engine


class QueueFull(Exception):
    """The bounded queue is full: answer 429 with Retry-After."""


class Dispatcher:
    """Bounded queue + one inference thread. ``submit`` is called from the event loop."""

    def __init__(self, engine: Engine, max_queue: int, window_s: float, max_batch: int, on_batch=None):
        self.engine = engine
        self.max_queue, self.window_s, self.max_batch = max_queue, window_s, max_batch
        self.on_batch = on_batch or (lambda size: None)
        self._queue: queue.Queue = queue.Queue()
        self._depth = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="onepass-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests submitted and not yet answered."""
        return self._depth

    def submit(self, state, questions) -> asyncio.Future:
        """Queue one parsed request; the future resolves to a Result or an OnepassError."""
        with self._lock:
            if self._depth >= self.max_queue:
                raise QueueFull(f"{self._depth} requests are waiting (limit {self.max_queue})")
            self._depth += 1
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((state, questions, loop, future))
        return future

    def close(self) -> None:
        """Stop the worker after the work already queued."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _take_batch(self):
        first = self._queue.get()
        if first is None:
            return None
        batch, deadline = [first], time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            batch.append(item)
        return batch

    def _work(self) -> None:
        while (batch := self._take_batch()) is not None:
            try:
                results = self.engine.run_many([(s, q) for s, q, _, _ in batch])
            except Exception as err:  # noqa: BLE001 - an engine fault must reach every waiting request
                results = [err] * len(batch)
            self.on_batch(len(batch))
            for (_, _, loop, future), result in zip(batch, results):
                loop.call_soon_threadsafe(_resolve, future, result)
            with self._lock:
                self._depth -= len(batch)


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)
