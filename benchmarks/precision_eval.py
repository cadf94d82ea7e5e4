"""Reduced precision vs fp32 on the 78-question workload: option log-prob error, argmax agreement, warm latency.

    python benchmarks/precision_eval.py --engine engines/smollm2

Exports an fp16 engine (block GEMMs in fp16, everything else float32) next to the fp32 one
(cached in ENGINE-fp16), then compares on this CPU: ONNX Runtime fp32, ONNX Runtime fp16
engine, and the PyTorch backend at fp32 / fp16 / bf16 (same mixed-precision recipe). The
numbers predict what GPU fp16/bf16 do to the answers; CPU speed is reported as measured.
Writes benchmarks/results/precision_eval.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from int8_explore import TEXTS, margins, warm  # noqa: E402
from latency import QUESTIONS, state_of_tokens  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.export.torch_backend import factory  # noqa: E402
from onepass.runtime import manifest as mf  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    args = ap.parse_args()
    fp16_dir = Path(args.engine + "-fp16")
    if not (fp16_dir / "manifest.json").exists():
        from onepass.export.build import export_engine
        from onepass.export.model_source import engine_source

        spec, adapters = engine_source(mf.load(args.engine, verify=False))
        export_engine(fp16_dir, spec, precision="fp16", adapters=adapters)
    base = Engine.load(args.engine, verify=False, threads=2)
    texts = TEXTS + [state_of_tokens(base, 512)]
    enc = base.encode_questions(QUESTIONS)
    ref = [base.option_logprobs(t, enc) for t in texts]
    m = margins(ref)
    variants = {
        "onnxruntime fp32": base,
        "onnxruntime fp16 engine": Engine.load(fp16_dir, verify=False, threads=2),
        "torch fp32": Engine.load(args.engine, verify=False, threads=2, backend=factory("cpu", "fp32")),
        "torch fp16 GEMMs": Engine.load(args.engine, verify=False, threads=2, backend=factory("cpu", "fp16")),
        "torch bf16 GEMMs": Engine.load(args.engine, verify=False, threads=2, backend=factory("cpu", "bf16")),
    }
    res = {"questions": int(m.size), "variants": {}}
    for name, eng in variants.items():
        got = [eng.option_logprobs(t, enc) for t in texts]
        pairs = [(a, b) for g, r in zip(got, ref) for a, b in zip(g, r)]
        res["variants"][name] = {
            "agreement": float(np.mean([np.argmax(a) == np.argmax(b) for a, b in pairs])),
            "max_logprob_error": float(max(np.abs(a - b).max() for a, b in pairs)),
            "warm_s": warm(eng, texts[-1]),
        }
        print(name, res["variants"][name], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "precision_eval.json").write_text(json.dumps(res, indent=2) + "\n")
    fp32 = res["variants"]["onnxruntime fp32"]["warm_s"]
    lines = ["# Reduced precision vs fp32 (this CPU, 2 threads)", "",
             "Recipe: block weights and GEMMs in fp16/bf16; embedding, norms, rotary, softmax, residual stream, "
             f"read-out and K/V in float32. {res['questions']} questions (6 states x 13), errors against ONNX Runtime "
             "fp32.", "", "| variant | argmax agreement | max option log-prob error | warm ms (13 q, 511-token state) "
             "| vs ORT fp32 |", "|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        lines.append(f"| {name} | {v['agreement']:.3f} | {v['max_logprob_error']:.4f} | {v['warm_s'] * 1000:.0f} | "
                     f"{fp32 / v['warm_s']:.2f}x |")
    (RESULTS / "precision_eval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
