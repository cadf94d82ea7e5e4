"""Fit temperature and bias per calibration group by minimising the NLL on training rows."""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize

from ..runtime.calibration import Calibration, GroupCalibration, group_key

MIN_ROWS = 20  # a group with fewer training rows stays uncalibrated
BIAS_L2 = 1e-3


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


def _padded(rows: list) -> np.ndarray:
    """[N, Kmax] scores; missing options (a choice group mixes 3 and 4 options) are -inf: probability 0."""
    k = max(len(r) for r in rows)
    out = np.full((len(rows), k), -np.inf)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _fit_members(key: str, members: list[dict]) -> GroupCalibration:
    labels = np.array([m["label"] for m in members])
    if key.startswith("choice"):  # temperature only, so option counts may differ within the group
        return fit_group(_padded([m["scores"] for m in members]), labels, with_bias=False)
    scores = np.array([m["scores"] for m in members], dtype=np.float64)
    if not key.startswith("question/"):
        return fit_group(scores, labels, with_bias=True)
    fitted = fit_group(scores, labels, with_bias=True)
    if members[0]["type"] != "choice":
        return fitted
    names = members[0]["names"]  # one question: the same options (in its own order) on every row
    return GroupCalibration(fitted.temperature, (), dict(zip(names, fitted.bias)), fitted.rows)


def fit(rows: list[dict], readout: str, source: dict | None = None) -> Calibration:
    """Rows of {"type", "scores": [K], "label", "qkey", "names"} -> Calibration of every group with enough rows.

    Type groups (noul, choice/K, score/K) always; a question's own group when at least
    MIN_ROWS rows ask exactly that question.
    """
    by_group: dict = {}
    for r in rows:
        by_group.setdefault(group_key(r["type"], len(r["scores"])), []).append(r)
        if r.get("qkey"):
            by_group.setdefault(r["qkey"], []).append(r)
    groups = {key: _fit_members(key, members) for key, members in sorted(by_group.items())
              if len(members) >= MIN_ROWS}
    return Calibration(groups=groups, readout=readout, source=source or {})
