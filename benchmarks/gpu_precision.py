"""The GPU pass's precision on real weights, measured on a CPU: the fused half-precision pass against ONNX Runtime
fp32, beside the reference decoder's mixed precision (fp32 residual stream, half GEMMs) that the export uses.

    python benchmarks/gpu_precision.py --engine engines/smollm2

The fused pass (runtime/backends/fused_decoder.py) keeps everything in one dtype, residual stream and K/V included:
that is what makes it a dozen kernels per block on a GPU, and what this measures. The same code runs on CPU torch
(CPU kernels, the same roundings up to accumulation order), so the figures carry to the GPU up to that order.
Workload: the 78 questions of benchmarks/precision_eval.py (6 states x 13 questions); errors against ONNX Runtime
fp32; and the golden file's outputs. Writes benchmarks/results/gpu/fused_precision.{json,md}; the test bounds
(tests/test_precision.py, runtime/core/selfcheck.py) are set from these figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from int8_explore import TEXTS  # noqa: E402
from latency import QUESTIONS, cpu_name, state_of_tokens  # noqa: E402
from precision_eval import errors, probabilities  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.runtime.backends import factory  # noqa: E402
from onepass.runtime.core.selfcheck import run_golden  # noqa: E402

OUT = Path(__file__).parent / "results" / "gpu"
VARIANTS = {"fused fp32": dict(precision="fp32"), "fused fp16": dict(precision="fp16"),
            "fused bf16": dict(precision="bf16"), "reference fp16 GEMMs (export's)": dict(precision="fp16", fused=False),
            "reference bf16 GEMMs (export's)": dict(precision="bf16", fused=False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    args = ap.parse_args()
    base = Engine.load(args.engine, verify=False, threads=2, backend="onnxruntime")
    texts = TEXTS + [state_of_tokens(base, 512)]
    enc = base.encode_questions(QUESTIONS)
    ref = [base.option_logprobs(t, enc) for t in texts]
    ref_p = [probabilities(base, t) for t in texts]
    res = {"cpu": cpu_name(), "questions": sum(len(r) for r in ref), "variants": {}}
    for name, options in VARIANTS.items():
        eng = Engine.load(args.engine, verify=False, threads=2, backend=factory("torch-cpu", **options))
        res["variants"][name] = {**errors(eng, texts, enc, ref, ref_p), "golden": run_golden(eng)}
        print(name, res["variants"][name], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fused_precision.json").write_text(json.dumps(res, indent=2) + "\n")
    (OUT / "fused_precision.md").write_text(markdown(res))
    print(markdown(res))


def markdown(res: dict) -> str:
    """The report as a page."""
    lines = [f"# The GPU pass's precision on SmolLM2's real weights ({res['cpu']}, CPU torch)", "",
             "Produced by `python benchmarks/gpu_precision.py`. Fused: the GPU pass (one dtype end to end: weights, "
             "residual stream, K/V, attention; statistics of norms and softmax in fp32 inside their kernels; read-out "
             "logits in fp32). Reference: the export's mixed precision (fp32 residual stream, norms, attention and "
             f"K/V; half GEMMs). {res['questions']} questions (6 states x 13), errors against ONNX Runtime fp32; "
             "golden: the engine's fp32 golden file.", "",
             "| variant | argmax agreement | max option log-prob error | p99 | max answer probability error | golden "
             "target_logprob | golden prefill K / V |", "|---|---|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        g = v["golden"]
        lines.append(f"| {name} | {v['agreement']:.3f} | {v['max_logprob_error']:.3g} | {v['p99_logprob_error']:.3g} "
                     f"| {v['max_probability_error']:.3g} | {g['target_logprob']:.3g} | "
                     f"{g['prefill_key_first']:.3g} / {g['prefill_value_last']:.3g} |")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
