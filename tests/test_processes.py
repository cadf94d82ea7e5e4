"""runtime/server/processes.py: the process tree below a process, and ending what of it is left (what `onepass
cluster` does after Ray's own shutdown)."""

import subprocess
import sys
import time

import pytest

from onepass.runtime.server.processes import descendants, end

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")


def test_children_of_children_are_found_and_ended_and_a_reused_pid_is_not_touched():
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                               "subprocess.Popen(['sleep', '60']); time.sleep(60)"])
    try:
        for _ in range(100):  # the grandchild appears once the child has started it
            tree = descendants()
            if len([p for p in tree if p != parent.pid]) >= 1 and parent.pid in tree:
                break
            time.sleep(0.05)
        assert parent.pid in tree and len(tree) >= 2
        other = subprocess.Popen(["sleep", "60"])
        try:
            ours = {p: t for p, t in tree.items() if p != other.pid}
            fake = {other.pid: "1"}  # the same pid with another start time: a reused pid is another process
            assert end(fake, grace_s=0.1) == set() and other.poll() is None
            signalled = end(ours, grace_s=0.5)
            assert signalled >= {parent.pid}
            parent.wait(timeout=10)
            assert other.poll() is None  # untouched
        finally:
            other.kill()
            other.wait()
    finally:
        parent.kill()
        parent.wait()


def test_processes_that_exit_by_themselves_are_not_signalled():
    quick = subprocess.Popen(["sleep", "0.2"])
    tree = {p: t for p, t in descendants().items() if p == quick.pid}
    assert end(tree, grace_s=5.0) == set()
    quick.wait()
