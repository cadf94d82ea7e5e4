"""`onepass tune` keeps the best of what it can write, never worse than the cheaper fit.

The candidates, all judged on the same held-out states (never trained on, never fitted on):

- ``base``: the untuned engine, zero-shot;
- ``base+calibrate``: the untuned engine with a calibration (temperature and bias per group,
  :func:`onepass.calibration.scoring.fit.fit`) fitted on the training rows' scores;
- ``head``: the untuned engine with a decision head fitted on the training rows' hidden states
  (:mod:`onepass.calibration.heads.candidate`; the engine's read-out becomes ``head``). It has no calibrated twin: its
  temperature is chosen on its own out-of-fold scores already, and a calibration fitted on the scores of the rows it
  was fitted on would only sharpen it;
- ``tuned``: the tuned weights;
- ``tuned+calibrate``: the tuned weights with a calibration fitted on the training rows' tuned scores.

The choice is the lowest held-out NLL (a smooth criterion: with a few dozen held-out questions accuracy moves in
steps of several points); on a tie within ``TIE`` the cheaper candidate, earlier in that list, wins, and a tuned
candidate must beat every earlier one by more than ``TIE``. One exception: the head is kept over the untuned
candidates unless one of them is *clearly* better, its NLL lower by more than ``HEAD_Z`` standard errors of the
per-row difference (:func:`clearly_better`; a tie goes to the head). The head's MLP corrects the untuned read-out
(calibrated on the same rows where a calibration fits: ``head_candidate.Prior``), and with 50 rows the held-out NLL
that compares them is mostly noise: over 30 draws of 50 rows (five data sets, 300 unseen states each) the head
answered the unseen states at least as accurately as base + calibrate in every draw, while the lowest cross-validated
NLL of the 50 rows chose base + calibrate in 7 of them (3 folds, as tune), by 0.4 to 1.8 standard errors
(``benchmarks/studies/results/head_choice_folds.md``). The standard error treats the fitted candidates as fixed (the refits of
each fold add noise it does not count), so ``HEAD_Z`` is a measured setting, not a nominal error rate. Scores come from
the trainer's own scorer (the served computation, in PyTorch), so choosing needs no export.

A head can also read the hidden states after fewer blocks (``head@k``: k of the decoder's blocks; ``head`` reads after
all of them), and an engine written with it runs only those k blocks, in every pass and every prefill. Among the heads
the one kept is the shallowest whose NLL is not clearly worse than the best head's (lower by no more than ``DEPTH_Z``
standard errors of the per-row difference, or within ``TIE``: :func:`chosen_head`); only it then stands against the
other candidates, as the full-depth head would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...runtime.core.readout import softmax
from ...runtime.core.readout_calibration import Calibration, question_key
from ..scoring.fit import fit
from ..scoring.metrics import target_nll

# cheapest first: a tie goes to the earlier (the heads at several depths sort shallowest first, ``head`` last of them)
ORDER = ("base", "base+calibrate", "head", "tuned", "tuned+calibrate")
UNTUNED = ORDER[:2]  # what the head corrects
TIE = 1e-3  # held-out NLL differences below this are ties
HEAD_Z = 2.0  # an untuned candidate replaces the head only when its NLL is lower by more than this many standard errors
DEPTH_Z = 1.0  # a shallower head is kept unless the best head's NLL is lower by more than this many standard errors
RULE = (f"lowest NLL on rows the candidate was not fitted on; a dearer candidate must win by > {TIE:g}; the head is "
        f"kept unless an untuned candidate's NLL is lower by > {HEAD_Z:g} standard errors of the per-row difference; "
        f"of the heads at several depths, the shallowest whose NLL is within {DEPTH_Z:g} standard error of the best "
        "head's")


def head_name(depth: int | None) -> str:
    """The candidate name of a head read after ``depth`` blocks (None: after every block)."""
    return "head" if depth is None else f"head@{depth}"


def head_depth(name: str) -> int | None:
    """The depth a head candidate's ``name`` reads at (None: the full depth, or not a head)."""
    return int(name[len("head@"):]) if name.startswith("head@") else None


def is_head(name: str) -> bool:
    return name == "head" or name.startswith("head@")


def _rank(name: str) -> tuple:
    """Where a candidate sorts: its place in ``ORDER``, the heads by depth (the full depth last)."""
    if is_head(name):
        depth = head_depth(name)
        return ORDER.index("head"), depth if depth is not None else float("inf")
    return ORDER.index(name), 0


@dataclass(frozen=True)
class Candidate:
    """One engine tune could write, with its held-out metrics."""

    name: str
    calibration: Calibration | None
    nll: float
    accuracy: float
    losses: tuple[float, ...] = field(default=(), repr=False, compare=False)  # per held-out row, one order for all
    states: tuple = field(default=(), repr=False, compare=False)  # each row's state (where the rows carry it)

    def as_dict(self) -> dict:
        """What the manifest and the report record (the calibration's groups counted, not listed)."""
        groups = len(self.calibration.groups) if self.calibration is not None else 0
        return {"name": self.name, "heldout_nll": self.nll, "heldout_accuracy": self.accuracy,
                "calibrated_groups": groups}


def scored_rows(scorer, chunks: list, encoder, features: bool = False, depths=()) -> list[dict]:
    """The rows of ``chunks`` scored by ``scorer`` (no gradient), as :func:`onepass.calibration.scoring.fit.fit` reads them:
    type, scores, label, option names, question key; ``target``: the label or the teacher's distribution. With
    ``features``, each row also carries what a decision head reads (``scorer.scores_and_features``) and its state's
    key, from the same pass; with ``depths`` as well, ``features_at``: per block count, the same features read after
    that many blocks (:meth:`onepass.calibration.tune.trainer.PackedScorer.scores_and_features`)."""
    out = []
    with torch.no_grad():
        for chunk in chunks:
            scored = (scorer.scores_and_features(chunk, depths) if features else
                      [(s, None) for s in scorer.scores(chunk)])
            for (scores, feats, *at), row in zip(scored, chunk.rows):
                q = row.question
                names = encoder.options(q)
                out.append({"type": q.type, "scores": scores.double().cpu().tolist(), "label": row.label,
                            "target": row.target, "names": names, "dataset": row.dataset,
                            "qkey": question_key(q.type, encoder.instructions(q), names),
                            **({"features": feats, "state": hash(tuple(chunk.state_ids))} if features else {}),
                            **({"features_at": at[0]} if at else {})})
    return out


def heldout_metrics(rows: list[dict], calibration: Calibration | None) -> tuple[float, int]:
    """(summed NLL of the label, or cross-entropy against the teacher's distribution; correct answers) of ``rows``."""
    losses, hits = row_losses(rows, calibration)
    return float(sum(losses)), hits


def row_losses(rows: list[dict], calibration: Calibration | None) -> tuple[list[float], int]:
    """(each row's NLL of the label, or cross-entropy against the teacher's distribution; correct answers)."""
    losses, hits = [], 0
    for r in rows:
        s = np.asarray(r["scores"], dtype=np.float64)
        p = softmax(calibration.apply(r["type"], s, r["names"], r["qkey"]) if calibration else s)
        losses.append(target_nll(np.log(np.clip(p, 1e-300, None)), r["target"]))
        hits += int(np.argmax(p) == r["label"])
    return losses, hits



def calibrated(train: list[dict], readout: str) -> Calibration | None:
    """A calibration of the training rows, or None when no group has the rows one needs."""
    calibration = fit(train, readout, source={"fitted_on": "tune's training rows", "rows": len(train)})
    return calibration if calibration.groups else None


def candidates(folds: list[tuple], readout: str, heads: list[tuple] | None = None) -> list[Candidate]:
    """Every candidate with its held-out metrics, in ``ORDER``.

    ``folds``: (base train rows, base held-out rows, tuned train rows, tuned held-out rows) of one held-out split,
    or of each fold of a cross-validation (the tuned rows then come from that fold's own run; None where no LoRA run
    was trained: no tuned candidates). ``heads``: per fold, head candidate name -> (train rows, held-out rows) as
    that fold's decision head at that depth scores them (None: no head candidates). A candidate's
    metrics are over every fold's held-out rows, a calibrated one's calibration fitted on that fold's training rows; a
    calibrated candidate exists only where every fold could fit one. With one fold a calibrated candidate carries
    its calibration; with several, none (the caller fits the one it writes on all the rows).
    """
    totals: dict[str, list] = {}
    for i, (base_train, base_held, tuned_train, tuned_held) in enumerate(folds):
        sets = [("base", base_train, base_held, True)] + ([("tuned", tuned_train, tuned_held, True)]
                                                          if tuned_held is not None else [])
        if heads is not None:  # after base, shallowest first; no calibrated twin (the module's docstring)
            sets[1:1] = [(name, train, held, False)
                         for name, (train, held) in sorted(heads[i].items(), key=lambda kv: _rank(kv[0]))]
        for name, train, held, calibrates in sets:
            keyed = [(name, None)] + ([(f"{name}+calibrate", calibrated(train, readout))] if calibrates else [])
            for key, calibration in keyed:
                if key != name and calibration is None:
                    totals[key] = None  # a fold without a calibration: no calibrated candidate at all
                if totals.get(key, []) is None:
                    continue
                losses, hits = row_losses(held, calibration)
                t = totals.setdefault(key, [[], 0, None, []])
                t[0].extend(losses)
                t[1], t[2] = t[1] + hits, calibration
                t[3].extend(r.get("state") for r in held)
    return [Candidate(name, t[2] if len(folds) == 1 else None, float(np.mean(t[0])), t[1] / len(t[0]), tuple(t[0]),
                      tuple(t[3]))
            for name, t in sorted(totals.items(), key=lambda kv: _rank(kv[0])) if t is not None]


def choose(found: list[Candidate], write: str = "best") -> Candidate:
    """The lowest held-out NLL; a later (dearer) candidate must beat every earlier one by more than ``TIE``, except
    the head, which replaces the untuned candidate chosen so far unless one of them is :func:`clearly_better` (the
    module's docstring). ``write="tuned"``: the tuned candidate, whatever the others measured (they are still
    reported)."""
    if write == "tuned":
        return next(c for c in found if c.name == "tuned")
    head = chosen_head(found)
    found = [c for c in found if not is_head(c.name) or c is head]  # one head stands against the others
    best = found[0]
    for i, c in enumerate(found[1:], 1):
        if _replaces(c, found[:i]):
            best = c
    return best


def chosen_head(found: list[Candidate]) -> Candidate | None:
    """Of the head candidates (several depths), the shallowest whose NLL is not clearly worse than the best head's
    (:func:`clearly_better` at ``DEPTH_Z`` standard errors); None where there is no head candidate."""
    heads = sorted((c for c in found if is_head(c.name)), key=lambda c: _rank(c.name))
    if not heads:
        return None
    best = min(heads, key=lambda c: c.nll)
    return next(c for c in heads if c is best or not clearly_better(best, c, DEPTH_Z))


def _replaces(c: Candidate, earlier: list[Candidate]) -> bool:
    """Whether ``c`` replaces the choice among ``earlier``: the head unless an untuned candidate is clearly better,
    any other by a lower NLL than every earlier one's, by more than ``TIE``."""
    if is_head(c.name):
        return not any(clearly_better(u, c) for u in earlier if u.name in UNTUNED)
    return c.nll < min(u.nll for u in earlier) - TIE


def paired_difference(a: Candidate, b: Candidate) -> tuple[float, float]:
    """(how much lower ``a``'s held-out NLL is than ``b``'s, the standard error of that): the mean per-row loss of
    ``b`` minus ``a``'s, both judged on the same rows in the same order, the rows of one state summed before their
    spread is taken (they are not independent); the error is infinite where it cannot be taken (no per-row losses on
    the same rows, or one state), and only the tie then judges."""
    if len(a.losses) != len(b.losses) or len(a.losses) < 2:
        return b.nll - a.nll, np.inf
    d = np.asarray(b.losses) - np.asarray(a.losses)
    keys = a.states if a.states == b.states and len(a.states) == len(d) and None not in a.states else range(len(d))
    return clustered_mean(d, keys)


def clustered_mean(d: np.ndarray, keys) -> tuple[float, float]:
    """(mean of per-row values ``d``, its standard error with the rows of one key summed before their spread is
    taken: a cluster-robust error, since rows about one state are not independent); infinite with one key."""
    d = np.asarray(d, dtype=np.float64)
    index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    per_key = np.bincount([index[k] for k in keys], weights=d - d.mean())
    n = len(per_key)
    se = float(np.sqrt(n / (n - 1) * np.sum(per_key ** 2))) / len(d) if n > 1 else np.inf
    return float(d.mean()), se


def clearly_better(a: Candidate, b: Candidate, z: float = HEAD_Z) -> bool:
    """Whether ``a``'s held-out NLL is lower than ``b``'s by more than ``TIE`` and by more than ``z`` standard
    errors of the difference (:func:`paired_difference`; where no error can be taken, by ``TIE`` alone)."""
    mean, se = paired_difference(a, b)
    return mean > TIE and (mean > z * se or not np.isfinite(se))


def kept_within_noise(found: list[Candidate], chosen: Candidate) -> str:
    """Why a chosen head was kept where an untuned candidate's or a deeper head's NLL is lower (what tune's log and
    report say); "" where none is lower."""
    return "; ".join(why for why in (_untuned_lower(found, chosen), _deeper_lower(found, chosen)) if why)


def _deeper_lower(found: list[Candidate], chosen: Candidate) -> str:
    heads = [c for c in found if is_head(c.name)]
    if not is_head(chosen.name) or not heads:
        return ""
    best = min(heads, key=lambda c: c.nll)
    if best is chosen or best.nll >= chosen.nll:
        return ""
    mean, se = paired_difference(best, chosen)
    within = f"{mean / se:.2f} standard errors" if np.isfinite(se) and se > 0 else "no error measurable"
    return (f"{chosen.name} kept: {best.name}'s NLL is lower by {mean:.4f} ({within}; more than {DEPTH_Z:g} would "
            "keep the deeper head)")


def _untuned_lower(found: list[Candidate], chosen: Candidate) -> str:
    lower = [c for c in found if c.name in UNTUNED and c.nll < chosen.nll]
    if not is_head(chosen.name) or not lower:
        return ""
    c = min(lower, key=lambda c: c.nll)
    mean, se = paired_difference(c, chosen)
    if mean <= TIE or not np.isfinite(se):
        return f"the head kept: {c.name}'s NLL is lower by {mean:.4f}, within the tie of {TIE:g}"
    return (f"the head kept: {c.name}'s NLL is lower by {mean:.4f}, {mean / se:.2f} standard errors of the per-row "
            f"difference (more than {HEAD_Z:g} replaces the head)")
