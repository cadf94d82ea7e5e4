"""Gates and cascades (runtime/core/cascade.py) with stand-in engines that count what they are asked."""

import pytest

from onepass.runtime.core.cascade import Cascade, Gate
from onepass.runtime.core.errors import InvalidRequest
from onepass.runtime.core.questions import ChoiceAnswer, NoulAnswer


class CountingEngine:
    """Answers from a fixed table; records every (state, question ids) it is asked."""

    def __init__(self, name, table):
        self.name, self.table, self.calls = name, table, []

    def ask(self, state, questions):
        self.calls.append((state, sorted(questions)))
        return {q: self.table[q] for q in questions}


def choice(p):  # a 2-option choice with p on "a": confidence |2p - 1|
    return ChoiceAnswer("a" if p >= 0.5 else "b", {"a": p, "b": 1 - p}, abs(2 * p - 1))


FAST = {"sure": NoulAnswer(0.97), "unsure": NoulAnswer(0.55), "pick": choice(0.6), "clear": choice(0.99)}
STRONG = {"unsure": NoulAnswer(0.1), "pick": choice(0.95), "sure": NoulAnswer(0.0), "clear": choice(0.0)}


def test_gate_splits_by_confidence_with_per_question_thresholds():
    decided, review = Gate(0.8).split(FAST)
    assert set(decided) == {"sure", "clear"} and set(review) == {"unsure", "pick"}
    decided, review = Gate(0.8, per_question={"pick": 0.1, "sure": 0.99}).split(FAST)
    assert set(decided) == {"clear", "pick"} and set(review) == {"unsure", "sure"}
    with pytest.raises(InvalidRequest, match="min_confidence must be a number within 0..1"):
        Gate(1.5)


def test_cascade_re_asks_only_what_is_below_the_threshold_about_the_same_state():
    fast, strong = CountingEngine("fast", FAST), CountingEngine("strong", STRONG)
    result = Cascade([fast, strong], min_confidence=0.8).ask("the state", dict.fromkeys(FAST))
    assert fast.calls == [("the state", ["clear", "pick", "sure", "unsure"])]
    assert strong.calls == [("the state", ["pick", "unsure"])]  # only the doubtful two
    assert result.answered_by == {"sure": "fast", "unsure": "strong", "pick": "strong", "clear": "fast"}
    assert result.answers["unsure"] is STRONG["unsure"] and result.answers["sure"] is FAST["sure"]
    assert list(result.answers) == list(FAST)  # the caller's order


def test_the_last_engine_answers_even_below_the_threshold_and_sure_answers_stop_early():
    fast, strong = CountingEngine("fast", FAST), CountingEngine("strong", {"unsure": NoulAnswer(0.6)})
    result = Cascade([fast, strong], min_confidence=0.9).ask("s", {"unsure": None})
    assert result.answered_by == {"unsure": "strong"} and result.answers["unsure"].noul == 0.6
    fast2, strong2 = CountingEngine("fast", FAST), CountingEngine("strong", STRONG)
    Cascade([fast2, strong2], min_confidence=0.5).ask("s", {"sure": None, "clear": None})
    assert strong2.calls == []  # nothing doubtful: the strong engine is never asked
    with pytest.raises(InvalidRequest, match="at least two engines"):
        Cascade([fast], min_confidence=0.5)


@pytest.mark.slow
def test_a_cascade_of_real_engines_equals_asking_each_engine(engine):
    """Two real engines (the same one under two names): the answers are the first engine's where it is sure and
    the second's otherwise, exactly as asking each alone."""
    from onepass import Choice, Noul

    class Named:
        def __init__(self, name):
            self.name = name

        def ask(self, state, questions):
            return engine.ask(state, questions)

    questions = {"r": Noul("Does the customer want a refund?"),
                 "t": Choice("Which team?", {"billing": None, "technical": None, "sales": None})}
    state = "I was charged twice and want my money back."
    alone = engine.ask(state, questions)
    gate = Gate(0.0, per_question={"t": 1.0})  # r is always decided by the first engine, t never
    result = Cascade([Named("first"), Named("second")], gate=gate).ask(state, questions)
    assert result.answered_by == {"r": "first", "t": "second"} and result.asked == [["r", "t"], ["t"]]
    assert result.answers["r"].to_wire() == alone["r"].to_wire()  # the same pass: bit for bit
    t = engine.ask(state, {"t": questions["t"]})["t"]  # asked alone, as the second engine was
    assert result.answers["t"].to_wire() == t.to_wire()
    assert result.answers["t"].probabilities == pytest.approx(alone["t"].probabilities, abs=1e-4)  # packed == alone
