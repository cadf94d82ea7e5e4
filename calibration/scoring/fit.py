"""Fit temperature and bias per calibration group by minimising the NLL on training rows."""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize

from ...runtime.core.readout_calibration import Calibration, GroupCalibration, group_key

MIN_ROWS = 20  # a group with fewer training rows stays uncalibrated
BIAS_L2 = 1e-3
MATRIX_ROWS_PER_PARAM = 5  # a question group tries a matrix only with >= 5 rows per parameter (K^2 + K)
MATRIX_L2 = (0.0, 0.01)  # off-diagonal L2 strengths tried (chosen by cross-validated NLL)
CV_FOLDS = 5


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def fit_group(scores: np.ndarray, labels: np.ndarray, with_bias: bool) -> GroupCalibration:
    """Temperature (and, with ``with_bias``, a bias per position; noul: on yes only) for [N, K] scores."""
    n, k = scores.shape
    nb = (1 if k == 2 else k) if with_bias else 0

    def unpack(theta):
        t = float(np.exp(theta[0]))
        b = np.zeros(k)
        if nb == 1:
            b[0] = theta[1]
        elif nb:
            b = theta[1:] - theta[1:].mean()  # one bias per level, centred (softmax ignores a shift)
        return t, b

    def loss(theta):
        t, b = unpack(theta)
        lp = _log_softmax(scores / t + b)
        return -lp[np.arange(n), labels].mean() + BIAS_L2 * float(np.sum(b ** 2))

    result = minimize(loss, np.zeros(1 + nb), method="L-BFGS-B", bounds=[(-5.0, 5.0)] + [(-20.0, 20.0)] * nb)
    t, b = unpack(result.x)
    return GroupCalibration(temperature=t, bias=tuple(b) if nb else (), rows=int(n))


def fit_matrix(scores: np.ndarray, labels: np.ndarray, l2: float) -> tuple[np.ndarray, np.ndarray]:
    """(W [K, K], b [K]) minimising the NLL of softmax(W s + b) + l2 * ||offdiag(W)||^2 (W starts at I)."""
    n, k = scores.shape

    def loss(theta):
        w, b = theta[:k * k].reshape(k, k), theta[k * k:]
        lp = _log_softmax(scores @ w.T + b)
        off = w - np.diag(np.diag(w))
        return -lp[np.arange(n), labels].mean() + l2 * float(np.sum(off ** 2)) + BIAS_L2 * float(np.sum(b ** 2))

    result = minimize(loss, np.concatenate([np.eye(k).ravel(), np.zeros(k)]), method="L-BFGS-B")
    return result.x[:k * k].reshape(k, k), result.x[k * k:]


def _cv_nll(scores: np.ndarray, labels: np.ndarray, fit_predict) -> float:
    """Mean held-out NLL over CV_FOLDS seeded folds; ``fit_predict(train_idx, test_idx)`` -> log-probs."""
    order = np.random.default_rng(0).permutation(len(labels))
    total = 0.0
    for f in range(CV_FOLDS):
        test = order[f::CV_FOLDS]
        train = np.setdiff1d(order, test)
        lp = fit_predict(train, test)
        total += -lp[np.arange(len(test)), labels[test]].sum()
    return total / len(labels)


def _question_group(scores: np.ndarray, labels: np.ndarray, names: list, qtype: str,
                    matrix: bool = True) -> GroupCalibration:
    """A question's own group: temperature + bias per name, or (``matrix``) a matrix when it wins by cross-validated
    NLL."""
    fitted = fit_group(scores, labels, with_bias=True)
    n, k = scores.shape

    def as_group(g: GroupCalibration) -> GroupCalibration:
        if qtype != "choice":
            return g
        return GroupCalibration(g.temperature, (), dict(zip(names, g.bias)), g.rows)

    if not matrix or n < MATRIX_ROWS_PER_PARAM * (k * k + k):
        return as_group(fitted)

    def simple(train, test):
        g = fit_group(scores[train], labels[train], with_bias=True)
        return _log_softmax(np.array([g.apply(s) for s in scores[test]]))

    def matrix(l2):
        def fit_predict(train, test):
            w, b = fit_matrix(scores[train], labels[train], l2)
            return _log_softmax(scores[test] @ w.T + b)
        return fit_predict

    best, best_nll = None, _cv_nll(scores, labels, simple)
    for l2 in MATRIX_L2:
        nll = _cv_nll(scores, labels, matrix(l2))
        if nll < best_nll - 1e-4:
            best, best_nll = l2, nll
    if best is None:
        return as_group(fitted)
    w, b = fit_matrix(scores, labels, best)
    return GroupCalibration(1.0, (), dict(zip(names, b.tolist())), int(n), tuple(names), tuple(map(tuple, w.tolist())))


def _padded(rows: list) -> np.ndarray:
    """[N, Kmax] scores; missing options (a choice group mixes 3 and 4 options) are -inf: probability 0."""
    k = max(len(r) for r in rows)
    out = np.full((len(rows), k), -np.inf)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _fit_members(key: str, members: list[dict], matrix: bool = True) -> GroupCalibration:
    labels = np.array([m["label"] for m in members])
    if key.startswith("choice"):  # temperature only, so option counts may differ within the group
        return fit_group(_padded([m["scores"] for m in members]), labels, with_bias=False)
    scores = np.array([m["scores"] for m in members], dtype=np.float64)
    if not key.startswith("question/"):
        return fit_group(scores, labels, with_bias=True)
    # one question: the same options on every row (rows written in another option order are reordered)
    names = members[0]["names"]
    if any(m["names"] != names for m in members):
        order = [[m["names"].index(n) for n in names] for m in members]
        scores = np.array([np.asarray(m["scores"])[o] for m, o in zip(members, order)])
        labels = np.array([o.index(m["label"]) for m, o in zip(members, order)])
    return _question_group(scores, labels, names, members[0]["type"], matrix)


def _groups(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows by calibration group: the type group (noul, choice/K, score/K) and, with a qkey, the question's own."""
    by_group: dict = {}
    for r in rows:
        by_group.setdefault(group_key(r["type"], len(r["scores"])), []).append(r)
        if r.get("qkey"):
            by_group.setdefault(r["qkey"], []).append(r)
    return by_group


def fit(rows: list[dict], readout: str, source: dict | None = None, matrix: bool = True) -> Calibration:
    """Rows of {"type", "scores": [K], "label", "qkey", "names"} -> Calibration of every group with enough rows.

    Type groups (noul, choice/K, score/K) always; a question's own group when at least
    MIN_ROWS rows ask exactly that question. ``matrix`` False: temperature and bias only, never a matrix (a decision
    head's prior, which must fold into a bias: ``calibration/heads/candidate.py``).
    """
    groups = {key: _fit_members(key, members, matrix) for key, members in sorted(_groups(rows).items())
              if len(members) >= MIN_ROWS}
    return Calibration(groups=groups, readout=readout, source=source or {})


def too_small(rows: list[dict]) -> dict[str, int]:
    """The groups :func:`fit` leaves uncalibrated (fewer than MIN_ROWS training rows), with their row counts."""
    return {key: len(members) for key, members in sorted(_groups(rows).items()) if len(members) < MIN_ROWS}
