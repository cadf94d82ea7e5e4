"""Typed questions and answers of the TypeSafe System One format: noul, choice, score."""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

from .errors import InvalidRequest, cut

MIN_LEVELS, MAX_LEVELS = 2, 10
QUESTION_TYPES = ("noul", "choice", "score")
NOUL_CRITERIA = ("true", "false")


def as_text(value) -> str:
    """Text the model reads for a caller value: strings as they are, JSON canonically (sorted keys)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)


def _content(value, what: str, field_path: str | None, optional: bool = False):
    """Validate a caller value: a non-empty string (stripped) or a non-empty JSON object/array."""
    if value is None and optional:
        return None
    if isinstance(value, (dict, list)):
        if not value:
            raise InvalidRequest(f"{what} must not be empty", field_path)
        try:
            check_utf8(as_text(value), what, field_path)
        except RecursionError:
            raise InvalidRequest(f"{what} is nested too deeply to serialise", field_path) from None
        except (TypeError, ValueError) as err:
            if isinstance(err, InvalidRequest):
                raise
            raise InvalidRequest(f"{what} must be JSON-serialisable: {err}", field_path) from None
        return value
    if not isinstance(value, str):
        allowed = "a string, a JSON object or array" + (", or null" if optional else "")
        raise InvalidRequest(f"{what} must be {allowed}; got {type(value).__name__}", field_path)
    if not value.strip():
        raise InvalidRequest(f"{what} must not be empty", field_path)
    check_utf8(value, what, field_path)
    return value.strip()


def _task(value, field_path: str = "task"):
    """A question's task: None (the base engine) or the name of one of the engine's tuned tasks (checked there)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidRequest(f"task must be the name of one of the engine's tuned tasks (a string) or left out; got "
                             f"{type(value).__name__}", field_path)
    return value


def check_visible(name: str, what: str, field_path: str | None) -> None:
    """Refuse a name (a question id, an option name) holding an invisible formatting character (Unicode category
    Cf: zero-width spaces and joiners, bidi controls, the BOM, soft hyphens, tags; and U+034F): two names that
    differ only by one look the same to a person; or a control character (Cc: NUL, tab, newline, ...): a name is one
    line of text, and a newline in an option name would write a line of its own into the prompt's option list."""
    if name.isascii() and name.isprintable():  # no ASCII printable character is Cf, Cc or ignorable: the common case
        return
    for i, ch in enumerate(name):
        category = unicodedata.category(ch)
        if category == "Cf" or ch == "\u034f":
            raise InvalidRequest(f"{what} contains the invisible character U+{ord(ch):04X} at position {i}; names "
                                 "must be visible text", field_path)
        if category == "Cc":
            raise InvalidRequest(f"{what} contains the control character U+{ord(ch):04X} at position {i}; names "
                                 "must be one line of visible text", field_path)
    if name and all(ignorable(ch) for ch in name):
        raise InvalidRequest(f"{what} is made only of characters that display as nothing (U+{ord(name[0]):04X}...); "
                             "names must be visible text", field_path)


def shown(value, limit: int = 80) -> str:
    """A caller's name as an error message repeats it: its repr, cut to ``limit`` characters."""
    return cut(repr(value), limit)


def check_trimmed(name, what: str, field_path: str | None) -> None:
    """Refuse a name (an option name, a score level) that begins or ends with whitespace: answers name options and
    levels exactly as the request did, and the model reads them trimmed, so "billing " would come back as another
    name than the one sent."""
    if isinstance(name, str) and name.strip() and name != name.strip():
        raise InvalidRequest(f"{what} {shown(name)} begins or ends with whitespace; answers use names exactly as "
                             "sent, so send it without", field_path)


# Unicode's Default_Ignorable_Code_Point ranges (DerivedCoreProperties.txt): characters that display as nothing. The
# Cf ones among them are refused in names outright (check_visible); the others (Hangul fillers, variation selectors,
# Khmer inherent vowels, Mongolian selectors) are legitimate inside a name ("\u2764\ufe0f", a heart as an emoji) but
# must not be all that tells two names apart. Python's unicodedata has no property lookup, hence the table; the
# tests check it against the regex package's \p{Default_Ignorable_Code_Point}.
IGNORABLE = ((0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
             (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
             (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
             (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF))


_IGNORABLE = re.compile("[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in IGNORABLE) + "]")


def ignorable(ch: str) -> bool:
    """Whether ``ch`` is a default-ignorable code point (displays as nothing)."""
    return _IGNORABLE.match(ch) is not None


def distinct(names: list, what: str, field_path: str | None) -> None:
    """Refuse names that are equal after Unicode NFC normalisation (the same text to a reader, different bytes), or
    once the characters that display as nothing (:data:`IGNORABLE`) are removed."""
    seen: dict = {}
    for name in names:
        key = name if name.isascii() else unicodedata.normalize("NFC", _IGNORABLE.sub("", name))
        if key in seen and seen[key] != name:
            raise InvalidRequest(f"{what} {shown(seen[key])} and {shown(name)} are the same text after Unicode "
                                 "normalisation (NFC), or but for characters that display as nothing (variation "
                                 "selectors, Hangul fillers); use names that differ", field_path)
        seen[key] = name


def check_utf8(text: str, what: str, field_path: str | None) -> None:
    """Reject strings that cannot be encoded as UTF-8 (lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequest(f"{what} is not valid UTF-8 at character {err.start}; send UTF-8 text", field_path) from None


@dataclass(frozen=True)
class Noul:
    """A yes/no question or statement. Its answer is ``noul`` = P(yes).

    ``criteria`` may say what counts as yes (``true``) and as no (``false``).
    """

    instructions: object = None
    criteria: Mapping | None = None
    task: str | None = None  # a tuned task of the engine that answers it (None: the base engine)

    def __post_init__(self):
        _task(self.task)
        object.__setattr__(self, "instructions", _content(self.instructions, "instructions", "instructions", True))
        crit = self.criteria
        if crit is not None:
            if not isinstance(crit, Mapping) or set(crit) - set(NOUL_CRITERIA):
                raise InvalidRequest("noul criteria must be an object with optional keys 'true' and 'false'",
                                     "criteria")
            crit = {k: _content(crit.get(k), f"criteria.{k}", f"criteria.{k}", True) for k in NOUL_CRITERIA}
            crit = {k: v for k, v in crit.items() if v is not None} or None
            object.__setattr__(self, "criteria", crit)
        if self.instructions is None and not crit:
            raise InvalidRequest("a noul question needs instructions or criteria (true/false); both are empty",
                                 "instructions")

    type = "noul"


@dataclass(frozen=True)
class Choice:
    """Pick one of N options. ``criteria`` maps option name -> description (or None)."""

    instructions: object = None
    criteria: Mapping = field(default_factory=dict)
    task: str | None = None  # a tuned task of the engine that answers it (None: the base engine)

    def __post_init__(self):
        _task(self.task)
        object.__setattr__(self, "instructions", _content(self.instructions, "instructions", "instructions", True))
        items = self.criteria.items() if isinstance(self.criteria, Mapping) else None
        if items is None and isinstance(self.criteria, (list, tuple)):
            items = [(name, None) for name in self.criteria]
        if items is None:
            raise InvalidRequest("criteria must map option names to descriptions (or null)", "criteria")
        clean: dict = {}
        for name, desc in items:
            if not isinstance(name, str):
                raise InvalidRequest("option names must be strings", "criteria")
            check_trimmed(name, "option name", "criteria")
            key = _content(name, "an option name", "criteria")
            check_visible(key, "an option name", "criteria")
            if key in clean:
                raise InvalidRequest(f"option {shown(key)} appears twice; option names must be unique", "criteria")
            clean[key] = _content(desc, f"the description of option {key!r}", f"criteria.{key}", True)
        if len(clean) < 2:
            raise InvalidRequest(f"a choice needs at least 2 options, got {len(clean)}", "criteria")
        distinct(list(clean), "options", "criteria")
        object.__setattr__(self, "criteria", clean)

    type = "choice"


@dataclass(frozen=True)
class Score:
    """An ordinal question: ``criteria`` lists 2..10 level descriptions, low to high."""

    instructions: object = None
    criteria: Sequence = ()
    task: str | None = None  # a tuned task of the engine that answers it (None: the base engine)

    def __post_init__(self):
        _task(self.task)
        object.__setattr__(self, "instructions", _content(self.instructions, "instructions", "instructions", True))
        if isinstance(self.criteria, (str, bytes)) or not isinstance(self.criteria, Sequence):
            raise InvalidRequest("criteria must be a list of level descriptions, low to high", "criteria")
        for i, c in enumerate(self.criteria):
            check_trimmed(c, f"level {i}", f"criteria.{i}")
        levels = tuple(_content(c, f"level {i}", f"criteria.{i}") for i, c in enumerate(self.criteria))
        if not MIN_LEVELS <= len(levels) <= MAX_LEVELS:
            raise InvalidRequest(
                f"a score needs {MIN_LEVELS} to {MAX_LEVELS} levels, got {len(levels)}", "criteria"
            )
        if len({as_text(x) for x in levels}) != len(levels):
            raise InvalidRequest("two levels have the same description; levels must differ", "criteria")
        object.__setattr__(self, "criteria", levels)

    type = "score"


Question = Union[Noul, Choice, Score]


def with_task(question: Question, task: str | None) -> Question:
    """``question`` asked of the engine's tuned ``task`` (None: of the engine itself)."""
    return dataclasses.replace(question, task=task)


def without_task(question: Question) -> Question:
    """``question`` as asked of another engine or a teacher: its task is this engine's own tuned adapter."""
    return dataclasses.replace(question, task=None) if getattr(question, "task", None) is not None else question


def to_wire(question: Question) -> dict:
    """The TypeSafe JSON form ``{type, instructions[, criteria][, task]}`` of a question (inverse of from_wire)."""
    body = {"type": question.type, "instructions": question.instructions}
    if isinstance(question, Choice):
        body["criteria"] = dict(question.criteria)
    elif isinstance(question, Score):
        body["criteria"] = list(question.criteria)
    elif question.criteria:
        body["criteria"] = dict(question.criteria)
    if question.task is not None:  # an extension of the wire: only where a task is named
        body["task"] = question.task
    return body


QUESTION_KEYS = ("type", "instructions", "criteria", "task")


def near_miss(key: str, known: Sequence[str]) -> str | None:
    """The known key ``key`` was likely meant as (another case, a plural or singular, one character added, dropped,
    changed or two swapped), or None."""
    low = key.lower()
    for name in known:
        if low in (name, name + "s") or low + "s" == name or _one_edit(low, name):
            return name
    return None


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one insertion, deletion or substitution, or one swap of neighbours."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                                  and a[diff[1]] == b[diff[0]])
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def from_wire(qid: str, body) -> Question:
    """Build a question from its TypeSafe JSON form ``{type, instructions, criteria}`` and, as an extension, ``task``
    (the engine's tuned task that answers it). Other keys are left alone, but a near miss of one of these ("Task",
    "tasks", "criterias") is refused: silently ignored, it would answer another question than the one meant."""
    path = f"questions.{qid}"
    if not isinstance(body, Mapping):
        raise InvalidRequest("a question must be an object with type, instructions and criteria", path)
    for key in body:
        meant = near_miss(key, QUESTION_KEYS) if isinstance(key, str) and key not in QUESTION_KEYS else None
        if meant is not None:
            raise InvalidRequest(f"unknown key {shown(key)}; did you mean {meant!r}? A question's keys are "
                                 f"{', '.join(QUESTION_KEYS)}", f"{path}.{cut(key, 40)}")
    kind = body.get("type")
    if kind == "box":
        raise InvalidRequest("box questions need a vision model; this engine answers noul, choice and score",
                             f"{path}.type")
    if kind not in QUESTION_TYPES:
        raise InvalidRequest(f"unknown question type {kind!r}; allowed: {', '.join(QUESTION_TYPES)}", f"{path}.type")
    try:
        task = body.get("task")
        if kind == "noul":
            return Noul(body.get("instructions"), body.get("criteria"), task)
        if kind == "choice":
            return Choice(body.get("instructions"), body.get("criteria") or {}, task)
        return Score(body.get("instructions"), body.get("criteria") or (), task)
    except InvalidRequest as err:
        raise InvalidRequest(err.reason, f"{path}.{err.field}" if err.field else path) from None


def _short(probabilities: dict, most: int = 5) -> str:
    """Probabilities to 3 decimals, the ``most`` likeliest first when there are more (reprs stay one short line)."""
    items = list(probabilities.items())
    if len(items) > most:
        top = sorted(items, key=lambda kv: -kv[1])[:most]
        return "{" + ", ".join(f"{k!r}: {v:.3f}" for k, v in top) + f", ... {len(items) - most} more}}"
    return "{" + ", ".join(f"{k!r}: {v:.3f}" for k, v in items) + "}"


class _Answered:
    """What every answer shares: ``abstained``, said in its repr and wire form only when set."""

    abstained: bool

    def _flag(self) -> str:
        return ", abstained" if self.abstained else ""

    def _wire(self, **fields) -> dict:
        """The TypeSafe JSON form: ``fields``, then ``abstained`` only when set."""
        return {**fields, **({"abstained": True} if self.abstained else {})}


@dataclass(frozen=True)
class NoulAnswer(_Answered):
    """``noul`` is P(yes)."""

    noul: float
    abstained: bool = False

    @property
    def certainty(self) -> float:
        """(K * p_max - 1) / (K - 1) with K = 2, as for choice and score."""
        return abs(2.0 * self.noul - 1.0)

    def __repr__(self) -> str:
        return f"NoulAnswer(noul={self.noul:.3f}{self._flag()})"

    def to_wire(self) -> dict:
        return self._wire(type="noul", noul=self.noul)


class _Confident(_Answered):
    """A choice or score answer: its certainty is its confidence."""

    confidence: float
    probabilities: dict

    @property
    def certainty(self) -> float:
        """The confidence."""
        return self.confidence

    def _tail(self) -> str:
        return f"probabilities={_short(self.probabilities)}, confidence={self.confidence:.3f}{self._flag()})"


@dataclass(frozen=True)
class ChoiceAnswer(_Confident):
    """The most likely option, every option's probability and a confidence in [0, 1]."""

    choice: str
    probabilities: dict
    confidence: float
    abstained: bool = False

    def __repr__(self) -> str:
        return f"ChoiceAnswer(choice={self.choice!r}, {self._tail()}"

    def to_wire(self) -> dict:
        return self._wire(type="choice", choice=self.choice, probabilities=dict(self.probabilities),
                          confidence=self.confidence)


@dataclass(frozen=True)
class ScoreAnswer(_Confident):
    """``score`` = sum(i * p_i); ``legend`` and ``probabilities`` are keyed "0", "1", ..."""

    score: float
    legend: dict
    probabilities: dict
    confidence: float
    abstained: bool = False

    def __repr__(self) -> str:
        return f"ScoreAnswer(score={self.score:.3f}, {self._tail()}"

    def to_wire(self) -> dict:
        return self._wire(type="score", score=self.score, legend=dict(self.legend),
                          probabilities=dict(self.probabilities), confidence=self.confidence)


Answer = Union[NoulAnswer, ChoiceAnswer, ScoreAnswer]
