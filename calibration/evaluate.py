"""`onepass eval`: how good an engine is on labelled rows, before trusting it (issue 12 item 2).

Rows are the ``onepass calibrate`` rows. The engine answers them as it serves (its read-out and
its calibration, if any). Reported overall, per data set and per question: accuracy against the
majority baseline, NLL, Brier, ECE (the calibration report's metrics module), the coverage curve
(answering only above a confidence), the accuracy at ``--min-confidence``, the lowest threshold
that reaches ``--target-accuracy``, a confusion matrix per question, and rows/s. JSON, markdown
and the calibration report's two plots (reliability, coverage).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..runtime.engine import Engine
from . import metrics
from .run import load_rows, probabilities, score_rows


def _block(probs, labels, k, min_confidence, target_accuracy) -> dict:
    conf = metrics.confidence(probs, k)
    hits = probs.argmax(1) == labels
    kept = conf >= min_confidence if min_confidence is not None else np.ones(len(labels), bool)
    out = {**metrics.summary(probs, labels), "majority": float(np.bincount(labels).max() / len(labels))}
    if min_confidence is not None:
        out["at_min_confidence"] = {"min_confidence": min_confidence, "coverage": float(kept.mean()),
                                    "accuracy": float(hits[kept].mean()) if kept.any() else None}
    if target_accuracy is not None:
        reaching = [c for c in metrics.coverage_curve(probs, labels, k, steps=50) if c["accuracy"] >= target_accuracy]
        best = max(reaching, key=lambda c: c["coverage"]) if reaching else None
        out["for_target_accuracy"] = {"target": target_accuracy, **(best or {"coverage": 0.0, "min_confidence": None})}
    return out


def evaluate_engine(engine_dir, data, min_confidence: float | None = None, target_accuracy: float | None = None,
                    threads: int | None = None) -> dict:
    """The evaluation report of the engine at ``engine_dir`` on the rows in ``data``."""
    engine = Engine.load(engine_dir, threads=threads)
    rows = load_rows(data)
    t0 = time.perf_counter()
    scored = score_rows(engine, rows)
    seconds = time.perf_counter() - t0
    cal = engine.manifest.calibration
    cal = cal if cal is not None and cal.readout == engine.manifest.scoring.readout else None
    probs, labels, k = probabilities(scored, cal)
    report = {"engine": str(engine_dir), "name": engine.name, "data": str(data), "rows": len(rows),
              "rows_per_second": len(rows) / seconds, "calibrated": cal is not None,
              "all": {**_block(probs, labels, k, min_confidence, target_accuracy),
                      "reliability": metrics.reliability(probs, labels),
                      "coverage": metrics.coverage_curve(probs, labels, k)},
              "datasets": {}, "questions": {}}
    for name in sorted({r["dataset"] for r in scored} - {""}):
        sel = np.array([r["dataset"] == name for r in scored])
        report["datasets"][name] = _block(probs[sel], labels[sel], k[sel], min_confidence, target_accuracy)
    for qkey in dict.fromkeys(r["qkey"] for r in scored):
        sel = np.array([r["qkey"] == qkey for r in scored])
        first = next(i for i, r in enumerate(scored) if r["qkey"] == qkey)
        names, n = scored[first]["names"], int(k[first])
        matrix = np.zeros((n, n), int)
        for label, guess in zip(labels[sel], probs[sel][:, :n].argmax(1)):
            matrix[label, guess] += 1
        report["questions"][qkey] = {"instructions": rows[first]["question"].instructions, "options": names,
                                     **_block(probs[sel][:, :n], labels[sel], k[sel], min_confidence,
                                              target_accuracy),
                                     "confusion": matrix.tolist()}
    return report


def write(report: dict, out: Path) -> None:
    """eval.json, eval.md, and the reliability and coverage plots (the calibration report's)."""
    from .report import write_report

    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    write_report({"before": {"all": report["all"]}, "after": {"all": report["all"]}}, out / "plots")
    lines = [f"# onepass eval: {report['name']} on {report['data']}", "",
             f"{report['rows']} rows, {report['rows_per_second']:.1f} rows/s, "
             f"{'calibrated' if report['calibrated'] else 'uncalibrated'}.", "",
             "| set | rows | accuracy | majority | NLL | Brier | ECE |", "|---|---|---|---|---|---|---|"]
    blocks = [("all", report["all"])] + list(report["datasets"].items()) + [
        (q["instructions"], q) for q in report["questions"].values()]
    for name, m in blocks:
        lines.append(f"| {name} | {m['rows']} | {m['accuracy']:.3f} | {m['majority']:.3f} | {m['nll']:.3f} | "
                     f"{m['brier']:.3f} | {m['ece']:.3f} |")
    (out / "eval.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
