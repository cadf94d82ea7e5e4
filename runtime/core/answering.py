"""From option log-likelihoods to typed answers: the engine's read-out (mean, sum, prior, head), its content-free
priors, and the manifest's calibration."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Mapping

import numpy as np

from .errors import InvalidRequest
from .prompt import PromptEncoder
from .question_set import QuestionSet, layout_of
from .readout import answers, option_scores, segment_softmax
from .readout_calibration import question_key

PRIOR_CACHE_ITEMS = 4096


class Answering:
    """The read-out of one engine. ``null_logprobs(encoded)`` scores questions over the content-free state (the
    ``prior`` read-out's priors, cached per question)."""

    def __init__(self, manifest, encoder: PromptEncoder, null_logprobs: Callable[[list], list],
                 task_calibrations: tuple = (), task_heads: tuple = ()):
        self.manifest, self.encoder, self._null_logprobs = manifest, encoder, null_logprobs
        self.task_calibrations = tuple(task_calibrations)  # per tuned task: its own calibration, or None
        # per tuned task: its decision head's beta where the task is a head (its questions then always read out
        # ``beta * mean + head score``, both read after the head's depth by the slot graph), else None
        self.task_heads = tuple(task_heads) or (None,) * len(self.task_calibrations)
        self._calibrated = manifest.calibration is not None or any(c is not None for c in self.task_calibrations)
        self._priors: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def prior_logprobs(self, encoded: list) -> list:
        """Content-free log-likelihoods (state = the template's null state), cached per question."""
        with self._lock:
            missing = [q for q in dict.fromkeys(encoded) if q not in self._priors]
        if missing:
            values = self._null_logprobs(missing)
            with self._lock:
                for q, v in zip(missing, values):
                    self._priors[q] = v
                while len(self._priors) > PRIOR_CACHE_ITEMS:
                    self._priors.popitem(last=False)
        with self._lock:
            return [self._priors.get(q) if q in self._priors else None for q in encoded]

    def calibration(self, task: int, readout: str):
        """The calibration of a question of ``task`` (-1: the engine's own), where it was fitted on the read-out its
        questions are read with (``readout``; a head task's: ``head``)."""
        cal = self.manifest.calibration if task == -1 else self.task_calibrations[task]
        if task >= 0 and self.task_heads[task] is not None:
            readout = "head"
        return cal if cal is not None and cal.readout == readout else None  # fitted on another read-out: not applicable

    def read(self, questions: Mapping, qs: QuestionSet, values: np.ndarray, heads: np.ndarray | None = None,
             readout: str | None = None) -> dict:
        """Typed answers by id of ``questions`` (compiled as ``qs``) from their options' values: the flat [O]
        summed log-likelihoods (and decision-head scores) the passes gave. The read-out, calibration and softmax run
        over every option at once."""
        scores = self.scores(list(questions.values()), qs, values, readout, True, heads)
        return answers(questions, segment_softmax(scores, qs.starts, qs.counts), qs.starts)

    def option_scores(self, questions, encoded, logprobs, readout=None, calibrated: bool = True,
                      heads=None) -> list:
        """Per question, the [K] scores that are soft-maxed: the read-out, then the manifest's calibration.

        The ``head`` read-out is ``beta * mean + head score`` and needs ``heads`` (from a graph
        with a decision head).
        """
        qs = QuestionSet(tuple(encoded), (), *layout_of(tuple(encoded)))
        flat = np.concatenate([np.asarray(lp, dtype=np.float64) for lp in logprobs])
        flat_heads = None if heads is None else np.concatenate([np.asarray(h, dtype=np.float64) for h in heads])
        return qs.split(self.scores(list(questions.values()), qs, flat, readout, calibrated, flat_heads))

    def scores(self, questions: list, qs: QuestionSet, values: np.ndarray, readout: str | None, calibrated: bool,
               heads: np.ndarray | None) -> np.ndarray:
        """[O] float64: every option's score to soft-max, question after question (``qs``'s numbering)."""
        readout = readout or self.manifest.scoring.readout
        if readout == "head":
            if self.manifest.head is None or heads is None:
                raise InvalidRequest("the 'head' read-out needs an engine with a decision head (export one with "
                                     "`onepass export --head FILE`, trained by `make head`); this one has none",
                                     "readout")
            scores = self.manifest.head.beta * (values / qs.lengths) + heads
        else:
            prior = self._flat_priors(qs) if readout == "prior" else None
            scores = option_scores(values, qs.lengths, prior, readout)
        scores = self._task_heads(qs, values, heads, scores)
        if calibrated and self._calibrated:
            scores = self._calibrate(questions, qs, scores, readout)
        return scores

    def _task_heads(self, qs: QuestionSet, values: np.ndarray, heads: np.ndarray | None,
                    scores: np.ndarray) -> np.ndarray:
        """``scores`` with the options of every head task's question read out as ``beta * mean + head score`` (the
        questions found once per set)."""
        if not any(beta is not None for beta in self.task_heads):
            return scores
        if "task heads" not in qs.memo:
            qs.memo["task heads"] = [(qs.starts[i], qs.starts[i] + qs.counts[i], self.task_heads[tokens.task])
                                     for i, tokens in enumerate(qs.encoded)
                                     if tokens.task >= 0 and self.task_heads[tokens.task] is not None]
        if not qs.memo["task heads"]:
            return scores
        if heads is None:
            raise InvalidRequest("a head task's question needs its head scores: pass heads= from the same pass "
                                 "(Engine.option_values gives both)", "heads")
        out = np.array(scores, dtype=np.float64)
        for a, b, beta in qs.memo["task heads"]:
            out[a:b] = beta * (values[a:b] / qs.lengths[a:b]) + heads[a:b]
        return out

    def _flat_priors(self, qs: QuestionSet) -> np.ndarray:
        """[O] the set's content-free log-likelihoods, computed once per set (and cached per question)."""
        if "prior" not in qs.memo:
            priors = self.prior_logprobs(list(qs.encoded))
            if any(p is None for p in priors):  # more questions than the prior cache holds: scored here at once
                priors = self._null_logprobs(list(qs.encoded))
            qs.memo["prior"] = np.concatenate(priors)
        return qs.memo["prior"]

    def _calibrate(self, questions: list, qs: QuestionSet, scores: np.ndarray, readout: str) -> np.ndarray:
        """``scores`` with each calibrated question's slice replaced by its calibration's (which questions have one,
        their option names and keys found once per set)."""
        memo = ("calibration", readout)
        if memo not in qs.memo:
            qs.memo[memo] = [(i, cal, self.encoder.options(q),
                              question_key(q.type, self.encoder.instructions(q), self.encoder.options(q)))
                             for i, (q, tokens) in enumerate(zip(questions, qs.encoded))
                             if (cal := self.calibration(tokens.task, readout)) is not None]
        out = np.array(scores, dtype=np.float64)
        for i, cal, names, key in qs.memo[memo]:
            a, b = qs.starts[i], qs.starts[i] + qs.counts[i]
            out[a:b] = cal.apply(questions[i].type, out[a:b], names, key)
        return out
