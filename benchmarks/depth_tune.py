"""The depth `onepass tune` chooses, end to end, against the full-depth head, on states never trained on.

For each data set: `tune` on ``--rows`` labelled rows with its default candidates (the decision head read after
40/50/60/80% of the blocks and after all of them, the untuned base and base+calibrate; the choice cross-validated
over whole states), and `tune --head-depths full` on the same rows (the head at full depth only). Both engines
answer the same TEST_ROWS rows of other states (speeches: other speakers); written: the chosen candidate and its
blocks, each engine's accuracy and NLL, and the tune times.

    python benchmarks/depth_tune.py --engine engines/smollm2 [--datasets bbc rotten ...] [--rows 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_eval import TEST_ROWS, _machine, user_rows  # noqa: E402

from onepass import Engine  # noqa: E402
from onepass.calibration.data.mixture import write_jsonl  # noqa: E402
from onepass.calibration.measure.calibrate import evaluate, load_rows, score_rows  # noqa: E402
from onepass.calibration.tune.config import TuneConfig  # noqa: E402
from onepass.calibration.tune.engine import tune  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DATASETS = ["bbc", "rotten", "tweets_choice", "tweets_score", "speeches"]


def _served(engine_dir: Path, test: Path) -> dict:
    engine = Engine.load(engine_dir)
    result = evaluate(score_rows(engine, load_rows(test)), engine.manifest.calibration)["all"]
    return {"accuracy": result["accuracy"], "nll": result["nll"], "rows": result["rows"],
            "blocks": engine.manifest.model.num_layers}


def _tuned(engine: str, train: Path, test: Path, out: Path, config: TuneConfig) -> dict:
    t0 = time.perf_counter()
    tune(engine, [train], out, config, report_dir=out.with_name(out.name + "-report"), log=lambda *a: None)
    seconds = time.perf_counter() - t0
    choice = json.loads((out.with_name(out.name + "-report") / "report.json").read_text())["choice"]
    return {"chosen": choice["chosen"], "tune_seconds": seconds, "candidates": choice["candidates"],
            **_served(out, test)}


def run(args) -> dict:
    out = {"engine": args.engine, "rows": args.rows, "test_rows": TEST_ROWS, "seed": args.seed,
           "machine": _machine(), "note": args.note, "datasets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.datasets:
            train_rows, test_rows = user_rows(name, args.rows, args.seed)
            train, test = Path(tmp) / f"{name}_train.jsonl", Path(tmp) / f"{name}_test.jsonl"
            write_jsonl(train_rows, train)
            write_jsonl(test_rows, test)
            chosen = _tuned(args.engine, train, test, Path(tmp) / f"{name}_chosen", TuneConfig(seed=args.seed))
            full = _tuned(args.engine, train, test, Path(tmp) / f"{name}_full",
                          TuneConfig(seed=args.seed, head_depths=()))
            out["datasets"][name] = {"chosen": chosen, "full": full}
            print(f"{name}: {chosen['chosen']} ({chosen['blocks']} blocks) accuracy {chosen['accuracy']:.3f} "
                  f"NLL {chosen['nll']:.3f}; full-depth head {full['accuracy']:.3f} NLL {full['nll']:.3f}",
                  flush=True)
    return out


def write_md(out: dict, path: Path) -> None:
    lines = [f"# The depth `onepass tune` chooses, on {out['test_rows']} test rows of unseen states",
             "",
             f"`python benchmarks/depth_tune.py --engine {out['engine']} --rows {out['rows']}` "
             f"({out['machine']['cpu']}, {out['machine']['when']}). Each data set: `tune` on {out['rows']} rows "
             "with its default candidates (the head after 12, 15, 18, 24 and 30 blocks; base; base+calibrate; "
             "cross-validated over whole states), and `tune --head-depths full` on the same rows. Test rows: other "
             "states (speeches: other speakers), never trained on." + (f" {out['note']}" if out.get("note") else ""),
             "",
             "| data set | chosen | blocks | accuracy | NLL | full-depth head accuracy | NLL | Δ accuracy (points) "
             "| tune s (chosen / full) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in out["datasets"].items():
        c, f = r["chosen"], r["full"]
        lines.append(f"| {name} | {c['chosen']} | {c['blocks']} | {c['accuracy']:.3f} | {c['nll']:.3f} | "
                     f"{f['accuracy']:.3f} | {f['nll']:.3f} | {100 * (c['accuracy'] - f['accuracy']):+.1f} | "
                     f"{c['tune_seconds']:.0f} / {f['tune_seconds']:.0f} |")
    shallow = [n for n, r in out["datasets"].items() if r["chosen"]["blocks"] <= 16]
    within = [n for n, r in out["datasets"].items()
              if r["chosen"]["accuracy"] >= r["full"]["accuracy"] - 0.01]
    lines += ["", f"Chosen depth <= 16 of 30 blocks: {len(shallow)} data set(s) ({', '.join(shallow) or 'none'}). "
              f"Accuracy within a point of the full-depth head (or better): {len(within)} of "
              f"{len(out['datasets'])} ({', '.join(within) or 'none'}).", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="the engine tuned (its decision head is fitted on its features)")
    ap.add_argument("--datasets", nargs="+", default=DATASETS, choices=DATASETS)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "depth_tune"), help="written: OUT.json and OUT.md")
    ap.add_argument("--note", default="", help="how the run was made, written beside its figures")
    args = ap.parse_args()
    out = run(args)
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    write_md(out, Path(args.out + ".md"))


if __name__ == "__main__":
    main()
