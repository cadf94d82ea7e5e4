"""The processes a command started, and making sure they are gone when it stops (Linux ``/proc``).

``ray.shutdown()`` stops the local cluster it started, but two of the raylet's children (``ray::DashboardAgent``
and ``ray::RuntimeEnvAgent``) outlive it, reparented to init, until someone kills them. ``onepass cluster``
notes its process tree while it runs and, after Ray's own shutdown, ends whatever of it is left: SIGTERM, a grace
period, then SIGKILL. Elsewhere (no ``/proc``) both are no-ops.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the name (state, ppid, ...), or None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # a name may hold ")" and spaces
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str) -> bool:
    """The same process (same start time: a reused pid is another one) and not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[19] == started and stat[0] != "Z"


def descendants(pid: int | None = None) -> dict[int, str]:
    """Every process below ``pid`` (this one by default), children of children included: pid -> start time."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(int(stat[1]), []).append((int(entry.name), stat[19]))
    out, todo = {}, [root]
    while todo:
        for child, started in children.get(todo.pop(), []):
            if child not in out:
                out[child] = started
                todo.append(child)
    return out


def end(procs: dict[int, str], grace_s: float = 5.0) -> set[int]:
    """Wait up to ``grace_s`` for ``procs`` (pid -> start time, from :func:`descendants`) to exit, then SIGTERM the
    rest, then SIGKILL what is still there after another ``grace_s``. Returns the pids that had to be signalled."""
    signalled: set[int] = set()
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        left = {p for p, started in procs.items() if _alive(p, started)}
        if not left:
            break
        if sig is not None:
            for p in left:
                try:
                    os.kill(p, sig)
                    signalled.add(p)
                except OSError:
                    pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p, procs[p]) for p in left):
            time.sleep(0.05)
    return signalled
