"""Peak and after-request RSS of the largest request an engine's limits allow (one process per setting).

    python benchmarks/memory_peak.py --engine engines/smollm2            # writes results/memory_peak.{json,md}

For each setting — `ort-arena` (ONNX Runtime's default CPU memory arena), `onepass` (ONNX Runtime with the
arena off, as the runtime loads it) and `openvino-cpu` (the default backend where OpenVINO is installed) — a fresh
process loads the engine, answers a warm-up, then one request at the
limits: a state of ~max_state_tokens and as many questions as pack into max_packed_tokens (run in the
backend's blocks of whole questions, as every request is). It
reports RSS after warm-up, the peak (ru_maxrss), RSS after the request and after malloc_trim,
and the request's seconds; then small requests side by side to price the arena (median ms).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

CHILD = r"""
import json, resource, sys, time
import numpy as np
from onepass import Choice, Engine, Noul
from onepass.runtime.server.memory import release_free_memory, rss_bytes

engine_dir, mode = sys.argv[1], sys.argv[2]
engine = Engine.load(engine_dir, backend="openvino-cpu" if mode == "openvino-cpu" else "onnxruntime")
if mode == "ort-arena":  # the same graph with ONNX Runtime's default CPU arena (onepass turns it off)
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    engine.backend.session = ort.InferenceSession(str(engine.root / engine.manifest.graph), opts,
                                                  providers=["CPUExecutionProvider"])
ticket = "I was charged twice for my subscription this month. Please refund the second payment. " * 3
small = {"refund": Noul("Does the customer request a refund?"),
         "team": Choice("Which team?", {"billing": None, "technical": None, "sales": None})}
for _ in range(3):
    engine.run(ticket, small)
times = {"cached": [], "fresh": []}
for i in range(25):
    t = time.perf_counter(); engine.run(ticket, small); times["cached"].append(time.perf_counter() - t)
    t = time.perf_counter(); engine.run(f"Ticket {i}. " + ticket, small); times["fresh"].append(time.perf_counter() - t)
release_free_memory()
out = {"mode": mode, "rss_warm_mb": rss_bytes() >> 20,
       "small_ms": {k: round(float(np.median(v)) * 1000, 1) for k, v in times.items()}}
lim = engine.manifest.limits
ids = engine.encoder._trusted.encode("alpha beta gamma delta " * (lim.max_state_tokens // 3)).ids
state = engine.encoder._trusted.decode(ids[: lim.max_state_tokens - 40])
while len(engine.encoder.state(state)) > lim.max_state_tokens:
    state = state[:-50]
def ask(i):
    return Noul(f"Question {i}: " + "is this about the greek letters " * 12 + "?")
(one,) = engine.encode_questions({"q": ask(0)})
per_question = len(one.trunk) + sum(len(o) for o in one.options)  # trunk and option tokens
questions = {f"q{i}": ask(i) for i in range(min(lim.max_questions, lim.max_packed_tokens // per_question))}
prefilled = engine.state(state)
t = time.perf_counter()
result = engine.run(prefilled, questions)
out.update(state_tokens=prefilled.num_tokens, packed_tokens=result.packed_tokens, questions=len(questions),
           large_s=round(time.perf_counter() - t, 1), peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
           rss_after_mb=rss_bytes() >> 20, state_cache_mb=engine.cache.bytes >> 20)
release_free_memory()
out["rss_after_trim_mb"] = rss_bytes() >> 20
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    args = ap.parse_args()
    runs = []
    for mode in ("ort-arena", "onepass", "openvino-cpu"):
        proc = subprocess.run([sys.executable, "-c", CHILD, args.engine, mode], capture_output=True, text=True,
                              check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory_peak.json").write_text(json.dumps(runs, indent=1) + "\n")
    r0 = runs[0]
    lines = ["# Memory of the largest request the limits allow", "",
             f"`python benchmarks/memory_peak.py --engine {args.engine}` ({time.strftime('%Y-%m-%d')}, 2 cores). "
             f"One request at the limits: a state of {r0['state_tokens']} tokens and {r0['questions']} questions "
             f"packed into {r0['packed_tokens']} tokens (limits: state 7168, packed 4096 per pass, run in blocks of 256 packed tokens on ONNX Runtime, 512 on OpenVINO). A fresh process per "
             "setting; small requests (2 questions) timed in the same process, median of 25.", "",
             "| backend, memory | RSS warm MB | peak MB | RSS after MB | after malloc_trim MB | state cache MB "
             "| large request s | small request ms (cached state / new state) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['mode']} | {r['rss_warm_mb']} | {r['peak_mb']} "
                     f"| {r['rss_after_mb']} | {r['rss_after_trim_mb']} | {r['state_cache_mb']} | {r['large_s']} "
                     f"| {r['small_ms']['cached']} / {r['small_ms']['fresh']} |")
    (RESULTS / "memory_peak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
