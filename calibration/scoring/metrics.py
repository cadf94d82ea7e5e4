"""Scoring rules for probabilistic answers: accuracy, NLL, Brier, ECE, coverage vs accuracy."""

from __future__ import annotations

import numpy as np

ECE_BINS = 15


def _check(probs: np.ndarray, labels: np.ndarray) -> None:
    if probs.ndim != 2 or labels.shape != (probs.shape[0],):
        raise ValueError("probs must be [N, K] and labels [N]")


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    """Share of rows whose most probable option is the label."""
    _check(probs, labels)
    return float(np.mean(probs.argmax(1) == labels))


def nll(probs: np.ndarray, labels: np.ndarray, eps: float = 1e-12) -> float:
    """Mean negative log-likelihood of the labels."""
    _check(probs, labels)
    return float(-np.mean(np.log(np.clip(probs[np.arange(len(labels)), labels], eps, 1.0))))


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean over rows of the squared distance between the probabilities and the one-hot label."""
    _check(probs, labels)
    onehot = np.eye(probs.shape[1])[labels]
    return float(np.mean(np.sum((probs - onehot) ** 2, axis=1)))


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error of the top answer, ``bins`` equal-width confidence bins."""
    _check(probs, labels)
    conf, hit = probs.max(1), probs.argmax(1) == labels
    index = np.minimum((conf * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = index == b
        if sel.any():
            total += sel.sum() / len(conf) * abs(hit[sel].mean() - conf[sel].mean())
    return float(total)


def reliability(probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> list[dict]:
    """Per bin: centre, count, mean confidence, accuracy (for the diagram)."""
    conf, hit = probs.max(1), probs.argmax(1) == labels
    index = np.minimum((conf * bins).astype(int), bins - 1)
    return [{"bin": (b + 0.5) / bins, "count": int((index == b).sum()),
             "confidence": float(conf[index == b].mean()) if (index == b).any() else None,
             "accuracy": float(hit[index == b].mean()) if (index == b).any() else None} for b in range(bins)]


def confidence(probs: np.ndarray, k: np.ndarray | None = None) -> np.ndarray:
    """Each row's confidence, (K * p_max - 1) / (K - 1) as in the answers; ``k`` gives each row's K when rows of
    different option counts are padded with zero probabilities into one array."""
    k = np.full(len(probs), probs.shape[1]) if k is None else np.asarray(k)
    return (k * probs.max(1) - 1) / (k - 1)


def coverage_curve(probs: np.ndarray, labels: np.ndarray, k: np.ndarray | None = None, steps: int = 20) -> list[dict]:
    """Answering only the most confident rows: accuracy at each coverage, with the confidence threshold
    (:func:`confidence`)."""
    conf = confidence(probs, k)
    order = np.argsort(-conf, kind="stable")
    hits = (probs.argmax(1) == labels)[order]
    out = []
    for i in range(1, steps + 1):
        n = max(1, int(round(len(order) * i / steps)))
        out.append({"coverage": n / len(order), "accuracy": float(hits[:n].mean()),
                    "min_confidence": float(conf[order][n - 1])})
    return out


def coverage_at(probs: np.ndarray, labels: np.ndarray, target: float, k: np.ndarray | None = None) -> dict:
    """The largest share of rows that can be answered at ``target`` accuracy by answering only the most confident
    ones: {"coverage", "min_confidence"} (coverage 0 and min_confidence None when no prefix reaches it)."""
    conf = confidence(probs, k)
    order = np.argsort(-conf, kind="stable")
    hits = (probs.argmax(1) == labels)[order]
    acc = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    ok = np.nonzero(acc >= target - 1e-12)[0]
    if not len(ok):
        return {"coverage": 0.0, "min_confidence": None}
    n = int(ok.max()) + 1
    return {"coverage": n / len(labels), "min_confidence": float(conf[order][n - 1])}


def summary(probs: np.ndarray, labels: np.ndarray) -> dict:
    """accuracy, nll, brier, ece of one set of predictions."""
    return {"accuracy": accuracy(probs, labels), "nll": nll(probs, labels), "brier": brier(probs, labels),
            "ece": ece(probs, labels), "rows": int(len(labels))}


def ece_floor(probs: np.ndarray, reps: int = 200, seed: int = 0) -> float:
    """Mean ECE of a *perfectly calibrated* predictor with these probabilities on this many rows:
    labels drawn from the probabilities themselves. Below it, a measured ECE is sampling noise."""
    rng = np.random.default_rng(seed)
    cum = np.cumsum(probs / probs.sum(1, keepdims=True), axis=1)
    out = []
    for _ in range(reps):
        labels = np.minimum((rng.random((len(probs), 1)) > cum).sum(1), probs.shape[1] - 1)
        out.append(ece(probs, labels))
    return float(np.mean(out))


def target_nll(logp: np.ndarray, target) -> float:
    """-log p of a label index, or the cross-entropy of ``logp`` against a teacher's distribution: the loss every
    candidate is judged by (and a head's temperature chosen by)."""
    return -float(logp[int(target)]) if np.ndim(target) == 0 else -float(np.dot(np.asarray(target), logp))
