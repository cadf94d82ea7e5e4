"""Giving freed memory back to the system after a pass (glibc keeps freed heap pages otherwise).

After one large request, glibc's malloc holds its freed arenas, so the process RSS stays at the
request's peak long after it is answered. ``malloc_trim(0)`` returns free pages at the top of
each arena and unused whole pages inside them; it costs well under a millisecond on this
server's heap. Elsewhere (macOS, musl) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
