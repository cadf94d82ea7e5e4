"""From option log-likelihoods to typed answers with probabilities."""

from __future__ import annotations

import numpy as np

from .questions import Answer, ChoiceAnswer, Noul, NoulAnswer, Question, Score, ScoreAnswer


def option_scores(logprob: np.ndarray, lengths: np.ndarray, prior: np.ndarray | None, readout: str) -> np.ndarray:
    """[K] scores to soft-max: summed log-likelihood, per-token mean, or minus a content-free prior."""
    if readout == "sum":
        return logprob
    if readout == "mean":
        return logprob / lengths
    if readout == "prior":
        if prior is None:
            raise ValueError("the prior read-out needs the content-free log-likelihoods")
        return logprob - prior
    raise ValueError(f"unknown read-out {readout!r}; allowed: sum, mean, prior")


def softmax(scores: np.ndarray) -> np.ndarray:
    """Numerically stable softmax in float64."""
    z = np.exp(scores - scores.max())
    return z / z.sum()


def confidence(probs: np.ndarray) -> float:
    """(K * p_max - 1) / (K - 1): 0 for a uniform answer, 1 for a certain one."""
    k = probs.shape[0]
    return float((k * probs.max() - 1.0) / (k - 1))


def answer(question: Question, probs: np.ndarray) -> Answer:
    """The typed answer of a question given its options' probabilities (in option order)."""
    if isinstance(question, Noul):
        return NoulAnswer(noul=float(probs[0]))
    if isinstance(question, Score):
        keys = [str(i) for i in range(len(question.criteria))]
        return ScoreAnswer(
            score=float(np.dot(np.arange(len(probs)), probs)),
            legend=dict(zip(keys, question.criteria)),
            probabilities={k: float(p) for k, p in zip(keys, probs)},
            confidence=confidence(probs),
        )
    names = list(question.criteria)
    return ChoiceAnswer(
        choice=names[int(np.argmax(probs))],
        probabilities={n: float(p) for n, p in zip(names, probs)},
        confidence=confidence(probs),
    )
