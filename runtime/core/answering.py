"""From option log-likelihoods to typed answers: the engine's read-out (mean, sum, prior, head), its content-free
priors, and the manifest's calibration."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import numpy as np

from .errors import InvalidRequest
from .prompt import PromptEncoder
from .readout import answer, option_scores, softmax
from .readout_calibration import question_key

PRIOR_CACHE_ITEMS = 4096


class Answering:
    """The read-out of one engine. ``null_logprobs(encoded)`` scores questions over the content-free state (the
    ``prior`` read-out's priors, cached per question)."""

    def __init__(self, manifest, encoder: PromptEncoder, null_logprobs: Callable[[list], list],
                 task_calibrations: tuple = ()):
        self.manifest, self.encoder, self._null_logprobs = manifest, encoder, null_logprobs
        self.task_calibrations = tuple(task_calibrations)  # per tuned task: its own calibration, or None
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
        """The calibration of a question of ``task`` (-1: the engine's own), where it was fitted on ``readout``."""
        cal = self.manifest.calibration if task == -1 else self.task_calibrations[task]
        return cal if cal is not None and cal.readout == readout else None  # fitted on another read-out: not applicable

    def answers(self, questions, encoded, logprobs, readout, calibrated: bool = True, heads=None) -> dict:
        scores = self.option_scores(questions, encoded, logprobs, readout, calibrated, heads)
        return {qid: answer(q, softmax(sc)) for (qid, q), sc in zip(questions.items(), scores)}

    def option_scores(self, questions, encoded, logprobs, readout=None, calibrated: bool = True,
                      heads=None) -> list:
        """Per question, the [K] scores that are soft-maxed: the read-out, then the manifest's calibration.

        The ``head`` read-out is ``beta * mean + head score`` and needs ``heads`` (from a graph
        with a decision head).
        """
        readout = readout or self.manifest.scoring.readout
        if readout == "head" and (self.manifest.head is None or heads is None):
            raise InvalidRequest("the 'head' read-out needs an engine with a decision head "
                                 "(export one with `onepass export --head FILE`, trained by `make head`); this one has none", "readout")
        priors = self.prior_logprobs(encoded) if readout == "prior" else [None] * len(encoded)
        head_iter = iter(heads) if heads is not None else None
        out = []
        for q, tokens, lp, prior in zip(questions.values(), encoded, logprobs, priors):
            lengths = np.array([len(o) for o in tokens.options], dtype=np.float64)
            if readout == "head":
                scores = self.manifest.head.beta * (lp / lengths) + next(head_iter)
            else:
                scores = option_scores(lp, lengths, prior, readout)
            cal = self.calibration(tokens.task, readout) if calibrated else None
            if cal is not None:
                names = self.encoder.options(q)
                scores = cal.apply(q.type, scores, names, question_key(q.type, self.encoder.instructions(q), names))
            out.append(scores)
        return out
