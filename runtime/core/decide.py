"""Pydantic models as questions: ``engine.decide(state, Model)`` answers every field in one packed pass.

Field -> question (the field's ``description`` is the instructions; else its name):

* ``bool`` -> noul (value: P(yes) >= 0.5);
* ``Literal["a", "b", ...]`` or an ``Enum`` -> choice over the values (value: the argmax); option
  descriptions from ``json_schema_extra={"options": {value: description}}``;
* ``Annotated[int, Levels("Calm", "Frustrated", "Very angry")]`` -> score (value: the most
  probable level's index);
* ``Optional[...]`` of any of these -> the field is ``None`` when its answer abstains
  (confidence under ``min_confidence``); a required field keeps its value and is listed in
  ``abstained``;
* a nested model -> its fields, with ids prefixed ``"outer.inner"``;
* ``json_schema_extra={"task": "fraud"}`` on a field -> its question is asked of the engine's tuned task
  ``fraud`` (``onepass tune --task``); on a nested model's field, every question inside it is.

Anything else is refused with an error naming the field. The client side (``request_body`` and
``parse_response``) builds the same TypeSafe request for ``onepass serve`` or any compatible
server, and reads its response into the same ``Decision``.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from .errors import InvalidRequest
from .questions import Choice, ChoiceAnswer, Noul, NoulAnswer, Score, ScoreAnswer, to_wire, with_task

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Levels:
    """Ordered levels (low to high) of an ``int`` field answered as a score question."""

    names: tuple

    def __init__(self, *names: str):
        object.__setattr__(self, "names", tuple(names))


@dataclass(frozen=True)
class _Field:
    """How one question id maps back to a model field."""

    path: tuple  # field names from the top model down
    kind: str  # noul | choice | score
    optional: bool
    values: dict = field(default_factory=dict)  # choice: option name -> the field's value


@dataclass
class Decision(Generic[M]):
    """A model instance decided by the engine, with the answer behind every field."""

    value: M
    answers: dict  # question id -> NoulAnswer | ChoiceAnswer | ScoreAnswer
    abstained: set


def _unwrap_optional(annotation) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0], True
    return annotation, False


def plan(model: type[BaseModel], prefix: tuple = (), task: str | None = None) -> tuple[dict, dict]:
    """({question id: Question}, {question id: _Field}) for every field of ``model`` (nested models flattened);
    ``task``: the tuned task a nested model's fields inherit where they name none."""
    if not (inspect.isclass(model) and issubclass(model, BaseModel)):
        raise InvalidRequest(f"decide needs a pydantic BaseModel class, got {model!r}", "model")
    questions, fields = {}, {}
    for name, info in model.model_fields.items():
        path = prefix + (name,)
        qid = ".".join(path)
        annotation, optional = _unwrap_optional(info.annotation)
        instructions = info.description or name.replace("_", " ")
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        described = extra.get("options", {}) or {}
        field_task = extra.get("task", task)
        levels = next((m for m in info.metadata if isinstance(m, Levels)), None)
        if levels is not None:
            if annotation is not int:
                raise InvalidRequest(f"field {qid}: Levels(...) needs an int field, not {annotation!r}", qid)
            questions[qid] = Score(instructions, list(levels.names))
            fields[qid] = _Field(path, "score", optional)
        elif annotation is bool:
            questions[qid] = Noul(instructions)
            fields[qid] = _Field(path, "noul", optional)
        elif typing.get_origin(annotation) is Literal or (inspect.isclass(annotation)
                                                          and issubclass(annotation, enum.Enum)):
            members = (list(typing.get_args(annotation)) if typing.get_origin(annotation) is Literal
                       else list(annotation))
            values = {str(m.value if isinstance(m, enum.Enum) else m): m for m in members}
            questions[qid] = Choice(instructions, {n: described.get(n) for n in values})
            fields[qid] = _Field(path, "choice", optional, values)
        elif inspect.isclass(annotation) and issubclass(annotation, BaseModel):
            if optional:
                raise InvalidRequest(f"field {qid}: an optional nested model is not supported", qid)
            inner_q, inner_f = plan(annotation, path, field_task)
            questions.update(inner_q)
            fields.update(inner_f)
            continue
        else:
            raise InvalidRequest(
                f"field {qid}: type {annotation!r} cannot be asked; use bool, Literal[...], an Enum, "
                "Annotated[int, Levels(...)], a nested model, or Optional[...] of one of these", qid)
        if field_task is not None:
            try:
                questions[qid] = with_task(questions[qid], field_task)
            except InvalidRequest as err:  # a task that is not a name
                raise InvalidRequest(err.reason, qid) from None
    return questions, fields


def build(model: type[M], fields: dict, answers: dict, min_confidence: float | None = None) -> Decision[M]:
    """The validated instance from the answers (None for an optional field whose answer abstains)."""
    if min_confidence is not None and (isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float))
                                       or not 0.0 <= min_confidence <= 1.0):
        raise InvalidRequest(f"min_confidence must be a number from 0 to 1, got {min_confidence!r}", "min_confidence")
    tree: dict = {}
    abstained = set()
    for qid, f in fields.items():
        answer = answers[qid]
        low = min_confidence is not None and answer.certainty < min_confidence
        if low:
            abstained.add(qid)
        if low and f.optional:
            value = None
        elif isinstance(answer, NoulAnswer):
            value = answer.noul >= 0.5
        elif isinstance(answer, ChoiceAnswer):
            value = f.values[answer.choice]
        elif isinstance(answer, ScoreAnswer):
            probs = [answer.probabilities[str(i)] for i in range(len(answer.probabilities))]
            value = max(range(len(probs)), key=probs.__getitem__)
        else:
            raise InvalidRequest(f"answer {qid} has an unexpected type {type(answer).__name__}", qid)
        node = tree
        for part in f.path[:-1]:
            node = node.setdefault(part, {})
        node[f.path[-1]] = value
    return Decision(model.model_validate(tree), answers, abstained)


def decide(engine, state, model: type[M], min_confidence: float | None = None) -> Decision[M]:
    """Every field of ``model`` answered about ``state`` in one packed pass."""
    questions, fields = plan(model)
    return build(model, fields, engine.ask(state, questions), min_confidence)


def request_body(model: type[BaseModel], state, engine_name: str = "jev-latest") -> dict:
    """The TypeSafe System One request asking every field of ``model`` (for a server or the official SDK)."""
    questions, _ = plan(model)
    return {"model": engine_name, "state": state, "questions": {q: to_wire(v) for q, v in questions.items()}}


def parse_response(model: type[M], response: dict, min_confidence: float | None = None) -> Decision[M]:
    """A server's response to :func:`request_body` as a ``Decision``."""
    _, fields = plan(model)
    answers = {}
    for qid, f in fields.items():
        body = (response.get("answers") or {}).get(qid)
        if body is None:
            raise InvalidRequest(f"the response has no answer for {qid}", qid)
        if f.kind == "noul":
            answers[qid] = NoulAnswer(noul=float(body["noul"]))
        elif f.kind == "choice":
            answers[qid] = ChoiceAnswer(choice=body["choice"], probabilities=dict(body["probabilities"]),
                                        confidence=float(body["confidence"]))
        else:
            answers[qid] = ScoreAnswer(score=float(body["score"]), legend=dict(body["legend"]),
                                       probabilities=dict(body["probabilities"]), confidence=float(body["confidence"]))
    return build(model, fields, answers, min_confidence)
