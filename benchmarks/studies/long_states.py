"""Cold and warm latency of the 13-question workload at long states, up to the engine's state limit.

Cold: prefill of the state included (a fresh engine state cache each time); warm: the state's K/V
cached, one packed pass for the 13 questions. Also the state's K/V size. Same workload and timing
helper as benchmarks/latency.py; writes benchmarks/studies/results/long_states.{json,md}.

    python benchmarks/studies/long_states.py --engine engines/smollm2 [--lengths 512 2048 7168]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
from latency import QUESTIONS, THREADS, cpu_name, state_of_tokens, timed  # noqa: E402

from onepass import Engine  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--lengths", nargs="+", type=int, default=None, help="state tokens (default: 512, 2048 and "
                    "the engine's max_state_tokens)")
    ap.add_argument("--cold-iters", type=int, default=3)
    ap.add_argument("--warm-iters", type=int, default=10)
    args = ap.parse_args()
    engine = Engine.load(args.engine, threads=THREADS)
    nocache = Engine(engine.root, engine.manifest, engine.backend, cache_bytes=0)
    limit = engine.manifest.limits.max_state_tokens
    lengths = args.lengths or [512, 2048, limit]
    out = {"machine": {"cpu": cpu_name(), "python": platform.python_version(), "threads": THREADS},
           "engine": args.engine, "max_state_tokens": limit, "runs": []}
    for n in lengths:
        text = state_of_tokens(engine, n)
        state = engine.state(text)
        cold = timed(lambda: nocache.ask(text, QUESTIONS), args.cold_iters)
        warm = timed(lambda: engine.ask(state, QUESTIONS), args.warm_iters)
        run = {"state_tokens": state.num_tokens, "kv_mb": state.kv.nbytes / 2**20, "cold": cold, "warm": warm}
        out["runs"].append(run)
        print(f"state {state.num_tokens:5d} tokens ({run['kv_mb']:.0f} MB K/V): cold p50 {cold['p50']:8.1f} ms, "
              f"warm p50 {warm['p50']:8.1f} ms", flush=True)
    (RESULTS / "long_states.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# 13 questions at long states ({out['machine']['cpu']}, {THREADS} threads)", "",
             f"`python benchmarks/studies/long_states.py --engine {args.engine}` (state limit {limit} tokens: the context "
             "minus the question budget). Cold: prefill included; warm: the state cached. ms.", "",
             "| state tokens | K/V MB | cold p50 | cold max | warm p50 | warm p90 | cold / warm |", "|---" * 7 + "|"]
    for r in out["runs"]:
        lines.append(f"| {r['state_tokens']} | {r['kv_mb']:.0f} | {r['cold']['p50']:.0f} | {r['cold']['max']:.0f} | "
                     f"{r['warm']['p50']:.0f} | {r['warm']['p90']:.0f} | {r['cold']['p50'] / r['warm']['p50']:.1f} |")
    (RESULTS / "long_states.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
