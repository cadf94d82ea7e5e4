"""From option log-likelihoods to typed answers with probabilities."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .questions import MAX_LEVELS, Answer, ChoiceAnswer, Noul, NoulAnswer, Question, Score, ScoreAnswer


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


def segment_softmax(scores: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[O] float64: :func:`softmax` of each question's slice of flat option ``scores`` (question ``i``'s options are
    ``starts[i]:starts[i] + counts[i]``, every question with at least one), in a few numpy calls for all questions."""
    z = np.exp(scores - np.repeat(np.maximum.reduceat(scores, starts), counts))
    return z / np.repeat(np.add.reduceat(z, starts), counts)


def confidence(probs) -> float:
    """(K * p_max - 1) / (K - 1): 0 for a uniform answer, 1 for a certain one."""
    k = len(probs)
    return float((k * max(probs) - 1.0) / (k - 1))


LEVEL_KEYS = tuple(str(i) for i in range(MAX_LEVELS))  # a score's legend and probabilities are keyed "0", "1", ...


def answer(question: Question, probs) -> Answer:
    """The typed answer of a question given its options' probabilities (in option order; floats or an array)."""
    p = probs.tolist() if isinstance(probs, np.ndarray) else list(probs)
    if isinstance(question, Noul):
        return NoulAnswer(noul=p[0])
    if isinstance(question, Score):
        keys = LEVEL_KEYS[:len(p)]
        return ScoreAnswer(score=sum(i * v for i, v in enumerate(p)), legend=dict(zip(keys, question.criteria)),
                           probabilities=dict(zip(keys, p)), confidence=confidence(p))
    names = list(question.criteria)
    return ChoiceAnswer(choice=names[max(range(len(p)), key=p.__getitem__)], probabilities=dict(zip(names, p)),
                        confidence=confidence(p))


def answers(questions: Mapping, probs: np.ndarray, starts: np.ndarray) -> dict:
    """Typed answers by id from every option's probability, flat (question ``i``'s from ``starts[i]``)."""
    flat = probs.tolist()
    bounds = starts.tolist() + [len(flat)]
    return {qid: answer(q, flat[a:b]) for (qid, q), a, b in zip(questions.items(), bounds, bounds[1:])}
