"""Pydantic models as questions (runtime/core/decide.py): mapping, one packed pass, values, abstention, the HTTP
helpers, and refusals that name the field."""

import enum
from pathlib import Path
from typing import Annotated, Literal, Optional

import pytest
from pydantic import BaseModel, Field

from onepass import Choice, Noul, Score
from onepass.runtime.core.decide import Levels, parse_response, plan, request_body
from onepass.runtime.core.errors import InvalidRequest

TICKET = (Path(__file__).parent / "data" / "ticket.txt").read_text()


class Kind(enum.Enum):
    complaint = "complaint"
    question = "question"


class Customer(BaseModel):
    angry: bool = Field(description="Is the customer angry?")


class Triage(BaseModel):
    refund: bool = Field(description="Does the customer request a refund?")
    team: Literal["billing", "technical", "sales"] = Field(
        description="Which team should handle this?", json_schema_extra={"options": {"billing": "payments, refunds"}})
    frustration: Annotated[int, Levels("Calm", "Frustrated", "Very angry")] = Field(
        description="How frustrated is the customer?")
    kind: Optional[Kind] = Field(None, description="What kind of message is this?")
    customer: Customer


def test_fields_map_to_questions_with_prefixed_nested_ids():
    questions, _ = plan(Triage)
    assert questions == {
        "refund": Noul("Does the customer request a refund?"),
        "team": Choice("Which team should handle this?", {"billing": "payments, refunds", "technical": None,
                                                          "sales": None}),
        "frustration": Score("How frustrated is the customer?", ["Calm", "Frustrated", "Very angry"]),
        "kind": Choice("What kind of message is this?", {"complaint": None, "question": None}),
        "customer.angry": Noul("Is the customer angry?")}


@pytest.mark.parametrize("annotation, message", [(str, "field x: type <class 'str'> cannot be asked"),
                                                 (float, "field x: type <class 'float'> cannot be asked"),
                                                 (Annotated[str, Levels("a", "b")], "Levels.* needs an int field")])
def test_unsupported_fields_are_refused_by_name(annotation, message):
    model = type("Bad", (BaseModel,), {"__annotations__": {"x": annotation}})
    with pytest.raises(InvalidRequest, match=message):
        plan(model)


def test_decide_answers_every_field_in_one_pass_as_asking_the_questions(engine, monkeypatch):
    questions, _ = plan(Triage)
    want = engine.ask(TICKET, questions)
    passes = []
    real = engine.backend.score_all
    monkeypatch.setattr(engine.backend, "score_all", lambda kv, b: passes.append(1) or real(kv, b))
    decision = engine.decide(TICKET, Triage)
    assert len(passes) == 1  # every field in one packed pass
    assert {k: a.to_wire() for k, a in decision.answers.items()} == {k: a.to_wire() for k, a in want.items()}
    value = decision.value
    assert isinstance(value, Triage) and isinstance(value.kind, Kind)
    assert value.refund == (want["refund"].noul >= 0.5) and value.team == want["team"].choice
    probs = want["frustration"].probabilities
    assert value.frustration == max(range(3), key=lambda i: probs[str(i)])
    assert value.customer.angry == (want["customer.angry"].noul >= 0.5) and decision.abstained == set()


def test_abstaining_optional_fields_are_none_required_ones_are_listed(engine):
    decision = engine.decide(TICKET, Triage, min_confidence=1.0)  # nothing is that certain
    assert decision.value.kind is None and "kind" in decision.abstained
    assert decision.abstained == {"refund", "team", "frustration", "kind", "customer.angry"}
    assert decision.value.team in ("billing", "technical", "sales")  # required: kept, listed


def test_http_helpers_round_trip_through_the_servers_wire_format(engine):
    body = request_body(Triage, TICKET)
    assert set(body["questions"]) == {"refund", "team", "frustration", "kind", "customer.angry"}
    response = engine.request(body)  # what onepass serve returns for this body
    over_http = parse_response(Triage, response)
    assert over_http.value == engine.decide(TICKET, Triage).value
    with pytest.raises(InvalidRequest, match="no answer for refund"):
        parse_response(Triage, {"answers": {}})


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.9", True])
def test_min_confidence_outside_0_to_1_is_refused_by_name(bad):
    response = {"answers": {"refund": {"type": "noul", "noul": 0.9}}}

    class Refund(BaseModel):
        refund: bool = Field(description="Does the customer request a refund?")

    assert parse_response(Refund, response, min_confidence=0.5).value.refund is True  # control: a valid threshold
    with pytest.raises(InvalidRequest, match="min_confidence must be a number from 0 to 1") as err:
        parse_response(Refund, response, min_confidence=bad)
    assert err.value.field == "min_confidence"
