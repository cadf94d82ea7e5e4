"""``onepass bench``: latency percentiles of a user's engine (in process, per backend) or server (HTTP).

Targets: every backend named (in process; unavailable ones are reported as skipped) or one URL (any
TypeSafe System One endpoint: ``onepass serve``, ``onepass cluster``). Kinds of request:

* ``warm``: the state is cached (after the warm-up);
* ``cold``: a fresh state per request — the state text with a short unique first line
  (``[bench N]``, a few tokens), so its prefill is included; ``--cold-fraction F`` mixes cold
  requests into the main runs at random (seeded);
* ``prefill``: prefilling a fresh state alone (in process).

Loads: open loop at each ``--rate`` (Poisson arrivals, latency from the intended send time) and closed
loop at each ``--concurrency`` (``runtime/tools/loadgen.py``). Each request's stage times (the engine's
tokenize/prefill/pack/score/readout, or a server's Server-Timing entries) get histograms of their own; on a
backend with a device clock (torch-cuda, tensorrt: CUDA events around each call, synchronised) a ``device``
stage too, and in process a ``host`` stage: the call's time outside the device (outside the backend's passes on a
CPU backend), the share a GPU cannot take off the host.
A progress bar shows live p50/p99; Ctrl-C ends the current run and the report keeps what was measured.
Reports: ``bench.json`` (machine, software, targets, workload hash, every run with its CDF and stages),
``bench.md`` (a table to paste), ``latency_cdf.png`` and ``throughput_p99.png``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import random
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..core.errors import BackendUnavailable, OnepassError
from ..core.guarantee import cpu_model
from .loadgen import Run, closed_loop, comparable, compare, length_differs, open_loop
from ..core.prompt import state_text

MAX_REQUESTS = 1_000_000  # scheduled requests per open-loop run (rate x duration)
STAGE_ORDER = ("queue", "tokenize", "prefill", "pack", "score", "readout", "cascade", "device", "host")  # the tables' columns; others last


def _load(mode: str, offered: float) -> str:
    return f"{offered:g} req/s" if mode == "open" else f"concurrency {offered:g}"


@dataclass
class Target:
    """Something to measure: a label, how to send one request of a kind, and what it is."""

    label: str
    sender: Callable[[str], Callable[[], dict | None]]  # kind -> send()
    info: dict
    kinds: tuple = ("warm", "cold")
    closers: list = field(default_factory=list)


def _cold_text(text: str, n: int) -> str:
    return f"[bench {n}]\n{text}"


def _chooser(states: list, seed: int, cold_fraction: float):
    """A thread-safe ``pick(kind) -> state`` over ``states``: cold picks (always for ``cold``, with probability
    ``cold_fraction`` otherwise) get a fresh, never-seen text."""
    rng, counter, lock = random.Random(seed), itertools.count(), threading.Lock()
    texts = [state_text(state) for state in states]  # what a cold pick prefixes, once

    def pick(kind: str):
        with lock:
            i = rng.randrange(len(states)) if len(states) > 1 else 0
            cold = kind == "cold" or (cold_fraction > 0 and rng.random() < cold_fraction)
            n = next(counter)
        return _cold_text(texts[i], n) if cold else states[i]
    return pick


def _on_device_clock(engine, call) -> dict:
    """``call()``'s stage times, plus ``device`` where the backend has a device clock: the sum of the CUDA-event
    spans around the call's device work only (``Backend.device_span``: prefill chunks, score passes), collected
    per thread, so concurrent senders time their own passes and host work (tokenise, pack, read-out) is not in it;
    and ``host``: the call's wall time outside the device (wall minus ``device``), or on a backend without a device
    clock outside the backend's passes (wall minus ``prefill`` and ``score``)."""
    backend = engine.backend
    backend.spans = spans = []
    t0 = time.perf_counter()
    try:
        stages = call()
    finally:
        backend.spans = None
    wall = (time.perf_counter() - t0) * 1000
    if spans:
        return {**stages, "device": float(sum(spans)), "host": max(0.0, wall - float(sum(spans)))}
    return {**stages, "host": max(0.0, wall - stages.get("prefill", 0.0) - stages.get("score", 0.0))}


def engine_targets(engine_dir: str, backends: list[str], threads: int | None, body: dict, states: list,
                   cold_fraction: float, seed: int) -> tuple[list[Target], dict]:
    """One target per backend that loads here; {backend: why} for the others."""
    from ..backends import factory
    from ..core.engine import Engine
    from ..core.wire import parse_request

    targets, skipped = [], {}
    for name in backends:
        try:
            engine = Engine.load(engine_dir, threads=threads, backend=factory(name))
        except (BackendUnavailable, OnepassError, ImportError, RuntimeError) as err:
            skipped[name] = " ".join(str(err).split())  # whole: a reason cut mid-sentence says nothing
            continue
        _, questions = parse_request({**body, "state": states[0]})  # bad questions fail here, once
        for state in states:
            engine.run(state, questions)  # and a bad state; it is cached too (warm)
        pick = _chooser(states, seed, cold_fraction)
        counter = itertools.count()
        first = state_text(states[0])

        def sender(kind, engine=engine, questions=questions, pick=pick, counter=counter):
            if kind == "prefill":
                def prefill() -> dict:
                    text = _cold_text(first, next(counter))
                    t0 = time.perf_counter()
                    engine.state(text)
                    return {"prefill": (time.perf_counter() - t0) * 1000}
                return lambda: _on_device_clock(engine, prefill)
            return lambda: _on_device_clock(engine, lambda: engine.run(pick(kind), questions).timings)
        manifest = Path(engine_dir) / "manifest.json"
        targets.append(Target(name, sender, {
            "engine": str(engine_dir), "name": engine.name, "backend": name, "precision": engine.manifest.precision,
            "manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest()[:16]},
            kinds=("warm", "cold", "prefill"), closers=[engine.close]))
    return targets, skipped


def parse_server_timing(header: str | None) -> dict:
    """{name: ms} of a Server-Timing header (``total`` left out: it is the latency itself)."""
    out = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";")
        for param in rest.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur" and name and name != "total":
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
    return out


def url_target(url: str, api_key: str | None, model: str | None, body: dict, states: list, cold_fraction: float,
               seed: int) -> Target:
    """The server at ``url``; unreachable → a one-line error."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    endpoint = url.rstrip("/") + "/v1/systemone"
    pick = _chooser(states, seed, cold_fraction)

    def sender(kind):
        def send():
            data = json.dumps({"model": model, **body, "state": pick(kind)}).encode()
            req = urllib.request.Request(endpoint, data=data, headers=headers)
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()
                return parse_server_timing(resp.headers.get("Server-Timing"))
        return send
    try:
        sender("warm")()
    except urllib.error.HTTPError as err:
        raise OnepassError(f"{url} answered {err.code} to the workload's request: "
                           f"{err.read()[:200].decode('utf-8', 'replace')}") from None
    except (urllib.error.URLError, OSError) as err:
        raise OnepassError(f"cannot reach {url}: {getattr(err, 'reason', err)}") from None
    return Target(url, sender, {"url": url})


def machine() -> dict:
    """The hardware a report was measured on (what --compare requires to be equal)."""
    cpu = cpu_model() or ""
    gpu = None
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10)
        gpu = done.stdout.strip() or None
    return {"cpu": cpu or platform.processor() or platform.machine(), "cores": os.cpu_count(), "gpu": gpu}


def software() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("onepass", "onnxruntime", "torch", "tensorrt"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


class Progress:
    """A live line per run (tqdm): elapsed of the duration, answered, failed, p50/p99 so far. Off when stderr is
    not a terminal."""

    def __init__(self, run: Run, label: str, duration: float | None):
        self.run, self.label, self.duration = run, label, duration
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(timeout=5)

    def _loop(self):
        try:
            from tqdm import tqdm
        except ImportError:
            return
        bar = tqdm(total=self.duration, desc=self.label, unit="s", disable=None, leave=False,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s {postfix}")
        while not self.done.wait(0.25):
            run = self.run
            if run.started:
                bar.n = min(self.duration or 0, time.perf_counter() - run.started)
            p50, p99 = run.percentile(50), run.percentile(99)
            bar.set_postfix_str(f"n={run.count} failed={sum(run.failures.values())}"
                                + (f" p50={p50:.1f}ms p99={p99:.1f}ms" if p50 is not None else ""))
        bar.close()


def planned(targets: list[Target], kinds: list[str], rates: list[float], concurrencies: list[int]) -> list[tuple]:
    """(target, kind, mode, load) of every run :func:`measure` makes, in order."""
    loads = [("open", r) for r in rates] + [("closed", c) for c in concurrencies]
    return [(t, kind, mode, load) for t in targets for kind in kinds if kind in t.kinds
            for mode, load in ([("closed", 1)] if kind == "prefill" else loads)]


def expected_length(targets: list[Target], kinds: list[str], rates: list[float], concurrencies: list[int],
                    duration: float, warmup: int, requests: int | None) -> str:
    """What the user is about to wait for, said before it starts."""
    runs = planned(targets, kinds, rates, concurrencies)
    timed = sum(requests / load if mode == "open" and requests else duration
                for _, _, mode, load in runs if not (mode == "closed" and requests))
    counted = sum(1 for _, _, mode, _ in runs if mode == "closed" and requests)
    text = f"about {timed:.0f} s of measuring" if timed else ""
    if counted:
        text += (" and " if text else "") + f"{counted} runs of {requests} requests each"
    return f"{text} ({len(targets)} targets x {len(kinds)} kinds x loads), plus {warmup} warm-up requests per target " \
           "and kind, and loading; Ctrl-C ends it early and keeps what was measured"


def measure(targets: list[Target], kinds: list[str], rates: list[float], concurrencies: list[int], duration: float,
            warmup: int, seed: int, echo=print, requests: int | None = None) -> tuple[list[dict], bool]:
    """Every (target, kind, load) run in order; (runs, interrupted). Ctrl-C ends the current run and the rest."""
    runs: list = []
    try:
        for target in targets:
            for kind in kinds:
                if kind not in target.kinds:
                    continue
                send = target.sender(kind)
                for _ in range(warmup):
                    send()
                loads = [("open", r) for r in rates] + [("closed", c) for c in concurrencies]
                for mode, load in ([("closed", 1)] if kind == "prefill" else loads):
                    run = Run(mode, offered=load)
                    what = _load(mode, load)
                    seconds = duration if mode == "closed" or requests is None else requests / load
                    echo(f"{target.label} {kind} {what}: measuring "
                         + (f"{requests} requests" if mode == "closed" and requests else f"for {seconds:g} s"))
                    with Progress(run, f"{target.label} {kind} {what}", seconds):
                        if mode == "open":
                            open_loop(send, load, seconds, seed=seed, run=run)
                        elif requests is not None:
                            closed_loop(send, load, requests=requests, run=run)
                        else:
                            closed_loop(send, load, duration=duration, run=run)
                    summary = {"target": target.label, "kind": kind, **run.summary()}
                    runs.append(summary)
                    echo(describe(summary))
                    if run.interrupted:
                        return runs, True
    except KeyboardInterrupt:  # during a warm-up or between runs: keep what was measured
        return runs, True
    return runs, False


def describe(r: dict) -> str:
    """One line of a run for the terminal."""
    head = f"{r.get('target', '')} {r.get('kind', '')} {r['mode']:6s} {_load(r['mode'], r['offered'])}".strip()
    if not r["requests"]:
        return f"{head}: no successful request; failures {r['failures']}"
    late = f", {r['late_starts']} started late (the generator fell behind)" if r.get("late_starts") else ""
    return (f"{head}: {r['requests']} ok, {sum(r['failures'].values())} failed, {r['throughput']:.1f} req/s; ms "
            f"p50 {r['p50']:.2f} p90 {r['p90']:.2f} p99 {r['p99']:.2f} p99.9 {r['p99.9']:.2f} max {r['max']:.2f}"
            + late + (" (interrupted)" if r.get("interrupted") else ""))


def markdown(report: dict) -> str:
    """The report as tables to paste: latency per run, then stage p50/p99 per run."""
    rows = ["| target | kind | mode | load | ok | failed | req/s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms |",
            "|---" * 12 + "|"]
    stages = sorted({s for r in report["runs"] for s in r.get("stages", {})},
                    key=lambda s: STAGE_ORDER.index(s) if s in STAGE_ORDER else len(STAGE_ORDER))
    stage_rows = ["| target | kind | mode | load | " + " | ".join(f"{s} p50 / p99 ms" for s in stages) + " |",
                  "|---" * (4 + len(stages)) + "|"]
    for r in report["runs"]:
        cells = [f"{r.get(k, float('nan')):.2f}" for k in ("p50", "p90", "p99", "p99.9", "max")]
        head = f"| {r.get('target', '')} | {r.get('kind', '')} | {r['mode']} | {r['offered']:g} |"
        rows.append(f"{head} {r['requests']} | {sum(r['failures'].values())} | {r['throughput'] or 0:.1f} | "
                    + " | ".join(cells) + " |")
        if stages:
            st = r.get("stages", {})
            stage_rows.append(head + " " + " | ".join(
                f"{st[s]['p50']:.2f} / {st[s]['p99']:.2f}" if s in st else "–" for s in stages) + " |")
    skipped = "".join(f"\n- {name}: skipped ({why})" for name, why in report.get("skipped", {}).items())
    m = report["machine"]
    text = (f"# onepass bench\n\n{m['cpu']}, {m['cores']} cores" + (f", {m['gpu']}" if m.get("gpu") else "")
            + f"; {', '.join(f'{k} {v}' for k, v in report['software'].items())}\n\nOpen loop: Poisson arrivals "
            "at the rate, latency from each request's intended send time (coordinated omission corrected). Closed "
            "loop: each sender sends again when answered. cold: a fresh state per request (prefill included); "
            "prefill: prefilling a fresh state alone.\n\n" + "\n".join(rows) + "\n")
    if stages:
        text += "\nStages (the engine's clock, or the server's Server-Timing):\n\n" + "\n".join(stage_rows) + "\n"
    if skipped:
        text += "\nBackends not measured here:" + skipped + "\n"
    if report.get("interrupted"):
        text += "\nInterrupted (Ctrl-C): the runs above are what was measured.\n"
    return text


def plots(report: dict, out: Path) -> list[str]:
    """latency_cdf.png (every run's CDF, log latency) and throughput_p99.png (p99 against achieved throughput
    per target, kind and mode); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in report["runs"]:
        if r.get("cdf"):
            p, ms = zip(*r["cdf"])
            ax.plot([max(v, 1e-3) for v in ms], p, marker=".",
                    label=f"{r.get('target', '')} {r.get('kind', '')} {r['mode']} {r['offered']:g}".strip())
    ax.set(xscale="log", xlabel="latency (ms, log)", ylabel="percentile", title="latency CDF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict = {}
    for r in report["runs"]:
        if r.get("requests"):
            series.setdefault((r.get("target", ""), r.get("kind", ""), r["mode"]), []).append(
                (r["throughput"], r["p99"], r["offered"]))
    for (target, kind, mode), points in series.items():
        points.sort()
        ax.plot([x for x, _, _ in points], [y for _, y, _ in points], marker="o", label=f"{target} {kind} {mode}")
        for x, y, load in points:
            ax.annotate(f"{load:g}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set(yscale="log", xlabel="achieved throughput (requests/s)", ylabel="p99 latency (ms, log)",
           title="throughput vs p99 (labels: offered rate or concurrency)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput_p99.png", dpi=110)
    plt.close(fig)
    return ["latency_cdf.png", "throughput_p99.png"]


def write_report(report: dict, out: Path) -> list[str]:
    """bench.json, bench.md and the plots into ``out`` (each file written whole, then renamed into place)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("bench.json", json.dumps(report, indent=2) + "\n"), ("bench.md", markdown(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out / name)
    return ["bench.json", "bench.md", *plots(report, out)]


def check_loads(rates: list[float], concurrencies: list[int], duration: float, cold_fraction: float,
                requests: int | None = None) -> None:
    """One-line errors for loads this generator cannot produce or that make no sense."""
    if requests is not None and requests < 1:
        raise OnepassError(f"--requests must be at least 1, got {requests}")
    if not duration > 0:
        raise OnepassError(f"--duration must be a positive number of seconds, got {duration:g}")
    for rate in rates:
        if not rate > 0:
            raise OnepassError(f"--rate must be positive requests/s, got {rate:g}")
        if rate * duration > MAX_REQUESTS:
            raise OnepassError(f"--rate {rate:g} for {duration:g} s schedules {rate * duration:,.0f} requests; this "
                               f"generator schedules at most {MAX_REQUESTS:,} per run: shorten --duration")
    for c in concurrencies:
        if not 1 <= c <= 1024:
            raise OnepassError(f"--concurrency must be 1..1024 senders, got {c}")
    if not 0 <= cold_fraction <= 1:
        raise OnepassError(f"--cold-fraction must be within 0..1, got {cold_fraction:g}")


def _say(line: str) -> None:
    print(line, flush=True)  # live, also when piped


def run_bench(targets: list[Target], kinds: list[str], rates: list[float], concurrencies: list[int],
              duration: float, warmup: int, seed: int, body: dict, states: list, cold_fraction: float,
              skipped: dict | None = None, old: dict | None = None, force: bool = False,
              report_dir: str | None = None, echo=_say, requests: int | None = None) -> dict:
    """Measure, compare with ``old`` (refused when workload or machine differ unless ``force``), write the report."""
    workload = {"questions": len(body.get("questions", {})), "states": len(states), "duration_s": duration,
                "requests": requests,
                "warmup": warmup, "cold_fraction": cold_fraction,
                "sha256": hashlib.sha256(json.dumps([body, states], sort_keys=True).encode()).hexdigest()[:16]}
    here = machine()
    if old is not None and not force:
        why = comparable(old, {"machine": here, "workload": workload})
        if why:
            raise OnepassError(f"--compare refused: {'; '.join(why)} (add --force to compare anyway)")
    if old is not None and (note := length_differs(old, {"workload": workload})):
        echo(f"note: {note}")
    echo(f"{len(planned(targets, kinds, rates, concurrencies))} runs planned: " + expected_length(
        targets, kinds, rates, concurrencies, duration, warmup, requests))
    try:
        runs, interrupted = measure(targets, kinds, rates, concurrencies, duration, warmup, seed, echo, requests)
    finally:
        for target in targets:
            for close in target.closers:
                close()
    report = {"targets": [t.info for t in targets], "skipped": skipped or {}, "machine": here, "software": software(),
              "workload": workload, "runs": runs, "interrupted": interrupted}
    if old is not None:
        for row in compare(old, report):
            head = f"{row['target'] or ''} {row['kind'] or ''} {row['mode']:6s} {_load(row['mode'], row['offered'])}"
            echo(f"{head.lstrip()}: new/old " + "  ".join(f"{k} {v:.2f}x" for k, v in row.items() if k.startswith("p")))
    if report_dir:
        files = write_report(report, Path(report_dir))
        echo(f"report written to {report_dir}: {', '.join(files)}")
    return report


def bench(body: dict, states: list, *, engine: str | None = None, url: str | None = None,
          backends: list[str] | None = None, threads: int | None = None, api_key: str | None = None,
          model: str | None = None, kinds: list[str] | None = None, rates: list[float] | None = None,
          concurrencies: list[int] | None = None, duration: float = 10.0, warmup: int = 3, seed: int = 0,
          cold_fraction: float = 0.0, requests: int | None = None, compare_with: str | None = None,
          force: bool = False, report_dir: str | None = None, echo=_say) -> dict:
    """`onepass bench`: an engine in process (each of ``backends`` that loads here; the others reported as skipped)
    or a server at ``url``; closed loops of ``concurrencies`` (default one client) and open loops of ``rates``;
    compared with the bench.json at ``compare_with``; the report written to ``report_dir``."""
    from ..backends import BACKENDS

    body = {k: v for k, v in body.items() if k != "state"}
    rates = rates or []
    concurrencies = concurrencies or ([] if rates else [1])
    check_loads(rates, concurrencies, duration, cold_fraction, requests)
    old = None
    if compare_with:
        try:
            old = json.loads(Path(compare_with).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise OnepassError(f"--compare {compare_with}: not a readable bench.json ({err})") from None
    skipped: dict = {}
    if engine:
        targets, skipped = engine_targets(engine, backends or list(BACKENDS), threads, body, states, cold_fraction,
                                          seed)
        for name, why in skipped.items():
            echo(f"{name}: skipped ({why})")
        if not targets:
            raise OnepassError(f"no backend could load {engine}: " + "; ".join(f"{k}: {v}" for k, v in
                                                                              skipped.items()))
        kinds = kinds or ["warm", "cold", "prefill"]
    else:
        targets = [url_target(url, api_key, model, body, states, cold_fraction, seed)]
        kinds = kinds or ["warm"]
    return run_bench(targets, kinds, rates, concurrencies, duration, warmup, seed, body, states, cold_fraction,
                     skipped=skipped, old=old, force=force, report_dir=report_dir, echo=echo, requests=requests)
