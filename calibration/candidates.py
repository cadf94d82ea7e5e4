"""`onepass tune` keeps the best of what it can write, never worse than the cheaper fit.

The candidates, all judged on the same held-out states (never trained on, never fitted on):

- ``base``: the untuned engine, zero-shot;
- ``base+calibrate``: the untuned engine with a calibration (temperature and bias per group,
  :func:`onepass.calibration.fit.fit`) fitted on the training rows' scores;
- ``head``: the untuned engine with a decision head fitted on the training rows' hidden states
  (:mod:`onepass.calibration.head_candidate`; the engine's read-out becomes ``head``). It has no calibrated twin: its
  temperature is chosen on its own out-of-fold scores already, and a calibration fitted on the scores of the rows it
  was fitted on would only sharpen it;
- ``tuned``: the tuned weights;
- ``tuned+calibrate``: the tuned weights with a calibration fitted on the training rows' tuned scores.

The choice is the lowest held-out NLL (a smooth criterion: with a few dozen held-out questions accuracy moves in
steps of several points); on a tie within ``TIE`` the cheaper candidate, earlier in that list, wins. Scores come from
the trainer's own scorer (the served computation, in PyTorch), so choosing needs no export.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..runtime.core.readout import softmax
from ..runtime.core.readout_calibration import Calibration, question_key
from .fit import fit

# cheapest first: a tie goes to the earlier
ORDER = ("base", "base+calibrate", "head", "tuned", "tuned+calibrate")
TIE = 1e-3  # held-out NLL differences below this are ties


@dataclass(frozen=True)
class Candidate:
    """One engine tune could write, with its held-out metrics."""

    name: str
    calibration: Calibration | None
    nll: float
    accuracy: float

    def as_dict(self) -> dict:
        """What the manifest and the report record (the calibration's groups counted, not listed)."""
        groups = len(self.calibration.groups) if self.calibration is not None else 0
        return {"name": self.name, "heldout_nll": self.nll, "heldout_accuracy": self.accuracy,
                "calibrated_groups": groups}


def scored_rows(scorer, chunks: list, encoder, features: bool = False) -> list[dict]:
    """The rows of ``chunks`` scored by ``scorer`` (no gradient), as :func:`onepass.calibration.fit.fit` reads them:
    type, scores, label, option names, question key; ``target``: the label or the teacher's distribution. With
    ``features``, each row also carries what a decision head reads (``scorer.scores_and_features``) and its state's
    key, from the same pass."""
    out = []
    with torch.no_grad():
        for chunk in chunks:
            scored = scorer.scores_and_features(chunk) if features else [(s, None) for s in scorer.scores(chunk)]
            for (scores, feats), row in zip(scored, chunk.rows):
                q = row.question
                names = encoder.options(q)
                out.append({"type": q.type, "scores": scores.double().cpu().tolist(), "label": row.label,
                            "target": row.target, "names": names, "dataset": row.dataset,
                            "qkey": question_key(q.type, encoder.instructions(q), names),
                            **({"features": feats, "state": hash(tuple(chunk.state_ids))} if features else {})})
    return out


def heldout_metrics(rows: list[dict], calibration: Calibration | None) -> tuple[float, int]:
    """(summed NLL of the label, or cross-entropy against the teacher's distribution; correct answers) of ``rows``."""
    nll, hits = 0.0, 0
    for r in rows:
        s = np.asarray(r["scores"], dtype=np.float64)
        p = softmax(calibration.apply(r["type"], s, r["names"], r["qkey"]) if calibration else s)
        nll += target_nll(np.log(np.clip(p, 1e-300, None)), r["target"])
        hits += int(np.argmax(p) == r["label"])
    return nll, hits


def target_nll(logp: np.ndarray, target) -> float:
    """-log p of a label index, or the cross-entropy of ``logp`` against a teacher's distribution: the loss every
    candidate is judged by (and a head's temperature chosen by)."""
    return -float(logp[int(target)]) if np.ndim(target) == 0 else -float(np.dot(np.asarray(target), logp))


def calibrated(train: list[dict], readout: str) -> Calibration | None:
    """A calibration of the training rows, or None when no group has the rows one needs."""
    calibration = fit(train, readout, source={"fitted_on": "tune's training rows", "rows": len(train)})
    return calibration if calibration.groups else None


def candidates(folds: list[tuple], readout: str, heads: list[tuple] | None = None) -> list[Candidate]:
    """Every candidate with its held-out metrics, in ``ORDER``.

    ``folds``: (base train rows, base held-out rows, tuned train rows, tuned held-out rows) of one held-out split,
    or of each fold of a cross-validation (the tuned rows then come from that fold's own run; None where no LoRA run
    was trained: no tuned candidates). ``heads``: per fold,
    (train rows, held-out rows) as that fold's decision head scores them (None: no head candidates). A candidate's
    metrics are over every fold's held-out rows, a calibrated one's calibration fitted on that fold's training rows; a
    calibrated candidate exists only where every fold could fit one. With one fold a calibrated candidate carries
    its calibration; with several, none (the caller fits the one it writes on all the rows).
    """
    totals: dict[str, list] = {}
    for i, (base_train, base_held, tuned_train, tuned_held) in enumerate(folds):
        sets = [("base", base_train, base_held, True)] + ([("tuned", tuned_train, tuned_held, True)]
                                                          if tuned_held is not None else [])
        if heads is not None:
            sets.insert(1, ("head", *heads[i], False))  # no calibrated twin (the module's docstring)
        for name, train, held, calibrates in sets:
            keyed = [(name, None)] + ([(f"{name}+calibrate", calibrated(train, readout))] if calibrates else [])
            for key, calibration in keyed:
                if key != name and calibration is None:
                    totals[key] = None  # a fold without a calibration: no calibrated candidate at all
                if totals.get(key, []) is None:
                    continue
                nll, hits = heldout_metrics(held, calibration)
                t = totals.setdefault(key, [0.0, 0, 0, None])
                t[0], t[1], t[2], t[3] = t[0] + nll, t[1] + hits, t[2] + len(held), calibration
    return [Candidate(name, t[3] if len(folds) == 1 else None, t[0] / t[2], t[1] / t[2])
            for name, t in sorted(totals.items(), key=lambda kv: ORDER.index(kv[0])) if t is not None]


def choose(found: list[Candidate], write: str = "best") -> Candidate:
    """The lowest held-out NLL; a later (dearer) candidate must beat every earlier one by more than ``TIE``.
    ``write="tuned"``: the tuned candidate, whatever the others measured (they are still reported)."""
    if write == "tuned":
        return next(c for c in found if c.name == "tuned")
    best = found[0]
    for c in found[1:]:
        if c.nll < best.nll - TIE:
            best = c
    return best
