"""Calibration on labelled data from registry packages: majority baseline, zero-shot, calibrated.

Builds one JSONL of {state, question, label, dataset} rows from the datasets of
readout_eval.py (BBC News topics, Rotten Tomatoes, CrowdFlower tweets as choice and as score),
runs `onepass calibrate` on a hard-linked copy of the engine (30% of rows held out, seeded),
and writes benchmarks/results/calibration/{report.json, report.md, reliability.png,
coverage.png} plus calibration_eval.md with the per-dataset table.

    python benchmarks/calibration_eval.py --engine engines/smollm2 [--n 300]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from readout_eval import bbc, rotten, tweets  # noqa: E402

from onepass.calibration.run import calibrate  # noqa: E402
from onepass.runtime.questions import Choice, Noul  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def wire(q) -> dict:
    body = {"type": q.type, "instructions": q.instructions}
    if not isinstance(q, Noul):
        body["criteria"] = q.criteria if isinstance(q, Choice) else list(q.criteria)
    return body


def rows(n: int, seed: int) -> list[dict]:
    sets = {"bbc_news_topic": bbc(n, random.Random(seed)), "rotten_tomatoes": rotten(n, random.Random(seed)),
            "tweets_choice": tweets(n, random.Random(seed), as_score=False),
            "tweets_score": tweets(n, random.Random(seed), as_score=True)}
    out = []
    for name, items in sets.items():
        for text, q, gold in items:
            label = int(gold) if name == "tweets_score" else gold
            out.append({"state": text, "question": wire(q), "label": label, "dataset": name})
    return out


def link_copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy(f, dst / f.name)
    (dst / "manifest.json").unlink()
    shutil.copy(src / "manifest.json", dst / "manifest.json")  # written anew: never touch the original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = RESULTS / "calibration"
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        all_rows = rows(args.n, args.seed)
        data.write_text("\n".join(json.dumps(r) for r in all_rows))
        engine = Path(tmp) / "engine"
        link_copy(Path(args.engine), engine)
        report = calibrate(engine, data, holdout=0.3, seed=args.seed, report_dir=out)
    lines = [f"# Calibration ({args.n} rows per dataset, 30% held out, seed {args.seed})", "",
             "Held-out rows only. Majority: always the most frequent held-out label.", "",
             "| dataset | rows | majority acc | zero-shot acc | calibrated acc | NLL before | NLL after | "
             "Brier before | Brier after | ECE before | ECE after |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in [k for k in report["before"] if k != "all"]:
        b, a = report["before"][name], report["after"][name]
        lines.append(f"| {name} | {b['rows']} | {b['majority']:.3f} | {b['accuracy']:.3f} | "
                     f"{a['accuracy']:.3f} | {b['nll']:.3f} | {a['nll']:.3f} | {b['brier']:.3f} | {a['brier']:.3f} | "
                     f"{b['ece']:.3f} | {a['ece']:.3f} |")
    (RESULTS / "calibration_eval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
