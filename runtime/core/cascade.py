"""Confidence gates and cascades: act on what is certain, send the rest on.

* ``Gate(min_confidence, per_question=...)`` splits answers into *decided* and *for review* by
  their confidence ((K p_max - 1)/(K - 1); |2p - 1| for noul). Per-question thresholds may come
  from ``onepass eval --target-accuracy`` (``Gate.from_eval``) or from a distilled engine's manifest
  (``Gate.from_manifest``): both are keyed by question key (type, instructions and options as the
  engine renders them) and become a request's thresholds with ``for_questions``.
* ``Cascade([fast, strong, ...], min_confidence)`` asks the first engine; only the questions it
  answers below the threshold are asked again of the next engine, about the same state; the last
  engine's answers are final. The result says which engine answered each question.

Engines here are anything with ``name`` and ``ask(state, questions)`` (an ``Engine``, or a client).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .errors import InvalidRequest
from .questions import without_task


def _threshold(value, what: str) -> float:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise InvalidRequest(f"{what} must be a number within 0..1, got {value!r}", what)
    return float(value)


@dataclass(frozen=True)
class Gate:
    """Answers at or above their question's threshold are decided; the rest go for review."""

    min_confidence: float
    per_question: Mapping = field(default_factory=dict)
    per_key: Mapping = field(default_factory=dict)  # question key -> threshold (for_questions maps them to ids)

    def __post_init__(self):
        _threshold(self.min_confidence, "min_confidence")
        for qid, t in self.per_question.items():
            _threshold(t, f"per_question.{qid}")
        for key, t in self.per_key.items():
            _threshold(t, f"per_key.{key}")

    @classmethod
    def from_manifest(cls, gate: Mapping, min_confidence: float | None = None) -> "Gate":
        """A distilled engine's gate (its manifest's ``gate``): thresholds by question key; questions it was not
        distilled on get ``min_confidence``, else the manifest's ``default`` (1.0: all of them go on)."""
        if not isinstance(gate, Mapping) or not isinstance(gate.get("per_key"), Mapping):
            raise InvalidRequest("a gate must be an object with per_key thresholds", "gate")
        default = gate.get("default", 1.0) if min_confidence is None else min_confidence
        return cls(_threshold(default, "gate.default"), per_key=dict(gate["per_key"]))

    def for_questions(self, engine, questions: Mapping) -> "Gate":
        """This gate's thresholds by question id for one request (its per-key thresholds looked up)."""
        if not self.per_key:
            return self
        keys = {qid: engine.question_key(q) for qid, q in questions.items()}
        found = {qid: self.per_key[key] for qid, key in keys.items() if key in self.per_key}
        return Gate(self.min_confidence, {**self.per_question, **found})

    @classmethod
    def from_eval(cls, report, engine, questions: Mapping, min_confidence: float) -> "Gate":
        """Per-question thresholds from an ``onepass eval --target-accuracy`` report (its eval.json path or dict).

        Each question of ``questions`` that the report evaluated (the same type, instructions and options, as
        ``engine`` renders them: the calibration's question key) gets the lowest confidence at which it reached the
        target on the eval rows; 1.0 where none did (all its answers go for review, unless certain). The others get
        ``min_confidence``."""
        if not isinstance(report, Mapping):
            try:
                report = json.loads(Path(report).read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                raise InvalidRequest(f"{report}: not a readable eval.json ({err})", "report") from None
        evaluated = report.get("questions") if isinstance(report, Mapping) else None
        if not isinstance(evaluated, Mapping) or any("for_target_accuracy" not in q for q in evaluated.values()):
            raise InvalidRequest("the eval report has no per-question thresholds: run `onepass eval` with "
                                 "--target-accuracy", "report")
        per_key = {key: 1.0 if q["for_target_accuracy"]["min_confidence"] is None
                   else q["for_target_accuracy"]["min_confidence"] for key, q in evaluated.items()}
        return cls(min_confidence, per_key=per_key).for_questions(engine, questions)

    def threshold(self, qid: str) -> float:
        return float(self.per_question.get(qid, self.min_confidence))

    def split(self, answers: Mapping) -> tuple[dict, dict]:
        """(decided, for_review): both keyed by question id, answers unchanged."""
        decided, review = {}, {}
        for qid, answer in answers.items():
            (decided if answer.certainty >= self.threshold(qid) else review)[qid] = answer
        return decided, review


@dataclass
class CascadeResult:
    answers: dict  # question id -> answer (the engine that was sure enough, or the last one)
    answered_by: dict  # question id -> engine name
    asked: list  # per engine, the question ids it was asked


class Cascade:
    """Ask engines in order; a question goes to the next engine only while its answer is below the gate."""

    def __init__(self, engines: list, min_confidence: float | None = None, gate: Gate | None = None):
        if len(engines) < 2:
            raise InvalidRequest("a cascade needs at least two engines", "engines")
        if (min_confidence is None) == (gate is None):
            raise InvalidRequest("give the cascade min_confidence or a Gate", "min_confidence")
        self.engines = list(engines)
        self.gate = gate or Gate(min_confidence)

    def ask(self, state, questions: Mapping) -> CascadeResult:
        pending = dict(questions)
        answers, by, asked = {}, {}, []
        for i, engine in enumerate(self.engines):
            asked.append(list(pending))
            got = engine.ask(state, pending if i == 0 else {q: without_task(v) for q, v in pending.items()})
            decided = got if i == len(self.engines) - 1 else self.gate.split(got)[0]  # the last engine is final
            for qid, answer in decided.items():
                answers[qid], by[qid] = answer, engine.name
                pending.pop(qid)
            if not pending:
                break
        return CascadeResult({q: answers[q] for q in questions}, {q: by[q] for q in questions}, asked)
