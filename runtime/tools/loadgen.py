"""Load generation and latency percentiles: the measurement core of ``onepass bench``.

Two ways to drive a ``send()`` callable (one request; raises on failure):

* **open loop** (``open_loop``): requests are *scheduled* at Poisson arrival times for a given
  rate, independent of how fast answers come back, and each latency is measured from the
  request's **intended** send time. A stall therefore counts for every request that should have
  been sent during it — the correction for coordinated omission (Gil Tene; wrk2). Senders are a
  pool of threads, so a slow answer never delays the schedule while a sender is free;
* **closed loop** (``closed_loop``): ``concurrency`` senders, each sending its next request when
  the previous one is answered (what most load generators do): throughput at that concurrency,
  and latency measured from the actual send time — which under-reports tails when the system
  stalls (the stall is counted once per sender, not for the requests it held back).

Latencies go into an HdrHistogram (the ``hdrhistogram`` package: 1 µs to 1 h, 3 significant
digits), from which the percentiles are read; where that package is not installed (a GPU image that
carries only what it needs), into ``ExactHistogram``, which keeps every sample (exact percentiles;
fine for the thousands of samples of a device check). Failures are counted by kind, the first
message of each kind kept, and never dropped.
``send()`` may return the request's stage times (milliseconds by stage name, e.g. the engine's
tokenize/prefill/pack/score/readout or a server's Server-Timing entries): each stage gets its own histogram.

Both loops stop early when ``stop`` is set or on Ctrl-C (the run is then marked ``interrupted``
and keeps what it measured); pass ``run`` to watch a run while it goes (a progress bar).
"""

from __future__ import annotations

import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..core.interrupt import ctrl_c_sets

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
CDF_POINTS = (0.0, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.99, 100.0)
MAX_MICROS = 3600 * 10**6


class ExactHistogram:
    """The slice of ``hdrh.histogram.HdrHistogram``'s interface the loops use, over every recorded value (µs): exact
    percentiles (the smallest value with at least p% of the samples at or below it, as HdrHistogram reads them)."""

    def __init__(self, lowest: int = 1, highest: int = MAX_MICROS, digits: int = 3):
        self._values: list[int] = []
        self._sorted = True

    def record_value(self, value: int) -> None:
        self._values.append(int(value))
        self._sorted = False

    def _ordered(self) -> list[int]:
        if not self._sorted:
            self._values.sort()
            self._sorted = True
        return self._values

    def get_total_count(self) -> int:
        return len(self._values)

    def get_value_at_percentile(self, p: float) -> int:
        values = self._ordered()
        if not values:
            return 0
        return values[max(0, min(len(values) - 1, math.ceil(p / 100.0 * len(values)) - 1))]

    def get_min_value(self) -> int:
        return self._ordered()[0] if self._values else 0

    def get_max_value(self) -> int:
        return self._ordered()[-1] if self._values else 0

    def get_mean_value(self) -> float:
        return sum(self._values) / len(self._values) if self._values else 0.0

    def get_stddev(self) -> float:
        if not self._values:
            return 0.0
        mean = self.get_mean_value()
        return math.sqrt(sum((v - mean) ** 2 for v in self._values) / len(self._values))


try:
    from hdrh.histogram import HdrHistogram as Histogram
except ImportError:  # e.g. the GPU check's image: percentiles from every sample instead
    Histogram = ExactHistogram


@dataclass
class Run:
    """What one load run measured: a latency histogram (µs) and failures by kind."""

    mode: str
    offered: float | None = None  # requests/s scheduled (open loop) or concurrency (closed loop)
    histogram: Histogram = field(default_factory=lambda: Histogram(1, MAX_MICROS, 3))
    failures: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # kind -> the first failure's message of that kind
    seconds: float = 0.0
    late_starts: int = 0  # open loop: requests that started after their intended time (no sender free)
    stages: dict = field(default_factory=dict)  # stage name -> Histogram (µs)
    interrupted: bool = False
    started: float = 0.0  # perf_counter at the start (progress)
    error: BaseException | None = None  # a sender's contract error: ends the run, raised to the caller
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, seconds: float, stages: dict | None = None) -> None:
        """One answered request: its latency and, if given, its stage times in milliseconds. Anything else as
        ``stages`` (e.g. the answers of a ``send`` that returns what it got) is a TypeError, nothing recorded."""
        if stages is not None and not (isinstance(stages, dict) and all(
                isinstance(ms, (int, float)) and not isinstance(ms, bool) for ms in stages.values())):
            raise TypeError("send() must return None or a dict of stage name -> milliseconds, not "
                            f"{type(stages).__name__} {str(stages)[:80]!r}")
        with self._lock:
            self.histogram.record_value(_micros(seconds))
            for name, ms in (stages or {}).items():
                if name not in self.stages:
                    self.stages[name] = Histogram(1, MAX_MICROS, 3)
                self.stages[name].record_value(_micros(ms / 1000.0))

    def percentile(self, p: float) -> float | None:
        """A latency percentile so far in milliseconds (None before the first answer)."""
        with self._lock:
            return self.histogram.get_value_at_percentile(p) / 1000.0 if self.count else None

    def mark_interrupted(self) -> None:
        """Ctrl-C ended the run early (what it measured is kept)."""
        self.interrupted = True

    def fail(self, kind: str, message: str | None = None) -> None:
        """One failed request of ``kind``; the first ``message`` of each kind is kept for the report."""
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1
            if message is not None:
                self.errors.setdefault(kind, message[:500])

    @property
    def count(self) -> int:
        return self.histogram.get_total_count()

    def summary(self) -> dict:
        """Percentiles, min/max/mean/std in milliseconds, counts and achieved throughput."""
        h = self.histogram
        ms = 1e-3
        out = {"mode": self.mode, "offered": self.offered, "requests": self.count,
               "failures": dict(self.failures), "errors": dict(self.errors), "seconds": round(self.seconds, 3),
               "throughput": round(self.count / self.seconds, 3) if self.seconds > 0 else None,
               "late_starts": self.late_starts, "interrupted": self.interrupted}
        if self.stages:  # 0 ms (e.g. prefill of a cached state) is recorded as 1 µs: the histogram's floor
            out["stages"] = {name: {f"p{p:g}": h.get_value_at_percentile(p) * ms for p in (50.0, 99.0)}
                             | {"mean": h.get_mean_value() * ms, "count": h.get_total_count()}
                             for name, h in self.stages.items()}
        if self.count:
            out.update({f"p{p:g}": h.get_value_at_percentile(p) * ms for p in PERCENTILES})
            out["cdf"] = [[p, h.get_value_at_percentile(p) * ms] for p in CDF_POINTS]
            out.update({"min": h.get_min_value() * ms, "max": h.get_max_value() * ms,
                        "mean": h.get_mean_value() * ms, "std": h.get_stddev() * ms})
        return out


def _micros(seconds: float) -> int:
    return min(MAX_MICROS, max(1, int(round(seconds * 1e6))))


def _wait(threads_done, interrupt) -> None:
    """Block until ``threads_done()``; after a Ctrl-C (``interrupt``), wait for the senders to finish their request
    in flight."""
    try:
        while not threads_done():
            time.sleep(0.05)
    except KeyboardInterrupt:  # raised by a handler other than ours (the loop run outside the main thread)
        interrupt()
        while not threads_done():
            time.sleep(0.05)


def poisson_schedule(rate: float, duration: float, seed: int = 0) -> list[float]:
    """Intended send times (seconds from the start) of a Poisson process of ``rate`` per second."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"the rate must be a positive number of requests per second, got {rate!r}")
    rng, t, times = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return times
        times.append(t)


def _classify(err: BaseException) -> str:
    status = getattr(err, "status", None) or getattr(err, "code", None)
    return f"http {status}" if isinstance(status, int) else type(err).__name__


def open_loop(send, rate: float, duration: float, senders: int = 64, seed: int = 0, run: Run | None = None,
              stop: threading.Event | None = None) -> Run:
    """Send at Poisson times for ``duration`` seconds; latency from each request's intended send time."""
    run = run or Run("open", offered=rate)
    stop = stop or threading.Event()
    with ctrl_c_sets(stop, run.mark_interrupted) as interrupt:
        schedule = poisson_schedule(rate, duration, seed)
        start = run.started = time.perf_counter() + 0.01

        def one(intended: float) -> None:
            at = start + intended
            wait = at - time.perf_counter()
            if stop.wait(wait) if wait > 0 else stop.is_set():
                return
            if wait < -0.001:
                with run._lock:
                    run.late_starts += 1
            try:
                stages = send()
            except Exception as err:  # noqa: BLE001 - every failure is counted by kind, never dropped
                run.fail(_classify(err), f"{type(err).__name__}: {err}")
                return
            _record(run, stop, time.perf_counter() - at, stages)

        pool = ThreadPoolExecutor(senders)
        futures = [pool.submit(one, t) for t in schedule]
        _wait(lambda: all(f.done() for f in futures), interrupt)
        pool.shutdown(wait=True)
        run.seconds = time.perf_counter() - start
    if run.error is not None:
        raise run.error
    return run


def closed_loop(send, concurrency: int, duration: float | None = None, requests: int | None = None,
                run: Run | None = None, stop: threading.Event | None = None) -> Run:
    """``concurrency`` senders, each sending again when answered, for ``duration`` s or ``requests`` in all;
    latency from the actual send time."""
    if (duration is None) == (requests is None):
        raise ValueError("give a duration or a number of requests")
    run = run or Run("closed", offered=concurrency)
    stop = stop or threading.Event()
    with ctrl_c_sets(stop, run.mark_interrupted) as interrupt:
        left = [requests if requests is not None else -1]
        start = run.started = time.perf_counter()
        end = start + duration if duration is not None else math.inf

        def worker() -> None:
            while time.perf_counter() < end and not stop.is_set():
                with run._lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                t0 = time.perf_counter()
                try:
                    stages = send()
                except Exception as err:  # noqa: BLE001 - counted by kind
                    run.fail(_classify(err), f"{type(err).__name__}: {err}")
                    continue
                if not _record(run, stop, time.perf_counter() - t0, stages):
                    return

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
        for t in threads:
            t.start()
        _wait(lambda: not any(t.is_alive() for t in threads), interrupt)
        run.seconds = time.perf_counter() - start
    if run.error is not None:
        raise run.error
    return run


def _record(run: Run, stop: threading.Event, seconds: float, stages) -> bool:
    """Record one answer; a ``send`` that breaks the stages contract stops the run (raised by the loop), instead
    of silently ending its sender after one sample."""
    try:
        run.record(seconds, stages)
        return True
    except TypeError as err:
        run.error = run.error or err
        stop.set()
        return False


RUN_LENGTH = ("duration_s", "requests", "warmup")  # how long a run measures, not what it measures


def comparable(old: dict, new: dict) -> list[str]:
    """Why two bench reports should not be compared (empty when they may): another workload (questions, states,
    cold share, request bodies) or machine. How long each run lasted is not the workload: see :func:`length_differs`."""
    why = []
    for key in ("workload", "machine"):
        a, b = dict(old.get(key) or {}), dict(new.get(key) or {})
        if key == "workload":
            for name in RUN_LENGTH:
                a.pop(name, None), b.pop(name, None)
        if a != b:
            changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            why.append(f"the {key} differs in {', '.join(changed)} ("
                       + "; ".join(f"{k}: {a.get(k)} vs {b.get(k)}" for k in changed) + ")")
    return why


def length_differs(old: dict, new: dict) -> str | None:
    """A warning when two comparable reports measured for different lengths (percentiles of short runs are noisier;
    a p99 needs 100s of requests), else None."""
    a, b = old.get("workload") or {}, new.get("workload") or {}
    changed = [f"{k} {a.get(k)} vs {b.get(k)}" for k in RUN_LENGTH if a.get(k) != b.get(k)]
    return f"the runs differ in length ({', '.join(changed)}): tail percentiles of the shorter are noisier" \
        if changed else None


def compare(old: dict, new: dict) -> list[dict]:
    """Per run present in both reports (same target, kind, mode and load): new / old for each percentile."""
    def key(r):
        return r.get("target"), r.get("kind"), r["mode"], r["offered"]

    before = {key(r): r for r in old.get("runs", [])}
    out = []
    for r in new.get("runs", []):
        o = before.get(key(r))
        if o is None or not o.get("requests") or not r.get("requests"):
            continue
        out.append({"target": r.get("target"), "kind": r.get("kind"), "mode": r["mode"], "offered": r["offered"],
                    **{f"p{p:g}": r[f"p{p:g}"] / o[f"p{p:g}"] for p in PERCENTILES}})
    return out
