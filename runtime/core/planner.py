"""Planning a request: its questions compiled into a question set once (checked, tokenised, packed and laid out for any
state: :mod:`onepass.runtime.core.question_set`), its state tokenised, the set placed after the state and sized —
once, before it queues, and without the model (:meth:`Planner.prepare` gives a :class:`Prepared`).

Where a request is prepared: ``onepass serve`` parses and prepares it in the thread pool, ``AsyncEngine`` in a worker
thread, ``Engine.run_many`` before grouping; the engine thread then only looks up or prefills the state, runs the
passes the request carries (joined with other requests' about the same state), and reads out. A question set asked
again is found by its content (a bounded LRU) and not tokenised or packed again: per ask the host adds the state's
length to its positions and checks the limits that depend on the state. A prepared request's size is exact (its
packed tokens, counted on the trie), so admission needs no estimate.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..backends.batch import PackedBatch, with_mask
from .errors import InvalidRequest, LimitExceeded, cut
from .prompt import PromptEncoder, state_text
from .question_set import KEEP_MASK_BYTES, CompiledPass, QuestionSet, content_key, layout_of, option_map
from .questions import Question
from .state_cache import ByteLru
from .tree import QuestionTokens, TooManyTokens, blocks, option_groups, pack, packed_size
from .wire import check_question_id

MAX_ENCODED_FACTOR = 4  # questions' tokens before prefix sharing, as a multiple of the request's packed limit


QUESTION_SETS_MIB = 32  # compiled question sets kept per engine, by the bytes of their arrays (a 13-question set: ~0.1 MiB)


@dataclass(frozen=True)
class Prepared:
    """One request, checked, tokenised, planned and sized: what the engine thread needs and nothing it must redo.

    ``question_set`` is the request's questions compiled (found again by content when it was asked before), and
    ``plan`` its passes placed after this state (a ``PackedBatch`` per pass of the set): the engine thread runs them
    as they are. ``ids`` (the state's token ids, template included) are the state's one identity: requests with equal
    ids share a pass, and the state cache is keyed by them. ``key`` is a digest of them, made once where the request is
    prepared: the dispatcher looks requests up by it on the event loop, where hashing a 7,000-token tuple again on
    every lookup cost ~35 us each. ``state`` is the prefilled state when the caller gave one (``Engine.state``),
    else None."""

    questions: Mapping[str, Question]
    question_set: QuestionSet | None
    ids: tuple
    packed_tokens: int  # over the request's own passes, exactly as they will be packed alone
    passes: int
    plan: tuple = ()
    state: object = None
    timings: dict = field(default_factory=dict)  # milliseconds: tokenize, and pack (the planning)
    # work in token-equivalents (Planner.work: tokens through the weights plus attention entries at their FLOP
    # cost): the request's passes, its state's prefill (None: the bare token counts), and the prefill of its long
    # questions' trunks onto the state, cached under ``trunks`` (the joint token ids) once done
    work: float | None = None
    state_work: float | None = None
    trunk_work: float = 0.0
    trunks: tuple = ()
    key: bytes = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "key", getattr(self.state, "key", None) or ids_key(self.ids))
        if self.work is None:
            object.__setattr__(self, "work", float(self.packed_tokens))
        if self.state_work is None:
            object.__setattr__(self, "state_work", float(self.state_tokens))

    @property
    def state_tokens(self) -> int:
        return len(self.ids)

    @property
    def encoded(self) -> tuple:
        """The questions' token ids (``QuestionTokens``), in the request's order."""
        return self.question_set.encoded


def ids_key(ids) -> bytes:
    """The digest a state's token ids are known by (``Prepared.key``, ``State.key``)."""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


def entries_per_token(hidden_size: int) -> float:
    """Attention entries (query x key pairs) that cost as many FLOPs as one token through a block's weight GEMMs:
    a llama-style block holds ~10 d^2 weights (the attention projections and a gated MLP of ~8/3 d), 20 d^2 FLOPs a
    token, and an entry costs 4 d (scores and values over every head). So 5 d: 2,880 for SmolLM2 (d = 576), where a
    fit of prefill times on a 2-core EPYC (300 to 4,200 tokens, OpenVINO) gave 2,834."""
    return 5.0 * hidden_size


def trunk_state_ids(state_ids: tuple, question: QuestionTokens) -> tuple:
    """The token ids a long question's trunk (all but its last token) prefilled onto a state is cached under: what
    ``States.extended`` prefills and admission looks up."""
    return tuple(state_ids) + tuple(question.trunk[:-1])


def causal_entries(tokens: int, past: int, chunk: int) -> int:
    """Attention entries a causal prefill of ``tokens`` after ``past`` computes in chunks of at most ``chunk``: each
    chunk attends densely to everything before it and to itself."""
    total, done = 0, 0
    while done < tokens:
        size = min(chunk, tokens - done)
        total += size * (past + done + size)
        done += size
    return total


SIGHTED = 4096  # question sets remembered (by a hash of their content) as compiled once


class Sighted:
    """The question sets compiled once lately, by a hash of their content: a set is cached the second time it is
    compiled, so a stream of one-off sets (every request a new wording) neither evicts the sets a service asks
    again and again nor spends the cache's bookkeeping on itself. A hash collision only caches a set early."""

    def __init__(self, size: int = SIGHTED):
        self.size, self._hashes, self._lock = size, collections.OrderedDict(), threading.Lock()

    def again(self, key: tuple) -> bool:
        """Whether ``key``'s set was compiled before (forgotten now), else remember it and say False."""
        h = hash(key)
        with self._lock:
            if self._hashes.pop(h, False):
                return True
            self._hashes[h] = True
            if len(self._hashes) > self.size:
                self._hashes.popitem(last=False)
            return False


class Planner:
    """The engine's limits applied to requests: checks, tokenising, and the passes that will answer them."""

    def __init__(self, encoder: PromptEncoder, limits, max_position: int, block_tokens: Callable[[], int],
                 tasks: tuple, hidden_size: int):
        self.encoder, self.limits, self.max_position = encoder, limits, max_position
        self._block_tokens = block_tokens
        self.tasks = tuple(tasks)  # the engine's tuned tasks by name: a question's ``task`` is its number here
        self.entries_per_token = entries_per_token(hidden_size)
        self.sets = ByteLru(QUESTION_SETS_MIB << 20)  # compiled question sets by content (question_set.content_key)
        self._sighted = Sighted()  # sets compiled once: kept the second time they are compiled
        self._stamp = object()  # marks the sets this planner compiled: another engine's are refused

    def task_number(self, name: str | None, field_path: str) -> int:
        """A question's task as its number (-1: none), or InvalidRequest naming the engine's tasks."""
        if name is None:
            return -1
        if name not in self.tasks:
            have = f"its tasks are {', '.join(self.tasks)}" if self.tasks else "it has none (onepass tune --task)"
            raise InvalidRequest(f"this engine has no tuned task {name!r}; {have}, or leave task out for the base "
                                 "engine", field_path)
        return self.tasks.index(name)

    @property
    def block_tokens(self) -> int:
        """Packed tokens per pass when a request is split into blocks of whole questions: the backend's choice
        (what measures fastest on it), never more than the engine's max_packed_tokens."""
        return min(self._block_tokens() or self.limits.max_packed_tokens, self.limits.max_packed_tokens)

    def prepare(self, state, questions, known: dict | None = None) -> Prepared:
        """``questions`` (a mapping of id -> question, or a :class:`QuestionSet` this planner compiled) about ``state``
        (text, bytes, a JSON value, or a prefilled State) checked against every limit, compiled (or found compiled),
        placed after the state and sized: OnepassError (InvalidRequest, LimitExceeded) otherwise. ``known``: state
        texts already tokenised ({text: ids}, filled here), for a caller preparing many requests at once."""
        clock: dict = {}
        qs = self.compile(questions, clock)
        t0 = time.perf_counter()
        given = state if hasattr(state, "kv") else None
        if given is not None:
            ids = given.ids
        elif known is None:
            ids = self.state_ids(state)
        else:
            text = state_text(state)
            ids = known[text] if text in known else known.setdefault(text, self.state_ids(text))
        t1 = time.perf_counter()
        plan = self.place(qs, len(ids))
        work, state_work, trunk_work = self.work(len(ids), qs)
        trunks = tuple(trunk_state_ids(ids, qs.encoded[i]) for i in qs.longs)
        timings = {"tokenize": clock.get("tokenize", 0.0) + (t1 - t0) * 1000,
                   "pack": clock.get("pack", 0.0) + (time.perf_counter() - t1) * 1000}
        return Prepared(qs.questions if isinstance(questions, QuestionSet) else questions, qs, ids, qs.packed_tokens,
                        len(qs.passes), plan, given, timings, work, state_work, trunk_work, trunks)

    def compile(self, questions, clock: dict | None = None) -> QuestionSet:
        """``questions`` (id -> question) checked against every limit, tokenised, packed and laid out for any state,
        or the set compiled before for the same content and block size (found without tokenising). A
        :class:`QuestionSet` a caller holds is returned as it is when this planner compiled it (InvalidRequest
        otherwise: another engine's tokens and limits). ``clock`` gets the milliseconds spent tokenising and
        packing (none when found)."""
        if isinstance(questions, QuestionSet):
            if questions.stamp is not self._stamp or questions.questions is None:
                raise InvalidRequest("this question set was compiled by another engine (or from token ids alone); "
                                     "compile the questions with the engine that answers them", "questions")
            return questions
        if isinstance(questions, Mapping) and len(questions) > self.limits.max_questions:
            self.check_counts(questions)  # refused before anything is read of them
        content = content_key(questions)
        key = None if content is None else (self.block_tokens, content)  # sets are laid out in blocks of this size
        found = self.sets.get(key) if key is not None else None
        if found is not None:
            return found
        t0 = time.perf_counter()
        encoded = self.encode_questions(questions)
        t1 = time.perf_counter()
        qs = self.layout(encoded, key)
        if clock is not None:
            clock["tokenize"], clock["pack"] = (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000
        if key is not None and self._sighted.again(key):  # a one-off set never pushes a repeated one out
            self.sets.put(key, qs, qs.nbytes)
        return qs

    def hold(self, questions) -> QuestionSet:
        """:meth:`compile`'s set of ``questions`` for a caller to hold and ask with (``Engine.compile``), carrying a
        copy of the questions taken now: answers name the options as they were compiled, whatever the caller's
        objects become."""
        if isinstance(questions, QuestionSet):
            return self.compile(questions)
        qs = self.compile(questions)
        return dataclasses.replace(qs, questions=copy.deepcopy(dict(questions)), memo=qs.memo)

    def layout(self, encoded, key: tuple | None = None) -> QuestionSet:
        """Token ids of questions (``QuestionTokens``) as a compiled set: the passes that answer them after an empty
        state (:meth:`passes`), their tree masks built where the set keeps them (``KEEP_MASK_BYTES``) and the map of
        each pass's read-outs back to options."""
        encoded = tuple(encoded)
        starts, counts, lengths = layout_of(encoded)
        plan = self.passes(encoded)
        keep = sum(batch.num_tokens ** 2 for _, batch, _ in plan) <= KEEP_MASK_BYTES
        passes = tuple(CompiledPass(with_mask(batch) if keep else batch, parts, over,
                                    0 if over is None else len(encoded[over].trunk) - 1,
                                    *option_map(parts, encoded, starts, batch))
                       for parts, batch, over in plan)
        return QuestionSet(encoded, passes, starts, counts, lengths, None, key, self._stamp)

    def place(self, qs: QuestionSet, past: int) -> tuple:
        """The set's passes after a state of ``past`` tokens (a ``PackedBatch`` each, positions moved on), once the
        limits that depend on the state's length are checked: a long question's trunk prefilled onto the state must
        fit a state, and no pass may reach past the model's positions (LimitExceeded)."""
        for i in qs.longs:
            self.check_state_length(past + len(qs.encoded[i].trunk) - 1)
        self.check_reach(past + qs.reach + 1)
        return tuple(p.at(past) for p in qs.passes)

    def work(self, past: int, qs: QuestionSet) -> tuple[float, float, float]:
        """(the passes' work, the state's prefill, the long trunks' prefill) in token-equivalents, what admission
        weighs against a deadline: tokens through the weights plus attention entries / :func:`entries_per_token`.
        The passes: N packed tokens over P past ones, N (P + N) entries each (the dense pass each backend runs);
        the state's and each long question's trunk prefilled onto it: their tokens and causal attention.
        Attention grows with the square of a state's length: a 4,200-token state is 1.8x its tokens of work (per
        token it took 1.65x the time of a 300-token state: 10.6 s against 0.46 s), so counting tokens alone let a
        request in that could not meet its deadline."""
        chunk, per = self.limits.prefill_chunk, self.entries_per_token
        packed, own = qs.attention
        entries, trunk_tokens, trunk_entries = past * packed + own, 0, 0
        for i in qs.longs:  # prefilled once each
            lead = len(qs.encoded[i].trunk) - 1
            trunk_tokens += lead
            trunk_entries += causal_entries(lead, past, chunk)
        return (packed + entries / per, past + causal_entries(past, 0, chunk) / per,
                trunk_tokens + trunk_entries / per)

    def state_ids(self, state) -> tuple:
        """The state segment's token ids (template included), within the state limit (LimitExceeded, found by
        tokenising no more than about the limit)."""
        text, limit = state_text(state), self.limits.max_state_tokens
        if self.encoder.surely_over(text, limit):
            raise LimitExceeded(f"the state is more than {limit} tokens; this engine allows at most {limit}. "
                                "Shorten the state or export an engine with a larger --max-state-tokens", "state")
        ids = tuple(self.encoder.state(text))
        if len(ids) > limit:
            raise LimitExceeded(
                f"the state is {len(ids)} tokens (template included); this engine allows at most {limit}. "
                "Shorten the state or export an engine with a larger --max-state-tokens", "state")
        return ids

    def check_wire(self, body) -> None:
        """What a request body (the wire's JSON, not validated yet) can be checked against before any of it is
        validated or tokenised: its questions per request, each question's options (counted as sent) and a state
        longer than its token limit can be (``PromptEncoder.longer_than``). A body that will be refused for these
        costs little; the rest is checked where the request is parsed and prepared."""
        if not isinstance(body, Mapping):
            return
        questions, limits = body.get("questions"), self.limits
        if isinstance(questions, Mapping):
            if len(questions) > limits.max_questions:
                raise LimitExceeded(f"{len(questions)} questions; this engine allows at most {limits.max_questions} "
                                    "per request", "questions")
            for qid, q in questions.items():
                crit = q.get("criteria") if isinstance(q, Mapping) else None
                if isinstance(crit, (Mapping, list)) and len(crit) > limits.max_options:
                    raise LimitExceeded(f"{len(crit)} options; this engine allows at most {limits.max_options}",
                                        f"questions.{cut(str(qid), 40)}.criteria")
        state = body.get("state")
        if isinstance(state, str) and self.encoder.longer_than(state, limits.max_state_tokens):
            raise LimitExceeded(f"the state is more than {limits.max_state_tokens} tokens; this engine allows at most "
                                f"{limits.max_state_tokens}. Shorten the state or export an engine with a larger "
                                "--max-state-tokens", "state")

    def check_counts(self, questions: Mapping[str, Question]) -> None:
        """The limits that need no tokenizer: questions per request, options per question."""
        limits = self.limits
        if not isinstance(questions, Mapping) or not questions:
            raise InvalidRequest("questions must be a non-empty object of id -> question", "questions")
        if len(questions) > limits.max_questions:
            raise LimitExceeded(f"{len(questions)} questions; this engine allows at most {limits.max_questions} "
                                "per request", "questions")
        for qid, q in questions.items():
            n_opts = len(self.encoder.options(q)) if hasattr(q, "instructions") else 0
            if n_opts > limits.max_options:
                raise LimitExceeded(f"{n_opts} options; this engine allows at most {limits.max_options}",
                                    f"questions.{qid}.criteria")

    @property
    def question_bound(self) -> int:
        """The most tokens one question's text may have: its trunk must fit a state or a pass, within a request."""
        limits = self.limits
        return min(limits.max_state_tokens + limits.max_packed_tokens, limits.max_request_tokens)

    def encode_questions(self, questions: Mapping[str, Question]) -> list[QuestionTokens]:
        """A request's questions checked against the limits and turned into token ids (a question's text past its
        bound is refused after tokenising no more than the bound, never the whole text)."""
        limits = self.limits
        self.check_counts(questions)
        encoded, total = [], 0
        bound = self.question_bound
        budget = MAX_ENCODED_FACTOR * limits.max_request_tokens  # tokens before sharing: past it, stop tokenising
        for qid, q in questions.items():
            check_question_id(qid)
            if not hasattr(q, "instructions"):
                raise InvalidRequest("expected a Noul, Choice or Score question", f"questions.{qid}")
            if self.encoder.surely_over(self.encoder.caller_text(q), bound):
                raise LimitExceeded(f"the question is more than {bound} tokens; this engine allows at most "
                                    f"{bound} per question", f"questions.{qid}")
            task = self.task_number(q.task, f"questions.{qid}.task")
            tokens = self.encoder.question(q)
            if task != -1:
                tokens = dataclasses.replace(tokens, task=task)
            if len(tokens.trunk) > limits.max_state_tokens:  # a long trunk is prefilled onto the state
                raise LimitExceeded(f"the question is {len(tokens.trunk)} tokens before its options; this engine "
                                    f"allows at most {limits.max_state_tokens}", f"questions.{qid}")
            longest = max(map(len, tokens.options))
            if longest > limits.max_packed_tokens:
                raise LimitExceeded(f"an option is {longest} tokens; this engine packs at most "
                                    f"{limits.max_packed_tokens} per pass", f"questions.{qid}.criteria")
            total += len(tokens.trunk) + sum(map(len, tokens.options))
            if total > budget:
                raise LimitExceeded(f"the questions are more than {budget} tokens before sharing; this engine packs "
                                    f"at most {limits.max_request_tokens} per request", "questions")
            encoded.append(tokens)
        return encoded

    def pack(self, past: int, encoded: list[QuestionTokens]) -> PackedBatch:
        """The questions packed into ONE pass after ``past`` state tokens (at most max_packed_tokens)."""
        try:
            batch = pack(encoded, past, max_tokens=self.limits.max_packed_tokens)
        except TooManyTokens as err:
            raise LimitExceeded(f"the questions pack into {err.num_tokens} tokens; this engine allows at most "
                                f"{self.limits.max_packed_tokens} per pass", "questions") from None
        self.check_positions(batch, past)
        return batch

    def check_positions(self, batch: PackedBatch, past: int) -> None:
        """LimitExceeded when the batch's last token sits past the model's positions."""
        self.check_reach(int(batch.position_ids.max()) + 1 if batch.num_tokens else past)

    def check_reach(self, last: int) -> None:
        """LimitExceeded when a pass whose last token is at position ``last - 1`` reaches past the model's
        positions."""
        if last + 1 > self.max_position:
            raise LimitExceeded(f"state plus question reach position {last + 1}; the model allows {self.max_position}",
                                "questions")

    def check_state_length(self, n: int) -> None:
        """A state and a long question's trunk prefilled onto it must fit a state."""
        if n > self.limits.max_state_tokens:
            raise LimitExceeded(f"the state and a question's text are {n} tokens together; this engine allows at "
                                f"most {self.limits.max_state_tokens}", "questions")

    def passes(self, encoded) -> list[tuple]:
        """The packed passes that answer ``encoded`` after an empty state (``Planner.place`` moves them after a state),
        as (((question index, option indices), ...), batch without its [N, N] mask, over): ``over`` is None for a pass
        over the state, or the index of a long question whose trunk (but its last token) is prefilled onto the state
        first; that pass's positions count from the end of the trunk.

        One pass when the questions pack into a block (:attr:`block_tokens`). Else blocks of whole questions
        (:func:`onepass.runtime.core.tree.blocks`), each a pass over the same state K/V. A question larger than a
        block (a choice of hundreds of options, listed in its own text) has its trunk but the last token prefilled
        onto the state, like a longer state, and its options scored below that last token in parts
        (:func:`onepass.runtime.core.tree.option_groups`). A token attends to the state, its trunk and its own
        option path only, so the answers do not depend on the split. Every limit that does not depend on the state is
        checked here, before any pass: LimitExceeded past the request's packed-token limit."""
        block = self.block_tokens
        whole = tuple((i, tuple(range(len(q.options)))) for i, q in enumerate(encoded))
        try:
            return self._within([(whole, pack(encoded, 0, max_tokens=block, mask=False), None)])
        except TooManyTokens:  # counted on the trie, before any [N, N] mask exists
            pass
        small = [i for i, q in enumerate(encoded) if packed_size(q) <= block]
        out = [(tuple(whole[small[k]] for k in ks), pack([encoded[small[k]] for k in ks], 0, mask=False), None)
               for ks in blocks([encoded[i] for i in small], block)]
        for i in sorted(set(range(len(encoded))) - set(small)):
            q = encoded[i]
            if q.task != -1:  # its trunk would be prefilled by the base weights, not its task's
                raise LimitExceeded(f"a question of the tuned task {self.tasks[q.task]!r} packs into "
                                    f"{packed_size(q)} tokens; a tuned task's question must fit one pass of "
                                    f"{block} tokens: send fewer or shorter options", "questions")
            tail = QuestionTokens(q.trunk[-1:], q.options)
            for group in option_groups(tail, block):
                part = QuestionTokens(tail.trunk, tuple(q.options[k] for k in group))
                out.append((((i, tuple(group)),), pack([part], 0, mask=False), i))
        return self._within(out)

    def _within(self, plan: list) -> list:
        """``plan`` once its packed tokens are within the request's limit (LimitExceeded otherwise)."""
        total = sum(batch.num_tokens for _, batch, _ in plan)
        if total > self.limits.max_request_tokens:
            raise LimitExceeded(f"the questions pack into {total} tokens; this engine allows at most "
                                f"{self.limits.max_request_tokens} per request. Send fewer or shorter questions",
                                "questions")
        return plan
