"""Segment-blocked scoring: warm latency and ms per packed token against the number of questions and the block
size, in one run (the cost should be linear in questions).

For each block size (``none`` = one pass of up to max_packed_tokens, the engine before blocking) and each
workload (1, 13, 64, 500, 5000 questions; a choice of 255 and of 1000 options) over one cached state: the
median warm time of ``engine.option_logprobs`` after a warm-up, the packed tokens, passes, and the largest
difference to the unblocked answers where an unblocked pass is possible (it is not past max_packed_tokens).

    python benchmarks/blocks.py --engine engines/smollm2 --blocks none 256 512 1024 --questions 1 13 64 500
    python benchmarks/blocks.py --backend openvino-cpu --blocks 128 256 512 1024 --out benchmarks/results/blocks_openvino
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from onepass import Choice, Engine, Noul, Score

RESULTS = Path(__file__).parent / "results"
STATE = ("Order 4521: the customer writes that the parcel arrived damaged, the charger does not work and the card "
         "was billed twice for one order. They want the duplicate charge reversed and a replacement sent.")
THINGS = ["refund", "parcel", "charger", "card", "invoice", "courier", "warranty", "screen"]


def questions(n: int) -> dict:
    """``n`` distinct questions of the three types (a third each)."""
    out = {}
    for i in range(n):
        thing = THINGS[i % len(THINGS)]
        if i % 3 == 0:
            out[f"q{i}"] = Noul(f"Is the {thing} mentioned in note {i}?")
        elif i % 3 == 1:
            names = ["billing", "technical", "shipping", "sales", "returns"][: 2 + i % 4]
            out[f"q{i}"] = Choice(f"Which team handles the {thing} ({i})?", {n_: None for n_ in names})
        else:
            out[f"q{i}"] = Score(f"How urgent is the {thing} ({i})?", ["Low", "Medium", "High"])
    return out


def options(k: int) -> dict:
    return {"q": Choice("Which product code is meant?", {f"code {i}": None for i in range(k)})}


def timed(engine: Engine, state, encoded, repeats: int) -> tuple[list, list]:
    engine.option_logprobs(state, encoded)  # warm-up (and the long-trunk prefill of a many-option choice)
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = engine.option_logprobs(state, encoded)
        times.append(time.perf_counter() - t0)
    return times, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--backend", default="onnxruntime", help="the backend measured (a name of onepass's table)")
    ap.add_argument("--blocks", nargs="+", default=["none", "256", "512", "1024"])
    ap.add_argument("--questions", nargs="+", type=int, default=[1, 13, 64, 500, 5000])
    ap.add_argument("--options", nargs="+", type=int, default=[255, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "blocks"))
    args = ap.parse_args()
    engine = Engine.load(args.engine, backend=args.backend)
    state = engine.state(STATE)
    workloads = [(f"{n} questions", questions(n)) for n in args.questions] + [
        (f"choice of {k} options", options(k)) for k in args.options]
    rows, reference = [], {}
    for block in args.blocks:
        engine.backend.block_tokens = None if block == "none" else int(block)
        for name, qs in workloads:
            encoded = engine.encode_questions(qs)
            passes = engine.passes(state, encoded)
            packed = sum(b.num_tokens for _, b, _ in passes)
            repeats = args.repeats if packed < 20000 else 1
            times, out = timed(engine, state, encoded, repeats)
            median = statistics.median(times)
            diff = None
            if name in reference:
                diff = max(float(np.abs(a - b).max()) for a, b in zip(out, reference[name]))
            elif block == args.blocks[0]:
                reference[name] = out
            rows.append({"block": block, "workload": name, "questions": len(encoded), "passes": len(passes),
                         "packed_tokens": packed, "median_ms": median * 1000, "ms_per_token": median * 1000 / packed,
                         "runs": repeats, "max_diff_vs_first_block": diff})
            print(json.dumps(rows[-1]), flush=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    machine = {"cpu": next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), ""),
               "python": platform.python_version(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "engine": engine.name, "backend": args.backend, "limits": engine.manifest.limits.__dict__}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    lines = [f"# Segment-blocked scoring ({machine['engine']}, {args.backend}, {machine['cpu']}, {machine['when']})", "",
             "Warm `engine.option_logprobs` over one cached state (median of the runs after a warm-up). `block`: "
             "packed tokens per pass (`none`: one pass of up to max_packed_tokens, as before blocking). "
             "`max diff`: largest option log-likelihood difference to the first block size's answers.", "",
             "| block | workload | passes | packed tokens | median ms | ms / packed token | max diff |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "–" if r["max_diff_vs_first_block"] is None else f"{r['max_diff_vs_first_block']:.1e}"
        lines.append(f"| {r['block']} | {r['workload']} | {r['passes']} | {r['packed_tokens']} | "
                     f"{r['median_ms']:.0f} | {r['ms_per_token']:.3f} | {diff} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
