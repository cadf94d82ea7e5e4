"""`onepass bench` as a user runs it, on the tiny engine (seconds): warm/cold/prefill kinds with their stage
histograms, backends side by side, both report plots, Ctrl-C keeping what was measured, and one-line errors.
The percentile arithmetic and coordinated-omission correction are proven in test_loadgen.py; the HTTP mode
against a real server in test_server.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from onepass.cli import main
from onepass.runtime.tools.bench import parse_server_timing
from onepass.runtime.tools.loadgen import closed_loop, open_loop

QUESTIONS = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
             "team": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "technical"]}}
FLOOR_MS = 0.001  # the histogram's 1 µs floor: what a 0 ms stage (a cached state's prefill) reads as


def default_sigint() -> None:
    """In the child: SIGINT's default action, so Python raises KeyboardInterrupt on it even when this test runs
    under a shell that ignores SIGINT in background jobs (as `nohup make test &` does)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def workload(tmp_path):
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps(QUESTIONS))
    states = tmp_path / "states"
    states.mkdir()
    for i in range(3):
        (states / f"{i}.txt").write_text(f"Customer {i}: I was charged twice for order {i}; please refund it.")
    return questions, states


def test_stage_times_get_histograms_of_their_own():
    run = closed_loop(lambda: {"prefill": 5.0, "score": 20.0}, concurrency=1, requests=50)
    stages = run.summary()["stages"]
    assert stages["prefill"]["p50"] == pytest.approx(5.0, rel=1e-2) and stages["prefill"]["count"] == 50
    assert stages["score"]["p99"] == pytest.approx(20.0, rel=1e-2)
    assert "stages" not in closed_loop(lambda: None, concurrency=1, requests=5).summary()  # control: none sent


def test_server_timing_is_parsed_without_total():
    assert parse_server_timing("queue;dur=5.74, tokenize;dur=0.58, prefill;dur=107.04, total;dur=198.18") == {
        "queue": 5.74, "tokenize": 0.58, "prefill": 107.04}
    assert parse_server_timing(None) == {} and parse_server_timing("x;desc=a, y;dur=oops") == {}


CTRL_C_RUN = """
import json, os, signal, threading, time
from onepass.runtime.tools.loadgen import open_loop
signal.signal(signal.SIGINT, signal.default_int_handler)
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
run = open_loop(lambda: time.sleep(0.001), rate=50, duration=60)
restored = signal.getsignal(signal.SIGINT) is signal.default_int_handler
print(json.dumps({"handler_restored": restored, **run.summary()}))
"""


def test_ctrl_c_ends_the_run_and_keeps_what_was_measured():
    """A real SIGINT mid-run: the open loop stops early, marked interrupted, with its answers, and its own handler is
    gone after it. In a process of its own: sent to a pytest worker that had loaded the inference libraries of earlier
    tests, the signal once killed the worker (SIGSEGV, cause not found; never in a plain process)."""
    out = subprocess.run([sys.executable, "-c", CTRL_C_RUN], capture_output=True, text=True, timeout=120,
                         preexec_fn=default_sigint)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["handler_restored"] and summary["interrupted"] and 0 < summary["requests"] < 50 * 60 * 0.5


GC_CTRL_C_RUN = """
import json, signal, threading, time, weakref
from onepass.runtime.tools import loadgen
from onepass.runtime.core.interrupt import ctrl_c_sets
from onepass.runtime.tools.loadgen import Run, _wait, open_loop

def collect_with_sigint():  # a weak-reference callback raises SIGINT: its handler runs inside a GC callback
    class Thing:
        pass
    thing = Thing()
    ref = weakref.ref(thing, lambda _: signal.raise_signal(signal.SIGINT))
    del thing

out = {}
signal.signal(signal.SIGINT, signal.default_int_handler)
real = loadgen.poisson_schedule
loadgen.poisson_schedule = lambda *a: collect_with_sigint() or real(*a)
started = time.perf_counter()
run = open_loop(lambda: None, rate=50, duration=5)  # SIGINT before the first sender exists
out["starting"] = [run.interrupted, run.count, time.perf_counter() - started]
loadgen.poisson_schedule = real
stop, run, polls = threading.Event(), Run("open"), []

def threads_done():  # the senders: they finish once told to stop, else after 200 polls (~10 s)
    polls.append(1)
    if len(polls) == 3:
        collect_with_sigint()
    return stop.is_set() or len(polls) > 200

with ctrl_c_sets(stop, run.mark_interrupted) as interrupt:
    _wait(threads_done, interrupt)
out["waiting"] = [run.interrupted, stop.is_set(), len(polls)]
out["restored"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
try:
    collect_with_sigint()  # control: the default handler's KeyboardInterrupt is dropped in the callback
    out["control_dropped"] = True
except KeyboardInterrupt:
    out["control_dropped"] = False
print(json.dumps(out))
"""


def test_a_ctrl_c_that_lands_in_a_garbage_collector_callback_still_ends_the_run():
    """Seen twice under pytest-xdist: Python's default SIGINT handler ran inside a weak-reference callback (the
    thread pool's and torch's weak dictionaries run them), where a KeyboardInterrupt is printed and dropped, and the
    run went on to its end. Here a weak-reference callback raises SIGINT itself, once while the senders are being
    started and once while the run waits: the run ends, interrupted, both times. Control: under the default handler
    the same callback's Ctrl-C never reaches the caller. In a process of its own, as the test above: a real SIGINT in
    a pytest worker that had loaded the inference libraries of earlier tests killed it once more (SIGSEGV)."""
    done = subprocess.run([sys.executable, "-c", GC_CTRL_C_RUN], capture_output=True, text=True, timeout=120,
                          preexec_fn=default_sigint)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    interrupted, count, seconds = out["starting"]
    assert interrupted and count == 0 and seconds < 4
    interrupted, stopped, polls = out["waiting"]
    assert interrupted and stopped and polls < 10
    assert out["restored"] and out["control_dropped"]


def test_a_sigint_ignored_before_the_run_stays_ignored():
    """Under nohup SIGINT comes in ignored: the run neither installs a handler nor stops."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        run = open_loop(lambda: None, rate=50, duration=0.6)
        timer.join()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not run.summary()["interrupted"]


def test_bench_engine_kinds_backends_stages_and_plots(tiny_engine_dir, workload, tmp_path, capsys):
    questions, states = workload
    out = tmp_path / "report"
    assert main(["bench", "--engine", str(tiny_engine_dir), "--states", str(states), "--questions", str(questions),
                 "--backend", "onnxruntime", "torch-cpu", "--rate", "20", "--concurrency", "1", "--requests", "20",
                 "--warmup", "1", "--report", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    runs = {(r["target"], r["kind"], r["mode"]): r for r in report["runs"]}
    for backend in ("onnxruntime", "torch-cpu"):
        assert {k for t, k, _ in runs if t == backend} == {"warm", "cold", "prefill"}
        warm, cold = runs[(backend, "warm", "closed")], runs[(backend, "cold", "closed")]
        assert warm["requests"] == cold["requests"] == 20 and not warm["failures"]
        assert warm["stages"]["prefill"]["p99"] == FLOOR_MS  # every warm state came from the cache
        assert cold["stages"]["prefill"]["p50"] > FLOOR_MS  # every cold one was prefilled
        assert set(runs[(backend, "prefill", "closed")]["stages"]) == {"prefill", "host"}
    assert report["workload"]["states"] == 3 and report["machine"]["cores"] == os.cpu_count()
    assert report["targets"][0]["manifest_sha256"] and not report["interrupted"]
    text = (out / "bench.md").read_text()
    assert "| onnxruntime | cold | closed | 1 | 20 | 0 |" in text and "prefill p50 / p99 ms" in text
    for png in ("latency_cdf.png", "throughput_p99.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_backend_with_a_device_clock_gets_a_device_stage(tiny_engine_dir, workload, monkeypatch):
    """On a backend with a device clock (torch-cuda: CUDA events) every warm and prefill request records a
    ``device`` stage from its own timer. Stood in for here by a clock that reports 3 ms; control: the plain CPU
    backend has no device stage."""
    from onepass.runtime.tools import bench
    from onepass.runtime.backends.ort import OrtBackend

    questions, states = workload
    body, texts = {"questions": json.loads(questions.read_text())}, [p.read_text() for p in sorted(states.iterdir())]

    def stages(kind):
        targets, _ = bench.engine_targets(str(tiny_engine_dir), ["onnxruntime"], None, body, texts, 0.0, 0)
        return closed_loop(targets[0].sender(kind), concurrency=2, requests=6).summary()["stages"]

    assert "device" not in stages("warm")  # control
    started = []

    class Clock:
        def start(self):
            started.append(self)

        def stop(self):
            assert self in started  # its own start, even with 2 senders
            return 3.0

    monkeypatch.setattr(OrtBackend, "device_timer", lambda self: Clock())  # as onnxruntime-gpu's CUDA events
    for kind in ("warm", "prefill"):
        device = stages(kind)["device"]
        assert device["count"] == 6 and device["p50"] == pytest.approx(3.0, rel=1e-2)
    assert len(set(map(id, started))) == 12  # one timer per call


@pytest.mark.parametrize("args, message", [
    (["--rate", "0"], "--rate must be positive"),
    (["--rate", "100000", "--duration", "60"], "schedules at most"),
    (["--cold-fraction", "1.5"], "--cold-fraction must be within 0..1"),
    (["--concurrency", "0"], "--concurrency must be 1..1024"),
])
def test_bad_loads_are_one_line_errors(tiny_engine_dir, workload, capsys, args, message):
    questions, states = workload
    assert main(["bench", "--engine", str(tiny_engine_dir), "--states", str(states), "--questions", str(questions),
                 *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_command_interrupted_by_ctrl_c_still_writes_its_report(tiny_engine_dir, workload, tmp_path):
    """`onepass bench` in its own process, SIGINT a second into a 600-second run: exit 0 and a report of what was
    measured, marked interrupted."""
    questions, states = workload
    out = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "onepass", "bench", "--engine", str(tiny_engine_dir), "--states",
                             str(states), "--questions", str(questions), "--backend", "onnxruntime", "--kind", "warm",
                             "cold", "--concurrency", "1", "--duration", "600", "--report", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        plan = proc.stdout.readline()  # said before it starts: 2 runs of 600 s
        assert plan.startswith("2 runs planned: about 1200 s of measuring"), plan
        line = proc.stdout.readline()
        assert "onnxruntime warm concurrency 1: measuring for 600 s" in line, line
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    report = json.loads((out / "bench.json").read_text())
    assert proc.returncode == 0 and report["interrupted"]
    assert len(report["runs"]) == 1 and report["runs"][0]["requests"] > 0 and report["runs"][0]["interrupted"]
    assert "Interrupted (Ctrl-C)" in (out / "bench.md").read_text()


def test_the_host_stage_is_the_call_outside_the_device_or_the_backends_passes(monkeypatch):
    """``host`` = the call's wall time minus its device spans on a backend with a device clock, else minus its
    prefill and score (the backend's passes). A fake clock makes the arithmetic exact: a call of 25 ms whose score
    took 20 is 5 ms of host; with 18 ms of device spans, 7. Control: the spans, not the score, are subtracted
    where there are any."""
    from onepass.runtime.tools import bench

    now = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])

    class Backend:
        spans = None

    class Engine:
        backend = Backend()

    def call(spans=()):
        def run():
            now[0] += 0.025
            if Engine.backend.spans is not None:
                Engine.backend.spans.extend(spans)
            return {"tokenize": 1.0, "prefill": 0.0, "score": 20.0}
        return run

    cpu = bench._on_device_clock(Engine, call())
    assert cpu["host"] == pytest.approx(5.0) and "device" not in cpu
    gpu = bench._on_device_clock(Engine, call([10.0, 8.0]))
    assert gpu["device"] == pytest.approx(18.0) and gpu["host"] == pytest.approx(7.0)
