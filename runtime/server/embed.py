"""``AsyncEngine``: the engine for a user's asyncio service, with the server's request merging and deadlines.

``Engine.ask`` is thread-safe, so an async service may call it through a thread pool; but each call is then its
own pass, where ``onepass serve`` merges the requests about one state that arrive together into one packed pass
(11.5 against 1.4 requests/s for 16 clients asking about one ticket, docs/serving.md). ``AsyncEngine`` is that
merging without HTTP: the server's dispatcher (one engine thread, a bounded queue, deadline-aware admission),
awaited from the caller's event loop::

    async with AsyncEngine(Engine.load("engines/smollm2")) as engine:
        answers = await engine.ask(ticket, {"team": Choice("Which team?", {"billing": None, "technical": None})})

Errors are the engine's typed ones (``InvalidRequest``, ``LimitExceeded``), plus ``QueueFull`` (busy: retry
after ``retry_after_s``), ``NeverFits`` (the request alone needs more time than its timeout) and
``DeadlineExceeded`` (its timeout passed before the engine could answer: the engine's own deadline error), and
``EngineStopped`` after ``close()`` — every one an ``OnepassError``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from ..core.engine import Engine
from ..core.questions import Answer, Question
from .config import ServerConfig
from .dispatch import STUCK_S, Dispatcher
from .errors import DeadlineExceeded, EngineStopped, NeverFits, QueueFull

__all__ = ["AsyncEngine", "DeadlineExceeded", "EngineStopped", "NeverFits", "QueueFull"]
SERVER = ServerConfig()  # the defaults: those of `onepass serve`, one source for both


class AsyncEngine:
    """``engine`` behind a merging dispatcher: ``await ask(...)`` from any coroutine of one or more event loops."""

    def __init__(self, engine: Engine, *, window_ms: float = SERVER.batch_window_ms, max_queue: int = SERVER.max_queue,
                 max_batch: int = SERVER.max_batch, timeout_s: float = SERVER.request_timeout_s):
        if timeout_s <= 0 or window_ms < 0 or max_queue < 1 or max_batch < 1:
            raise ValueError("timeout_s must be > 0, window_ms >= 0, max_queue and max_batch >= 1")
        self.engine, self.timeout_s = engine, timeout_s
        self.dispatcher = Dispatcher(engine, max_queue, window_ms / 1000.0, max_batch)

    async def ask(self, state, questions: Mapping[str, Question], *, timeout_s: float | None = None) -> dict[str, Answer]:
        """Typed answers by question id, as ``Engine.ask``; requests about the same state that arrive within the
        window share one pass. ``timeout_s`` (default: the engine's) bounds the wait and the work."""
        seconds = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + seconds
        # checked, tokenised and sized once, off the caller's event loop (and off the engine thread)
        prepared = await asyncio.to_thread(self.engine.prepare, state, questions)
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"the timeout ({seconds:g} s) passed while the request was prepared")
        future = self.dispatcher.submit(prepared, deadline, budget=seconds)
        try:  # the dispatcher answers by the deadline; this bounds a wait on an engine thread that died meanwhile
            result = await asyncio.wait_for(future, seconds + STUCK_S)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"no answer within {seconds:g} s (+{STUCK_S:g} s): is the engine thread alive?") \
                from None
        if isinstance(result, BaseException):
            raise result
        return result.answers

    def close(self) -> None:
        """Answer what is queued, then stop the engine thread (the engine itself stays open)."""
        self.dispatcher.close()

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.close)
