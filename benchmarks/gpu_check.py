"""GPU check: environment, parity of every available GPU backend, GPU and host time, CUDA-graph counts.

    python benchmarks/gpu_check.py --engine engines/smollm2 --out OUT [--device cuda] [--budget-s 420]

Writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` after every step (a run cut short returns what it
measured). Every import on this path is in the lent H200 image (``benchmarks/h200_image.txt``; rehearsed on
a CPU by ``tests/test_gpu_check.py`` with nothing else importable): no hdrhistogram, no server packages.

Per backend (the fused pass of torch-cuda at fp32, fp16 and bf16 with buckets and CUDA graphs; fp16 eager, without
graphs; the export's reference decoder at fp16, eager: the "before", light workloads; ONNX Runtime CUDA and TensorRT
where they load):

* parity: the golden file at the precision's tolerance, and before and after the timed loops every option
  log-likelihood of 1/4/13 questions on two states against ONNX Runtime fp32 on the CPU (max difference against
  the precision's measured bound, ``selfcheck.OPTION_TOLERANCES``, and argmax agreement);
* timing, p50/p90/p99 after warm-up through `onepass bench`'s closed loop: **device span** = the sum of CUDA-event
  spans around the device work (prefill chunks, the state's copy into the workspace, score passes with their
  input upload: ``Backend.device_span``; on an eager pass the span holds the gaps while the host launches),
  **host** = the call's wall time minus it (tokenise, pack, read-out, launch), and the wall time; then
  **kernel** time over 20 more calls (``kernel_times``: torch.profiler's device time of the kernels and copies,
  launches and idle gaps excluded). Graph captures, replays and uncaptured passes are counted per measurement;
  one that captured a graph inside its timed loop is labelled **cold**;
* workloads: warm 13 questions on a cached ~512-token state; 1/4/13/64 questions; prefill of 64/512/2048
  tokens; a service's traffic (13 questions about a new ~512-token state on every call: prefill
  included, graphs reused across states); 13 separate cold calls; Hugging Face transformers eager on the
  same device (per-option forwards; greedy generation of exactly the tokens of the JSON answer onepass
  gives — skipped on random weights, where the answer means nothing).

``--shape DIR`` (what gpu_check.sh runs when SHAPE is set and no engine exists: one call on a bare machine) makes
the engine in memory from the model's config and tokenizer (``gpu_shape.shape_engine``): seeded random weights of
the model's real dimensions drawn on the device, no export, no graph; the torch variants only, each compared with
the reference decoder at fp32 on the same weights (``vs_reference``), every timing of the targets measured. Its
latency is the real model's, its answers and precision errors are not (random weights hide precision error:
measured in benchmarks/results/gpu/precision_golden.md); ``--random-weights`` says the same of an exported engine.
``--device cpu`` rehearses the flow on CPU torch.

The report ends with the targets, each with its measured value (``targets``), and the host's share of each call.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, HFBaselines, many_questions, state_of_tokens  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.runtime.tools.loadgen import closed_loop  # noqa: E402
from onepass.runtime.core.selfcheck import OPTION_TOLERANCES, TOLERANCES_BY_PRECISION, run_golden  # noqa: E402

TARGETS = ("GPU targets (torch-cuda, the fused pass, CUDA graphs, fp16/bf16): 13 questions on a ~512-token state "
           "kernel time p50 <= 1 ms, wall p50 <= 2 ms, p99 <= 3 ms, host <= 20% of the wall time; prefill of 512 "
           "tokens <= 2 ms; 64 questions <= 5 ms; answers equal the reference within the precision's measured "
           "tolerance")
# (what, where in a backend's latency report, statistic, bound): what ``targets`` checks
BOUNDS = (("13 questions kernel p50 (ms)", "warm_13_questions_512_state", ("kernel", "p50"), 1.0),
          ("13 questions wall p50 (ms)", "warm_13_questions_512_state", ("p50",), 2.0),
          ("13 questions wall p99 (ms)", "warm_13_questions_512_state", ("p99",), 3.0),
          ("13 questions host share of wall p50", "warm_13_questions_512_state", ("host share",), 0.2),
          ("prefill of 512 tokens wall p50 (ms)", "prefill 512", ("p50",), 2.0),
          ("64 questions wall p50 (ms)", "questions 64", ("p50",), 5.0))
KERNEL_ITERS = 20  # calls profiled per kernel-time measurement


def environment(device: str, random_weights: bool) -> dict:
    """Versions, the GPU, and whether the engine's weights are real."""
    matmul = torch.backends.cuda.matmul
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
           "cuda_available": torch.cuda.is_available(),
           "reduced_precision_reductions": {"fp16": getattr(matmul, "allow_fp16_reduced_precision_reduction", None),
                                            "bf16": getattr(matmul, "allow_bf16_reduced_precision_reduction", None)},
           "weights": "RANDOM (shape check: latency real, answers and precision errors not)" if random_weights
           else "real"}
    if torch.cuda.is_available():
        capability = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env.update(gpu=torch.cuda.get_device_name(0), capability=capability, cuda=torch.version.cuda)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            env["driver"] = f"nvidia-smi failed: {err}"
    for mod in ("numpy", "onnxruntime", "onnx", "transformers", "tensorrt", "tensorrt_rtx", "cuda.bindings", "hdrh"):
        try:
            m = importlib.import_module(mod)
            env[mod] = getattr(m, "__version__", "present")
        except ImportError as err:
            env[mod] = f"missing ({err.name})"
    return env


def kernel_times(fn, iters: int = KERNEL_ITERS) -> dict | None:
    """The device time of the kernels and copies each of ``iters`` calls ran, host launches and idle gaps excluded
    (torch.profiler's CUDA activity; ``call_device_ms``): p50, max and mean per call. None without CUDA.

    Each call ends with a device synchronisation inside its ``record_function`` range, so its kernels (graph replays'
    included, which no operator launches) run within the range's CPU time span, on the clock the profiler puts
    device events on."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            with record_function(f"onepass_call_{i}"):
                fn()
                torch.cuda.synchronize()
    per_call = call_device_ms(prof.events())
    if not per_call:
        return {"error": "the profiler recorded no call"}
    return {"p50": float(np.median(per_call)), "max": max(per_call), "mean": float(np.mean(per_call)),
            "n": len(per_call)}


def call_device_ms(events) -> list[float]:
    """Per ``onepass_call_*`` CPU range, the summed durations (ms) of the device events (kernels, copies, memsets:
    device type CUDA, not a user annotation) that start inside it. Each device event counts once, whatever
    operator launched it (an operator's own device time would count its kernels again)."""
    from torch.autograd import DeviceType

    calls = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name.startswith("onepass_call_") and e.device_type == DeviceType.CPU)
    device = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    return [sum(e.time_range.elapsed_us() for e in device if start <= e.time_range.start <= end) / 1000
            for start, end in calls]


class Timer:
    """Times a call through `onepass bench`'s closed loop: wall time, and the ``gpu`` (CUDA-event spans of the
    device work, ``Backend.device_span``: from the first device operation to the last, so on an eager pass it holds
    the gaps while the host launches) and ``host`` (wall minus gpu) stages of each call; counts the graph captures,
    replays and uncaptured passes inside the timed loop; then the ``kernel`` time (``kernel_times``: the kernels'
    own device time) over a few more calls."""

    def __init__(self, engine: Engine):
        self.backend = engine.backend

    def send(self, fn):
        """The loop's sender: runs ``fn`` with the backend's device spans collected."""
        def timed() -> dict | None:
            self.backend.spans = spans = []
            t0 = time.perf_counter()
            try:
                fn()
            finally:
                self.backend.spans = None
            wall = (time.perf_counter() - t0) * 1000
            if not spans:  # no device clock (CPU): the wall time says it all
                return None
            gpu = float(sum(spans))
            return {"gpu": gpu, "host": max(wall - gpu, 0.0)}
        return timed

    def __call__(self, fn, iters: int, warmup: int = 2, profiled: bool = True) -> dict:
        for _ in range(warmup):  # captures happen here, outside the timed loop
            fn()
        before = self.backend.graph_stats() or {}
        summary = closed_loop(self.send(fn), concurrency=1, requests=iters).summary()
        after = self.backend.graph_stats() or {}
        out = {"n": summary["requests"], "failures": summary["failures"], "errors": summary["errors"]}
        out.update({k: summary[k] for k in ("p50", "p90", "p99", "min", "max", "mean") if k in summary})
        for stage, value in summary.get("stages", {}).items():
            out[stage] = value
        graphs = {k: after[k] - before.get(k, 0) for k in ("captures", "replays", "uncaptured", "slot_copies")
                  if k in after}
        if graphs:
            out["graphs"] = graphs
            if graphs["captures"]:
                out["cold"] = f"{graphs['captures']} graph capture(s) inside the timed loop"
        try:  # the profiled calls are few: a slow measurement (an HF baseline) is not profiled at all
            kernel = kernel_times(fn, min(KERNEL_ITERS, iters)) if profiled else None
        except Exception as err:  # noqa: BLE001 - a profiler failure never costs the wall-time figures
            kernel = {"error": f"{type(err).__name__}: {err}"[:300]}
        if kernel is not None:
            out["kernel"] = kernel
        return out


def backends(device: str, engine: Path, all_variants: bool = False, weights: dict | None = None) -> tuple[dict, dict]:
    """(name -> (engine directory, Engine.load backend factory, precision), name -> why it cannot run here). Every
    torch variant on CUDA, or with ``all_variants`` on a CPU too (the rehearsal of the GPU run's code paths); with
    ``weights`` (a shape check: no exported graph) the torch variants only, fed those weights."""
    from onepass.runtime.backends import factory

    ok, skipped = {}, {}
    if device.startswith("cuda") and not torch.cuda.is_available():
        skipped[f"torch-{device}"] = "torch.cuda.is_available() is False"
    else:
        name = "torch-cuda" if device.startswith("cuda") else "torch-cpu"
        given = {} if weights is None else {"weights": weights}

        def torch_on(precision, **options):
            return factory(name, device=device, precision=precision, **given, **options)
        ok[f"torch-{device}"] = (engine, torch_on("fp32"), "fp32")  # on CUDA: the fused pass, buckets + CUDA graphs
        if device.startswith("cuda") or all_variants:
            ok[f"torch-{device}-fp16"] = (engine, torch_on("fp16"), "fp16")
            ok[f"torch-{device}-bf16"] = (engine, torch_on("bf16"), "bf16")
            ok[f"torch-{device}-fp16-eager"] = (engine, torch_on("fp16", cuda_graphs=False, buckets=True), "fp16")
            # the "before": the export's reference decoder (fp32 residual, fp16 GEMMs), eager
            ok[f"torch-{device}-reference-fp16"] = (engine, torch_on("fp16", fused=False), "fp16")
    if weights is not None:
        skipped["onnxruntime-gpu, tensorrt"] = "they run an exported graph, and a shape check has none"
    elif device.startswith("cuda"):  # ONNX Runtime's CUDA provider: needs onnxruntime-gpu in place of onnxruntime
        from onepass.runtime.core import manifest as mf
        from onepass.runtime.core.errors import BackendUnavailable

        try:
            make = factory("onnxruntime-gpu")
            make(engine, mf.load(engine, verify=False))  # fail fast here, not in the parity loop
            ok["onnxruntime-gpu"] = (engine, make, "fp32")
        except BackendUnavailable as err:
            skipped["onnxruntime-gpu"] = str(err)
        try:
            # the engine copy with its plan lives outside OUT: OUT is what a device run brings back (small files)
            copy = tensorrt_engine(engine, Path(tempfile.gettempdir()) / "onepass-gpu-check-trt")
            ok["tensorrt"] = (copy, factory("tensorrt"), "fp32")
        except Exception as err:  # noqa: BLE001 -- any reason TensorRT cannot run here is reported, not fatal
            skipped["tensorrt"] = f"{type(err).__name__}: {err}"
    return ok, skipped


def tensorrt_engine(engine: Path, copy: Path) -> Path:
    """A copy of ``engine`` with a TensorRT plan built on this GPU (the images' ``--build-trt-if-missing`` path)."""
    from onepass.runtime.core import manifest as mf
    from onepass.runtime.backends.cuda_device import CudaDevice
    from onepass.runtime.backends.tensorrt_build import import_tensorrt
    from onepass.runtime.core.plans import build_native_plan_if_missing

    import_tensorrt(), CudaDevice()  # fail fast, before copying, where either is missing
    if not (copy / "manifest.json").exists():
        mf.copy_engine(engine, copy)
    build_native_plan_if_missing(copy)
    return copy


class Measure:
    """The timed workloads of one backend, each guarded: a failure is reported with its error, the rest runs."""

    def __init__(self, engine: Engine, iters: int, deadline: float, log, out: dict):
        self.engine, self.iters, self.deadline, self.log, self.out = engine, iters, deadline, log, out
        self.timer = Timer(engine)

    def left(self) -> bool:
        return time.perf_counter() < self.deadline

    def run(self, name: str, fn, iters: int | None = None, warmup: int = 2, into: dict | None = None,
            profiled: bool = True) -> None:
        """Time ``fn`` as ``name`` (into ``into``, default the backend's report), or record why it failed; its kernel
        time too when ``profiled`` and the budget is not spent."""
        into = self.out if into is None else into
        if not self.left():
            self.out["budget"] = "time budget spent: later measurements skipped"
            return
        try:
            into[name] = self.timer(fn, iters or self.iters, warmup, profiled=profiled and self.left())
        except Exception as err:  # noqa: BLE001 - the report says what failed and goes on
            into[name] = {"error": f"{type(err).__name__}: {err}"[:500], "trace": traceback.format_exc()[-1500:]}
        self.log(name, into[name])

    def all(self, hf, light: bool = False) -> None:
        """Every workload; ``light``: the warm 13 questions and a 512-token prefill only (the "before" backend)."""
        engine = self.engine
        text512 = state_of_tokens(engine, 512)
        state = engine.state(text512)
        self.run("warm_13_questions_512_state", lambda: engine.ask(state, QUESTIONS))
        if light:
            ids = engine.encoder.state(text512)
            self.out["prefill"] = {}
            self.run(str(len(ids)), lambda: engine.backend.prefill(ids, engine.manifest.limits.prefill_chunk),
                     into=self.out["prefill"])
            return
        self.out["questions"] = {}
        for k in (1, 4, 13, 64):
            qs = many_questions(k)
            self.run(str(k), lambda: engine.ask(state, qs), into=self.out["questions"])
        self.out["prefill"] = {}
        for n in (64, 512, 2048):
            ids = engine.encoder.state(state_of_tokens(engine, n))
            chunk = engine.manifest.limits.prefill_chunk
            self.run(str(len(ids)), lambda: engine.backend.prefill(ids, chunk), into=self.out["prefill"])
        fresh = iter(distinct_states(engine, 512, 10**6))
        self.run("service_new_state_each_call_13_questions",  # a service: every request a new ticket
                 lambda: engine.ask(next(fresh), QUESTIONS), iters=max(10, self.iters // 2))
        nocache = Engine(engine.root, engine.manifest, engine.backend, cache_bytes=0)
        self.run("13_separate_cold_calls", lambda: [nocache.ask(text512, {k: q}) for k, q in QUESTIONS.items()],
                 iters=max(3, self.iters // 10), profiled=False)
        if hf is not None:
            self.run("hf_eager_score_options", lambda: hf.score_options(engine, text512), iters=3, warmup=1,
                     profiled=False)
        if hf is not None and self.left():
            n = hf.answer_tokens(engine, text512)
            self.run("hf_eager_generate_json", lambda: hf.generate_json(text512, n, exactly=True), iters=3, warmup=1,
                     profiled=False)
            if "hf_eager_generate_json" in self.out:  # absent when the budget ran out meanwhile
                self.out["hf_eager_generate_json"]["new_tokens"] = n


def distinct_states(engine: Engine, tokens: int, count: int):
    """``count`` different states of about ``tokens`` tokens: the ticket with a changing order number in front."""
    base = state_of_tokens(engine, tokens - 12)
    for i in range(count):
        yield f"Order {100000 + i}. {base}"


def parity(engine: Engine, reference: Engine | None, precision: str) -> dict:
    """Golden-file differences at the precision's tolerances (an engine with a golden file); against the reference
    (ONNX Runtime fp32 on the CPU, or for a shape check the reference decoder at fp32 on the same weights), every
    option log-likelihood of 1, 4 and 13 questions on three states (each asked twice: the second is a replay; the
    longest prefilled in three chunks) with argmax agreement."""
    tol = TOLERANCES_BY_PRECISION[precision]
    out = {"golden": {}}
    if (engine.root / engine.manifest.golden).is_file():
        out["golden"] = {k: {"max_diff": v, "tolerance": tol[k], "within": v <= tol[k]}
                         for k, v in run_golden(engine).items()}
    if reference is None:
        return out
    worst, agree, total = 0.0, 0, 0
    for text in (state_of_tokens(engine, 100), state_of_tokens(engine, 512), state_of_tokens(engine, 1300)):
        for k in (1, 4, 13):
            qs = many_questions(k)
            encoded = engine.encode_questions(qs)
            for _ in range(2):
                got = engine.option_logprobs(text, encoded)
            want = reference.option_logprobs(text, reference.encode_questions(qs))
            worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(got, want)))
            agree += sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(got, want))
            total += len(want)
    bound = OPTION_TOLERANCES[precision]  # measured on real weights (benchmarks/results/gpu/fused_precision.md)
    out["vs_reference"] = {"reference": reference.backend.name, "max_diff": worst, "tolerance": bound,
                           "within": worst <= bound, "argmax_agree": f"{agree}/{total}"}
    return out


def targets(report: dict) -> list[dict]:
    """Each target of ``BOUNDS`` for each torch variant that runs the fused pass in half precision (fp16, bf16: not
    the eager or reference ones): its measured value and whether it is met (None: not measured)."""
    out = []
    for name, m in report["latency"].items():
        if not name.endswith(("-fp16", "-bf16")):
            continue
        for what, where, path, bound in BOUNDS:
            value = _measured(m, where, path)
            out.append({"backend": name, "target": what, "bound": bound, "measured": value,
                        "met": None if value is None else value <= bound})
    return out


def _measured(m: dict, where: str, path: tuple):
    """A value of a backend's latency report: ``where`` names a measurement ("questions 64", "prefill 512": the
    group's entry nearest that size), ``path`` the statistic in it ("host share": host p50 / wall p50)."""
    group, _, size = where.partition(" ")
    entries = m.get(group, {}) if size else {}
    r = m.get(where) if not size else (entries[min(entries, key=lambda k: abs(int(k) - int(size)))] if entries
                                       else None)
    if not isinstance(r, dict) or "error" in r:
        return None
    if path == ("host share",):
        host = r.get("host", {}).get("p50")
        return host / r["p50"] if host is not None and r.get("p50") else None
    for key in path:
        r = r.get(key) if isinstance(r, dict) else None
    return r if isinstance(r, (int, float)) else None


def _cell(r: dict | None, key: str = "p50", stage: str | None = None) -> str:
    if not r or "error" in r:
        return "–"
    value = r.get(stage, {}).get(key) if stage else r.get(key)
    return f"{value:.3f}" if isinstance(value, (int, float)) else "–"


def markdown(report: dict) -> str:
    """The report as a page."""
    lines = ["# GPU check", "", "Produced by `bash benchmarks/gpu_check.sh`.", "", "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in report["environment"].items()]
    lines += ["", "## Parity", "", "| backend | golden (max diff / tolerance) | vs the reference | argmax |",
              "|---|---|---|---|"]
    for name, p in report["parity"].items():
        if "error" in p:
            lines.append(f"| {name} | failed: {p['error']} | | |")
            continue
        golden = "; ".join(f"{k} {v['max_diff']:.3g}/{v['tolerance']}{'' if v['within'] else ' **OVER**'}"
                           for k, v in p["golden"].items()) or "no golden file"
        ref = p.get("vs_reference", {})
        vs = f"{ref['max_diff']:.3g}/{ref['tolerance']}{'' if ref['within'] else ' **OVER**'}" if ref else "–"
        lines.append(f"| {name} | {golden} | {vs} | {ref.get('argmax_agree', '–')} |")
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | not run: {why} | | |")
    lines += ["", "## Timing (ms)", "",
              "kernel = the device time of the kernels and copies of a call (torch.profiler, host launches and idle "
              "gaps excluded; p50 per call, and the mean of all device time over the calls); device span = CUDA "
              "events from a call's first device operation to its last (on an eager pass it includes the gaps while "
              "the host launches); host = wall - device span; wall = the whole call.", "",
              "| backend | measurement | kernel p50 | kernel mean | device span p50 | device span p99 | host p50 | "
              "wall p50 | wall p99 | n | graphs (captures/replays/uncaptured) | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in report["latency"].items():
        flat = [(k, v) for k, v in m.items() if isinstance(v, dict) and ("n" in v or "error" in v)]
        for group in ("questions", "prefill"):
            flat += [(f"{group} {k}", v) for k, v in m.get(group, {}).items()]
        for what, r in flat:
            g = r.get("graphs", {})
            graphs = f"{g['captures']}/{g['replays']}/{g['uncaptured']}" if g else "–"
            note = r.get("error") or r.get("cold") or (f"{sum(r['failures'].values())} failed: {r['errors']}"
                                                        if r.get("failures") else "")
            lines.append(f"| {name} | {what} | {_cell(r, 'p50', 'kernel')} | {_cell(r, 'mean', 'kernel')} | "
                         f"{_cell(r, 'p50', 'gpu')} | {_cell(r, 'p99', 'gpu')} | {_cell(r, 'p50', 'host')} | "
                         f"{_cell(r)} | {_cell(r, 'p99')} | {r.get('n', '–')} | {graphs} | {note} |")
    lines += ["", "Fused operations picked on this device: " + "; ".join(
        f"{name}: {k}" for name, k in report.get("kernels", {}).items()), "", "## Targets", "", TARGETS, "",
              "| backend | target | bound | measured | met |", "|---|---|---|---|---|"]
    for t in targets(report):
        value = "not measured" if t["measured"] is None else f"{t['measured']:.3f}"
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['backend']} | {t['target']} | {t['bound']:g} | {value} | {met} |")
    lines.append("")
    for name, m in report["latency"].items():
        warm = m.get("warm_13_questions_512_state", {}).get("p50")
        for base in ("hf_eager_score_options", "hf_eager_generate_json", "13_separate_cold_calls"):
            if warm and m.get(base, {}).get("p50"):
                lines.append(f"- {name}: {base} / warm 13 questions (wall p50) = {m[base]['p50'] / warm:.1f}x")
    for name, err in report.get("errors", {}).items():
        lines += ["", f"## {name} failed", "", "```", err, "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--random-weights", action="store_true", help="the engine has random weights (a SHAPE check)")
    ap.add_argument("--shape", help="a model's config and tokenizer (gpu_shape.py pack): the engine made in memory, "
                                    "random weights drawn on the device, no export (the torch variants only)")
    ap.add_argument("--all-variants", action="store_true",
                    help="on a CPU too, every torch variant the GPU run measures (rehearsing their code paths)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(what, r=None):
        tail = ""
        if isinstance(r, dict) and "error" in r:
            tail = f" FAILED {r['error']}"
        elif isinstance(r, dict) and "p50" in r:
            tail = f" wall p50 {r['p50']:.3f} ms" + (f", gpu p50 {r['gpu']['p50']:.3f} ms" if "gpu" in r else "")
        print(f"[{time.perf_counter() - t0:6.1f}s] {what}{tail}", flush=True)

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 matmuls
    if torch.cuda.is_available():  # profiling replays of graphs captured before (torch issue 75504)
        init = getattr(importlib.import_module("torch.profiler._utils"), "_init_for_cuda_graphs", None)
        if init is not None:
            init()
    report = {"environment": environment(args.device, args.random_weights or bool(args.shape)), "parity": {},
              "latency": {}, "skipped": {}, "graphs": {}, "kernels": {}, "errors": {}}
    log(json.dumps(report["environment"]))
    save(report, out)  # written after every step: a run cut short still returns what it measured
    opener = Opener(args)
    report["environment"]["engine"] = opener.describe()
    ok, report["skipped"] = backends(args.device, opener.root, args.all_variants, opener.weights)
    log(f"backends: {sorted(ok)}; skipped: {report['skipped']}")
    save(report, out)
    hf = None
    if args.random_weights or args.shape:
        report["skipped"]["hf_eager"] = "random weights: the generated answer would mean nothing"
    elif not args.skip_hf:
        try:
            hf = HFBaselines(Engine.load(args.engine, verify=False, backend="onnxruntime"), args.device)
        except Exception as err:  # noqa: BLE001 - the baseline is optional; say why it is missing
            report["skipped"]["hf_eager"] = f"{type(err).__name__}: {err}"[:300]
    try:  # the reference of the answer comparisons (bf16 engines have none on ONNX Runtime)
        reference = opener.reference()
    except Exception as err:  # noqa: BLE001
        reference = None
        report["skipped"]["reference"] = f"{type(err).__name__}: {err}"[:300]
    for name, (root, make, precision) in ok.items():
        try:
            check_backend(report, name, opener(root, make), precision, reference,
                          hf if name == f"torch-{args.device}" else None, args, deadline, log, out)
        except Exception:  # noqa: BLE001 - one backend's failure never hides the others' results
            report["errors"][name] = traceback.format_exc()[-3000:]
            log(f"{name} FAILED: {report['errors'][name].splitlines()[-1]}")
        save(report, out)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["targets"] = targets(report)
    save(report, out)
    print(markdown(report))
    return 0


class Opener:
    """How this run opens its engines: an engine directory (``--engine``), or a shape check's engine made in memory
    (``--shape``: ``gpu_shape.shape_engine``, its weights drawn once on the device and fed to every variant)."""

    def __init__(self, args):
        self.device, self.weights = args.device, None
        if args.shape:
            from gpu_shape import shape_engine

            self.root, self.manifest, self.weights = shape_engine(Path(args.shape), args.device)
        else:
            self.root, self.manifest = Path(args.engine), None

    def __call__(self, root: Path, make) -> Engine:
        """The engine at ``root`` on the backend ``make`` builds."""
        if self.manifest is None:
            return Engine.load(root, backend=make, verify=False)
        return Engine(root, self.manifest, make(root, self.manifest, None))

    def reference(self) -> Engine:
        """What answers are compared with: ONNX Runtime fp32 on the CPU, or for a shape check the reference decoder
        at fp32 on the device, the same weights."""
        if self.manifest is None:
            return Engine.load(self.root, verify=False, backend="onnxruntime")
        from onepass.runtime.backends import factory

        name = "torch-cuda" if self.device.startswith("cuda") else "torch-cpu"
        return self(self.root, factory(name, device=self.device, precision="fp32", fused=False, weights=self.weights))

    def describe(self) -> str:
        if self.manifest is None:
            return str(self.root)
        model = self.manifest.model
        return (f"{self.manifest.name}: made in memory (no export), {model.num_layers} layers, hidden "
                f"{model.hidden_size}, vocabulary {model.vocab_size}, the compact prompt form")


def check_backend(report: dict, name: str, engine: Engine, precision: str, reference, hf, args, deadline, log,
                  out: Path) -> None:
    """Parity first, then the timed workloads (the reference decoder: a light set), then parity again after the
    loops (many graphs captured by then); once the time budget is spent, nothing more of this backend runs."""
    if time.perf_counter() > deadline:
        report["skipped"][name] = "the time budget was spent before this backend"
        engine.close()
        return
    report["parity"][name] = parity(engine, reference, precision)
    log(f"{name} parity {json.dumps(report['parity'][name])}")
    save(report, out)
    kernels = getattr(getattr(engine.backend, "decoder", None), "kernels", None)
    if kernels is not None:  # the fused pass: which fused operations this device's torch runs
        report["kernels"][name] = kernels.describe()
    report["latency"][name] = {}
    # light: the "before" (the reference decoder), and on a CPU every variant but the first (a rehearsal of their
    # code paths; the full set is the fp32 backend's, the same workloads)
    light = "reference" in name or (not args.device.startswith("cuda") and name != f"torch-{args.device}")
    Measure(engine, args.iters, deadline, log, report["latency"][name]).all(hf, light=light)
    save(report, out)
    if time.perf_counter() < deadline:
        report["parity"][f"{name} (after the loops)"] = parity(engine, reference, precision)
    report["graphs"][name] = engine.backend.graph_stats()
    engine.close()


def save(report: dict, out: Path) -> None:
    """gpu_check.json and .md as measured so far (atomic renames)."""
    for name, text in (("gpu_check.json", json.dumps(report, indent=2) + "\n"), ("gpu_check.md", markdown(report))):
        tmp = out / (name + ".partial")
        tmp.write_text(text)
        tmp.replace(out / name)


if __name__ == "__main__":
    sys.exit(main())
