"""RSS after the heaviest legal request a server sees: one 1000-option choice, per backend, one process each.

    python benchmarks/memory_options.py --engine engines/smollm2 [--options 1000]

For each backend a fresh process loads the engine, answers two small requests (warm), then one choice of
``--options`` short options about a ~400-token state, and reports RSS after warm-up and after the request (both
after ``malloc_trim``, as the server does after every batch), their ratio (the target is <= 1.2), the request's
seconds, and for OpenVINO RSS once its infer request (which holds the largest pass's intermediate buffers) is
dropped too. Writes benchmarks/results/memory_options.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

CHILD = r"""
import gc, json, sys, time
from onepass import Choice, Engine, Noul
from onepass.runtime.server.memory import release_free_memory, rss_bytes

engine = Engine.load(sys.argv[1], backend=sys.argv[2])
mb = lambda: rss_bytes() / 2**20
engine.ask("Warm-up ticket: charged twice.", {"q": Noul("Is it billing?")})
engine.ask("Another warm-up ticket: the app crashes.", {"q": Noul("Is it a bug?")})
release_free_memory()
out = {"backend": sys.argv[2], "warm_mb": mb()}
options = {f"o{i}": None for i in range(int(sys.argv[3]))}
start = time.perf_counter()
engine.ask("I was charged twice for my subscription. Please refund it. " * 20, {"t": Choice("Which team?", options)})
out["seconds"] = time.perf_counter() - start
release_free_memory()
out["after_mb"] = mb()
if hasattr(engine.backend, "_requests"):  # OpenVINO: its per-thread infer request keeps the largest pass's buffers
    engine.backend._requests.value = None
    gc.collect()
    release_free_memory()
    out["after_dropping_infer_request_mb"] = mb()
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--options", type=int, default=1000)
    args = ap.parse_args()
    rows = []
    for backend in ("onnxruntime", "openvino-cpu"):
        done = subprocess.run([sys.executable, "-c", CHILD, args.engine, backend, str(args.options)],
                              capture_output=True, text=True, timeout=1800, cwd=RESULTS)
        line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not line:
            rows.append({"backend": backend, "error": done.stderr[-500:]})
        else:
            rows.append(json.loads(line[-1]))
        print(rows[-1], flush=True)
    (RESULTS / "memory_options.json").write_text(json.dumps({"options": args.options, "runs": rows}, indent=2) + "\n")
    lines = [f"# RSS after one {args.options}-option choice (target: <= 1.2x warm)", "",
             "`python benchmarks/memory_options.py --engine engines/smollm2` (2 cores, AMD EPYC, 2026-12-02; RSS after "
             "malloc_trim, as the server does after every batch).", "",
             "| backend | warm MB | after MB | after / warm | request s | after dropping the infer request MB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | failed: {r['error'][:200]} | | | | |")
            continue
        dropped = r.get("after_dropping_infer_request_mb")
        after_drop = f"{dropped:.0f} ({dropped / r['warm_mb']:.2f}x)" if dropped else "–"
        lines.append(f"| {r['backend']} | {r['warm_mb']:.0f} | {r['after_mb']:.0f} | {r['after_mb'] / r['warm_mb']:.2f} "
                     f"| {r['seconds']:.1f} | {after_drop} |")
    (RESULTS / "memory_options.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
