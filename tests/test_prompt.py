"""The prompt encoder's memo of short texts' token ids: the same ids as tokenising every piece afresh, trust kept
apart (a caller's "<|im_end|>" never reuses the template's special token), memory bounded."""

from __future__ import annotations

import random

import pytest

from onepass.runtime.core import prompt
from onepass.runtime.core.prompt import PromptEncoder, PromptTemplate
from onepass.runtime.core.questions import Choice, Noul, Score

SPECIALS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")
WORDS = ["billing", "technical", "yes", "no", "refund", "积极", "fraud review", "x" * 80, *SPECIALS]


def _fresh(monkeypatch, tokenizer_path) -> PromptEncoder:
    """The reference: every piece tokenised afresh, nothing memoised."""
    monkeypatch.setattr(PromptEncoder, "_memo", staticmethod(
        lambda memo, tok, text: tuple(tok.encode(text, add_special_tokens=False).ids)))
    return PromptEncoder(tokenizer_path, PromptTemplate())


def _questions(rng: random.Random, n: int) -> list:
    out = []
    for i in range(n):
        names = rng.sample(WORDS, rng.randint(2, 5))
        kind = i % 3
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        if kind == 0:
            out.append(Noul(f"Is it {text}?", {"true": rng.choice(WORDS)} if rng.random() < 0.3 else None))
        elif kind == 1:
            out.append(Choice(f"Which {text}?", {n_: rng.choice([None, *WORDS]) for n_ in names}))
        else:
            out.append(Score(f"How {text}?", names))
    return out


@pytest.fixture(scope="module")
def tokenizer_path(tiny_engine_dir) -> str:
    return str(tiny_engine_dir / "tokenizer.json")


def test_memoised_ids_equal_tokenising_every_piece_afresh(tokenizer_path, monkeypatch):
    questions = _questions(random.Random(3), 300)
    memo = PromptEncoder(tokenizer_path, PromptTemplate())
    first = [memo.question(q) for q in questions]
    again = [memo.question(q) for q in questions]  # served from the memo
    fresh = _fresh(monkeypatch, tokenizer_path)
    want = [fresh.question(q) for q in questions]
    assert first == want and again == want
    assert memo._untrusted_memo and memo._trusted_memo  # the memo was really used
    assert not fresh._untrusted_memo and not fresh._trusted_memo  # ... and the reference really bypassed it


def test_a_callers_special_token_string_is_plain_text_even_after_the_template_used_it(tokenizer_path):
    """The template's trusted "<|im_end|>" is memoised first; a caller's state or option "<|im_end|>" must still be
    plain text. Control: one memo shared by both kinds of text hands the caller the special token."""
    from tokenizers import Tokenizer

    end = Tokenizer.from_file(tokenizer_path).token_to_id("<|im_end|>")

    def ends(enc) -> tuple:
        enc.question(Noul("Is it ok?"))  # the template's "<|im_end|>" is now memoised as trusted text
        state = enc.state("<|im_end|>")
        option = enc.question(Choice("Which?", {"<|im_end|>": None, "other": None})).options[0]
        return state.count(end), option.count(end)

    assert ends(PromptEncoder(tokenizer_path, PromptTemplate())) == (1, 1)  # only the template's own end of turn
    shared = PromptEncoder(tokenizer_path, PromptTemplate())
    shared._untrusted_memo = shared._trusted_memo  # the bug the control stands for
    assert ends(shared)[0] == 2


def test_the_memo_stays_bounded_under_a_stream_of_distinct_names(tokenizer_path, monkeypatch):
    monkeypatch.setattr(prompt, "MEMO_ENTRIES", 50)
    enc = PromptEncoder(tokenizer_path, PromptTemplate())
    fresh = PromptEncoder(tokenizer_path, PromptTemplate())
    for i in range(400):
        q = Choice("Which?", {f"name {i}": None, f"other {i}": None})
        assert enc.question(q) == fresh.question(q)
        assert len(enc._untrusted_memo) <= 50 and len(enc._trusted_memo) <= 50
    long = "word " * 40  # longer than MEMO_MAX_CHARS: never memoised
    enc.question(Noul(long))
    assert long not in enc._untrusted_memo and f" {long}" not in enc._untrusted_memo


def test_the_compact_form_asks_the_same_question_in_fewer_tokens(tokenizer_path):
    """``FORMS["compact"]`` (issue 46): the caller's instructions, option names and descriptions reach the model as in
    ``chat``; the options scored are the same token ids; no turn is closed and opened, no hint repeated: fewer packed
    tokens on the README ticket's questions. Control: the chat form's trunk closes the user's turn."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer

    from onepass.runtime.core.questions import from_wire
    from onepass.runtime.core.tree import pack

    tok = Tokenizer.from_file(tokenizer_path)
    qs = [from_wire(k, v) for k, v in json.loads((Path(__file__).parent / "data" / "questions.json").read_text()).items()]
    chat, compact = (PromptEncoder(tokenizer_path, prompt.FORMS[f]) for f in ("chat", "compact"))
    turns = {tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")}
    assert prompt.FORMS["chat"] == PromptTemplate()
    for q in qs + _questions(random.Random(5), 60):
        a, b = chat.question(q), compact.question(q)
        assert a.options == b.options
        text = tok.decode(list(b.trunk), skip_special_tokens=False)
        assert not turns & set(b.trunk) and text.endswith("\nAnswer:")  # a caller's "<|im_end|>" is plain text
        assert turns <= set(a.trunk)
        for part in [chat.instructions(q), *(chat.options(q) if isinstance(q, Choice) else [])]:
            assert part in text
    described = Noul("Is it fraud?", {"true": "money taken", "false": "anything else"})
    assert tok.decode(list(compact.question(described).trunk), skip_special_tokens=False) == (
        "Question: Is it fraud?\nYes means: money taken.\nNo means: anything else.\nAnswer:")
    packed = {f: pack([enc.question(q) for q in qs], 100).num_tokens for f, enc in (("chat", chat), ("compact", compact))}
    assert packed["compact"] < 0.8 * packed["chat"], packed


def test_an_export_that_asks_unlike_its_adapter_says_so(caplog):
    """Exporting an adapter with another prompt form or read-out than its card records warns, naming both forms;
    the adapter's own form and read-out (or none given: the export takes the card's) stay silent."""
    import logging

    from onepass.export.build import _warn_unlike_training
    from onepass.runtime.core import manifest as mf
    from onepass.runtime.core.prompt import FORMS

    with caplog.at_level(logging.WARNING, logger="onepass.export.build"):
        _warn_unlike_training(["adapters/x"], FORMS["chat"], FORMS["chat"], "sum", mf.Scoring("sum"))
        _warn_unlike_training(["adapters/x"], FORMS["chat"], None, "sum", None)
        _warn_unlike_training([], None, FORMS["compact"], None, mf.Scoring("mean"))  # no adapter: nothing to contradict
        assert caplog.records == []
        _warn_unlike_training(["adapters/x"], FORMS["chat"], FORMS["compact"], "sum", mf.Scoring("mean"))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "trained in the chat prompt form" in messages[0] and "the compact form" in messages[0]
    assert "'sum' read-out" in messages[1] and "reads out 'mean'" in messages[1]
