"""Limits come before the work they guard: spies count the guarded work, at and around each limit.

A mutation audit found four realistic bugs no test caught, because a limit that runs *after* its work (or a
guard that is bypassed) still refuses the request: only the cost changes. Each test here counts the work a
limit exists to prevent, on the tiny Llama's engine (SmolLM2's tokenizer and limits, 2 blocks):

1. the position limit at its exact boundary (one position under is accepted, the boundary refused);
2. the dispatcher drops a queued request whose pass would end after its deadline *before* running it;
3. a question over its token bound is refused after tokenising a bounded prefix, never the whole text;
4. the prior read-out's cache, partly filled, gives every question its own prior.

And for every other limit, the work it guards counted at and around it: the request's packed tokens before any
pass or trunk prefill (a refused request used to prefill its long question's trunk first), question and option
counts before any tokenising (in the engine and in the server's parse, before admission), the body limit while
reading and while decompressing, nesting before the JSON parser, the packed-token limit before the tree mask; the
prior read-out against a hand-computed softmax(lp - null); the API key compared exactly; the state cache keyed by
token ids. Each test was run against its mutation (the guard moved after its work) and fails there.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from fake_engine import FakeEngine

from onepass import Engine, Noul
from onepass.runtime.core.errors import InvalidRequest, LimitExceeded, OnepassError
from onepass.runtime.backends.batch import PackedBatch


@pytest.fixture(scope="module")
def tiny(tiny_engine_dir):
    with Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False) as engine:
        yield engine


def _batch_ending_at(position: int) -> PackedBatch:
    return PackedBatch(np.array([5], np.int64), np.array([position], np.int64), np.ones((1, 1), bool),
                       np.array([0], np.int64), np.array([5], np.int64))


def test_the_position_limit_holds_exactly_at_its_boundary(tiny):
    """The last packed token's position plus the position its read-out predicts must stay within the model's
    positions: max_position - 2 is the last accepted, max_position - 1 the first refused (a `>` for `>=` or a
    dropped +1 moves the boundary by one, and only a test at the boundary sees it)."""
    limit = tiny.manifest.model.max_position
    tiny.planner.check_positions(_batch_ending_at(limit - 2), past=10)  # accepted
    with pytest.raises(LimitExceeded, match=f"reach position {limit + 1}; the model allows {limit}"):
        tiny.planner.check_positions(_batch_ending_at(limit - 1), past=10)
    with pytest.raises(LimitExceeded):
        tiny.planner.check_positions(_batch_ending_at(limit), past=10)


class _Engine(FakeEngine):
    """Runs a batch when released; records every request it ran."""

    def __init__(self, hold_s: float):
        super().__init__()
        self.hold_s, self.ran = hold_s, []

    def run_group(self, prepared, readout=None, deadline=None):
        self.ran.extend(self.text(p) for p in prepared)
        time.sleep(self.hold_s)
        return [RuntimeError("answered")] * len(prepared)


def test_a_queued_request_whose_pass_would_end_after_its_deadline_is_dropped_without_a_pass():
    """Passes take 1 s (measured). A is running (held 1.8 s); B, about another state with a 2.5 s deadline, was
    admitted (2 passes = 2 s of work < 2.5 s). When B's turn comes at ~1.8 s its pass would end at ~2.8 s: B is
    dropped (503) and never run. Ignoring the pass's own time, the worker would have run it (finishing too late)."""
    from onepass.runtime.server.dispatch import DeadlineExceeded, Dispatcher

    engine = _Engine(hold_s=1.8)
    dispatcher = Dispatcher(engine, max_queue=8, window_s=0.0, max_batch=4)
    dispatcher.observe(1, 0.0, 1.0)  # a pass of 1 s

    async def main():
        a = dispatcher.submit(engine.prepare("state A", {"q": Noul("a?")}), time.monotonic() + 60)
        await asyncio.sleep(0.1)  # A is taken by the worker and runs
        b = dispatcher.submit(engine.prepare("state B", {"q": Noul("b?")}), time.monotonic() + 2.4)
        return await a, await b

    try:
        _, b = asyncio.run(main())
    finally:
        dispatcher.close()
    assert isinstance(b, DeadlineExceeded)
    assert engine.ran == ["state A"]  # B's pass never ran


class _CountingTokenizer:
    """A tokenizer stand-in that counts the characters it was asked to encode (the guarded work)."""

    def __init__(self, real):
        self.real, self.chars = real, 0
        self.lock = threading.Lock()

    def encode(self, text, *args, **kwargs):
        with self.lock:
            self.chars += len(text)
        return self.real.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_question_over_its_token_bound_is_refused_after_tokenising_a_bounded_prefix(tiny, monkeypatch):
    """A question whose text is ~3x its bound (min(max_state + max_packed, max_request) tokens) is refused having
    tokenised about the bound's worth of it, not the whole text; one just under the bound is accepted (it may be
    tokenised in full: that is the work it is allowed)."""
    lim = tiny.manifest.limits
    bound = min(lim.max_state_tokens + lim.max_packed_tokens, lim.max_request_tokens)
    counter = _CountingTokenizer(tiny.encoder._untrusted)
    monkeypatch.setattr(tiny.encoder, "_untrusted", counter)
    word = " refund"  # one token each
    over = "Is this about a" + word * (3 * bound)
    with pytest.raises(LimitExceeded, match=f"more than {bound} tokens"):
        tiny.encode_questions({"q": Noul(over)})
    assert counter.chars < 0.6 * len(over), (counter.chars, len(over))  # a bounded prefix, not the whole text
    under = "Is this about a" + word * (lim.max_state_tokens - 200)
    counter.chars = 0
    (encoded,) = tiny.encode_questions({"q": Noul(under)})
    assert len(encoded.trunk) <= lim.max_state_tokens and counter.chars >= len(under)


def test_priors_partly_cached_give_each_question_its_own(tiny_engine_dir):
    """The prior read-out caches each question's content-free log-likelihoods. With one question's prior cached
    and another's not, each must get its own: filling the cache against the wrong list gives the new question the
    cached one's values (the path a request of several questions takes once any of them was asked before)."""
    a, b = Noul("Is the customer asking for a refund?"), Noul("Is the app crashing on the reports page?")
    with Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False) as warm, \
            Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False) as fresh:
        qa, qb = warm.encode_questions({"a": a, "b": b})
        warm.prior_logprobs([qa])  # a's prior is cached
        got_a, got_b = warm.prior_logprobs([qa, qb])  # a cached and first, b missing
        want_a, want_b = fresh.prior_logprobs([qa])[0], fresh.prior_logprobs([qb])[0]
    np.testing.assert_allclose(got_a, want_a, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_b, want_b, rtol=0, atol=1e-6)
    assert np.abs(want_a - want_b).max() > 1e-3  # the two priors differ: a swap would show


def test_the_packed_token_limit_is_counted_before_the_tree_mask_is_built(monkeypatch):
    """Over max_tokens, pack refuses with no N x N mask built (the quadratic work the count guards); exactly at
    the limit it packs. (Built after the count, the mask of a huge request was caught only as a MemoryError.)"""
    from onepass.runtime.core import tree
    from onepass.runtime.core.prompt import QuestionTokens

    built = []
    real = tree.interval_mask
    monkeypatch.setattr(tree, "interval_mask", lambda order: built.append(len(order)) or real(order))
    questions = [QuestionTokens(trunk=(1, 2, 3, 100 + i), options=((7, 2), (8, 2))) for i in range(10)]
    size = tree.pack(questions, 5).num_tokens  # the packed size (no limit)
    built.clear()
    with pytest.raises(tree.TooManyTokens):
        tree.pack(questions, 5, max_tokens=size - 1)
    assert built == []
    assert tree.pack(questions, 5, max_tokens=size).num_tokens == size and built == [size]


@pytest.mark.parametrize("header", ["Bearer sekret-key", "Bearer sekret-key-123x", "Bearer SEKRET-KEY-123",
                                    "Bearer ", "Bearer  sekret-key-123", "Bearer sekret-key-123 ", "sekret-key-123",
                                    "Basic sekret-key-123", ""])
def test_the_api_key_is_compared_exactly(tiny, header):
    """A prefix, a suffix, another case, an empty key, whitespace around it, no scheme or another scheme: 401.
    The control: the exact key (scheme in any case) passes."""
    import types

    from onepass.runtime.server.app import Server
    from onepass.runtime.server.config import ServerConfig
    from onepass.runtime.server.errors import Unauthorized, status_of

    server = Server(tiny, ServerConfig(api_key="sekret-key-123"))
    try:
        request = types.SimpleNamespace(headers={"authorization": header} if header else {})
        with pytest.raises(Unauthorized) as err:
            server.check_auth(request)
        assert status_of(err.value) == 401
        for good in ("Bearer sekret-key-123", "bearer sekret-key-123"):
            server.check_auth(types.SimpleNamespace(headers={"authorization": good}))
    finally:
        server.dispatcher.close()


def test_two_states_of_equal_token_length_are_two_cache_entries_with_their_own_answers(tiny_engine_dir):
    """The state cache is keyed by the state's token ids, not by anything coarser (its length): two tickets of
    the same token length are two entries, and each is answered about itself."""
    with Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False) as engine:
        one, two = "Order 111 was charged twice.", "Order 999 arrived broken today."
        assert engine.state(one).num_tokens == engine.state(two).num_tokens and len(engine.cache) == 2
        encoded = engine.encode_questions({"q": Noul("Is the customer asking for a refund?")})
        a = engine.option_logprobs(one, encoded)[0]
        b = engine.option_logprobs(two, encoded)[0]
        assert np.abs(a - b).max() > 1e-4 and len(engine.cache) == 2


# -- every limit before its work: spies on the backend's passes and the tokenizer ---------------------------------


class _Passes:
    """Counts the backend's forward passes (prefill chunks, trunk extensions and packed passes all run ``_run``)."""

    def __init__(self, engine, monkeypatch):
        self.count = 0
        real = engine.backend._run

        def run(batch, kv):
            self.count += 1
            return real(batch, kv)

        monkeypatch.setattr(engine.backend, "_run", run)


def test_the_request_token_limit_refuses_before_any_pass_or_trunk_prefill(tiny, monkeypatch):
    """A choice larger than a block has its trunk prefilled onto the state before its options are scored; the
    request's packed-token total must be counted before that prefill (it was counted after it: a refused request
    still ran a prefill of its whole trunk). One token over the total: refused with zero passes; at it: answered."""
    from onepass import Choice

    state = "I was charged twice for my subscription and want my money back."
    questions = {"team": Choice("Which product line is this about?",
                                {f"product line number {i}": None for i in range(120)}),
                 "refund": Noul("Is a refund requested?")}
    encoded = tiny.encode_questions(questions)
    total = sum(batch.num_tokens for _, batch, _ in tiny.passes(tiny.state(state), encoded))
    assert any(over.num_tokens > tiny.state(state).num_tokens for _, _, over in tiny.passes(tiny.state(state), encoded))
    tiny.cache.clear()
    tiny.state(state)  # the state itself is within its own limit: its prefill is allowed work
    passes = _Passes(tiny, monkeypatch)
    with pytest.raises(LimitExceeded, match=f"pack into {total} tokens; this engine allows at most {total - 1}"):
        tiny.with_limits(max_request_tokens=total - 1).option_logprobs(state, encoded)
    assert passes.count == 0 and len(tiny.cache) == 1  # no trunk prefill, no trunk state cached
    tiny.with_limits(max_request_tokens=total).option_logprobs(state, encoded)
    assert passes.count > 0


@pytest.mark.parametrize("limit, field", [("max_questions", "questions"), ("max_options", "options")])
def test_count_limits_refuse_with_nothing_tokenised_and_no_pass(tiny, monkeypatch, limit, field):
    """Questions per request and options per question are counted before any tokenising or pass: one over the
    limit is refused having encoded zero characters; exactly at the limit it is answered."""
    from onepass import Choice

    engine = tiny.with_limits(**{limit: 4})
    counter = _CountingTokenizer(engine.encoder._untrusted)
    monkeypatch.setattr(engine.encoder, "_untrusted", counter)
    passes = _Passes(engine, monkeypatch)

    def request(n):
        if field == "questions":
            return {f"q{i}": Noul(f"Is this about topic {i}?") for i in range(n)}
        return {"q": Choice("Which one?", {f"option {i}": None for i in range(n)})}

    with pytest.raises(LimitExceeded, match="at most 4"):
        engine.ask("A short ticket about a refund.", request(5))
    assert counter.chars == 0 and passes.count == 0
    assert len(engine.ask("A short ticket about a refund.", request(4))) == (4 if field == "questions" else 1)
    assert counter.chars > 0 and passes.count > 0


def test_the_server_refuses_count_limits_while_parsing_before_the_dispatcher(tiny, monkeypatch):
    """Over a count limit the server answers 413 from its parse step (off the event loop, before admission):
    nothing is tokenised and nothing reaches the dispatcher's queue."""
    import json

    from onepass.runtime.server.app import Server
    from onepass.runtime.server.errors import HTTPError, status_of
    from onepass.runtime.server.config import ServerConfig

    server = Server(tiny.with_limits(max_questions=3), ServerConfig())
    try:
        counter = _CountingTokenizer(server.engine.encoder._untrusted)
        monkeypatch.setattr(server.engine.encoder, "_untrusted", counter)
        body = lambda n: json.dumps({"state": "A ticket.", "questions": {  # noqa: E731
            f"q{i}": {"type": "noul", "instructions": f"Is it about {i}?"} for i in range(n)}}).encode()
        with pytest.raises(HTTPError) as err:
            server.parse(body(4))
        assert err.value.status == 413 and counter.chars == 0 and server.dispatcher.depth == 0
        _, _, prepared = server.parse(body(3))
        assert len(prepared.questions) == 3 and prepared.packed_tokens > 0
    finally:
        server.dispatcher.close()


class _Stream:
    """A request whose body arrives in chunks; counts the chunks the server pulled."""

    def __init__(self, size: int, chunk: int, declared: bool = False):
        self.size, self.chunk, self.pulled = size, chunk, 0
        self.headers = {"content-length": str(size)} if declared else {}

    async def stream(self):
        for start in range(0, self.size, self.chunk):
            self.pulled += 1
            yield b"x" * min(self.chunk, self.size - start)


def test_the_body_limit_stops_reading_at_the_limit():
    """A body 10x the limit is refused once the bytes read pass the limit (not after reading it all); a declared
    Content-Length over the limit is refused before any read; a body of exactly the limit is read."""
    from onepass.runtime.server.body import read_raw
    from onepass.runtime.server.errors import BodyTooLarge, status_of

    limit, chunk = 64 * 1024, 4096
    over = _Stream(10 * limit, chunk)
    with pytest.raises(BodyTooLarge) as err:
        asyncio.run(read_raw(over, limit))
    assert status_of(err.value) == 413 and over.pulled == limit // chunk + 1
    declared = _Stream(10 * limit, chunk, declared=True)
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_raw(declared, limit))
    assert declared.pulled == 0
    assert len(asyncio.run(read_raw(_Stream(limit, chunk), limit))) == limit


def test_a_gzip_bomb_is_refused_having_decompressed_at_most_the_limit(monkeypatch):
    """100 MiB of zeros gzipped (~100 KB) against a 1 MiB limit: refused with at most limit + 1 bytes produced;
    a body that decompresses to exactly the limit is accepted."""
    import gzip
    import zlib

    from onepass.runtime.server import body

    produced = []
    real = zlib.decompressobj

    class Counting:
        def __init__(self, *args):
            self.d = real(*args)

        def decompress(self, data, max_length=0):
            out = self.d.decompress(data, max_length)
            produced.append(len(out))
            return out

        def __getattr__(self, name):
            return getattr(self.d, name)

    monkeypatch.setattr(body.zlib, "decompressobj", Counting)
    limit = 1 << 20
    with pytest.raises(LimitExceeded) as err:
        body.decode(gzip.compress(bytes(100 << 20)), "gzip", limit)
    assert "decompressed body exceeds" in str(err.value) and sum(produced) <= limit + 1
    assert len(body.decode(gzip.compress(bytes(limit)), "gzip", limit)) == limit


def test_the_nesting_limit_refuses_before_the_json_parser_runs(monkeypatch):
    """A body nested one deeper than MAX_DEPTH is refused by the linear scan with the parser never called (the
    recursive parser is the work it guards); exactly MAX_DEPTH deep is parsed."""
    from onepass.runtime.server import body

    calls = []
    real = body.json.loads
    monkeypatch.setattr(body.json, "loads", lambda *a, **k: calls.append(1) or real(*a, **k))
    deep = lambda n: ("[" * n + "]" * n).encode()  # noqa: E731
    with pytest.raises(InvalidRequest, match=f"more than {body.MAX_DEPTH} deep"):
        body.parse_json(deep(body.MAX_DEPTH + 1))
    assert calls == []
    parsed = body.parse_json(deep(body.MAX_DEPTH))
    assert calls == [1] and str(parsed).count("[") == body.MAX_DEPTH


def test_the_prior_read_out_of_b_a_after_a_equals_softmax_of_likelihood_minus_the_null_states(tiny_engine_dir):
    """{B, A} asked with the prior read-out after {A} alone (A's prior cached, B's not), then {A, C} (the cached
    one first): each answer equals softmax(log-likelihood - content-free log-likelihood), computed here from
    another engine's passes over the state and over the template's null state."""
    from onepass import Choice

    state = "My card was charged twice for the same order and the app crashed when I tried to cancel."
    a = Choice("Which team should handle this?", {"billing": None, "technical": None, "sales": None})
    b = Choice("How does the customer feel?", {"calm": None, "annoyed": None, "furious": None, "happy": None})
    c = Choice("Which channel was used?", {"email": None, "phone": None, "chat": None, "letter": None})
    with Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False) as engine, \
            Engine.load(tiny_engine_dir, backend="onnxruntime", verify=False) as reference:
        engine.ask(state, {"a": a}, readout="prior")
        got = engine.ask(state, {"b": b, "a": a}, readout="prior")
        got.update(engine.ask(state, {"a": a, "c": c}, readout="prior"))
        null = reference.state(reference.manifest.prompt.null_state)
        for qid, q in (("a", a), ("b", b), ("c", c)):
            (encoded,) = reference.encode_questions({qid: q})
            lp = reference.option_logprobs(state, [encoded])[0]
            prior = reference.option_logprobs(null, [encoded])[0]
            scores = lp - prior
            want = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
            np.testing.assert_allclose(list(got[qid].probabilities.values()), want, rtol=0, atol=1e-6)
            plain = np.exp(lp - lp.max()) / np.exp(lp - lp.max()).sum()
            assert np.abs(plain - want).max() > 1e-3  # the prior changes the answer: a test that could fail


def test_merged_requests_build_no_mask_on_the_engine_thread_and_a_long_trunk_is_prefilled_once(tiny, monkeypatch):
    """Three requests about one state, one of them a choice of 120 options too long for a pass: each question set's
    tree masks are built once, when it is compiled (where the request is prepared), and not again when it is asked
    again and merged: the engine thread joins the compiled passes side by side (``batch.concat``). The long
    question's trunk is prefilled once. Answers equal each request alone. The control: with the compiled sets
    dropped, the same requests build their masks again, one per pass."""
    from onepass import Choice
    from onepass.runtime.backends import batch as batch_module

    state = "The parcel arrived late and the box was damaged."
    requests = [(state, {"a": Noul("Is the parcel late?")}), (state, {"b": Noul("Is the box damaged?")}),
                (state, {"c": Choice("Which product?", {f"product number {i}": None for i in range(120)})})]
    alone = [tiny.run(s, q).answers for s, q in requests]
    for _, q in requests:  # compiled a second time: kept
        tiny.planner.compile(q)
    tiny.cache.clear()
    masks, extends = [], []
    real_mask, real_extend = batch_module.interval_mask, tiny.backend.extend
    monkeypatch.setattr(batch_module, "interval_mask", lambda order: masks.append(len(order)) or real_mask(order))
    monkeypatch.setattr(tiny.backend, "extend", lambda *a, **k: extends.append(1) or real_extend(*a, **k))
    results = tiny.run_many(requests)
    assert masks == [] and extends == [1, 1]  # no mask built; the state's prefill and the long trunk's, once each
    passes = sum(len(tiny.compile(q).passes) for _, q in requests)
    assert passes >= 3  # the long choice is split in parts
    tiny.question_sets.clear()
    tiny.run_many(requests)  # compiled again (and not kept: the sets were forgotten as sighted)
    assert len(masks) == passes
    for got, want in zip(results, alone):
        for qid, answer in want.items():
            a, b = got.answers[qid].to_wire(), answer.to_wire()
            assert a.get("choice") == b.get("choice")
            for k, v in (b.get("probabilities") or {"noul": b.get("noul")}).items():
                assert abs((a.get("probabilities") or {"noul": a.get("noul")})[k] - v) <= 1e-5


def test_run_many_groups_by_the_states_tokens_and_tokenises_each_state_once(tiny, monkeypatch):
    """A JSON state, the same state as its canonical text and a third request about it are one group (equal token
    ids): the state text is tokenised once for the three (the batch's requests are prepared together) and prefilled
    at most once, their answers equal to each alone; a different state is its own group. The cache counts a lookup
    per request, as alone. A bad request (an empty state) fails alone, before any tokenising."""
    from onepass.runtime.core import prompt
    from onepass.runtime.core.prompt import state_text

    ticket = {"ticket": "The parcel arrived late.", "order": 12}
    requests = [(ticket, {"a": Noul("Is the parcel late?")}), (str(state_text(ticket)), {"b": Noul("Is it an order?")}),
                (ticket, {"c": Noul("Is the parcel damaged?")}), ("Another text.", {"d": Noul("Is it late?")}),
                ("  ", {"e": Noul("Is it late?")})]
    alone = [tiny.run(s, q).answers for s, q in requests[:4]]
    tiny.cache.clear()
    tokenised, groups = [], []
    real_state, real_group = prompt.PromptEncoder.state, tiny.run_group
    monkeypatch.setattr(prompt.PromptEncoder, "state", lambda self, text: tokenised.append(text) or
                        real_state(self, text))
    monkeypatch.setattr(tiny, "run_group", lambda prepared, *a, **k: groups.append(len(prepared)) or
                        real_group(prepared, *a, **k))
    hits, misses = tiny.cache.hits, tiny.cache.misses
    results = tiny.run_many(requests)
    assert sorted(groups) == [1, 3] and len(tokenised) == 2  # two state texts, each tokenised once for the batch
    # each request looked the state up as it would alone: the first two misses (two states), the later two hits
    assert (tiny.cache.hits - hits, tiny.cache.misses - misses) == (2, 2)
    assert results[0].cached_tokens == 0 and results[1].cached_tokens == results[1].input_tokens - \
        results[1].packed_tokens  # the first request's prefill served the others
    assert isinstance(results[4], InvalidRequest) and "empty" in str(results[4])
    for got, want in zip(results, alone):
        for qid, answer in want.items():
            assert abs(got.answers[qid].noul - answer.noul) <= 1e-5


def test_the_cascade_goes_through_admission_with_the_requests_deadline(tiny):
    """The cascade's re-asked questions are queued on a dispatcher of their own with the request's deadline (they
    ran in a bare thread pool, past every deadline); a deadline already spent is refused before any cascade pass."""
    import types

    from onepass.runtime.server.app import Server
    from onepass.runtime.server.errors import HTTPError, status_of
    from onepass.runtime.server.config import ServerConfig

    server = Server(tiny, ServerConfig(), cascade=tiny, min_confidence=1.0)  # every answer is doubtful
    try:
        questions = {"q": Noul("Is the parcel late?")}
        result = tiny.run("The parcel arrived late.", questions)
        seen, ran = [], []
        real_submit, real_group = server.cascade_dispatcher.submit, tiny.run_group
        server.cascade_dispatcher.submit = lambda prepared, deadline, budget=None, client=None: \
            seen.append(deadline) or real_submit(prepared, deadline, budget, client)
        tiny.run_group = lambda *a, **k: ran.append(1) or real_group(*a, **k)
        request = types.SimpleNamespace(state=types.SimpleNamespace(deadline=time.monotonic() + 60), headers={})
        out = asyncio.run(server.escalate(request, "The parcel arrived late.", questions, result, {}))
        assert seen == [request.state.deadline] and ran == [1] and request.state.answered_by == "q=" + tiny.name
        assert abs(out.answers["q"].noul - result.answers["q"].noul) <= 1e-6
        late = types.SimpleNamespace(state=types.SimpleNamespace(deadline=time.monotonic() - 1), headers={})
        with pytest.raises(OnepassError) as err:
            asyncio.run(server.escalate(late, "The parcel arrived late.", questions, result, {}))
        assert status_of(err.value) in (413, 429, 503) and ran == [1]  # refused: no cascade pass ran
    finally:
        del tiny.run_group
        server.dispatcher.close()
        server.cascade_dispatcher.close()


def test_the_server_refuses_a_question_over_its_token_bound_while_parsing(tiny, monkeypatch):
    """A question's text over its token bound is 413 from the parse step (before admission, which could answer a
    retryable 429 while others are queued), having tokenised at most about the bound, not the whole text (here
    nothing: its length alone is over what 4096 tokens can hold); one under it is parsed having tokenised its text
    once (no guard's pass: shorter in bytes than the bound)."""
    import json

    from onepass.runtime.server.app import Server
    from onepass.runtime.server.errors import HTTPError, status_of
    from onepass.runtime.server.config import ServerConfig

    server = Server(tiny.with_limits(max_request_tokens=4096), ServerConfig())
    try:
        counter = _CountingTokenizer(server.engine.encoder._untrusted)
        monkeypatch.setattr(server.engine.encoder, "_untrusted", counter)
        body = lambda text: json.dumps({"state": "A ticket.", "questions": {  # noqa: E731
            "q": {"type": "noul", "instructions": text}}}).encode()
        over = "x " * 200_000
        with pytest.raises(HTTPError) as err:
            server.parse(body(over))
        assert err.value.status == 413 and "more than 4096 tokens" in err.value.message
        assert counter.chars < 0.2 * len(over) and server.dispatcher.depth == 0  # by its length, or the bound's
        counter.chars = 0
        text = "Is the customer asking for a refund? " * 20
        server.parse(body(text))
        assert 0 < counter.chars < 1.5 * len(text)  # tokenised once (with the template's spaces), no guard's pass
    finally:
        server.dispatcher.close()


def test_counts_and_lengths_are_checked_before_the_body_is_validated_or_tokenised(tiny, monkeypatch):
    """A body over the questions' count, a question's option count or the state's length (more characters than the
    state limit's tokens can cover) is 413 before any question is built or any text tokenised (parse_request and the
    tokenizer never called); the control: a body within them is parsed and tokenised."""
    import json

    from onepass.runtime.core import wire
    from onepass.runtime.server import app as app_module
    from onepass.runtime.server.app import Server
    from onepass.runtime.server.config import ServerConfig
    from onepass.runtime.server.errors import HTTPError

    server = Server(tiny.with_limits(max_questions=8, max_options=4), ServerConfig())
    built = []
    monkeypatch.setattr(app_module, "parse_request", lambda data: built.append(1) or wire.parse_request(data))
    counter = _CountingTokenizer(server.engine.encoder._untrusted)
    monkeypatch.setattr(server.engine.encoder, "_untrusted", counter)
    noul = {"type": "noul", "instructions": "Is it late?"}
    limit = server.engine.manifest.limits.max_state_tokens * server.engine.encoder.token_chars
    try:
        for body, says in (({"state": "x", "questions": {f"q{i}": noul for i in range(9)}}, "9 questions"),
                           ({"state": "x", "questions": {"q": {"type": "choice", "instructions": "Which?",
                                                               "criteria": [f"o{i}" for i in range(5)]}}},
                            "5 options"),
                           ({"state": "a" * (limit + 1), "questions": {"q": noul}}, "the state is more than")):
            with pytest.raises(HTTPError) as err:
                server.parse(json.dumps(body).encode())
            assert err.value.status == 413 and says in err.value.message, err.value.message
        assert built == [] and counter.chars == 0
        server.parse(json.dumps({"state": "The parcel arrived late.", "questions": {"q": noul}}).encode())
        assert built == [1] and counter.chars > 0
    finally:
        server.dispatcher.close()
