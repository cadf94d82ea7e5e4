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

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and np.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        object.__setattr__(self, "bias", tuple(float(b) for b in self.bias))
        if not all(np.isfinite(self.bias)) or not all(np.isfinite(list(self.option_bias.values()))):
            raise ValueError("bias values must be finite")

    def apply(self, scores: np.ndarray, names: list | None = None) -> np.ndarray:
        """[K] calibrated scores; ``names`` are the option texts, needed for ``option_bias``."""
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
        group = self.groups.get(qkey) if qkey else None
        if group is not None:
            return group.apply(scores, names)
        group = self.groups.get(group_key(question_type, scores.shape[0]))
        return scores if group is None else group.apply(scores)

    def to_dict(self) -> dict:
        """JSON-ready form for the manifest."""
        return {"groups": {k: asdict(g) for k, g in sorted(self.groups.items())}, "readout": self.readout,
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        """Parse and validate the manifest's form."""
        groups = {k: GroupCalibration(**g) for k, g in data.get("groups", {}).items()}
        return cls(groups=groups, readout=data.get("readout", "mean"), source=data.get("source", {}))
