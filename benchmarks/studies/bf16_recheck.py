"""bf16 with its doubtful answers asked again at fp32: can a cascade keep issue 46's bounds and bf16's speed?

bf16 moves answer probabilities most where the model is unsure (a logit error e moves p by about p(1 - p) e), so a
cascade (``core.cascade.Cascade``: OpenVINO in bf16 first, every answer whose certainty is below a threshold asked
again of OpenVINO at f32 about the same state) answers the doubtful questions exactly as fp32 does and leaves bf16 only
the confident ones. This measures what it costs:

- On the requests of ``bf16_guarantee.py`` (N questions per data set, fixed seed), both backends answer every
  question. For each threshold, per data set: the share of questions asked again, and on the answers the cascade
  returns the argmax agreement and max |dp| against f32 (an answer asked again is f32's own: dp 0).
- The smallest threshold at which the bounds (core.guarantee.BOUNDS) hold on every data set is chosen on one seed
  and checked on requests of another seed (a threshold fitted and judged on the same questions would flatter it).
- The README ticket's 13 questions warm: f32, bf16 and the real cascade at the chosen threshold, interleaved round
  by round (medians after a warm-up round).

Writes benchmarks/studies/results/bf16_recheck.{json,md}.

    python benchmarks/studies/bf16_recheck.py --engine engines/smollm2 [--n 100] [--seed 7] [--check-seed 8] [--rounds 9]
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # studies, benchmarks
from bf16_guarantee import parser, requests  # noqa: E402
from latency import QUESTIONS, TICKET, cpu_name, interleaved  # noqa: E402

from onepass.runtime import Engine  # noqa: E402
from onepass.runtime.core.cascade import Cascade  # noqa: E402
from onepass.runtime.core.guarantee import BF16, BOUNDS, REFERENCE, cpu_bf16_kind  # noqa: E402
from onepass.runtime.tools.guarantee import answered, probabilities  # noqa: E402

RESULTS = Path(__file__).parent / "results"
THRESHOLDS = [round(t, 2) for t in np.arange(0.0, 1.0001, 0.05)]


def probability_rows(engine_dir: str, asked: list, threads: int) -> list[dict]:
    """Per question: its data set, f32's and bf16's probabilities, and bf16's certainty (what the gate reads)."""
    engines = {name: Engine.load(engine_dir, backend=name, threads=threads, cache_bytes=0)
               for name in (REFERENCE, BF16)}
    def progress(i, n):
        print(f"\r{i}/{n}", end="", file=sys.stderr, flush=True)

    try:
        rows = [{"dataset": dataset, "f32": probabilities(ref).tolist(), "bf16": probabilities(var).tolist(),
                 "certainty": float(var.certainty)}
                for dataset, ref, var in answered([engines[REFERENCE], engines[BF16]], asked, progress)]
    finally:
        for engine in engines.values():
            engine.close()
    print(file=sys.stderr)
    return rows


def at_threshold(rows: list[dict], t: float) -> dict:
    """Per data set, the cascade at threshold ``t``: questions, share asked again, argmax agreement, max |dp|."""
    out: dict = {}
    for r in rows:
        f32, bf16 = np.array(r["f32"]), np.array(r["bf16"])
        again = r["certainty"] < t
        m = out.setdefault(r["dataset"], {"questions": 0, "asked_again": 0, "agree": 0, "max_abs_dp": 0.0})
        m["questions"] += 1
        m["asked_again"] += int(again)
        m["agree"] += int(again or f32.argmax() == bf16.argmax())
        m["max_abs_dp"] = max(m["max_abs_dp"], 0.0 if again else float(np.abs(f32 - bf16).max()))
    return {name: {"questions": m["questions"], "asked_again": m["asked_again"] / m["questions"],
                   "argmax_agreement": m["agree"] / m["questions"], "max_abs_dp": m["max_abs_dp"]}
            for name, m in sorted(out.items())}


def holds(per_dataset: dict, bounds: dict = BOUNDS) -> bool:
    return all(m["argmax_agreement"] >= bounds["argmax_agreement"] and m["max_abs_dp"] <= bounds["max_abs_dp"]
               for m in per_dataset.values())


def speed(engine_dir: str, threshold: float, rounds: int, threads: int) -> tuple[dict, dict]:
    """Warm p50/min of the ticket for f32, bf16 and the cascade; and which of the ticket's questions it asks again."""
    f32, bf16 = (Engine.load(engine_dir, backend=name, threads=threads) for name in (REFERENCE, BF16))
    try:
        cascade = Cascade([bf16, f32], min_confidence=threshold)
        asked_again = cascade.ask(TICKET, QUESTIONS).asked[1]
        runs = {REFERENCE: lambda: f32.ask(TICKET, QUESTIONS), BF16: lambda: bf16.ask(TICKET, QUESTIONS),
                f"cascade at {threshold}": lambda: cascade.ask(TICKET, QUESTIONS)}
        times = interleaved(runs, rounds)  # round 0 (untimed) fills both engines' state caches
    finally:
        f32.close()
        bf16.close()
    return ({k: {"p50_s": round(statistics.median(v), 3), "min_s": round(min(v), 3)} for k, v in times.items()},
            {"asked_again": asked_again, "of": len(QUESTIONS)})


def markdown(result: dict, args) -> str:
    bounds = result["bounds"]
    lines = [f"# bf16 answers, doubtful ones asked again at f32 ({result['cpu']}, CPU bf16: {result['cpu_bf16']}, "
             f"{args.threads} threads, {result['measured']})", "",
             f"{args.n} questions per data set of `bf16_guarantee.py` (seed {args.seed}); bounds: argmax agreement >= "
             f"{bounds['argmax_agreement']} and max |dp| <= {bounds['max_abs_dp']} on every data set. A question whose "
             "bf16 certainty is below the threshold is asked again at f32 (its answer is then f32's).", "",
             "| threshold | " + " | ".join(f"{d}: again / argmax / max dp" for d in result["datasets"]) + " | bounds |",
             "|---|" + "---|" * len(result["datasets"]) + "---|"]
    for t, per in result["sweep"].items():
        cells = [f"{m['asked_again']:.2f} / {m['argmax_agreement']:.2f} / {m['max_abs_dp']:.3f}" for m in per.values()]
        lines.append(f"| {t} | " + " | ".join(cells) + f" | {'hold' if holds(per, bounds) else 'missed'} |")
    chosen = result["chosen"]
    if chosen is None:
        lines += ["", "No threshold below 1 keeps the bounds: every question would be asked again."]
    else:
        check = result["check"]
        cells = "; ".join(f"{d} again {m['asked_again']:.2f}, argmax {m['argmax_agreement']:.2f}, max dp "
                          f"{m['max_abs_dp']:.3f}" for d, m in check.items())
        lines += ["", f"Chosen on seed {args.seed}: threshold **{chosen}** (the smallest that holds). On seed "
                      f"{args.check_seed}'s requests it {'holds' if holds(check, bounds) else 'misses'}: {cells}."]
    s, ticket = result["speed"], result["ticket"]
    lines += ["", f"The README ticket's 13 questions warm, {args.rounds} interleaved rounds (seconds); the cascade "
                  f"asks {len(ticket['asked_again'])} of {ticket['of']} again at f32 "
                  f"({', '.join(ticket['asked_again']) or 'none'}):", "",
              "| run | warm p50 | warm min |", "|---|---|---|"]
    lines += [f"| {name} | {v['p50_s']:.3f} | {v['min_s']:.3f} |" for name, v in s.items()]
    lines += ["", f"    python benchmarks/studies/bf16_recheck.py --engine {args.engine} --n {args.n} --seed {args.seed} "
                  f"--check-seed {args.check_seed} --rounds {args.rounds}", ""]
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--check-seed", type=int, default=8, help="the requests the chosen threshold is checked on")
    args = ap.parse_args()
    rows = probability_rows(args.engine, requests(args.n, args.seed), args.threads)
    sweep = {t: at_threshold(rows, t) for t in THRESHOLDS}
    chosen = next((t for t in THRESHOLDS if t < 1.0 and holds(sweep[t])), None)
    check = None
    if chosen is not None:
        check = at_threshold(probability_rows(args.engine, requests(args.n, args.check_seed), args.threads), chosen)
    fast, ticket = speed(args.engine, 1.0 if chosen is None else chosen, args.rounds, args.threads)
    measured = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result = {"measured": measured, "cpu": cpu_name(), "cpu_bf16": cpu_bf16_kind(), "n": args.n, "seed": args.seed,
              "check_seed": args.check_seed, "bounds": BOUNDS, "datasets": sorted(sweep[0.0]),
              "sweep": {str(t): v for t, v in sweep.items()}, "chosen": chosen, "check": check, "speed": fast,
              "ticket": ticket}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bf16_recheck.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "bf16_recheck.md").write_text(markdown(result, args))
    print((RESULTS / "bf16_recheck.md").read_text())


if __name__ == "__main__":
    main()
