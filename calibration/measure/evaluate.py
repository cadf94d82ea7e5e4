"""`onepass eval`: how good an engine is on labelled rows, before trusting it.

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

from ...runtime.core.engine import Engine
from ..scoring import metrics
from .calibrate import load_rows, probabilities, score_rows


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
    rows = load_rows(data)  # a bad file is refused before the engine is loaded
    engine = Engine.load(engine_dir, threads=threads)
    t0 = time.perf_counter()
    scored = score_rows(engine, rows)
    seconds = time.perf_counter() - t0
    cal = engine.manifest.calibration
    cal = cal if cal is not None and cal.readout == engine.manifest.scoring.readout else None
    probs, labels, k = probabilities(scored, cal)
    report = {"engine": str(engine_dir), "name": engine.name, "backend": engine.backend.name, "data": str(data),
              "rows": len(rows),
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


def engine_reports(report: dict) -> list[dict]:
    """The report and, with ``--compare``, the second engine's report on the same rows."""
    return [report] + ([report["compare"]] if "compare" in report else [])


def _blocks(report: dict) -> list[tuple[str, dict]]:
    """(name, metrics) of the overall, per data set and per question blocks, in report order."""
    return [("all", report["all"]), *report["datasets"].items(),
            *((q["instructions"], q) for q in report["questions"].values())]


CONFUSION_PANELS, CONFUSION_OPTIONS = 8, 12  # the plot's readable limits; eval.json holds every matrix


def _confusion_plot(report: dict, path: Path) -> None:
    """The confusion matrices (rows: label, columns: answer) of the first 8 questions with at most 12 options, one
    panel each; no file when no question qualifies."""
    from ..scoring.report import plt

    questions = [q for q in report["questions"].values() if len(q["options"]) <= CONFUSION_OPTIONS][:CONFUSION_PANELS]
    if not questions:
        return
    fig, axes = plt.subplots(1, len(questions), figsize=(4 * len(questions), 4), squeeze=False)
    for ax, q in zip(axes[0], questions):
        matrix = np.array(q["confusion"])
        ax.imshow(matrix, cmap="Blues")
        ticks = range(len(q["options"]))
        ax.set(xticks=ticks, yticks=ticks, xlabel="answer", ylabel="label", title=q["instructions"][:40])
        ax.set_xticklabels(q["options"], rotation=45, ha="right")
        ax.set_yticklabels(q["options"])
        for (i, j), count in np.ndenumerate(matrix):
            ax.text(j, i, str(count), ha="center", va="center",
                    color="white" if count > matrix.max() / 2 else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict, out: Path) -> None:
    """eval.json, eval.md and plots/ (reliability, coverage, confusion). With ``report["compare"]`` (a second
    engine's report on the same rows, ``--compare``) the table, the reliability and coverage plots show both."""
    from ..scoring.report import plot_coverage, plot_reliability

    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    reports = engine_reports(report)
    distinct = len({r["name"] for r in reports}) == len(reports)  # else the engines' folders tell them apart
    names = [r["name"] if distinct else r["engine"] for r in reports]
    (out / "plots").mkdir(exist_ok=True)
    plot_reliability([(n, r["all"]) for n, r in zip(names, reports)], out / "plots" / "reliability.png")
    plot_coverage([(n, r["all"]) for n, r in zip(names, reports)], out / "plots" / "coverage.png")
    _confusion_plot(report, out / "plots" / "confusion.png")
    columns = ["accuracy", "nll", "brier", "ece"]
    target = "for_target_accuracy" in report["all"]
    head = columns + ([f"coverage at accuracy {report['all']['for_target_accuracy']['target']}"] if target else [])
    lines = [f"# onepass eval: {' vs '.join(names)} on {report['data']}", ""]
    lines += [f"- {r['name']}: {r['rows']} rows, {r['rows_per_second']:.1f} rows/s, "
              f"{'calibrated' if r['calibrated'] else 'uncalibrated'} ({r['engine']})" for r in reports]
    if len(reports) > 1:
        lines += ["", f"Each cell: {' / '.join(names)}."]
    lines += ["", "| set | rows | majority | " + " | ".join(head) + " |", "|---" * (3 + len(head)) + "|"]
    for (name, first), *others in zip(*(_blocks(r) for r in reports)):
        blocks = [first] + [m for _, m in others]
        cells = [" / ".join(f"{m[c]:.3f}" for m in blocks) for c in columns]
        if target:
            cells.append(" / ".join(f"{m['for_target_accuracy']['coverage']:.3f}" for m in blocks))
        lines.append(f"| {name} | {first['rows']} | {first['majority']:.3f} | " + " | ".join(cells) + " |")
    (out / "eval.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def summary(report: dict) -> list[str]:
    """What `onepass eval` prints: per engine, accuracy against the majority, NLL, Brier, ECE and the coverages."""
    lines = []
    for r in engine_reports(report):
        m = r["all"]
        lines.append(f"{r['name']} on {r.get('backend', '?')}: {r['rows']} rows ({r['rows_per_second']:.1f}/s): "
                     f"accuracy {m['accuracy']:.3f} (majority {m['majority']:.3f})  NLL {m['nll']:.3f}  "
                     f"Brier {m['brier']:.3f}  ECE {m['ece']:.3f}")
        if "at_min_confidence" in m:
            at = m["at_min_confidence"]
            acc = f"{at['accuracy']:.3f}" if at["accuracy"] is not None else "-"
            lines.append(f"  confidence >= {at['min_confidence']}: coverage {at['coverage']:.3f}, accuracy {acc}")
        if "for_target_accuracy" in m:
            t = m["for_target_accuracy"]
            lines.append(f"  accuracy >= {t['target']}: coverage {t['coverage']:.3f} at confidence >= "
                         f"{t['min_confidence']}")
    return lines
