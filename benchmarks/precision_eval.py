"""The CPU paths and reduced precisions vs fp32 on the 78-question workload: option log-prob and answer
probability error, argmax agreement, warm latency measured side by side.

    python benchmarks/precision_eval.py --engine engines/smollm2 [--rounds 15]

Exports an fp16 engine (block GEMMs in fp16, everything else float32) next to the fp32 one
(cached in ENGINE-fp16), then compares on this CPU: ONNX Runtime fp32, ONNX Runtime fp16
engine, the PyTorch backend at fp32 / fp16 / bf16 (same mixed-precision recipe), and
OpenVINO's CPU plugin at f32 and bf16 (when installed). Errors are against ONNX Runtime fp32.
Latency: the 13-question request on a cached 511-token state, every variant once per round
(interleaved, so machine noise hits all alike), after one warm-up round; p50 and p90.
Writes benchmarks/results/precision_eval.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from int8_explore import TEXTS, margins  # noqa: E402
from latency import QUESTIONS, cpu_name, state_of_tokens  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.runtime.backends import factory  # noqa: E402
from onepass.runtime.core import manifest as mf  # noqa: E402
from onepass.runtime.core.errors import BackendUnavailable  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def probabilities(engine: Engine, text: str) -> np.ndarray:
    """Every answer probability of the 13 questions (yes of a noul, each option of a choice or score)."""
    values = []
    for a in engine.ask(text, QUESTIONS).values():
        wire = a.to_wire()
        values += [wire["noul"]] if "noul" in wire else list(wire["probabilities"].values())
    return np.array(values)


def errors(engine: Engine, texts: list, encoded, ref: list, ref_p: list) -> dict:
    """Against the reference's option log-likelihoods ``ref`` and answer probabilities ``ref_p`` on ``texts``:
    argmax agreement, the largest and 99th-percentile option log-prob errors, the largest probability error."""
    got = [engine.option_logprobs(t, encoded) for t in texts]
    pairs = [(a, b) for g, r in zip(got, ref) for a, b in zip(g, r)]
    got_p = [probabilities(engine, t) for t in texts]
    return {"agreement": float(np.mean([np.argmax(a) == np.argmax(b) for a, b in pairs])),
            "max_logprob_error": float(max(np.abs(a - b).max() for a, b in pairs)),
            "p99_logprob_error": float(np.percentile([np.abs(a - b).max() for a, b in pairs], 99)),
            "max_probability_error": float(max(np.abs(a - b).max() for a, b in zip(got_p, ref_p)))}


def interleaved(variants: dict, text: str, rounds: int) -> dict:
    """{name: [seconds]}: the 13-question request on a cached state, each variant once per round."""
    states = {name: eng.state(text) for name, eng in variants.items()}
    times: dict = {name: [] for name in variants}
    for r in range(rounds + 1):
        for name, eng in variants.items():
            t0 = time.perf_counter()
            eng.ask(states[name], QUESTIONS)
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    fp16_dir = Path(args.engine + "-fp16")
    if not (fp16_dir / "manifest.json").exists():
        from onepass.export.build import export_engine
        from onepass.export.model_source import engine_source

        m = mf.load(args.engine, verify=False)
        spec, adapters = engine_source(m)
        export_engine(fp16_dir, spec, precision="fp16", adapters=adapters, prompt=m.prompt)
    base = Engine.load(args.engine, verify=False, threads=2, backend="onnxruntime")  # the reference
    texts = TEXTS + [state_of_tokens(base, 512)]
    enc = base.encode_questions(QUESTIONS)
    ref = [base.option_logprobs(t, enc) for t in texts]
    ref_p = [probabilities(base, t) for t in texts]
    m = margins(ref)
    variants = {
        "onnxruntime fp32": base,
        "onnxruntime fp16 engine": Engine.load(fp16_dir, verify=False, threads=2, backend="onnxruntime"),
        "torch fp32": Engine.load(args.engine, verify=False, threads=2, backend=factory("torch-cpu", precision="fp32")),
        "torch fp16 GEMMs": Engine.load(args.engine, verify=False, threads=2, backend=factory("torch-cpu", precision="fp16")),
        "torch bf16 GEMMs": Engine.load(args.engine, verify=False, threads=2, backend=factory("torch-cpu", precision="bf16")),
    }
    try:
        for name, backend in (("openvino f32", "openvino-cpu"), ("openvino bf16", "openvino-cpu-bf16")):
            variants[name] = Engine.load(args.engine, verify=False, threads=2, backend=backend)
    except BackendUnavailable as err:
        print(f"OpenVINO left out: {err}", flush=True)
    res = {"questions": int(m.size), "cpu": cpu_name(), "rounds": args.rounds, "variants": {}}
    for name, eng in variants.items():
        res["variants"][name] = errors(eng, texts, enc, ref, ref_p)
        print(name, res["variants"][name], flush=True)
    for name, samples in interleaved(variants, texts[-1], args.rounds).items():
        res["variants"][name].update(warm_s=float(np.median(samples)), warm_p90_s=float(np.percentile(samples, 90)))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "precision_eval.json").write_text(json.dumps(res, indent=2) + "\n")
    fp32 = res["variants"]["onnxruntime fp32"]["warm_s"]
    lines = [f"# CPU paths and reduced precision vs fp32 ({res['cpu']}, 2 threads)", "",
             "Recipe of the fp16/bf16 engines and torch variants: block weights and GEMMs in fp16/bf16; embedding, "
             "norms, rotary, softmax, residual stream, read-out and K/V in float32. OpenVINO: the fp32 engine's graph "
             "compiled at its f32 or bf16 inference precision (the CPU plugin's own choice of what stays f32). "
             f"{res['questions']} questions (6 states x 13), errors against ONNX Runtime fp32. Latency: the 13 "
             f"questions on a cached 511-token state, {args.rounds} interleaved rounds after a warm-up round.", "",
             "| variant | argmax agreement | max option log-prob error | max answer probability error "
             "| warm p50 ms | warm p90 ms | p50 vs ORT fp32 |", "|---|---|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        lines.append(f"| {name} | {v['agreement']:.3f} | {v['max_logprob_error']:.4f} | "
                     f"{v['max_probability_error']:.4f} | {v['warm_s'] * 1000:.0f} | {v['warm_p90_s'] * 1000:.0f} | "
                     f"{fp32 / v['warm_s']:.2f}x |")
    (RESULTS / "precision_eval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
