"""Question validation: every bad input gets a typed error that names the rule."""

import json

import pytest

from onepass.runtime.core.errors import InvalidRequest
from onepass.runtime.core.questions import Choice, Noul, Score, from_wire, to_wire
from onepass.runtime.core.readout import answer, confidence

import numpy as np


@pytest.mark.parametrize("make, match", [
    (lambda: Noul(""), "instructions must not be empty"),
    (lambda: Noul("   "), "instructions must not be empty"),
    (lambda: Noul(None), "needs instructions or criteria"),
    (lambda: Noul(42), "instructions must be a string, a JSON object or array, or null; got int"),
    (lambda: Noul({}), "instructions must not be empty"),
    (lambda: Noul("ok", {"maybe": "x"}), "optional keys 'true' and 'false'"),
    (lambda: Noul(None, {"true": " "}), "criteria.true must not be empty"),
    (lambda: Choice("Pick", {}), "at least 2 options"),
    (lambda: Choice("Pick", {"a": None}), "at least 2 options"),
    (lambda: Choice("Pick", {"a": None, " ": None}), "option name must not be empty"),
    # answers name options as sent: a name the model would read trimmed is refused, never answered under another name
    (lambda: Choice("Pick", {"a": None, "a ": None}), "option name 'a ' begins or ends with whitespace"),
    (lambda: Choice("Pick", {"billing": None, "\u00a0sales": None}), "begins or ends with whitespace"),
    (lambda: Choice("Pick", ["a", "a"]), "appears twice"),
    (lambda: Choice("Pick", {"billing\n- sales": None, "x": None}), "control character U\\+000A at position 7"),
    (lambda: Choice("Pick", {"a\x00": None, "b": None}), "control character U\\+0000"),
    (lambda: Score("How?", ["low", "high "]), "level 1 'high ' begins or ends with whitespace"),
    (lambda: Choice("Pick", {"a": "", "b": None}), "description of option 'a' must not be empty"),
    (lambda: Choice("Pick", "a,b"), "criteria must map option names"),
    (lambda: Score("How?", ["low"]), "2 to 10 levels, got 1"),
    (lambda: Score("How?", [str(i) for i in range(11)]), "2 to 10 levels, got 11"),
    (lambda: Score("How?", []), "2 to 10 levels, got 0"),
    (lambda: Score("How?", ["low", "low"]), "levels must differ"),
    (lambda: Score("How?", "low,high"), "list of level descriptions"),
    (lambda: Noul("bad \ud800 text"), "not valid UTF-8"),
    (lambda: Choice("Pick", {"ok": None, "bad\udcff": None}), "not valid UTF-8"),
])
def test_invalid_questions(make, match):
    with pytest.raises(InvalidRequest, match=match):
        make()


@pytest.mark.parametrize("body, match, field", [
    ({"type": "maybe", "instructions": "x"}, "unknown question type 'maybe'", "questions.q.type"),
    ({"instructions": "x"}, "unknown question type None", "questions.q.type"),
    ("not an object", "must be an object", "questions.q"),
    ({"type": "noul", "instructions": "x", "criteria": {"a": None}}, "optional keys", "questions.q.criteria"),
    ({"type": "noul"}, "needs instructions or criteria", "questions.q.instructions"),
    ({"type": "box", "instructions": "the cat"}, "box questions need a vision model", "questions.q.type"),
    ({"type": "choice", "instructions": "x"}, "at least 2 options", "questions.q.criteria"),
    ({"type": "score", "instructions": "x", "criteria": ["a"]}, "2 to 10 levels", "questions.q.criteria"),
    ({"type": "score", "instructions": "", "criteria": ["a", "b"]}, "must not be empty", "questions.q.instructions"),
])
def test_wire_questions_name_the_field(body, match, field):
    with pytest.raises(InvalidRequest, match=match) as info:
        from_wire("q", body)
    assert info.value.field == field


def test_answers_follow_the_system_one_semantics():
    assert confidence(np.array([0.25, 0.25, 0.25, 0.25])) == pytest.approx(0.0)
    assert confidence(np.array([1.0, 0.0])) == pytest.approx(1.0)
    assert confidence(np.array([0.6, 0.2, 0.2])) == pytest.approx((3 * 0.6 - 1) / 2)
    s = answer(Score("How?", ["low", "mid", "high"]), np.array([0.2, 0.3, 0.5]))
    assert s.score == pytest.approx(0 * 0.2 + 1 * 0.3 + 2 * 0.5)
    assert s.legend == {"0": "low", "1": "mid", "2": "high"} and list(s.probabilities) == ["0", "1", "2"]
    c = answer(Choice("Pick", {"b": None, "a": "first"}), np.array([0.3, 0.7]))
    assert c.choice == "a" and c.probabilities == {"b": 0.3, "a": 0.7}
    assert answer(Noul("Yes?"), np.array([0.8, 0.2])).noul == pytest.approx(0.8)
    wire = c.to_wire()
    assert wire["type"] == "choice" and set(wire) == {"type", "choice", "probabilities", "confidence"}


def test_wire_shapes_of_the_official_format_are_accepted():
    """Instructions and descriptions may be JSON; noul may carry true/false criteria; instructions may be absent."""
    n = from_wire("q", {"type": "noul", "instructions": {"task": "spam?"},
                        "criteria": {"true": "unsolicited advertising", "false": None}})
    assert n.instructions == {"task": "spam?"} and n.criteria == {"true": "unsolicited advertising"}
    c = from_wire("q", {"type": "choice", "criteria": {"angry": {"tone": "hostile"}, "calm": None}})
    assert c.instructions is None and c.criteria["angry"] == {"tone": "hostile"}
    s = from_wire("q", {"type": "score", "criteria": ["Can wait", {"level": "today"}]})
    assert answer(s, np.array([0.5, 0.5])).legend == {"0": "Can wait", "1": {"level": "today"}}


@pytest.mark.parametrize("question", [
    Noul("Is it spam?"), Noul(criteria={"true": "asks for money"}), Choice("Team?", ["billing", "tech"]),
    Choice("Team?", {"billing": "payments", "tech": None}), Score("Urgency?", ["low", {"level": "high"}])],
    ids=lambda q: q.type)
def test_to_wire_is_the_inverse_of_from_wire(question):
    assert from_wire("q", json.loads(json.dumps(to_wire(question)))) == question


@pytest.mark.parametrize("body, message", [
    ({"a\u200bb": {"type": "noul", "instructions": "Is it?"}}, "invisible character U\\+200B"),
    ({"\u00e9": {"type": "noul", "instructions": "Is it?"}, "e\u0301": {"type": "noul", "instructions": "Or?"}},
     "same text after Unicode normalisation"),
    ({"q": {"type": "choice", "instructions": "Which?", "criteria": {"\u00e9": None, "e\u0301": None}}},
     "same text after Unicode normalisation"),
    ({"q": {"type": "choice", "instructions": "Which?", "criteria": {"bill\u200bing": None, "billing": None}}},
     "invisible character U\\+200B"),
    ({"a\u3164": {"type": "noul", "instructions": "Is it?"}, "a": {"type": "noul", "instructions": "Or?"}},
     "but for characters that display as nothing"),
    ({"q": {"type": "choice", "instructions": "Which?", "criteria": {"a\ufe0f": None, "a": None}}},
     "but for characters that display as nothing"),
    ({"q": {"type": "choice", "instructions": "Which?", "criteria": {"\u3164": None, "a": None}}},
     "made only of characters that display as nothing"),
    ({"a\x00": {"type": "noul", "instructions": "Is it?"}}, "control character U\\+0000"),
    ({"a\nb": {"type": "noul", "instructions": "Is it?"}}, "control character U\\+000A"),
])
def test_ids_and_option_names_that_look_the_same_are_refused(body, message):
    """Two question ids or option names that differ only by a zero-width character, or only in Unicode
    normalisation, would be different keys that look identical to a reader: refused with the reason. The
    control: an accented name in its one form is accepted."""
    from onepass.runtime.core.wire import parse_request

    with pytest.raises(InvalidRequest, match=message):
        parse_request({"state": "s", "questions": body})
    _, questions = parse_request({"state": "s", "questions": {
        "caf\u00e9": {"type": "choice", "instructions": "Which?", "criteria": {"caf\u00e9": None, "tea": None}}}})
    assert list(questions["caf\u00e9"].criteria) == ["caf\u00e9", "tea"]
    _, questions = parse_request({"state": "s", "questions": {  # an emoji's variation selector inside a name: fine
        "q": {"type": "choice", "instructions": "Which?", "criteria": {"\u2764\ufe0f": None, "tea": None}}}})
    assert list(questions["q"].criteria) == ["\u2764\ufe0f", "tea"]


def test_the_ignorable_table_is_unicodes_default_ignorable_code_points():
    """questions.IGNORABLE is a hand-kept table (Python's unicodedata has no property lookup): checked code point by
    code point against the regex package's \\p{Default_Ignorable_Code_Point} (installed with transformers)."""
    regex = pytest.importorskip("regex")
    from onepass.runtime.core.questions import ignorable

    every = "".join(chr(cp) for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF)
    expected = set(regex.findall(r"\p{Default_Ignorable_Code_Point}", every))
    assert expected and {ch for ch in every if ignorable(ch)} == expected


@pytest.mark.parametrize("key, meant", [("Task", "task"), ("tasks", "task"), ("Criteria", "criteria"),
                                        ("criterias", "criteria"), ("instruction", "instructions"),
                                        ("intructions", "instructions"), ("tpye", "type")])
def test_a_near_miss_of_a_question_key_is_refused_naming_the_key_meant(key, meant):
    """A misspelt key was ignored silently (the question was answered without its task or criteria): another case,
    a plural or singular, one edit or swap of a known key is a 422 naming the key meant and the field. Control: a key
    unlike any (an id a client adds) is still left alone."""
    from onepass.runtime.core.errors import InvalidRequest
    from onepass.runtime.core.questions import from_wire

    body = {"type": "noul", "instructions": "Is it late?", key: "x"}
    if key == "tpye":
        body = {"tpye": "noul", "type": "noul", "instructions": "Is it late?"}
    with pytest.raises(InvalidRequest, match=f"unknown key '{key}'; did you mean '{meant}'") as err:
        from_wire("q", body)
    assert err.value.field == f"questions.q.{key}"
    assert from_wire("q", {"type": "noul", "instructions": "Is it late?", "note": "x"}).instructions == "Is it late?"
