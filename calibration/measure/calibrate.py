"""`onepass calibrate`: labelled JSONL -> fitted calibration in the engine manifest + a report.

Rows: ``{"state": ..., "question": {type, instructions, criteria}, "label": ...}`` where the
label is "yes"/"no" (or true/false) for noul, an option name for choice, and a level index
(or the level's text) for score. A seeded split keeps ``holdout`` of the rows out of the fit;
every metric in the report is measured on those held-out rows only.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np

from ...runtime.core import manifest as mf
from ...runtime.core.engine import Engine
from ...runtime.core.errors import InvalidRequest, OnepassError
from ...runtime.core.questions import Noul, Score, as_text, from_wire
from ...runtime.core.readout import softmax
from ..data.rows import label_index
from ..scoring import metrics
from ..scoring.fit import MIN_ROWS, fit, too_small



def load_rows(path: str | Path) -> list[dict]:
    """Parse the JSONL file; errors name the line."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question = from_wire("question", row["question"])
            if question.task is not None:  # its answers would be the task's, its calibration the engine's
                raise InvalidRequest(f"question.task: calibrate and eval measure the engine itself; a row naming "
                                     f"the tuned task {question.task!r} is not read (leave task out)")
            rows.append({"state": row["state"], "question": question, "label": label_index(question, row["label"]),
                         "dataset": row.get("dataset", "")})
        except (json.JSONDecodeError, KeyError, TypeError, OnepassError) as err:
            raise InvalidRequest(f"{path}:{n}: {err}") from None
    if not rows:
        raise InvalidRequest(f"{path} has no rows")
    return rows


def score_rows(engine: Engine, rows: list[dict]) -> list[dict]:
    """Uncalibrated read-out scores of every row (one packed pass per row)."""
    out = []
    for row in rows:
        questions = {"q": row["question"]}
        encoded = engine.encode_questions(questions)
        logprobs, heads = engine.option_values(row["state"], encoded)
        scores = engine.option_scores(questions, encoded, logprobs, calibrated=False, heads=heads)[0]
        q = row["question"]
        names = engine.encoder.options(q)
        out.append({"type": q.type, "scores": scores.tolist(), "label": row["label"], "dataset": row["dataset"],
                    "names": names, "qkey": engine.question_key(q)})
    return out


def split(n: int, holdout: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded shuffle: (train indices, held-out indices)."""
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be between 0 and 1, got {holdout}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = int(round(n * (1 - holdout)))
    return sorted(order[:cut]), sorted(order[cut:])


def probabilities(rows: list[dict], calibration=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, Kmax] probabilities (zero-padded), labels [N], option counts [N]."""
    kmax = max(len(r["scores"]) for r in rows)
    probs = np.zeros((len(rows), kmax))
    for i, r in enumerate(rows):
        s = np.array(r["scores"])
        probs[i, :len(s)] = softmax(calibration.apply(r["type"], s, r.get("names"), r.get("qkey"))
                                    if calibration else s)
    return probs, np.array([r["label"] for r in rows]), np.array([len(r["scores"]) for r in rows])


def evaluate(rows: list[dict], calibration=None) -> dict:
    """Metrics overall and per dataset, with reliability bins and the coverage curve."""
    probs, labels, k = probabilities(rows, calibration)
    out = {"all": {**metrics.summary(probs, labels), "reliability": metrics.reliability(probs, labels),
                   "coverage": metrics.coverage_curve(probs, labels, k)}}
    out["all"]["majority"] = _majority(labels)
    for name in sorted({r["dataset"] for r in rows} - {""}):
        sel = np.array([r["dataset"] == name for r in rows])
        out[name] = {**metrics.summary(probs[sel], labels[sel]), "majority": _majority(labels[sel])}
    return out


def _majority(labels: np.ndarray) -> float:
    """Accuracy of always answering the most frequent label."""
    return float(np.bincount(labels).max() / len(labels))


class NothingCalibrated(OnepassError):
    """No group had enough training rows: nothing is written."""


def _head_prior(manifest):
    """The calibration a tuned head engine carries (``heads.candidate.served``: the bias of the prior its head corrects,
    on the raw head scores), or None. Calibrating such an engine again refits each group the new rows have and keeps
    the others, so no question loses the bias its head was fitted around."""
    cal = manifest.calibration
    return cal if cal is not None and cal.readout == "head" == manifest.scoring.readout else None


def calibrate(engine_dir: str | Path, data: str | Path, holdout: float = 0.3, seed: int = 0,
              report_dir: str | Path | None = None, scored: list[dict] | None = None) -> dict:
    """Fit on the training split, report on the held-out split, write the calibration into the manifest.

    ``scored``: the rows of ``data`` already scored by :func:`score_rows` with this engine (a cache).
    """
    rows = load_rows(data) if scored is None else None  # a bad file is refused before the engine is loaded
    engine = Engine.load(engine_dir)
    if scored is None:
        scored = score_rows(engine, rows)
    train, test = split(len(scored), holdout, seed)
    calibration = fit([scored[i] for i in train], engine.manifest.scoring.readout,
                      source={"data": str(data), "rows": len(scored), "train": len(train), "holdout": len(test),
                              "seed": seed})
    skipped = too_small([scored[i] for i in train])
    if not calibration.groups:
        named = ", ".join(f"{k if len(k) <= 60 else k[:57] + '...'} ({n} rows)" for k, n in list(skipped.items())[:5])
        raise NothingCalibrated(f"no group has the {MIN_ROWS} training rows a calibration needs ({len(train)} of "
                                f"{len(scored)} rows train, --holdout {holdout} hold out): {named}; the manifest is "
                                "unchanged. Give more labelled rows per question type (or per question)")
    held = [scored[i] for i in test]
    kept = _head_prior(engine.manifest)
    if kept is not None:  # a tuned head's prior bias calibrates its raw scores too: refitted where the rows allow
        calibration = dataclasses.replace(calibration, groups={**kept.groups, **calibration.groups}, source={
            **calibration.source, "kept_from_tune": sorted(set(kept.groups) - set(calibration.groups))})
    report = {"before": evaluate(held, kept), "after": evaluate(held, calibration), "calibration": calibration.to_dict(),
              "skipped": skipped, "min_rows": MIN_ROWS}
    mf.write(engine_dir, dataclasses.replace(engine.manifest, calibration=calibration))
    if report_dir:
        from ..scoring.report import write_report

        write_report(report, Path(report_dir))
    return report


def cross_fitted_probabilities(scored: list[dict], folds: int = 5, seed: int = 0) -> list[np.ndarray]:
    """Every row's probabilities [K] under a calibration fitted without it (seeded K folds; K may vary by row)."""
    order = np.random.default_rng(seed).permutation(len(scored))
    cal_of = {}
    for f in range(folds):
        held = set(order[f::folds].tolist())
        cal = fit([r for i, r in enumerate(scored) if i not in held], "mean")
        cal_of.update({i: cal for i in held})
    return [probabilities([r], cal_of[i])[0][0] for i, r in enumerate(scored)]


def cross_fitted(scored: list[dict], folds: int = 5, seed: int = 0) -> dict:
    """Every row predicted by a calibration fitted without it (seeded K folds): per-dataset metrics on all rows."""
    every = cross_fitted_probabilities(scored, folds, seed)
    out = {}
    for name in sorted({r["dataset"] for r in scored}):
        idx = [i for i, r in enumerate(scored) if r["dataset"] == name]
        probs = np.zeros((len(idx), max(len(every[i]) for i in idx)))
        for j, i in enumerate(idx):
            probs[j, :len(every[i])] = every[i]
        labels = np.array([scored[i]["label"] for i in idx])
        out[name] = {"rows": len(idx), **metrics.summary(probs, labels), "ece_floor": metrics.ece_floor(probs)}
    return out


def summary(report: dict, engine_dir, report_dir=None) -> list[str]:
    """What `onepass calibrate` prints: before/after on the held-out rows, the groups skipped, where it wrote."""
    lines = []
    for phase in ("before", "after"):
        m = report[phase]["all"]
        lines.append(f"{phase:6s} held-out rows {m['rows']}: accuracy {m['accuracy']:.3f}  NLL {m['nll']:.3f}  "
                     f"Brier {m['brier']:.3f}  ECE {m['ece']:.3f}")
    skipped = list(report["skipped"].items())
    for key, n in skipped[:5]:
        lines.append(f"skipped {key if len(key) <= 80 else key[:77] + '...'}: {n} training rows, "
                     f"{report['min_rows']} needed")
    if len(skipped) > 5:
        lines.append(f"... and {len(skipped) - 5} more groups under {report['min_rows']} rows (report.json lists them)")
    lines.append(f"calibration of {len(report['calibration']['groups'])} groups written to {engine_dir}/manifest.json"
                 + (f"; report in {report_dir}" if report_dir else ""))
    return lines
