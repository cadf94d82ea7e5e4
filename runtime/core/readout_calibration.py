"""Calibration stored in the manifest and applied by the runtime: temperature and bias per group.

A group is a question type and option count: ``noul``, ``choice/2``, ``choice/3-4``,
``choice/5-8``, ``choice/9+``, ``score/K``. Calibrated scores are ``scores / T + b``:

* noul: T and a bias on "yes" (position 0) — yes/no is the same pair in every question;
* choice: T only — option names differ between questions, so a positional bias would be
  meaningless and would make answers depend on option order;
* score: T and one bias per level — levels are ordered, low to high, in every question.

A question seen often enough in the calibration data also gets its own group,
``question/<hash>`` (hash of its type, instructions and sorted options): a temperature and a
bias per option *name* (per level for score, on yes for noul). That is the per-task
calibration that corrects a model's preference for some labels; being keyed by name, it
never makes an answer depend on option order.

When it has enough rows, a question's group may instead be a *matrix* (Dirichlet-style
calibration of the log-scores): ``W s + b`` with ``W`` indexed by option name on both
axes, chosen over temperature + bias by cross-validated NLL at fit time. It corrects
labels that the model confuses with each other (BBC topics), still by name, so still
order-invariant.

A positive temperature never changes which option has the highest score.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import numpy as np


def group_key(question_type: str, num_options: int) -> str:
    """The calibration group of a question."""
    if question_type == "noul":
        return "noul"
    if question_type == "score":
        return f"score/{num_options}"
    for upper, name in ((2, "2"), (4, "3-4"), (8, "5-8")):
        if num_options <= upper:
            return f"choice/{name}"
    return "choice/9+"


def question_key(question_type: str, instructions: str, options: list[str]) -> str:
    """The per-question group: a hash of the type, instructions and sorted option texts."""
    blob = json.dumps([question_type, instructions, sorted(options)], ensure_ascii=False)
    return "question/" + hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class GroupCalibration:
    """Temperature and bias of one group: per position (``bias``) or per option name (``option_bias``)."""

    temperature: float = 1.0
    bias: tuple = ()
    option_bias: dict = field(default_factory=dict)
    rows: int = 0  # training rows it was fitted on
    matrix_names: tuple = ()  # option names indexing ``matrix`` (question groups only)
    matrix: tuple = ()  # rows of W: calibrated = W @ scores (in matrix_names order) + option_bias

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and np.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        object.__setattr__(self, "bias", tuple(float(b) for b in self.bias))
        if not all(np.isfinite(self.bias)) or not all(np.isfinite(list(self.option_bias.values()))):
            raise ValueError("bias values must be finite")
        object.__setattr__(self, "matrix_names", tuple(self.matrix_names))
        object.__setattr__(self, "matrix", tuple(tuple(float(w) for w in row) for row in self.matrix))
        k = len(self.matrix_names)
        if self.matrix and (len(self.matrix) != k or any(len(row) != k for row in self.matrix)
                            or not np.all(np.isfinite(self.matrix))):
            raise ValueError(f"matrix must be {k} x {k} finite weights (one row and column per option name)")

    def apply(self, scores: np.ndarray, names: list | None = None) -> np.ndarray:
        """[K] calibrated scores; ``names`` are the option texts, needed for ``option_bias`` and ``matrix``."""
        if self.matrix and names is not None and sorted(names) == sorted(self.matrix_names):
            order = [self.matrix_names.index(n) for n in names]  # request position -> matrix index
            w = np.asarray(self.matrix)[np.ix_(order, order)]
            return w @ scores + np.array([self.option_bias.get(n, 0.0) for n in names])
        out = scores / self.temperature
        if self.option_bias and names is not None:
            out = out + np.array([self.option_bias.get(n, 0.0) for n in names])
        elif self.bias:
            if len(self.bias) != out.shape[0]:
                raise ValueError(f"bias has {len(self.bias)} values for {out.shape[0]} options")
            out = out + np.asarray(self.bias)
        return out


@dataclass(frozen=True)
class Calibration:
    """All groups fitted for an engine, plus where they came from."""

    groups: dict = field(default_factory=dict)  # key -> GroupCalibration
    readout: str = "mean"  # the read-out the scores were computed with
    source: dict = field(default_factory=dict)

    def apply(self, question_type: str, scores: np.ndarray, names: list | None = None,
              qkey: str | None = None) -> np.ndarray:
        """Calibrated scores: the question's own group if fitted, else its type group, else unchanged."""
        group, own = self.group_of(question_type, scores.shape[0], qkey)
        if group is None:
            return scores
        return group.apply(scores, names) if own else group.apply(scores)

    def group_of(self, question_type: str, num_options: int, qkey: str | None = None) -> tuple:
        """(the group that calibrates a question, whether it is the question's own) or (None, False)."""
        group = self.groups.get(qkey) if qkey else None
        if group is not None:
            return group, True
        return self.groups.get(group_key(question_type, num_options)), False

    def to_dict(self) -> dict:
        """JSON-ready form for the manifest."""
        return {"groups": {k: asdict(g) for k, g in sorted(self.groups.items())}, "readout": self.readout,
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        """Parse and validate the manifest's form."""
        groups = {k: GroupCalibration(**{**g, "matrix_names": tuple(g.get("matrix_names", ())),
                                         "matrix": tuple(map(tuple, g.get("matrix", ())))})
                  for k, g in data.get("groups", {}).items()}
        return cls(groups=groups, readout=data.get("readout", "mean"), source=data.get("source", {}))
