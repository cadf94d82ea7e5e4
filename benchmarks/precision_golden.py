"""Golden-file error of the mixed-precision PyTorch paths with real weights vs the shape check's random weights.

    python benchmarks/precision_golden.py --engine engines/smollm2 [--random-engine DIR]

The GPU check's tolerances by precision (``runtime/core/selfcheck.py: TOLERANCES_BY_PRECISION``) must come from the
real model: random weights keep activations small and hide precision error. For each engine, the PyTorch backend
on this CPU at fp32 / fp16 / bf16 (block GEMMs in that precision, everything else float32: the same recipe as on
CUDA) runs the engine's golden file; the max |difference| of each output is reported, with the tolerance in force.
Writes benchmarks/results/gpu/precision_golden.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from onepass import Engine
from onepass.runtime.backends import factory
from onepass.runtime.core.guarantee import cpu_model
from onepass.runtime.core.selfcheck import TOLERANCES_BY_PRECISION, run_golden

OUT = Path(__file__).parent / "results" / "gpu"


def measure(engine_dir: str) -> dict:
    """precision -> output -> max |difference| from the golden file."""
    out = {}
    for precision in ("fp32", "fp16", "bf16"):
        engine = Engine.load(engine_dir, backend=factory("torch-cpu", precision=precision), verify=False)
        out[precision] = run_golden(engine)
        engine.close()
        print(engine_dir, precision, out[precision], flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--random-engine", default=None, help="the same model shape with random weights (gpu_shape.py)")
    args = ap.parse_args(argv)
    cpu = cpu_model() or platform.machine()
    report = {"machine": cpu, "tolerances": TOLERANCES_BY_PRECISION,
              "real_weights": measure(args.engine)}
    if args.random_engine:
        report["random_weights"] = measure(args.random_engine)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "precision_golden.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Golden-file error by precision (PyTorch backend, this CPU)", "",
             f"Produced by `python benchmarks/precision_golden.py` on {report['machine']} (2 threads). Random weights: "
             "the same shape with seeded random weights (`benchmarks/gpu_shape.py`).", "",
             "| weights | precision | output | max abs diff | tolerance | within |", "|---|---|---|---|---|---|"]
    for weights in ("real_weights", "random_weights"):
        for precision, diffs in report.get(weights, {}).items():
            for name, value in diffs.items():
                tol = TOLERANCES_BY_PRECISION[precision][name]
                lines.append(f"| {weights.split('_')[0]} | {precision} | {name} | {value:.4g} | {tol} | "
                             f"{'yes' if value <= tol else '**no**'} |")
    (OUT / "precision_golden.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
