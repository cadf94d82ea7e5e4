"""Typed questions and answers of the TypeSafe System One format: noul, choice, score."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

from .errors import InvalidRequest

MIN_LEVELS, MAX_LEVELS = 2, 10
QUESTION_TYPES = ("noul", "choice", "score")


def _text(value, what: str, field_path: str | None) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a string, got {type(value).__name__}", field_path)
    if not value.strip():
        raise InvalidRequest(f"{what} must not be empty", field_path)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequest(f"{what} is not valid UTF-8 at character {err.start}; send UTF-8 text", field_path) from None
    return value.strip()


@dataclass(frozen=True)
class Noul:
    """A yes/no question. Its answer is ``noul`` = P(yes)."""

    instructions: str

    def __post_init__(self):
        object.__setattr__(self, "instructions", _text(self.instructions, "instructions", "instructions"))

    type = "noul"


@dataclass(frozen=True)
class Choice:
    """Pick one of N options. ``criteria`` maps option name -> description (or None)."""

    instructions: str
    criteria: Mapping[str, str | None] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "instructions", _text(self.instructions, "instructions", "instructions"))
        items = self.criteria.items() if isinstance(self.criteria, Mapping) else None
        if items is None and isinstance(self.criteria, (list, tuple)):
            items = [(name, None) for name in self.criteria]
        if items is None:
            raise InvalidRequest("criteria must map option names to descriptions (or null)", "criteria")
        clean: dict[str, str | None] = {}
        for name, desc in items:
            key = _text(name, "an option name", "criteria")
            if key in clean:
                raise InvalidRequest(f"option {key!r} appears twice; option names must be unique", "criteria")
            if desc is not None:
                desc = _text(desc, f"the description of option {key!r}", f"criteria.{key}")
            clean[key] = desc
        if len(clean) < 2:
            raise InvalidRequest(f"a choice needs at least 2 options, got {len(clean)}", "criteria")
        object.__setattr__(self, "criteria", clean)

    type = "choice"


@dataclass(frozen=True)
class Score:
    """An ordinal question: ``criteria`` lists 2..10 level descriptions, low to high."""

    instructions: str
    criteria: Sequence[str] = ()

    def __post_init__(self):
        object.__setattr__(self, "instructions", _text(self.instructions, "instructions", "instructions"))
        if isinstance(self.criteria, (str, bytes)) or not isinstance(self.criteria, Sequence):
            raise InvalidRequest("criteria must be a list of level descriptions, low to high", "criteria")
        levels = tuple(_text(c, f"level {i}", f"criteria.{i}") for i, c in enumerate(self.criteria))
        if not MIN_LEVELS <= len(levels) <= MAX_LEVELS:
            raise InvalidRequest(
                f"a score needs {MIN_LEVELS} to {MAX_LEVELS} levels, got {len(levels)}", "criteria"
            )
        if len(set(levels)) != len(levels):
            raise InvalidRequest("two levels have the same description; levels must differ", "criteria")
        object.__setattr__(self, "criteria", levels)

    type = "score"


Question = Union[Noul, Choice, Score]


def from_wire(qid: str, body) -> Question:
    """Build a question from its TypeSafe JSON form ``{type, instructions, criteria}``."""
    path = f"questions.{qid}"
    if not isinstance(body, Mapping):
        raise InvalidRequest("a question must be an object with type, instructions and criteria", path)
    kind = body.get("type")
    if kind not in QUESTION_TYPES:
        raise InvalidRequest(f"unknown question type {kind!r}; allowed: {', '.join(QUESTION_TYPES)}", f"{path}.type")
    try:
        if kind == "noul":
            if body.get("criteria") not in (None, {}, []):
                raise InvalidRequest("a noul question takes no criteria", "criteria")
            return Noul(body.get("instructions"))
        if kind == "choice":
            return Choice(body.get("instructions"), body.get("criteria") or {})
        return Score(body.get("instructions"), body.get("criteria") or ())
    except InvalidRequest as err:
        raise InvalidRequest(err.reason, f"{path}.{err.field}" if err.field else path) from None


@dataclass(frozen=True)
class NoulAnswer:
    """``noul`` is P(yes)."""

    noul: float

    def to_wire(self) -> dict:
        """The TypeSafe JSON form."""
        return {"type": "noul", "noul": self.noul}


@dataclass(frozen=True)
class ChoiceAnswer:
    """The most likely option, every option's probability and a confidence in [0, 1]."""

    choice: str
    probabilities: dict
    confidence: float

    def to_wire(self) -> dict:
        """The TypeSafe JSON form."""
        return {"type": "choice", "choice": self.choice, "probabilities": dict(self.probabilities),
                "confidence": self.confidence}


@dataclass(frozen=True)
class ScoreAnswer:
    """``score`` = sum(i * p_i); ``legend`` and ``probabilities`` are keyed "0", "1", ..."""

    score: float
    legend: dict
    probabilities: dict
    confidence: float

    def to_wire(self) -> dict:
        """The TypeSafe JSON form."""
        return {"type": "score", "score": self.score, "legend": dict(self.legend),
                "probabilities": dict(self.probabilities), "confidence": self.confidence}


Answer = Union[NoulAnswer, ChoiceAnswer, ScoreAnswer]
