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

    Resident means RSS less the state cache's bytes: the cache is memory the operator sized (``--cache-mib``,
    reported in ``/metrics``) and keeping recent states is its job. What grows past the floor is working memory a
    backend sized to its largest pass and kept (OpenVINO's compiled model keeps a gigabyte after a 1000-option
    choice); when the engine thread goes idle above the floor, the backend is asked to release it
    (:meth:`Backend.release_memory`), so the cost (about a second of CPU) delays no request.
    """

    def __init__(self, engine, factor: float = RETURN_FACTOR, rss=rss_bytes, on_release=None):
        self.engine, self.factor, self._rss = engine, factor, rss
        self.on_release = on_release or (lambda: None)
        self.floor: int | None = None  # bytes, once warm
        self.releases = 0

    def resident(self) -> int:
        return self._rss() - self.engine.cache.bytes

    def mark(self) -> None:
        """Take the current resident size (after a trim) as the warm floor."""
        release_free_memory()
        self.floor = self.resident()

    def on_idle(self) -> bool:
        """Release the backend's working memory if the resident size is above ``factor`` times the floor; True if
        it was released."""
        if not self.floor:
            return False
        before = self.resident()
        if before <= self.factor * self.floor or not self.engine.release_memory():
            return False
        release_free_memory()
        self.releases += 1
        self.on_release()
        log.info("released the backend's working memory when idle: resident %d MiB -> %d MiB (warm %d MiB)",
                 before >> 20, self.resident() >> 20, self.floor >> 20)
        return True
