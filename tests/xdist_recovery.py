"""A crashed pytest-xdist worker costs its one test, not the run: a fixed ``--dist loadfile`` scheduler, and what
killed the worker in the crashed test's report.

pytest-xdist 3.8.0 (the newest release) hangs the whole run after a worker crash under ``--dist loadfile``: its
``LoadScopeScheduling.remove_node`` puts every file the dead worker ever had back on the queue, those it had finished
included. A finished file reaches a worker as an empty list of tests, which never completes, so nothing reschedules
that worker again, and at the end of the run every worker waits for work that never comes (pytest-xdist issues
#1323, #1363, #1378; CI hit it in stop 27: one worker killed, then 80 idle minutes until the 90-minute limit). It
also runs the test the worker died on again, on the replacement, which the crash report has already failed (#1371).
No release carries the fixes, so this scheduler does what they do: only unfinished files go back, without the
crashed test, and a worker is topped up until it has more than two tests to run or the queue is empty (then it is
told to stop after them: a worker only runs a test once it knows the next one, or that there is none). A replacement
still collecting gets no work before its collection is in: when two workers crashed close together, the second's
rescheduling reached the first's replacement and pytest-xdist stopped on a KeyError (INTERNALERROR).

The report of the crashed test names how the worker process ended (a signal, or an exit status) and the machine's
memory at that moment, with the kernel's OOM-killer count where it can be read: SIGKILL with a grown OOM count is
the out-of-memory killer, which leaves no traceback behind. A crash by a fault (SIGSEGV, SIGABRT, ...) prints every
thread's Python stack: pytest arms faulthandler once, but a library can put SIGSEGV and SIGABRT back to their
default actions (Ray's ``ray.init``/``ray.shutdown`` do: the cluster tests ran a Ray driver inside their worker until
tests/ray_driver.py), after which that worker would die of a fault without a word; so faulthandler is armed again
before every test.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling


class RecoveringLoadFileScheduling(LoadFileScheduling):
    """``--dist loadfile`` that survives a worker crash (see the module's docstring)."""

    def remove_node(self, node):
        workload = self.assigned_work.pop(node)
        pending = [(scope, nodeid) for scope, unit in workload.items() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        scope, crashed = pending[0]  # a worker runs its tests in the order sent: the first unfinished one crashed
        workload[scope][crashed] = True  # failed by the crash report; never run again
        for unfinished, unit in workload.items():
            if not all(unit.values()):
                self.workqueue[unfinished] = unit
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node):
        if node.shutting_down or node not in self.registered_collections:
            return  # a replacement still collecting gets its work once its collection is in (schedule())
        held = set(self.assigned_work[node])
        try:
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()
        except OSError:  # the worker died and its removal is not in yet (a test it finished was reported first):
            for scope in set(self.assigned_work[node]) - held:  # what could not be sent goes back on the queue,
                self.workqueue[scope] = self.assigned_work[node].pop(scope)  # never blamed for the crash


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return RecoveringLoadFileScheduling(config, log)
    return None


_fault_fd: int | None = None


def pytest_configure(config):
    """A descriptor of this process's stderr as it is before any capture, for faulthandler (as pytest keeps one)."""
    global _fault_fd
    _fault_fd = os.dup(sys.__stderr__.fileno())


def pytest_runtest_setup(item):
    """faulthandler armed again (disable, then enable: a second enable alone changes nothing, even where a library
    has put the signals' default actions back)."""
    if _fault_fd is not None:
        faulthandler.disable()
        faulthandler.enable(file=_fault_fd, all_threads=True)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def how_it_ended(popen) -> str:
    """How a worker's process ended ("killed by SIGKILL", "exit status 3"), after waiting up to 10 s for it."""
    try:
        code = popen.wait(timeout=10)
    except Exception:  # noqa: BLE001 - a diagnosis must not turn into a second error
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def machine_memory() -> str:
    """MemAvailable, and the OOM-killer count of this cgroup (v2 memory.events, or v1 memory.oom_control)."""
    parts = []
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith(("MemTotal:", "MemAvailable:")):
            name, kib = line.split()[:2]
            parts.append(f"{name} {int(kib) // 1024} MiB")
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        for line in _read(path).splitlines():
            if line.startswith("oom_kill "):
                parts.append(f"OOM kills so far ({path}): {line.split()[1]}")
    return ", ".join(parts) or "unknown"


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    popen = getattr(getattr(getattr(getattr(report, "node", None), "gateway", None), "_io", None), "popen", None)
    ended = how_it_ended(popen) if popen is not None else "unknown"
    report.longrepr = f"{report.longrepr}\nthe worker's process: {ended}; memory now: {machine_memory()}"
