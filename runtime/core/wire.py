"""The TypeSafe System One wire: a request body parsed once into (state, questions), and a result as a response body.

Every check of a request's form and values is here; InvalidRequest names the field (the server's 422 detail).
"""

from __future__ import annotations

from typing import Mapping

from .errors import InvalidRequest
from .prompt import state_text
from .questions import check_visible, distinct, from_wire

MAX_QUESTION_ID_CHARS = 256


def check_question_id(qid) -> None:
    """A question id is non-empty text of at most MAX_QUESTION_ID_CHARS that UTF-8 can encode."""
    if not isinstance(qid, str) or not qid:
        raise InvalidRequest("question ids must be non-empty strings", "questions")
    if len(qid) > MAX_QUESTION_ID_CHARS:
        raise InvalidRequest(f"a question id is {len(qid)} characters; at most {MAX_QUESTION_ID_CHARS} are allowed",
                             "questions")
    try:
        qid.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequest(f"a question id is not valid UTF-8 text (character {err.start}); send UTF-8 text",
                             "questions") from None
    check_visible(qid, "a question id", "questions")


def parse_request(body: Mapping) -> tuple:
    """(state text, {id: Question}) of a TypeSafe System One request body: the one parse of a request (the server's
    too), every check of its form and values; InvalidRequest names the field (NotText for a state of bytes that are
    not UTF-8)."""
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    if "state" not in body:
        raise InvalidRequest("the request has no state", "state")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string (or left out: the default engine answers)", "model")
    if not isinstance(body["state"], (str, bytes, Mapping, list)):  # bytes: from Python (UTF-8 checked later)
        raise InvalidRequest("the state must be text, or JSON: an object or an array", "state")
    raw = body.get("questions")
    if not isinstance(raw, Mapping) or not raw:
        raise InvalidRequest("questions must be a non-empty object of id -> question", "questions")
    if body.get("assets") is not None and not isinstance(body["assets"], Mapping):
        raise InvalidRequest("assets must be an object (and empty: this engine reads text only)", "assets")
    if body.get("assets"):
        raise InvalidRequest("assets (images) need a vision model; this engine reads text only", "assets")
    for qid in raw:
        check_question_id(qid)
    distinct(list(raw), "question ids", "questions")
    questions = {qid: from_wire(qid, q) for qid, q in raw.items()}
    return state_text(body["state"]), questions  # the state's text once: grouping and the engine read it as it is


def response_body(body: Mapping, name: str, result) -> dict:
    """The TypeSafe System One response for an engine Result."""
    return {
        "model": body.get("model") or name,
        "answers": {qid: a.to_wire() for qid, a in result.answers.items()},
        "usage": {"input_tokens": int(result.input_tokens), "output_tokens": 0},
    }
