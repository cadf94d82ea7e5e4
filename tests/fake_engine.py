"""An engine without a model for the dispatcher's and admission's tests: ``prepare`` and ``run_group`` only.

A word is a token: a state's ids are its words' numbers in a vocabulary the engine grows, a question costs its
instruction's words plus two tokens an option, so sizes are known exactly and the tests run in milliseconds (the real-engine tests stay for what only
they can show: merged passes equal to alone, the stage clocks)."""

from __future__ import annotations

from onepass.runtime.core.planner import Prepared
from onepass.runtime.core.prompt import state_text


class FakeEngine:
    """Answers every request with its state's text; subclasses change ``run_group``."""

    def __init__(self):
        self.calls: list = []  # the size of each group handed to run_group
        self.words: dict = {}  # word -> token id

    def prepare(self, state, questions) -> Prepared:
        ids = tuple(self.words.setdefault(w, len(self.words)) for w in str(state_text(state)).split() or [""])
        packed = sum(len(str(q.instructions).split()) + 2 * len(getattr(q, "criteria", None) or "yn")
                     for q in questions.values())
        return Prepared(questions, tuple(questions.values()), ids, packed, 1)

    def run_group(self, prepared: list, readout=None, deadline=None) -> list:
        self.calls.append(len(prepared))
        return [self.text(p) for p in prepared]

    def text(self, prepared: Prepared) -> str:
        """The state's words back from its ids."""
        names = {i: w for w, i in self.words.items()}
        return " ".join(names[i] for i in prepared.ids)
