"""The prompt template and how questions become token ids.

Text is rendered as *pieces*: template text (trusted; special tokens such as
``<|im_end|>`` are recognised) and caller text (state, instructions, option
names and descriptions), in which special-token strings are encoded as plain
text so a caller can never close the template's turns.
"""

from __future__ import annotations

import functools
import string
from dataclasses import asdict, dataclass
from typing import Sequence

from tokenizers import Tokenizer

from .errors import InvalidRequest, NotText
from .questions import Choice, Noul, Question, Score, as_text, check_utf8
from .tree import QuestionTokens

Piece = tuple  # (text, trusted)


OLD_OPTION_LINE = "- {name}: {description}\n"  # the option line of older engines' manifests: see option_line


@dataclass(frozen=True)
class PromptTemplate:
    """How the state, a question and an answer are written for the model."""

    state: str = ("<|im_start|>system\nYou read a text and answer a question about it with one of the allowed "
                  "answers.<|im_end|>\n<|im_start|>user\nText:\n{state}\n\n")
    # chosen by measurement (benchmarks/results/readout_eval.md: "lead")
    question: str = "Question: {instructions}\n{hint}<|im_end|>\n<|im_start|>assistant\nAnswer:"
    answer: str = " {option}<|im_end|>"
    noul_hint: str = "Answer yes or no."
    choice_hint: str = "Options:\n{options}Answer with one option."
    # a described name stands alone on its line as an undescribed one does, its description indented under it: after
    # "- billing: payments" the model expects the name to go on, so " billing<|im_end|>" lost to bare names and the
    # README ticket answered sales when only billing was described (benchmarks/studies/results/option_descriptions.md)
    option_line: str = "- {name}\n  ({description})\n"
    option_line_bare: str = "- {name}\n"
    score_hint: str = "Answer in a few words."
    noul_yes_means: str = " Yes means: {text}."
    noul_no_means: str = " No means: {text}."
    noul_default: str = "Does the statement apply to the text?"
    choice_default: str = "Which option fits the text best?"
    score_default: str = "Which description fits the text best?"
    yes: str = "yes"
    no: str = "no"
    null_state: str = "N/A"

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, str):
                raise ValueError(f"prompt.{name} must be a string")
        for name, field_ in (("state", "{state}"), ("question", "{instructions}"), ("answer", "{option}")):
            if field_ not in getattr(self, name):
                raise ValueError(f"prompt.{name} must contain {field_}")


# Named prompt forms (`onepass export --prompt`). "chat" is the template's default above (a base model without an
# adapter asks in it); the default engine asks in "compact" (its adapter's card), which writes each
# question inside the user's turn, ending "Answer:" with no turn closed and opened, and no hint that only repeats
# what the options say ("Answer yes or no.", "Answer in a few words.", "Answer with one option."): 147 fewer packed
# tokens on the README ticket's 13 questions (421 -> 274). An adapter is trained for one form: its card records it,
# and export then writes that form (export/adapter.py: ``prompt_of``).
FORMS = {
    "chat": PromptTemplate(),
    "compact": PromptTemplate(question="Question: {instructions}\n{hint}Answer:", noul_hint="", score_hint="",
                              choice_hint="Options:\n{options}", noul_yes_means="Yes means: {text}.\n",
                              noul_no_means="No means: {text}.\n"),
}


def render(template: str, **values) -> list[Piece]:
    """Fill ``template``: literal text is trusted; str values are caller text; lists are pieces."""
    pieces: list[Piece] = []
    for literal, name, _, _ in string.Formatter().parse(template):
        if literal:
            pieces.append((literal, True))
        if name is not None:
            value = values[name]
            pieces.extend(value if isinstance(value, list) else [(value, False)])
    return pieces


class StateText(str):
    """A state's text as the engine reads it, already checked (what :func:`state_text` returns): a request's state is
    made text once, when it is parsed, and carried as this through grouping, the cache and the prefill."""

    __slots__ = ()


def state_text(state) -> StateText:
    """A state as text: strings as they are, JSON values serialised canonically (sorted keys); checked (UTF-8, not
    empty) once: a StateText is returned as it is."""
    if isinstance(state, StateText):
        return state
    if isinstance(state, bytes):
        try:
            state = state.decode("utf-8")
        except UnicodeDecodeError as err:
            raise NotText(f"the state is not valid UTF-8 (byte {err.start}); send UTF-8 text", "state") from None
    if isinstance(state, str):
        text = state
    else:
        try:
            text = as_text(state)
        except RecursionError:
            raise InvalidRequest("the state is nested too deeply to serialise", "state") from None
        except (TypeError, ValueError) as err:
            raise InvalidRequest(f"the state must be a string or JSON-serialisable: {err}", "state") from None
    check_utf8(text, "the state", "state")
    if not text.strip():
        raise InvalidRequest("the state must not be empty", "state")
    return StateText(text)


COUNT_CHUNK = 16384  # characters tokenised at a time when counting a long text against a limit
BOUNDARY_SLACK = 4  # tokens a cut at whitespace can change the count by, at most
MEMO_MAX_CHARS = 64  # caller texts up to this length (option names, yes/no) have their token ids memoised
MEMO_ENTRIES = 4096  # per memo; when full it is cleared, so its memory stays bounded


class PromptEncoder:
    """Turns states and questions into token ids with the engine's tokenizer and template."""

    def __init__(self, tokenizer_path: str, template: PromptTemplate):
        self.template = template
        self._trusted = Tokenizer.from_file(tokenizer_path)
        self._untrusted = Tokenizer.from_file(tokenizer_path)
        self._untrusted.encode_special_tokens = True
        self._trusted_memo: dict[str, tuple] = {}  # text -> ids; dict get/set are atomic under the GIL
        self._untrusted_memo: dict[str, tuple] = {}

    @functools.cached_property
    def token_chars(self) -> int:
        """The most characters one token covers (in the byte-level vocabulary, a character is a byte): a text of
        more than ``limit * token_chars`` characters is more than ``limit`` tokens, known without tokenising it."""
        return max(len(token) for token in self._untrusted.get_vocab())

    def longer_than(self, text: str, limit: int) -> bool:
        """Whether ``text`` is more than ``limit`` tokens by its length alone (no tokenising; False when unsure)."""
        return len(text) > limit * self.token_chars

    def surely_over(self, text: str, limit: int) -> bool:
        """True when ``text`` is certainly more than ``limit`` tokens, found without tokenising all of it.

        A long text is tokenised in pieces cut at whitespace, stopping as soon as the count passes
        the limit plus a margin for the pieces' boundaries (a cut can change the count by a few
        tokens, never more): the work is bounded by the limit, not by the text's length.
        """
        if len(text) <= COUNT_CHUNK:
            return False
        if self.longer_than(text, limit):
            return True
        count, pieces, start = 0, 0, 0
        while start < len(text):
            end = min(len(text), start + COUNT_CHUNK)
            if end < len(text):
                half = start + COUNT_CHUNK // 2
                cut = max(text.rfind(" ", half, end), text.rfind("\n", half, end))
                end = cut if cut > start else end
            count += len(self._untrusted.encode(text[start:end], add_special_tokens=False).ids)
            pieces += 1
            if count > limit + BOUNDARY_SLACK * pieces:
                return True
            start = end
        return False

    def encode(self, pieces: Sequence[Piece]) -> list[int]:
        """Token ids of pieces; adjacent pieces of one kind are encoded together."""
        ids: list[int] = []
        merged: list[list] = []
        for text, trusted in pieces:
            if merged and merged[-1][1] == trusted:
                merged[-1][0] += text
            else:
                merged.append([text, trusted])
        for prev, nxt in zip(merged, merged[1:]):  # "Question: " + "Is ..." tokenizes as "Question:" + " Is ..."
            if prev[1] and not nxt[1]:
                stripped = prev[0].rstrip(" ")
                nxt[0] = prev[0][len(stripped):] + nxt[0]
                prev[0] = stripped
        for text, trusted in merged:
            if text:
                ids += self._encode_trusted(text) if trusted else self._encode_untrusted(text)
        return ids

    def _encode_trusted(self, text: str) -> tuple:
        """Template text, special tokens recognised. Memoised: it only ever comes from the template's literals."""
        return self._memo(self._trusted_memo, self._trusted, text)

    def _encode_untrusted(self, text: str) -> tuple:
        """Caller text, special-token strings kept as plain text; short texts (option names, yes/no) memoised."""
        if len(text) > MEMO_MAX_CHARS:
            return self._untrusted.encode(text, add_special_tokens=False).ids
        return self._memo(self._untrusted_memo, self._untrusted, text)

    @staticmethod
    def _memo(memo: dict, tok: Tokenizer, text: str) -> tuple:
        ids = memo.get(text)
        if ids is None:
            ids = tuple(tok.encode(text, add_special_tokens=False).ids)
            if len(memo) >= MEMO_ENTRIES:  # bounded: a hostile stream of distinct names cannot grow it
                memo.clear()
            memo[text] = ids
        return ids

    def state(self, text: str) -> list[int]:
        """The state segment's token ids."""
        return self.encode(render(self.template.state, state=text))

    def options(self, question: Question) -> list[str]:
        """The answer texts scored for a question, in the order the caller gave."""
        if isinstance(question, Noul):
            return [self.template.yes, self.template.no]
        return [as_text(o) for o in question.criteria]

    def hint(self, question: Question) -> list[Piece]:
        """The line under the question: what kind of answer is expected.

        Choice options are listed sorted by name, so the order a caller gives them
        in never changes an answer. Score levels are never listed: each level is
        judged on its own, with no numbers and no neighbours visible.
        """
        t = self.template
        if isinstance(question, Noul):
            crit = question.criteria or {}
            pieces = render(t.noul_hint)
            for key, line in (("true", t.noul_yes_means), ("false", t.noul_no_means)):
                if key in crit:
                    pieces += render(line, text=as_text(crit[key]))
            return pieces
        if isinstance(question, Score):
            return render(t.score_hint)
        lines: list[Piece] = []
        for name in sorted(question.criteria):
            desc = question.criteria[name]
            lines += (render(t.option_line, name=name, description=as_text(desc)) if desc is not None
                      else render(t.option_line_bare, name=name))
        return render(t.choice_hint, options=lines)

    def instructions(self, question: Question) -> str:
        """The question's instructions as text, or the template's default for its type."""
        if question.instructions is not None:
            return as_text(question.instructions)
        return {"noul": self.template.noul_default, "choice": self.template.choice_default,
                "score": self.template.score_default}[question.type]

    def caller_text(self, question: Question) -> str:
        """The caller's text in a question (instructions, option names, descriptions), for limit checks."""
        parts = [self.instructions(question), *self.options(question)]
        if isinstance(question, Choice):
            parts += [as_text(d) for d in question.criteria.values() if d is not None]
        elif isinstance(question, Noul) and question.criteria:
            parts += [as_text(v) for v in question.criteria.values()]
        return " ".join(parts)

    def question(self, question: Question) -> QuestionTokens:
        """Trunk and option token ids of one question."""
        trunk = self.encode(render(self.template.question, instructions=self.instructions(question),
                                   hint=self.hint(question)))
        opts = tuple(tuple(self.encode(render(self.template.answer, option=o))) for o in self.options(question))
        return QuestionTokens(tuple(trunk), opts)
