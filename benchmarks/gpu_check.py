"""GPU check: environment, parity of every available GPU backend with the golden file, latency percentiles.

    python benchmarks/gpu_check.py --engine engines/smollm2 --out OUT [--device cuda] [--budget-s 420]

Writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.md``. Latency is p50/p90/p99 over timed runs
after warm-up, through `onepass bench`'s closed loop: the wall time of the full call (host packing,
transfers and kernels), and on CUDA the CUDA-event time of each call on the device's stream
(synchronised) beside it. Side by side in one
run: onepass on each backend (warm 13 questions on a cached 512-token state; 1/4/13/64
questions; prefill of 64/512/2048 tokens; 13 separate cold calls) and Hugging Face transformers
eager on the same device (per-option forwards, and greedy generation of a JSON answer).
Backends that cannot run here are listed with the reason. ``--device cpu`` runs the same script
on CPU torch (a dry run: it proves the script, not GPU speed). Stops adding measurements when
the time budget is spent and says so.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, HFBaselines, _short, many_questions, state_of_tokens  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.export.torch_backend import CudaEvents  # noqa: E402
from onepass.runtime.backends.tensorrt import factory as trt_factory  # noqa: E402
from onepass.runtime import manifest as mf  # noqa: E402
from onepass.runtime.loadgen import closed_loop  # noqa: E402
from onepass.runtime.selfcheck import TOLERANCES_BY_PRECISION, run_golden, tolerances  # noqa: E402

TARGETS = "H200 + TensorRT FP16 targets: 13 questions p50 <= 2 ms, p99 <= 3 ms; prefill 512 <= 3 ms; >= 10x HF eager"


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   cuda=torch.version.cuda)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            env["driver"] = f"nvidia-smi failed: {err}"
    for mod in ("onnxruntime", "onnx", "transformers", "tensorrt", "tensorrt_rtx", "cuda.bindings"):
        try:
            m = importlib.import_module(mod)
            env[mod] = getattr(m, "__version__", "present")
        except ImportError as err:
            env[mod] = f"missing ({err.name})"
    return env


class Timer:
    """Times a call through `onepass bench`'s closed loop (runtime/loadgen.py: one measurement core, HdrHistogram
    percentiles): the wall time of the whole call; on CUDA each call is also bracketed by CUDA events on the
    current stream and synchronised, recorded as the ``device`` stage (p50/p99/mean ms)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def send(self, fn):
        """The loop's sender for ``fn``: None on CPU, {"device": event ms} on CUDA."""
        if not self.cuda:
            return lambda: (fn(), None)[1]

        def timed() -> dict:
            events = CudaEvents()  # the torch backend's device timer
            torch.cuda.synchronize()  # nothing earlier left on the device
            events.start()
            fn()
            return {"device": events.stop()}
        return timed

    def __call__(self, fn, iters: int, warmup: int = 2) -> dict:
        for _ in range(warmup):
            fn()
        summary = closed_loop(self.send(fn), concurrency=1, requests=iters).summary()
        out = _short(summary)
        if "device" in summary.get("stages", {}):
            out["device"] = summary["stages"]["device"]
        return out


def backends(device: str, engine: Path, out: Path) -> tuple[dict, dict]:
    """(name -> (engine directory, Engine.load backend factory), name -> why it cannot run here)."""
    from onepass.export.torch_backend import factory

    ok, skipped = {}, {}
    if device.startswith("cuda") and not torch.cuda.is_available():
        skipped[f"torch-{device}"] = "torch.cuda.is_available() is False"
    else:
        ok[f"torch-{device}"] = (engine, factory(device, "fp32"))  # on CUDA: bucketed shapes + CUDA graphs
        if device.startswith("cuda"):  # eager for comparison; mixed precision: block GEMMs in fp16/bf16
            ok[f"torch-{device}-eager"] = (engine, factory(device, "fp32", cuda_graphs=False, buckets=False))
            ok[f"torch-{device}-fp16"] = (engine, factory(device, "fp16"))
            ok[f"torch-{device}-bf16"] = (engine, factory(device, "bf16"))
    if device.startswith("cuda"):  # ONNX Runtime's CUDA provider: needs onnxruntime-gpu in place of onnxruntime
        from onepass.runtime.backends import factory as open_backend
        from onepass.runtime.errors import BackendUnavailable

        try:
            make = open_backend("onnxruntime-gpu")
            make(engine, mf.load(engine, verify=False))  # fail fast here, not in the parity loop
            ok["onnxruntime-gpu"] = (engine, make)
        except BackendUnavailable as err:
            skipped["onnxruntime-gpu"] = str(err)
    try:
        # the engine copy with its plan lives outside OUT: OUT is what a device run brings back (small files only)
        ok["tensorrt"] = (tensorrt_engine(engine, Path(tempfile.gettempdir()) / "onepass-gpu-check-trt"), trt_factory())
    except Exception as err:  # noqa: BLE001 -- any reason TensorRT cannot run here is reported, not fatal
        skipped["tensorrt"] = f"{type(err).__name__}: {err}"
    return ok, skipped


def tensorrt_engine(engine: Path, copy: Path) -> Path:
    """A copy of ``engine`` with a TensorRT plan built on this GPU (``onepass build-trt --arch native``)."""
    from onepass.cli import build_native_plan_if_missing
    from onepass.runtime import manifest as mf
    from onepass.runtime.backends.cuda_device import CudaDevice
    from onepass.runtime.backends.tensorrt_build import import_tensorrt

    import_tensorrt(), CudaDevice()  # fail fast, before copying, where either is missing
    if not (copy / "manifest.json").exists():
        mf.copy_engine(engine, copy)
    build_native_plan_if_missing(copy)
    return copy


def measure(engine: Engine, hf, timer: Timer, iters: int, deadline: float, log) -> dict:
    out: dict = {}

    def left() -> bool:
        return time.perf_counter() < deadline

    text512 = state_of_tokens(engine, 512)
    state = engine.state(text512)
    engine.ask(state, QUESTIONS)
    out["warm_13_questions_512_state"] = timer(lambda: engine.ask(state, QUESTIONS), iters)
    log("warm 13 questions", out["warm_13_questions_512_state"])
    out["questions"] = {}
    for k in (1, 4, 13, 64):
        if not left():
            break
        qs = many_questions(k)
        out["questions"][k] = timer(lambda: engine.ask(state, qs), iters)
        log(f"{k} questions", out["questions"][k])
    out["prefill"] = {}
    for n in (64, 512, 2048):
        if not left():
            break
        ids = engine.encoder.state(state_of_tokens(engine, n))
        chunk = engine.manifest.limits.prefill_chunk
        out["prefill"][n] = timer(lambda: engine.backend.prefill(ids, chunk), iters)
        out["prefill"][n]["tokens"] = len(ids)
        log(f"prefill {len(ids)}", out["prefill"][n])
    if left():
        nocache = Engine(engine.root, engine.manifest, engine.backend, cache_bytes=0)
        out["13_separate_cold_calls"] = timer(
            lambda: [nocache.ask(text512, {k: q}) for k, q in QUESTIONS.items()], max(3, iters // 10))
        log("13 separate calls", out["13_separate_cold_calls"])
    if hf is not None and left():
        out["hf_eager_score_options"] = timer(lambda: hf.score_options(engine, text512), max(3, iters // 10))
        log("HF eager per-option forwards", out["hf_eager_score_options"])
    if hf is not None and left():
        out["hf_eager_generate_json"] = timer(lambda: hf.generate_json(text512, 160), 3, warmup=1)
        log("HF eager generate JSON", out["hf_eager_generate_json"])
    if not left():
        out["budget"] = "time budget spent: later measurements skipped"
    return out


def markdown(report: dict) -> str:
    lines = ["# GPU check", "", "Produced by `bash benchmarks/gpu_check.sh`.", "", "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in report["environment"].items()]
    lines += ["", "## Parity with the golden file (max |difference|; tolerances by precision "
              + json.dumps(TOLERANCES_BY_PRECISION) + ")", ""]
    for name, p in report["parity"].items():
        lines.append(f"- {name}: {p}")
    for name, why in report["skipped"].items():
        lines.append(f"- {name}: not run ({why})")
    if report.get("parity_after"):
        lines += ["", "## Parity after the latency loops (golden again; replayed graphs of 3 buckets x 2 states "
                  "against ONNX Runtime on the CPU)", ""]
        lines += [f"- {name}: {p}" for name, p in report["parity_after"].items()]
    lines += ["", "## Latency (ms: wall time of the whole call; device = CUDA events around it)", "",
              "| backend | measurement | p50 | p90 | p99 | device p50 | device p99 | n |", "|---|---|---|---|---|---|---|---|"]
    for name, m in report["latency"].items():
        flat = [(k, v) for k, v in m.items() if isinstance(v, dict) and "p50" in v]
        for group in ("questions", "prefill"):
            flat += [(f"{group} {k}", v) for k, v in m.get(group, {}).items()]
        for what, r in flat:
            dev = r.get("device")
            device = f"{dev['p50']:.2f} | {dev['p99']:.2f}" if dev else "– | –"
            lines.append(f"| {name} | {what} | {r['p50']:.2f} | {r['p90']:.2f} | {r['p99']:.2f} | {device} | {r['n']} |")
    lines += ["", TARGETS, ""]
    for name, m in report["latency"].items():
        warm = m["warm_13_questions_512_state"]["p50"]
        for base in ("hf_eager_score_options", "hf_eager_generate_json", "13_separate_cold_calls"):
            if base in m:
                lines.append(f"- {name}: {base} / warm 13 questions = {m[base]['p50'] / warm:.1f}x")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(what, r=None):
        tail = f" p50 {r['p50']:.2f} ms p99 {r['p99']:.2f} ms" if r else ""
        print(f"[{time.perf_counter() - t0:6.1f}s] {what}{tail}", flush=True)

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 matmuls
    report = {"environment": environment(args.device), "parity": {}, "latency": {}, "parity_after": {}}
    log(json.dumps(report["environment"]))
    ok, report["skipped"] = backends(args.device, Path(args.engine), out)
    log(f"backends: {sorted(ok)}; skipped: {report['skipped']}")
    save(report, out)  # written after every step: a run cut short still returns what it measured
    hf = None
    if not args.skip_hf:
        try:
            hf = HFBaselines(Engine.load(args.engine, verify=False, backend="onnxruntime"), args.device)
        except Exception as err:  # noqa: BLE001 - the baseline is optional; say why it is missing
            report["skipped"]["hf_eager"] = f"{type(err).__name__}: {err}"[:300]
            log(f"HF baseline skipped: {report['skipped']['hf_eager']}")
    try:  # the CPU reference of the replayed-graph comparisons (bf16 engines have none on ONNX Runtime)
        reference = Engine.load(args.engine, verify=False, backend="onnxruntime")
    except Exception as err:  # noqa: BLE001
        reference = None
        report["skipped"]["parity_after"] = f"{type(err).__name__}: {err}"[:300]
    for name, (root, make) in ok.items():
        engine = Engine.load(root, backend=make, verify=False)
        diffs = run_golden(engine)
        precision = name.rsplit("-", 1)[-1]  # torch-cuda-fp16 runs the fp32 engine at fp16
        tol = TOLERANCES_BY_PRECISION.get(precision, tolerances(engine))
        report["parity"][name] = {k: {"max_diff": v, "within_tolerance": v <= tol[k]} for k, v in diffs.items()}
        log(f"{name} parity {diffs}")
        save(report, out)
        report["latency"][name] = measure(engine, hf, Timer(args.device), args.iters, deadline, log)
        hf = None  # HF baselines once, beside the first backend
        save(report, out)
        if reference is not None:
            after = run_golden(engine)  # the golden pass again, now that many graphs were captured
            report["parity_after"][name] = {
                "golden": {k: {"max_diff": v, "within_tolerance": v <= tol[k]} for k, v in after.items()},
                "replayed": parity_after(engine, reference, tol["target_logprob"])}
            log(f"{name} parity after the loops {report['parity_after'][name]}")
            save(report, out)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    save(report, out)
    print(markdown(report))
    return 0


def parity_after(engine: Engine, reference: Engine, tolerance: float) -> dict:
    """After the latency loops (graphs captured for many keys): every option log-likelihood of 1, 4 and 13
    questions (three buckets) on two states of different lengths, replayed, against ONNX Runtime on the CPU."""
    worst = 0.0
    cases = 0
    for text in (state_of_tokens(engine, 100), state_of_tokens(engine, 512)):
        for k in (1, 4, 13):
            qs = many_questions(k)
            encoded = engine.encode_questions(qs)
            for _ in range(2):  # the second call replays the captured graph
                got = engine.option_logprobs(text, encoded)
            want = reference.option_logprobs(text, reference.encode_questions(qs))
            worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(got, want)))
            cases += 1
    return {"cases": cases, "max_diff": worst, "within_tolerance": worst <= tolerance}


def save(report: dict, out: Path) -> None:
    """gpu_check.json and .md as measured so far (atomic renames)."""
    for name, text in (("gpu_check.json", json.dumps(report, indent=2) + "\n"), ("gpu_check.md", markdown(report))):
        tmp = out / (name + ".partial")
        tmp.write_text(text)
        tmp.replace(out / name)


if __name__ == "__main__":
    sys.exit(main())
