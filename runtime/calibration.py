"""Calibration stored in the manifest and applied by the runtime: temperature and bias per group.

A group is a question type and option count: ``noul``, ``choice/2``, ``choice/3-4``,
``choice/5-8``, ``choice/9+``, ``score/K``. Calibrated scores are ``scores / T + b``:

* noul: T and a bias on "yes" (position 0) — yes/no is the same pair in every question;
* choice: T only — option names differ between questions, so a positional bias would be
  meaningless and would make answers depend on option order;
* score: T and one bias per level — levels are ordered, low to high, in every question.

A positive temperature never changes which option has the highest score.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class GroupCalibration:
    """Temperature and per-position bias of one group."""

    temperature: float = 1.0
    bias: tuple = ()
    rows: int = 0  # training rows it was fitted on

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and np.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        object.__setattr__(self, "bias", tuple(float(b) for b in self.bias))
        if not all(np.isfinite(self.bias)):
            raise ValueError("bias values must be finite")

    def apply(self, scores: np.ndarray) -> np.ndarray:
        """[K] calibrated scores."""
        out = scores / self.temperature
        if self.bias:
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

    def apply(self, question_type: str, scores: np.ndarray) -> np.ndarray:
        """Calibrated scores; a group never fitted is left as it is."""
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
