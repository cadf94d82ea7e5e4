"""The load generator's percentiles against a synthetic system with known latencies and an injected stall.

The system answers in 5 ms, one request at a time, except for a 600 ms stall starting 0.5 s into
the run. At 40 requests/s for 2 s (~80 requests), about 24 requests are *scheduled* during the
stall: a user sending at that rate sees every one of them wait. The open-loop run must report
that (from intended send times); a closed-loop run at concurrency 1 sees the stall once.
"""

import threading
import time

import pytest

from onepass.runtime.tools.loadgen import closed_loop, open_loop, poisson_schedule

SERVICE_S, STALL_AT, STALL_S = 0.005, 0.5, 0.6


class StallingSystem:
    """One request at a time (a lock), 5 ms each, and one 600 ms stall at STALL_AT seconds after start."""

    def __init__(self):
        self.lock = threading.Lock()
        self.start = None
        self.stalled = False

    def send(self):
        with self.lock:
            now = time.perf_counter()
            self.start = self.start or now
            if not self.stalled and now - self.start >= STALL_AT:
                self.stalled = True
                time.sleep(STALL_S)
            time.sleep(SERVICE_S)


def _slow_fraction(run, threshold_ms: float = 100.0) -> float:
    """Share of recorded requests slower than ``threshold_ms`` (from the histogram)."""
    h = run.histogram
    slow = sum(item.count_added_in_this_iter_step for item in h.get_recorded_iterator()
               if item.value_iterated_to > threshold_ms * 1000)
    return slow / run.count


def test_poisson_schedule_has_the_rate_and_is_seeded():
    times = poisson_schedule(200.0, 10.0, seed=3)
    assert 1800 < len(times) < 2200 and times == poisson_schedule(200.0, 10.0, seed=3)
    assert all(0 < a < b < 10.0 for a, b in zip(times, times[1:]))
    with pytest.raises(ValueError, match="positive number"):
        poisson_schedule(0.0, 1.0)


def test_open_loop_counts_the_stall_for_every_request_scheduled_during_it():
    run = open_loop(StallingSystem().send, rate=40.0, duration=2.0, seed=1)
    s = run.summary()
    # ~24 of ~80 requests were scheduled during the stall (or queued behind it): well over 10% are slow
    assert run.count >= 60 and not run.failures
    assert _slow_fraction(run) > 0.15, s
    assert s["p90"] > 100.0 and s["max"] >= STALL_S * 1000 * 0.9, s


def test_negative_control_closed_loop_sees_the_stall_once():
    """The naive count: one sender, latency from the actual send. The same stall is one slow request out of
    many — the assertion the open loop passes fails here (coordinated omission)."""
    run = closed_loop(StallingSystem().send, concurrency=1, duration=2.0)
    assert run.count > 100 and run.summary()["max"] >= STALL_S * 1000 * 0.9
    assert not _slow_fraction(run) > 0.15  # the open-loop assertion, failing as it should
    assert 1 <= round(_slow_fraction(run) * run.count) <= 3  # the stalled request (+ a rare scheduler hiccup)


def test_failures_are_counted_by_kind_never_dropped():
    calls = []

    def send():
        calls.append(1)
        if len(calls) % 3 == 0:
            raise ConnectionError("refused")

    run = closed_loop(send, concurrency=2, requests=30)
    assert run.count + sum(run.failures.values()) == 30 == len(calls)
    assert run.failures == {"ConnectionError": 10}


def test_summary_percentiles_from_known_latencies():
    run = closed_loop(lambda: time.sleep(0.002), concurrency=1, requests=20)
    s = run.summary()
    assert s["requests"] == 20 and 1.9 <= s["min"] <= s["p50"] <= s["p99"] <= s["max"] < 50
    assert s["throughput"] == pytest.approx(20 / s["seconds"], rel=1e-2)


def test_compare_gives_new_over_old_per_percentile_for_matching_runs():
    from onepass.runtime.tools.loadgen import comparable, compare

    old = {"machine": {"cpu": "x"}, "workload": {"sha256": "a"},
           "runs": [{"mode": "open", "offered": 5.0, "requests": 10, "p50": 10.0, "p90": 20.0, "p99": 40.0,
                     "p99.9": 50.0},
                    {"mode": "closed", "offered": 1, "requests": 10, "p50": 1.0, "p90": 1.0, "p99": 1.0, "p99.9": 1.0}]}
    new = {"machine": {"cpu": "x"}, "workload": {"sha256": "a"},
           "runs": [{"mode": "open", "offered": 5.0, "requests": 10, "p50": 5.0, "p90": 30.0, "p99": 40.0,
                     "p99.9": 100.0},
                    {"mode": "open", "offered": 9.0, "requests": 10, "p50": 1.0, "p90": 1.0, "p99": 1.0, "p99.9": 1.0}]}
    assert compare(old, new) == [{"target": None, "kind": None, "mode": "open", "offered": 5.0, "p50": 0.5, "p90": 1.5, "p99": 1.0, "p99.9": 2.0}]
    assert comparable(old, new) == []
    assert comparable(old, {**new, "workload": {"sha256": "b"}}) == ["the workload differs in sha256 (sha256: a vs b)"]


def test_runs_of_one_workload_that_differ_only_in_length_compare_with_a_note():
    """Two bench runs of the same workload for 10 s and 30 s (or other request counts or warm-ups) are comparable:
    the run length is not the workload. A note says the shorter's tails are noisier; the same length has none."""
    from onepass.runtime.tools.loadgen import comparable, length_differs

    machine = {"cpu": "x"}
    work = {"sha256": "a", "questions": 3, "states": 1, "cold_fraction": 0.0}
    short = {"machine": machine, "workload": {**work, "duration_s": 10.0, "requests": None, "warmup": 3}}
    long = {"machine": machine, "workload": {**work, "duration_s": 30.0, "requests": None, "warmup": 3}}
    assert comparable(short, long) == []
    assert "duration_s 10.0 vs 30.0" in length_differs(short, long) and length_differs(short, short) is None
    other = {"machine": machine, "workload": {**work, "questions": 4, "duration_s": 30.0, "requests": None, "warmup": 3}}
    assert comparable(short, other) == ["the workload differs in questions (questions: 3 vs 4)"]


def test_a_send_that_returns_its_answers_is_a_clear_error_not_one_silent_sample():
    """``send`` must return None or stage times. Returning what it got (answers) used to end the closed loop's
    sender after one recorded sample (benchmarks/latency.py reported n=1); now both loops raise. Control: the
    same send returning None records every request."""
    answers = {"refund": object()}
    with pytest.raises(TypeError, match="stage name -> milliseconds"):
        closed_loop(lambda: answers, concurrency=1, requests=5)
    with pytest.raises(TypeError, match="stage name -> milliseconds"):
        open_loop(lambda: answers, rate=200, duration=0.1)
    assert closed_loop(lambda: None, concurrency=1, requests=5).summary()["requests"] == 5
    assert closed_loop(lambda: {"score": 1.5}, concurrency=2, requests=6).summary()["requests"] == 6


def test_gpu_check_times_gpu_work_apart_from_host_work_through_the_loadgen_loop():
    """benchmarks/gpu_check.py's Timer is `onepass bench`'s closed loop: wall percentiles of every call, the ``gpu``
    stage = the device spans of the call's passes only (``Backend.device_span``), ``host`` = wall - gpu. A stand-in
    device clock reports 7 ms per span; a call sleeps 20 ms on the host and runs two passes: gpu 14 ms, host
    >= 20 ms. A graph captured inside the timed loop marks the measurement cold. Control: a backend without a
    device clock has no gpu stage."""
    import sys
    import types
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import gpu_check

    from onepass.runtime.backends.base import Backend

    class Clocked(Backend):
        clock = True
        captures = 0

        def device_timer(self):
            return types.SimpleNamespace(start=lambda: None, stop=lambda: 7.0) if self.clock else None

        def graph_stats(self):
            return {"captures": self.captures, "replays": 0, "uncaptured": 0}

        def empty(self):
            raise NotImplementedError

        def _run(self, batch, kv):
            raise NotImplementedError

        def _append(self, kv, new):
            raise NotImplementedError

    backend = Clocked(None)

    def call():
        time.sleep(0.02)
        for _ in range(2):
            with backend.device_span():
                pass

    calls = []
    cuda = gpu_check.Timer(types.SimpleNamespace(backend=backend))(lambda: calls.append(call()), iters=5, warmup=1)
    assert len(calls) == 6 and cuda["n"] == 5 and cuda["p50"] >= 20
    assert cuda["gpu"]["p50"] == pytest.approx(14.0, rel=1e-2) and cuda["gpu"]["count"] == 5
    assert cuda["host"]["p50"] >= 20 - 14 and "cold" not in cuda and backend.spans is None

    def capturing():
        backend.captures += 1
        call()
    cold = gpu_check.Timer(types.SimpleNamespace(backend=backend))(capturing, iters=3, warmup=0)
    assert cold["graphs"]["captures"] == 3 and "3 graph capture" in cold["cold"]

    backend.clock = False
    cpu = gpu_check.Timer(types.SimpleNamespace(backend=backend))(call, iters=5, warmup=0)
    assert cpu["n"] == 5 and cpu["p50"] >= 20 and "gpu" not in cpu


def test_exact_histogram_reads_the_percentiles_hdrhistogram_reads():
    """Where hdrhistogram is not installed (the GPU image, Jetson), the loops keep every sample: its percentiles
    agree with HdrHistogram's to HdrHistogram's own 3 significant digits."""
    import random

    hdr_module = pytest.importorskip("hdrh.histogram")
    from onepass.runtime.tools.loadgen import MAX_MICROS, ExactHistogram

    rng = random.Random(0)
    values = [int(rng.lognormvariate(8, 1)) + 1 for _ in range(5000)]
    exact, hdr = ExactHistogram(), hdr_module.HdrHistogram(1, MAX_MICROS, 3)
    for v in values:
        exact.record_value(v)
        hdr.record_value(v)
    for p in (0.0, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0):
        assert exact.get_value_at_percentile(p) == pytest.approx(hdr.get_value_at_percentile(p), rel=2e-3), p
    assert exact.get_total_count() == hdr.get_total_count() == 5000
    assert exact.get_mean_value() == pytest.approx(hdr.get_mean_value(), rel=2e-3)
    assert exact.get_stddev() == pytest.approx(hdr.get_stddev(), rel=1e-2)
    assert (exact.get_min_value(), exact.get_max_value()) == (min(values), max(values))


def test_a_run_whose_calls_all_fail_reports_the_error_instead_of_percentiles():
    """Failures in a timed loop are counted by kind with their first message, and a run with no answer has no
    percentiles rather than a KeyError later."""
    def send():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    summary = closed_loop(send, concurrency=1, requests=4).summary()
    assert summary["requests"] == 0 and summary["failures"] == {"RuntimeError": 4}
    assert summary["errors"] == {"RuntimeError": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert "p50" not in summary
