"""bf16 against fp32 on the data sets we may train on, and what it buys: the guarantee `onepass guarantee` records.

Requests (fixed seed, N questions per data set, states never used to tune the default adapter's evaluation sets):
BBC News topics (a 5-way choice and a yes/no topic question per article), Rotten Tomatoes (is the review positive),
CrowdFlower tweets (sentiment as a choice, a score or a yes/no question), 2012 convention speeches (which party).
OpenVINO's CPU plugin answers each at f32 (the reference) and in bf16 (``openvino-cpu-bf16``): argmax agreement,
max and mean |dp| per data set, the bounds' verdict (core.guarantee.BOUNDS), and so which backend the default
(`auto`) gets on this machine. Then speed side by side: the README ticket's 13 questions warm (state cached) and
cold, f32 and bf16 interleaved, medians after a warm-up round. With ``--write`` the guarantee is recorded in the
engine's manifest (as ``onepass guarantee --write`` does). Writes benchmarks/results/bf16_guarantee.{json,md}
(``--out NAME``: NAME.{json,md}, to keep another CPU's record beside it: the guarantee holds per kind of CPU bf16).

    python benchmarks/bf16_guarantee.py --engine engines/smollm2 [--n 100] [--rounds 9] [--out bf16_guarantee_amx]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from latency import QUESTIONS, TICKET, interleaved  # noqa: E402
from readout_eval import rotten  # noqa: E402

from onepass.calibration.data.mixture import bbc_rows, speech_rows, tweet_rows  # noqa: E402
from onepass.runtime import Engine  # noqa: E402
from onepass.runtime.core.guarantee import BF16, BOUNDS, REFERENCE  # noqa: E402
from onepass.runtime.core.questions import to_wire  # noqa: E402
from onepass.runtime.core.wire import parse_request  # noqa: E402
from onepass.runtime.tools.guarantee import measure, record, report_lines  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def requests(n: int, seed: int) -> list:
    """(data set, (state, questions)) of n questions per data set, one question per request."""
    rows = {"bbc": bbc_rows(n // 2, random.Random(seed)), "tweets": tweet_rows(n, random.Random(seed)),
            "speeches": speech_rows(n, random.Random(seed)),
            "rotten_tomatoes": [{"state": text, "question": to_wire(q)} for text, q, _ in
                                rotten(n, random.Random(seed))]}
    return [(name, parse_request({"state": r["state"], "questions": {"q": r["question"]}}))
            for name, items in rows.items() for r in items]


def speed(engine_dir: str, rounds: int, threads: int) -> dict:
    """Warm and cold p50/min of the 13 questions, f32 and bf16 interleaved round by round."""
    engines = {name: Engine.load(engine_dir, backend=name, threads=threads) for name in (REFERENCE, BF16)}
    cold = {name: Engine.load(engine_dir, backend=name, threads=threads, cache_bytes=0) for name in engines}
    times = interleaved({f"{name} {kind}": lambda e=group[name]: e.ask(TICKET, QUESTIONS)  # round 0 fills the caches
                         for name in engines for kind, group in (("warm", engines), ("cold", cold))}, rounds)
    for engine in [*engines.values(), *cold.values()]:
        engine.close()
    return {k: {"p50_s": round(statistics.median(v), 3), "min_s": round(min(v), 3), "max_s": round(max(v), 3)}
            for k, v in times.items()}


def markdown(result: dict, fast: dict, args) -> str:
    g = result["guarantee"]
    lines = [f"# bf16 against fp32 on OpenVINO's CPU plugin ({g.get('cpu_model') or platform.machine()}, "
             f"{args.threads} threads, CPU bf16: {g['cpu']}, computed in {g.get('computed_in')}, {g['measured']})", "",
             f"{result['n']} questions per data set (seed {result['seed']}); bounds: argmax agreement >= "
             f"{BOUNDS['argmax_agreement']}, max |dp| <= {BOUNDS['max_abs_dp']} on every data set.", "",
             "| data set | questions | argmax kept | max abs dp | mean abs dp |", "|---|---|---|---|---|"]
    for name, m in g["datasets"].items():
        lines.append(f"| {name} | {m['questions']} | {m['argmax_agreement']:.3f} | {m['max_abs_dp']:.4f} | "
                     f"{m['mean_abs_dp']:.4f} |")
    verdict = ("the bounds hold: the default backend answers in bf16 on this machine" if result["misses"] is None
               else f"the bounds are missed, so the default stays fp32 on this machine: {result['misses']}")
    lines += ["", f"**Verdict:** {verdict}.", "",
              f"Speed, the 13-question ticket, {args.rounds} interleaved rounds after a warm-up (seconds):", "",
              "| backend | warm p50 | warm min | cold p50 | cold min |", "|---|---|---|---|---|"]
    for name in (REFERENCE, BF16):
        w, c = fast[f"{name} warm"], fast[f"{name} cold"]
        lines.append(f"| {name} | {w['p50_s']} | {w['min_s']} | {c['p50_s']} | {c['min_s']} |")
    ratio = fast[f"{REFERENCE} warm"]["p50_s"] / fast[f"{BF16} warm"]["p50_s"]
    cold = fast[f"{REFERENCE} cold"]["p50_s"] / fast[f"{BF16} cold"]["p50_s"]
    lines += ["", f"bf16 is {ratio:.2f}x fp32 warm and {cold:.2f}x cold here.", "",
              f"    python benchmarks/bf16_guarantee.py --engine {args.engine} --n {result['n']} "
              f"--seed {result['seed']} "
              f"--rounds {args.rounds}" + (f" --out {args.out}" if args.out != "bf16_guarantee" else "")
              + "   (--speed-only: the timing again, the guarantee kept)",
              ""]
    return "\n".join(lines)


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every bf16 benchmark takes: the engine, the requests (N per data set, seed) and the timing."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--n", type=int, default=100, help="questions per data set")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--write", action="store_true", help="record the guarantee in the engine's manifest")
    ap.add_argument("--speed-only", action="store_true",
                    help="time again on a quiet machine, keeping the guarantee of the last run's JSON")
    ap.add_argument("--out", default="bf16_guarantee", help="results file name in benchmarks/results (no suffix)")
    args = ap.parse_args()
    json_path, md_path = RESULTS / f"{args.out}.json", RESULTS / f"{args.out}.md"
    if args.speed_only:
        result = {k: v for k, v in json.loads(json_path.read_text()).items() if k != "speed"}
    else:
        asked = requests(args.n, args.seed)
        result = measure(args.engine, asked, threads=args.threads,
                         progress=lambda i, n: print(f"\r{i}/{n}", end="", file=sys.stderr, flush=True))
        result.update(n=args.n, seed=args.seed)
        print(file=sys.stderr)
    print("\n".join(report_lines(result)))
    fast = speed(args.engine, args.rounds, args.threads)
    if args.write:
        record(args.engine, result["variant"], result["guarantee"])
    RESULTS.mkdir(exist_ok=True)
    json_path.write_text(json.dumps({**result, "speed": fast}, indent=2) + "\n")
    md_path.write_text(markdown(result, fast, args))
    print(md_path.read_text())


if __name__ == "__main__":
    main()
