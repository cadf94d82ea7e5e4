"""The decision engine: prefill a state once, answer any number of typed questions in one pass."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

from . import manifest as manifest_mod
from ..backends.base import Backend, StateKV
from .readout_calibration import question_key
from .errors import DeadlineExceeded, InvalidRequest, LimitExceeded
from .prompt import OLD_OPTION_LINE, PromptEncoder, state_text
from .questions import Answer, Question
from .readout import answer, option_scores, softmax
from .state_cache import StateCache
from .tree import (PackedBatch, QuestionTokens, TooManyTokens, blocks, option_groups, option_head_scores,
                   option_logprobs, pack, packed_size)
from .wire import check_question_id, parse_request, response_body

DEFAULT_CACHE_BYTES = 512 << 20
log = logging.getLogger("onepass.engine")
_WARNED: set = set()  # engine directories already warned about
MAX_ENCODED_FACTOR = 4  # questions' tokens before prefix sharing, as a multiple of the request's packed limit
PRIOR_CACHE_ITEMS = 4096


@dataclass(frozen=True)
class State:
    """A prefilled state: its token ids and its K/V. Asking never changes it."""

    ids: tuple
    kv: StateKV

    @property
    def num_tokens(self) -> int:
        """Tokens of the state segment (template included)."""
        return len(self.ids)

    def __repr__(self) -> str:  # never the ids or the arrays: a state is thousands of numbers
        return f"State({self.num_tokens} tokens, K/V {self.kv.nbytes / 2**20:.1f} MiB)"


@dataclass(frozen=True)
class Result:
    """Answers of one request plus what was spent: tokens, the state tokens served from the cache, and the
    milliseconds of each stage (tokenize, prefill — 0 when cached —, pack — the packed tree, its mask and
    positions —, score — the backend's passes; a merged pass is counted for each request it answered —,
    readout)."""

    answers: dict
    input_tokens: int
    packed_tokens: int
    cached_tokens: int = 0
    timings: dict = field(default_factory=dict)


class Engine:
    """An engine directory loaded for serving. Thread-safe for concurrent ``ask`` calls."""

    def __init__(self, root: Path, manifest, backend: Backend, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.root = root
        self.manifest = manifest
        self.backend = backend
        self.encoder = PromptEncoder(str(root / manifest.tokenizer), manifest.prompt)
        if manifest.prompt.option_line == OLD_OPTION_LINE and str(root) not in _WARNED:  # once, not per with_limits
            _WARNED.add(str(root))
            log.warning("%s renders a described choice option as %r, which works against it (a choice with only some "
                        "options described can answer an undescribed one); export the engine again for the new "
                        "rendering (its answers change only for described options)", root,
                        OLD_OPTION_LINE.strip())
        # the backend's own device K/V (TensorRT's graph slots, the PyTorch backend's workspace) counts in the budget
        reserved = getattr(backend, "reserved_bytes", 0)
        if reserved and reserved >= cache_bytes:
            log.warning("the backend's graph slots or workspace take %d MiB of the %d MiB state-cache budget: no state will be "
                        "cached; give a larger cache (onepass serve --cache-mib, Engine.load(cache_bytes=...))",
                        reserved >> 20, cache_bytes >> 20)
        self.cache = StateCache(max(0, cache_bytes - reserved))
        self._priors: OrderedDict = OrderedDict()
        self._null: State | None = None
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | os.PathLike, *, verify: bool = True, threads: int | None = None,
             cache_bytes: int = DEFAULT_CACHE_BYTES, backend=None) -> "Engine":
        """Open an engine directory: read and (by default) hash-verify the manifest's files.

        ``backend``: None (or "auto") for the default CPU backend (OpenVINO at f32 where it is installed and
        reproduces the engine's golden file here, else ONNX Runtime: ``onepass.runtime.backends.default``), a
        backend's name (``onepass.runtime.backends.BACKENDS``: "onnxruntime", "openvino-cpu", "tensorrt",
        "torch-cpu", "torch-cuda", ...), or a factory ``(root, manifest, threads) -> Backend`` (e.g.
        ``onepass.runtime.backends.factory("torch-cuda", buckets=True)``).
        """
        from .. import backends

        root = Path(path)
        manifest = manifest_mod.load(root, verify=verify)
        if backend in (None, backends.AUTO):
            backend = backends.default
        elif isinstance(backend, str):
            backend = backends.factory(backend)
        return cls(root, manifest, backend(root, manifest, threads), cache_bytes)

    def close(self) -> None:
        """Drop the cached states and release the backend (device memory, graphs). Engines made by
        :meth:`with_limits` share the backend: close the last one used."""
        self.cache.clear()
        with self.backend.serial():
            self.backend.close()

    def release_memory(self) -> bool:
        """Give back the backend's working memory grown by past large passes (a long state, hundreds of options);
        cached states stay. Answers are unchanged; True if anything was released (OpenVINO, which rebuilds its
        compiled model in about a second; a no-op elsewhere). ``onepass serve`` calls it when idle above 1.2x its
        warm size."""
        with self.backend.serial():
            return self.backend.release_memory()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def with_limits(self, **lower) -> "Engine":
        """This engine (same session and cache) with some limits lowered; raising one past the manifest is refused."""
        lower = {k: v for k, v in lower.items() if v is not None}
        if not lower:
            return self
        current = self.manifest.limits
        for key, value in lower.items():
            if value > getattr(current, key):
                raise LimitExceeded(f"{key}={value} is above this engine's {getattr(current, key)}; "
                                    "export an engine with a larger limit instead", key)
        manifest = dataclasses.replace(self.manifest, limits=dataclasses.replace(current, **lower))
        budget = self.cache.max_bytes + getattr(self.backend, "reserved_bytes", 0)  # as this engine was given
        engine = Engine(self.root, manifest, self.backend, budget)
        engine.cache = self.cache
        return engine

    @property
    def name(self) -> str:
        """The engine's name from its manifest."""
        return self.manifest.name

    # -- states -------------------------------------------------------------------------------

    def state(self, state) -> State:
        """Prefill a state (a string, bytes in UTF-8, or a JSON value) or take it from the cache."""
        return self._state(state)[0]

    def _state(self, state, clock: dict | None = None) -> tuple[State, bool]:
        """(the state, whether it came from the cache); ``clock`` gets the tokenize and prefill milliseconds."""
        t0 = time.perf_counter()
        if isinstance(state, State):
            return state, True
        text = state_text(state)
        limit = self.manifest.limits.max_state_tokens
        if self.encoder.surely_over(text, limit):
            raise LimitExceeded(f"the state is more than {limit} tokens; this engine allows at most {limit}. "
                                "Shorten the state or export an engine with a larger --max-state-tokens", "state")
        ids = tuple(self.encoder.state(text))
        if len(ids) > limit:
            raise LimitExceeded(
                f"the state is {len(ids)} tokens (template included); this engine allows at most {limit}. "
                "Shorten the state or export an engine with a larger --max-state-tokens", "state")
        t1 = time.perf_counter()
        if clock is not None:
            clock["tokenize"] = clock.get("tokenize", 0.0) + (t1 - t0) * 1000
            clock["prefill"] = 0.0
        cached = self.cache.get(ids)
        if cached is not None:
            return cached, True
        with self.backend.serial():
            kv = self.backend.prefill(ids, self.manifest.limits.prefill_chunk)
        prefilled = State(ids, kv)
        self.cache.put(ids, prefilled, kv.nbytes)
        if clock is not None:
            clock["prefill"] = (time.perf_counter() - t1) * 1000
        return prefilled, False

    # -- questions ------------------------------------------------------------------------------

    def check_counts(self, questions: Mapping[str, Question]) -> None:
        """The limits no retry can meet that need no tokenizer: questions per request, options per question
        (the server checks them before admission, so such a request is a 413 at once, never a retryable 429)."""
        limits = self.manifest.limits
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
        limits = self.manifest.limits
        return min(limits.max_state_tokens + limits.max_packed_tokens, limits.max_request_tokens)

    def check_lengths(self, questions: Mapping[str, Question]) -> None:
        """LimitExceeded (413) for a question whose text is over its token bound, found by tokenising at most about
        the bound (nothing at all for a text of fewer bytes than the bound: a token is at least a byte). The server
        checks this before admission, so such a request is refused at once, never queued behind others or answered
        a retryable 429. (A state over its limit is refused by the engine, which tokenises it anyway.)"""
        enc, bound = self.encoder, self.question_bound
        for qid, q in questions.items():
            text = enc.caller_text(q)
            if len(text) > bound // 4 and len(text.encode("utf-8", "surrogatepass")) > bound and \
                    enc.surely_over(text, bound):
                raise LimitExceeded(f"the question's text is more than {bound} tokens; this engine allows at most "
                                    f"{bound} per question", f"questions.{qid}")

    def question_key(self, question: Question) -> str:
        """The key a calibration group and a gate threshold are stored under: the question's type, instructions and
        options as this engine renders them."""
        return question_key(question.type, self.encoder.instructions(question), self.encoder.options(question))

    def encode_questions(self, questions: Mapping[str, Question]) -> list[QuestionTokens]:
        """Validate a request's questions against the limits and turn them into token ids."""
        limits = self.manifest.limits
        self.check_counts(questions)
        encoded, total = [], 0
        # a question's text is in its trunk, which must fit a state (max_state_tokens) or a pass: past that bound it
        # is refused after tokenising no more than the bound, never the whole text
        bound = self.question_bound
        budget = MAX_ENCODED_FACTOR * limits.max_request_tokens  # tokens before sharing: past it, stop tokenising
        for qid, q in questions.items():
            check_question_id(qid)
            if not hasattr(q, "instructions"):
                raise InvalidRequest("expected a Noul, Choice or Score question", f"questions.{qid}")
            if self.encoder.surely_over(self.encoder.caller_text(q), bound):
                raise LimitExceeded(f"the question is more than {bound} tokens; this engine allows at most "
                                    f"{bound} per question", f"questions.{qid}")
            tokens = self.encoder.question(q)
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

    def pack(self, state: State, encoded: list[QuestionTokens]) -> PackedBatch:
        """The questions packed into ONE pass over a state (at most max_packed_tokens); raises LimitExceeded past
        the limits."""
        limits = self.manifest.limits
        try:
            batch = pack(encoded, state.num_tokens, max_tokens=limits.max_packed_tokens)
        except TooManyTokens as err:
            raise LimitExceeded(f"the questions pack into {err.num_tokens} tokens; this engine allows at most "
                                f"{limits.max_packed_tokens} per pass", "questions") from None
        self._check_positions(batch, state.num_tokens)
        return batch

    def _check_positions(self, batch: PackedBatch, past: int) -> None:
        """LimitExceeded when the batch's last token sits past the model's positions."""
        model = self.manifest.model
        last = int(batch.position_ids.max()) + 1 if batch.num_tokens else past
        if last + 1 > model.max_position:
            raise LimitExceeded(f"state plus question reach position {last + 1}; the model allows {model.max_position}",
                                "questions")

    @property
    def block_tokens(self) -> int:
        """Packed tokens per pass when a request is split into blocks of whole questions: the backend's
        choice (what measures fastest on it), never more than the engine's max_packed_tokens."""
        limit = self.manifest.limits.max_packed_tokens
        return min(self.backend.block_tokens or limit, limit)

    def passes(self, state: State, encoded: list[QuestionTokens],
               plan_only: bool = False) -> list[tuple[list, PackedBatch, State]]:
        """The packed passes that answer ``encoded`` over ``state``, as ([(question index, option indices)],
        batch, the state the batch continues).

        One pass when the questions pack into a block (the backend's :attr:`block_tokens`). Else blocks of
        whole questions (:func:`onepass.runtime.core.tree.blocks`), each a pass over the same state K/V. A question
        larger than a block (a choice of hundreds of options, listed in its own text) has its trunk but the
        last token prefilled onto the state, like a longer state (and cached the same way), and its options
        scored below that last token in parts (:func:`onepass.runtime.core.tree.option_groups`). A token attends to
        the state, its trunk and its own option path only, so the answers do not depend on the split. Raises
        LimitExceeded past the request's packed-token limit before any pass. ``plan_only``: every limit checked and
        the sizes counted, with no tree mask built and no trunk prefilled (the passes' batches have no mask and a
        long question's entry names its index instead of its longer state)."""
        limits, block = self.manifest.limits, self.block_tokens
        try:
            whole = [(i, list(range(len(q.options)))) for i, q in enumerate(encoded)]
            out = [(whole, pack(encoded, state.num_tokens, max_tokens=block, mask=not plan_only), state)]
        except TooManyTokens:  # counted on the trie, before any [N, N] mask exists
            small = [i for i, q in enumerate(encoded) if packed_size(q) <= block]
            out = [([(small[k], whole[small[k]][1]) for k in ks], pack([encoded[small[k]] for k in ks],
                                                                        state.num_tokens, mask=not plan_only), state)
                   for ks in blocks([encoded[i] for i in small], block)]
            long = sorted(set(range(len(encoded))) - set(small))
            for i in long:  # packed against the longer state's length: every limit is checked before its prefill
                q = encoded[i]
                self._check_state_length(state.num_tokens + len(q.trunk) - 1)
                tail = QuestionTokens(q.trunk[-1:], q.options)
                for group in option_groups(tail, block):
                    part = QuestionTokens(tail.trunk, tuple(q.options[k] for k in group))
                    out.append(([(i, group)], pack([part], state.num_tokens + len(q.trunk) - 1, mask=not plan_only),
                                i))
        total = sum(batch.num_tokens for _, batch, _ in out)
        if total > limits.max_request_tokens:
            raise LimitExceeded(f"the questions pack into {total} tokens; this engine allows at most "
                                f"{limits.max_request_tokens} per request. Send fewer or shorter questions",
                                "questions")
        for _, batch, over in out:
            past = over.num_tokens if isinstance(over, State) else state.num_tokens + len(encoded[over].trunk) - 1
            self._check_positions(batch, past)
        if plan_only:
            return out
        longer = {}  # the prefills, once every limit passed
        for k, (ids, batch, over) in enumerate(out):
            if not isinstance(over, State):
                if over not in longer:
                    longer[over] = self._extended(state, encoded[over].trunk[:-1])
                out[k] = (ids, batch, longer[over])
        return out

    def _check_state_length(self, n: int) -> None:
        """A state and a long question's trunk prefilled onto it must fit a state."""
        if n > self.manifest.limits.max_state_tokens:
            raise LimitExceeded(f"the state and a question's text are {n} tokens together; this engine allows at "
                                f"most {self.manifest.limits.max_state_tokens}", "questions")

    def _extended(self, state: State, ids: tuple) -> State:
        """``state`` followed by ``ids`` (a long question's trunk) as a state of its own, from the cache or
        prefilled onto ``state``'s K/V (which stays as it is)."""
        limits = self.manifest.limits
        joint = tuple(state.ids) + tuple(ids)
        self._check_state_length(len(joint))
        cached = self.cache.get(joint)
        if cached is not None:
            return cached
        with self.backend.serial():
            kv = self.backend.extend(state.kv, ids, limits.prefill_chunk)
        longer = State(joint, kv)
        self.cache.put(joint, longer, kv.nbytes)
        return longer

    def option_logprobs(self, state, encoded: list[QuestionTokens]) -> list[np.ndarray]:
        """Summed log-likelihood of every option of every question (one packed pass, or blocks of whole
        questions past the backend's block size: see :meth:`passes`)."""
        return self._score(self.state(state), encoded)[1]

    def option_values(self, state, encoded: list[QuestionTokens]) -> tuple[list, list | None]:
        """(summed log-likelihoods, decision-head scores or None) of every option, from ONE packed pass."""
        _, logprobs, heads = self._score(self.state(state), encoded)
        return logprobs, heads

    def _score(self, state: State, encoded: list[QuestionTokens],
               clock: dict | None = None, deadline: float | None = None) -> tuple[int, list, list | None]:
        """(packed tokens over all passes, per-question option log-likelihoods, head scores or None).

        ``clock`` gets ``pack`` (building the tree, its mask and positions; a long question's trunk
        prefill included) and ``score`` (the backend's passes) in milliseconds."""
        t0 = time.perf_counter()
        plan = self.passes(state, encoded)
        t1 = time.perf_counter()
        logprobs = [np.zeros(len(q.options)) for q in encoded]
        heads: list | None = None
        packed = 0
        for parts, batch, over in plan:
            if deadline is not None and time.monotonic() > deadline:  # nobody waits for the rest: stop here
                raise DeadlineExceeded(f"every waiter's deadline passed after {packed} packed tokens of this request's "
                                       "passes; the rest were not run")
            with self.backend.serial():
                logprob, head = self.backend.score_all(over.kv, batch)
            packed += batch.num_tokens
            for (i, group), lp in zip(parts, option_logprobs(batch, logprob)):
                logprobs[i][group] = lp
            if head is not None:
                heads = heads if heads is not None else [np.zeros(len(q.options)) for q in encoded]
                for (i, group), h in zip(parts, option_head_scores(batch, head)):
                    heads[i][group] = h
        if clock is not None:
            clock["pack"] = (t1 - t0) * 1000
            clock["score"] = (time.perf_counter() - t1) * 1000
        return packed, logprobs, heads

    def prior_logprobs(self, encoded: list[QuestionTokens]) -> list[np.ndarray]:
        """Content-free log-likelihoods (state = the template's null state), cached per question."""
        with self._lock:
            missing = [q for q in dict.fromkeys(encoded) if q not in self._priors]
        if missing:
            if self._null is None:
                self._null = self.state(self.manifest.prompt.null_state)
            values = self.option_logprobs(self._null, missing)
            with self._lock:
                for q, v in zip(missing, values):
                    self._priors[q] = v
                while len(self._priors) > PRIOR_CACHE_ITEMS:
                    self._priors.popitem(last=False)
        with self._lock:
            return [self._priors.get(q) if q in self._priors else None for q in encoded]

    def _prepare(self, state, questions: Mapping[str, Question]) -> tuple:
        """(encoded questions, the state, whether it came from the cache, the stage clock so far: tokenize, prefill)."""
        clock: dict = {}
        t0 = time.perf_counter()
        encoded = self.encode_questions(questions)
        clock["tokenize"] = (time.perf_counter() - t0) * 1000
        state, hit = self._state(state, clock)
        return encoded, state, hit, clock

    def run(self, state, questions: Mapping[str, Question], readout: str | None = None) -> Result:
        """Answer questions about a state in one packed forward pass."""
        encoded, state, hit, clock = self._prepare(state, questions)
        packed, logprobs, heads = self._score(state, encoded, clock)
        t2 = time.perf_counter()
        answers = self._answers(questions, encoded, logprobs, readout, heads=heads)
        clock["readout"] = (time.perf_counter() - t2) * 1000
        return Result(answers, state.num_tokens + packed, packed,
                      state.num_tokens if hit else 0, clock)

    def run_many(self, requests: list, readout: str | None = None, deadline: float | None = None) -> list:
        """Answer several ``(state, questions)`` requests; those about the same state share ONE pass.

        The requests are grouped here by their state's text (``state_text``), once, and each group answered by
        :meth:`run_group`. Returns, per request, a Result or the exception it raised (OnepassError for bad input): a
        bad or failing request never fails the others. ``deadline``: as :meth:`run_group`'s.
        """
        out: list = [None] * len(requests)
        groups: dict = {}
        for i, (raw, _) in enumerate(requests):
            try:
                state = raw if isinstance(raw, State) else state_text(raw)
            except Exception as err:  # noqa: BLE001 - a request's failure is its own answer
                out[i] = err
                continue
            groups.setdefault(state.ids if isinstance(state, State) else state, (state, []))[1].append(i)
        for state, members in groups.values():
            for i, result in zip(members, self.run_group(state, [requests[i][1] for i in members], readout,
                                                          deadline=deadline)):
                out[i] = result
        return out

    def run_group(self, state, requests: list, readout: str | None = None, deadline: float | None = None) -> list:
        """Answer several requests' questions (``requests``: one {id: Question} each) about ONE state in one merged
        pass (or the blocks it splits into): the server's dispatcher groups requests by their state's text and hands
        each group here, so a request is grouped once. The state is tokenised and prefilled (or taken from the cache)
        once for the group, after the questions are checked.

        Each request's questions are separate subtrees of the packed tree, so every answer equals its request run
        alone. Returns, per request, a Result or the exception it raised (OnepassError for bad input): a bad or
        failing request never fails the others — when a merged pass fails, its requests are run again one by one.
        ``deadline`` (monotonic seconds, the latest of the waiters'): past it, no further pass starts, and the
        requests get ``DeadlineExceeded`` (a request split into blocks stops between blocks).
        """
        out: list = [None] * len(requests)
        clocks: list = [{} for _ in requests]
        encoded: list = [None] * len(requests)
        for i, questions in enumerate(requests):
            try:
                t0 = time.perf_counter()
                encoded[i] = self.encode_questions(questions)
                clocks[i]["tokenize"] = (time.perf_counter() - t0) * 1000
            except Exception as err:  # noqa: BLE001 - a request's failure is its own answer
                out[i] = err
        valid = [i for i in range(len(requests)) if out[i] is None]
        if not valid:
            return out
        first = clocks[valid[0]]  # the state's tokenize and prefill are the first request's; the others reuse them
        given = state
        try:
            state, hit = self._state(state, first)
        except Exception as err:  # noqa: BLE001 - the requests share the state, and its failure
            for i in valid:
                out[i] = err
            return out
        # each later request looks the state up in the cache as it would alone (the cache's hit and miss counts and
        # each answer's cached tokens say so), but is never prefilled again: a state the cache cannot hold is a miss
        # for every request, prefilled once for the group
        hits = {i: hit if i == valid[0] or isinstance(given, State) else self.cache.get(state.ids) is not None
                for i in valid}
        members = []
        for i in valid:
            clocks[i].setdefault("prefill", 0.0)
            try:
                t0 = time.perf_counter()
                # its own size and limits, as alone: counted, never packed (the merged pass packs it once)
                own = sum(b.num_tokens for _, b, _ in self.passes(state, encoded[i], plan_only=True))
                clocks[i]["pack"] = (time.perf_counter() - t0) * 1000
                members.append((i, requests[i], encoded[i], own))
            except Exception as err:  # noqa: BLE001 - a request's failure is its own answer
                out[i] = err
        if not members:
            return out
        shared: dict = {}  # the merged pass's pack and score, the same for every member
        try:
            scored = self._score_merged(state, [q for _, _, mine, _ in members for q in mine], shared, deadline)
        except DeadlineExceeded as err:
            for i, *_ in members:
                out[i] = err
            return out
        if scored is None:  # the pass failed: each request alone, so that it can only fail itself
            for i, questions, _, _ in members:
                try:
                    out[i] = self.run(state, questions, readout)
                except Exception as err:  # noqa: BLE001 - its failure is its own answer
                    out[i] = err
            return out
        merged, merged_heads = scored
        logprobs = iter(merged)
        heads = iter(merged_heads) if merged_heads is not None else None
        for i, questions, mine_encoded, own in members:
            mine = [next(logprobs) for _ in mine_encoded]
            my_heads = [next(heads) for _ in mine_encoded] if heads is not None else None
            try:
                t2 = time.perf_counter()
                answers = self._answers(questions, mine_encoded, mine, readout, heads=my_heads)
                clocks[i].update(pack=clocks[i]["pack"] + shared["pack"], score=shared["score"],
                                 readout=(time.perf_counter() - t2) * 1000)
                out[i] = Result(answers, state.num_tokens + own, own, state.num_tokens if hits[i] else 0, clocks[i])
            except Exception as err:  # noqa: BLE001 - its failure is its own answer
                out[i] = err
        return out

    def _score_merged(self, state: State, encoded: list, clock: dict, deadline: float | None = None):
        """(logprobs, heads) of the requests' encoded questions in one pass, or None if that pass fails; DeadlineExceeded
        when the deadline passed between its passes (then nothing is retried)."""
        try:
            _, logprobs, heads = self._score(state, encoded, clock, deadline)
        except DeadlineExceeded:
            raise
        except Exception:  # noqa: BLE001 - too large together, or a fault: the caller retries each alone
            return None
        return logprobs, heads

    def _answers(self, questions, encoded, logprobs, readout, calibrated: bool = True, heads=None) -> dict:
        scores = self.option_scores(questions, encoded, logprobs, readout, calibrated, heads)
        return {qid: answer(q, softmax(sc)) for (qid, q), sc in zip(questions.items(), scores)}

    def option_scores(self, questions, encoded, logprobs, readout=None, calibrated: bool = True,
                      heads=None) -> list:
        """Per question, the [K] scores that are soft-maxed: the read-out, then the manifest's calibration.

        The ``head`` read-out is ``beta * mean + head score`` and needs ``heads`` (from a graph
        with a decision head).
        """
        readout = readout or self.manifest.scoring.readout
        if readout == "head" and (self.manifest.head is None or heads is None):
            raise InvalidRequest("the 'head' read-out needs an engine with a decision head "
                                 "(export one with `onepass export --head FILE`, trained by `make head`); this one has none", "readout")
        cal = self.manifest.calibration if calibrated else None
        if cal is not None and cal.readout != readout:
            cal = None  # fitted on another read-out: not applicable
        priors = self.prior_logprobs(encoded) if readout == "prior" else [None] * len(encoded)
        head_iter = iter(heads) if heads is not None else None
        out = []
        for q, tokens, lp, prior in zip(questions.values(), encoded, logprobs, priors):
            lengths = np.array([len(o) for o in tokens.options], dtype=np.float64)
            if readout == "head":
                scores = self.manifest.head.beta * (lp / lengths) + next(head_iter)
            else:
                scores = option_scores(lp, lengths, prior, readout)
            if cal is not None:
                names = self.encoder.options(q)
                scores = cal.apply(q.type, scores, names, question_key(q.type, self.encoder.instructions(q), names))
            out.append(scores)
        return out

    def ask(self, state, questions: Mapping[str, Question], readout: str | None = None,
            min_confidence: float | None = None) -> dict[str, Answer]:
        """Typed answers by question id. ``state`` is a State from :meth:`state` or raw text/JSON.

        With ``min_confidence``, answers whose confidence ((K p_max - 1)/(K - 1); for noul
        |2p - 1|) is below it keep their value and are marked ``abstained``.
        """
        answers = self.run(state, questions, readout).answers
        if min_confidence is None:
            return answers
        if not 0.0 <= min_confidence <= 1.0:
            raise InvalidRequest(f"min_confidence must be within 0..1, got {min_confidence}", "min_confidence")
        return {qid: dataclasses.replace(a, abstained=a.certainty < min_confidence) for qid, a in answers.items()}

    def decide(self, state, model, min_confidence: float | None = None):
        """A pydantic model's fields answered about ``state`` in one packed pass (:mod:`onepass.runtime.core.decide`):
        a ``Decision`` with the validated instance, every field's answer and the fields that abstained."""
        from .decide import decide

        return decide(self, state, model, min_confidence)

    def request(self, body: Mapping) -> dict:
        """Answer a TypeSafe System One request body; returns the response body."""
        state, questions = parse_request(body)
        return response_body(body, self.name, self.run(state, questions))
