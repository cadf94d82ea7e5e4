"""Giving memory back to the system after a pass: freed heap pages, and a backend's grown working memory.

After one large request, glibc's malloc holds its freed arenas, so the process RSS stays at the
request's peak long after it is answered. ``malloc_trim(0)`` returns free pages at the top of
each arena and unused whole pages inside them; it costs well under a millisecond on this
server's heap. Elsewhere (macOS, musl) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        _libc = None


def release_free_memory() -> None:
    """Return the allocator's free pages to the system (glibc only)."""
    if _libc is not None:
        _libc.malloc_trim(0)


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set size, this one by default (Linux /proc; 0 where unknown)."""
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


log = logging.getLogger("onepass.memory")

RETURN_FACTOR = 1.2  # a server idle after heavy requests returns to at most this times its warm resident size


class MemoryFloor:
    """The resident size a server returns to once idle: its size when warm (``mark``), times ``factor``.

    Resident means RSS less the state caches' bytes: a cache is memory the operator sized (``--cache-mib``,
    reported in ``/metrics``) and keeping recent states is its job. What grows past the floor is working memory a
    backend sized to its largest pass and kept (OpenVINO's compiled model keeps a gigabyte after a 1000-option
    choice); when the engine thread goes idle above the floor, each engine's backend is asked to release it
    (:meth:`Backend.release_memory`) on a thread of its own, so its cost (a second or two of CPU: OpenVINO compiles
    again) holds no request up. If a release leaves the process above the floor anyway (memory no backend can give
    back), the next one waits for that much more growth: releases never repeat on every idle moment. Where RSS is
    unknown (no /proc) nothing is released.
    """

    def __init__(self, engines, factor: float = RETURN_FACTOR, rss=rss_bytes, on_release=None,
                 background: bool = True):
        self.engines = [e for e in (engines if isinstance(engines, (list, tuple)) else [engines]) if e is not None]
        self.factor, self._rss, self.background = factor, rss, background
        self.on_release = on_release or (lambda: None)
        self.floor: int | None = None  # bytes, once warm
        self.limit: float | None = None  # release above this: factor x floor, raised when a release cannot reach it
        self.releases = 0
        self._running: threading.Thread | None = None

    def resident(self) -> int | None:
        rss = self._rss()
        return rss - sum(e.cache.bytes for e in self.engines) if rss > 0 else None

    def mark(self) -> None:
        """Take the current resident size (after a trim) as the warm floor."""
        release_free_memory()
        size = self.resident()
        self.floor = size if size and size > 0 else None
        self.limit = self.factor * self.floor if self.floor else None

    def on_idle(self) -> bool:
        """Start a release if the resident size is above the limit (and none is running); True if one started."""
        size = self.resident()
        if self.limit is None or size is None or size <= self.limit:
            return False
        if self._running is not None and self._running.is_alive():
            return False
        if not self.background:
            self._release(size)
            return True
        self._running = threading.Thread(target=self._release, args=(size,), name="onepass-memory", daemon=True)
        self._running.start()
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Until a running release ends (tests, shutdown)."""
        if self._running is not None:
            self._running.join(timeout)

    def _release(self, before: int) -> None:
        try:
            released = [e.release_memory() for e in self.engines]
        except Exception:  # noqa: BLE001 - the next pass will show a broken backend; housekeeping never raises
            log.exception("releasing the backends' working memory failed")
            return
        release_free_memory()
        after = self.resident() or before
        # what a release could not give back becomes the new base: the next release waits for growth beyond it
        self.limit = max(self.factor * self.floor, self.factor * after)
        if any(released):
            self.releases += 1
            self.on_release()
            log.info("released the backends' working memory when idle: resident %d MiB -> %d MiB (warm %d MiB)",
                     before >> 20, after >> 20, self.floor >> 20)
