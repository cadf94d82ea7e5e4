"""Ctrl-C as a flag, not an exception, for code that waits on threads (the bench load loops, `onepass cluster`).

Python's default SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be. When that is a
garbage-collector callback (the thread pool's and torch's weak dictionaries run them) the exception is printed as
"Exception ignored" and dropped: the Ctrl-C is lost and the wait goes on. Inside :func:`ctrl_c_sets` a handler
only sets a flag, which nothing can drop.
"""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def ctrl_c_sets(stop: threading.Event, then=None):
    """While inside, SIGINT sets ``stop`` and calls ``then()``; yields that action, for a caller that still catches a
    KeyboardInterrupt raised by another handler. Only the main thread can install a handler: elsewhere nothing
    changes. A SIGINT ignored before (nohup) stays ignored; the previous handler is back on leaving."""
    def interrupt(*_):
        stop.set()
        if then is not None:
            then()

    installed, previous = False, None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGINT)
        if previous is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, interrupt)
            installed = True
    try:
        yield interrupt
    finally:
        if installed:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def stop_signals_set(stop: threading.Event):
    """For a long-running service (``onepass cluster``): SIGINT and SIGTERM both set ``stop``, even where SIGINT was
    inherited ignored (a background job of a script: ``onepass cluster ... & kill -INT $!``), so containers and
    process managers (SIGTERM) and a script's ``kill -INT`` stop it cleanly. Main thread only; handlers restored."""
    def interrupt(*_):
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: a handler set from C
