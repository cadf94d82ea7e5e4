"""Exploration for INT8 on CPU: ONNX Runtime dynamic INT8 (per-channel weights) with layers kept in fp32.

For each variant the decoder's weight MatMuls (Gemm in the export) are quantized except the
kept ones; then, on six states x the 13-question latency workload (78 questions), it reports
argmax agreement with the fp32 engine, the max option log-prob error, and warm latency.
Issue targets: agreement >= 99%, log-prob error <= 0.1, >= 1.5x faster. Writes
benchmarks/results/int8_explore.{json,md}.

    python benchmarks/int8_explore.py --engine engines/smollm2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, state_of_tokens  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.calibration.quantize import excluded_nodes, quantize_graph  # noqa: E402

RESULTS = Path(__file__).parent / "results"
EDGES = (0, 1, 28, 29)
VARIANTS = {  # name: (blocks kept in fp32, weight-name parts kept in fp32)
    "all_blocks": ((), ()),
    "edge_blocks_fp32": (EDGES, ()),
    "attention_only": (EDGES, (".gate.", ".up.", ".down.")),
    "no_down_proj": (EDGES, (".down.",)),
}
TEXTS = ["I was charged twice, refund me now!", "The app crashes when I open reports.", "Great service, thanks a lot.",
         "Can I upgrade to the team plan?", "My password reset email never arrives."]


def quantized_copy(src: Path, dst: Path, blocks, parts) -> int:
    """An engine directory whose graph is dynamically quantized; returns the number of quantized Gemms."""
    dst.mkdir()
    for f in ("manifest.json", "tokenizer.json", "golden.npz"):
        shutil.copy(src / f, dst / f)
    model = onnx.load(str(src / "decoder.onnx"), load_external_data=False)
    exclude = excluded_nodes(model, blocks, parts)
    quantized = sum(n.op_type == "Gemm" and n.name not in exclude for n in model.graph.node)
    quantize_graph(src / "decoder.onnx", dst / "decoder.onnx", exclude)
    return quantized


def warm(engine: Engine, text: str, iters: int = 7) -> float:
    state = engine.state(text)
    engine.ask(state, QUESTIONS)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        engine.ask(state, QUESTIONS)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "fp32"
        shutil.copytree(args.engine, src)  # a real copy: onnx refuses hard-linked external data
        base = Engine.load(src, verify=False, threads=2)
        texts = TEXTS + [state_of_tokens(base, 512)]
        ref = [base.option_logprobs(t, base.encode_questions(QUESTIONS)) for t in texts]
        res = {"fp32_warm_s": warm(base, texts[-1]), "variants": {}}
        for name, (blocks, parts) in VARIANTS.items():
            n = quantized_copy(src, Path(tmp) / name, blocks, parts)
            eng = Engine.load(Path(tmp) / name, verify=False, threads=2)
            got = [eng.option_logprobs(t, eng.encode_questions(QUESTIONS)) for t in texts]
            pairs = [(a, b) for g, r in zip(got, ref) for a, b in zip(g, r)]
            agree = sum(int(np.argmax(a) == np.argmax(b)) for a, b in pairs)
            res["variants"][name] = {"quantized_gemms": n, "agreement": agree / len(pairs), "questions": len(pairs),
                                     "max_logprob_error": float(max(np.abs(a - b).max() for a, b in pairs)),
                                     "warm_s": warm(eng, texts[-1])}
            print(name, res["variants"][name], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int8_explore.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = ["# Dynamic INT8 exploration (ONNX Runtime quantize_dynamic, per-channel QInt8 weights)", "",
             f"fp32 warm (13 questions, 511-token state): {res['fp32_warm_s'] * 1000:.0f} ms", "",
             "| variant | quantized Gemms | argmax agreement | max log-prob error | warm ms | speed-up |",
             "|---|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        lines.append(f"| {name} | {v['quantized_gemms']} | {v['agreement']:.3f} ({v['questions']}) | "
                     f"{v['max_logprob_error']:.2f} | {v['warm_s'] * 1000:.0f} | {res['fp32_warm_s'] / v['warm_s']:.2f}x |")
    lines += ["", "Targets (issue): agreement >= 0.99, error <= 0.1, >= 1.5x. No dynamic variant meets them; "
              "static QDQ with calibration states and SmoothQuant-style scaling are next.", ""]
    (RESULTS / "int8_explore.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
