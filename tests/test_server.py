"""`onepass serve` over loopback: the official SDK unchanged, error mapping, fuzzing, load, merging, MCP."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
typesafe_sdk = pytest.importorskip("typesafe_sdk")

from conftest import fuzz_cases  # noqa: E402
from onepass import Choice, Engine, Noul, Score  # noqa: E402
from onepass.runtime.backends import BACKENDS  # noqa: E402
from onepass.runtime.server.app import create_app  # noqa: E402
from onepass.runtime.server.config import ServerConfig  # noqa: E402

pytestmark = pytest.mark.slow
TICKET = ("Hi, I was charged twice for my Pro subscription this month. Please refund the second payment. "
          "This is the second time this has happened and I am getting really annoyed. ") * 8  # > 1 KiB: zstd
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer request a refund?"},
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"billing": "payments, refunds", "technical": None, "sales": None}},
    "mood": {"type": "score", "instructions": "How frustrated is the customer?",
             "criteria": ["Calm", "Frustrated", "Very angry"]},
}
PROB_TOL = 1e-4  # merged vs alone: packed == separate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(engine, wait_ready: bool = True, **settings):
    """A real uvicorn server on a loopback port, in a thread; yields its base URL once /readyz says ready
    (the warm-up runs in the background), or as soon as it accepts connections with ``wait_ready=False``."""
    config = ServerConfig(port=_free_port(), **settings)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, config), host="127.0.0.1", port=config.port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    base = f"http://127.0.0.1:{config.port}"
    while wait_ready and get(base, "/readyz")[0] != 200:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not become ready")
        time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def url(engine):
    with running(engine) as base:
        yield base


def post(url: str, body, headers: dict | None = None, raw: bytes | None = None, path="/v1/systemone"):
    """(status, headers, json body) of a POST; never raises on HTTP errors."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read() or b"null")


def get(url: str, path: str, headers: dict | None = None):
    req = urllib.request.Request(url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def sdk_client(url: str, **kwargs):
    from typesafe_sdk import RetryPolicy, TypeSafeClient

    return TypeSafeClient(api_key=kwargs.pop("api_key", "test-key"), base_url=url,
                          retry=RetryPolicy(max_retries=0), **kwargs)


# -- the official SDK, unchanged ------------------------------------------------------------------


def test_sdk_answers_equal_engine_ask(url, engine, caplog):
    from typesafe_sdk import Choice as SChoice, Noul as SNoul, Score as SScore

    caplog.set_level("INFO", logger="onepass.access")
    with sdk_client(url) as client:
        result = client.system_one(state=TICKET, questions={
            "refund": SNoul(instructions=QUESTIONS["refund"]["instructions"]),
            "team": SChoice(instructions=QUESTIONS["team"]["instructions"], criteria=QUESTIONS["team"]["criteria"]),
            "mood": SScore(instructions=QUESTIONS["mood"]["instructions"], criteria=QUESTIONS["mood"]["criteria"]),
        })
    want = engine.ask(TICKET, {"refund": Noul(QUESTIONS["refund"]["instructions"]),
                               "team": Choice(QUESTIONS["team"]["instructions"], QUESTIONS["team"]["criteria"]),
                               "mood": Score(QUESTIONS["mood"]["instructions"], QUESTIONS["mood"]["criteria"])})
    answers = result.answers
    assert answers["refund"].noul == pytest.approx(want["refund"].noul, abs=1e-9)
    assert answers["team"].choice == want["team"].choice
    assert answers["team"].probabilities == pytest.approx(want["team"].probabilities, abs=1e-9)
    assert answers["mood"].score == pytest.approx(want["mood"].score, abs=1e-9)
    assert answers["mood"].legend == {0: "Calm", 1: "Frustrated", 2: "Very angry"}
    assert result.usage.input_tokens > 100 and result.usage.output_tokens == 0
    encodings = [json.loads(r.getMessage()).get("encoding") for r in caplog.records if r.name == "onepass.access"]
    assert "zstd" in encodings, "the SDK should have sent a zstd-compressed body (>= 1 KiB)"


def test_sdk_lists_models(url, engine):
    with sdk_client(url) as client:
        names = [m.name for m in client.models.list().models]
    assert engine.name in names and "jev-latest" in names


@pytest.mark.parametrize("case, error", [
    ("unknown model", "TypeSafeNotFoundError"),
    ("bad question", "TypeSafeUnprocessableEntityError"),
])
def test_sdk_raises_the_matching_exception(url, case, error):
    import typesafe_sdk
    from typesafe_sdk import Choice as SChoice, Noul as SNoul

    with sdk_client(url, model="no-such-model" if case == "unknown model" else None) as client:
        questions = {"q": SNoul(instructions="Is it?")} if case == "unknown model" else {
            "q": SChoice(instructions="Pick", criteria={"only": None})}
        with pytest.raises(getattr(typesafe_sdk, error)):
            client.system_one(state="some text", questions=questions)


def test_sdk_authentication(engine):
    import typesafe_sdk
    from typesafe_sdk import Noul as SNoul

    with running(engine, api_key="s3cret") as base:
        with sdk_client(base, api_key="wrong") as client, pytest.raises(typesafe_sdk.TypeSafeAuthenticationError):
            client.system_one(state="text", questions={"q": SNoul(instructions="Is it?")})
        with sdk_client(base, api_key="s3cret") as client:
            assert 0 <= client.system_one(state="text", questions={"q": SNoul(instructions="Is it?")}).answers[
                "q"].noul <= 1


# -- wire details and error mapping ---------------------------------------------------------------


def test_gzip_body_and_request_id(url):
    body = gzip.compress(json.dumps({"model": "jev-latest", "state": TICKET, "questions": QUESTIONS}).encode())
    status, headers, resp = post(url, None, {"Content-Encoding": "gzip"}, raw=body)
    assert status == 200 and set(resp["answers"]) == set(QUESTIONS)
    assert resp["answers"]["mood"]["probabilities"].keys() == {"0", "1", "2"}
    assert len(headers["x-typesafe-request-id"]) == 32


@pytest.mark.parametrize("body, raw, headers, status, field", [
    (None, b"{not json", {}, 400, None),
    (None, b"\x28\xb5\x2f\xfd garbage", {"Content-Encoding": "zstd"}, 400, None),
    (None, b"{}", {"Content-Encoding": "br"}, 400, None),
    ({"model": "gpt-5", "state": "x", "questions": QUESTIONS}, None, {}, 404, "model"),
    ({"model": "jev-latest", "questions": QUESTIONS}, None, {}, 422, "state"),
    ({"model": "jev-latest", "state": 5, "questions": QUESTIONS}, None, {}, 422, "state"),
    ({"model": "jev-latest", "state": "x", "questions": {}}, None, {}, 422, "questions"),
    ({"model": "jev-latest", "state": "x", "questions": {"q": {"type": "score", "instructions": "How?",
                                                                 "criteria": ["one"]}}}, None, {}, 422,
     "questions.q.criteria"),
    ({"model": "jev-latest", "state": "x", "questions": {"q": {"type": "poll", "instructions": "x"}}}, None, {},
     422, "questions.q.type"),
    ({"model": "jev-latest", "state": "x", "questions": {"q": {"type": "choice", "instructions": "x",
                                                                 "criteria": {"a": None, "a ": None}}}},
     None, {}, 422, "questions.q.criteria"),
    ({"model": "jev-latest", "state": "x", "assets": {"img": {"type": "image"}}, "questions": QUESTIONS},
     None, {}, 422, "assets"),
])
def test_error_statuses(url, body, raw, headers, status, field):
    got, resp_headers, resp = post(url, body, headers, raw=raw)
    assert got == status, resp
    assert isinstance(resp["error"]["message"], str) and resp["error"]["message"]
    if field:
        assert resp["error"]["field"] == field
    assert resp_headers["x-typesafe-request-id"]


def test_unknown_paths_and_methods_answer_in_the_error_format(url):
    """A wrong path or method gets the same {"error": {message, field}} body as every other error (the SDK parses
    it), with the request id; a trailing slash is a 404, not a redirect built from the client's Host header. The
    control: the same body at the right path and method is answered."""
    for method, path, status, says in (("GET", "/v1/systemone", 405, "GET is not allowed on /v1/systemone"),
                                       ("DELETE", "/v1/systemone", 405, "allowed: POST"),
                                       ("POST", "/v1/systemonex", 404, "nothing at POST /v1/systemonex"),
                                       ("POST", "/v1/systemone/", 404, "the service answers POST /v1/systemone"),
                                       ("POST", "/v1%2Fsystemone", 404, "has an encoded slash"),
                                       ("POST", "/v1%2fsystemone", 404, "has an encoded slash"),
                                       ("POST", "/v1/systemone%5C", 404, "has an encoded slash or backslash"),
                                       ("HEAD", "/v1/systemone", 405, "")):
        data = json.dumps({"state": "x", "questions": QUESTIONS}).encode() if method == "POST" else None
        req = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:  # urllib follows no 307 for a POST: it raises it
            urllib.request.urlopen(req, timeout=60)
        assert caught.value.code == status and caught.value.headers["x-typesafe-request-id"]
        if method == "HEAD":  # no body to a HEAD
            continue
        body = json.loads(caught.value.read())
        assert says in body["error"]["message"] and body["error"]["field"] is None
    assert post(url, {"state": "x", "questions": QUESTIONS})[0] == 200


def test_the_probes_answer_head_with_their_status_and_no_body(url):
    """HEAD /healthz, /readyz and /metrics (what some probes send) answer their GET's status with no body (they
    were 405). The control: GET still has the body."""
    for path in ("/healthz", "/readyz", "/metrics"):
        req = urllib.request.Request(url + path, method="HEAD")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200 and resp.read() == b"", path
    assert json.loads(get(url, "/healthz")[2]) == {"status": "ok"}


def test_bodies_over_the_size_limit_are_413(engine):
    """Small limit, so the whole request fits in socket buffers and the client always reads the answer."""
    import zstandard

    big = {"model": "jev-latest", "state": "word " * 1500, "questions": QUESTIONS}
    bomb = zstandard.ZstdCompressor().compress(json.dumps({**big, "state": "a" * 200_000}).encode())
    with running(engine, max_body_bytes=4096) as base:
        status, headers, resp = post(base, big)
        assert status == 413 and "4096" in resp["error"]["message"] and headers["x-typesafe-request-id"]
        assert len(bomb) < 4096
        status, _, resp = post(base, None, {"Content-Encoding": "zstd"}, raw=bomb)  # small on the wire only
        assert status == 413 and "decompressed body exceeds 4096" in resp["error"]["message"]


def test_state_over_the_engine_limit_is_413(engine):
    manifest = dataclasses.replace(engine.manifest, limits=dataclasses.replace(engine.manifest.limits,
                                                                               max_state_tokens=64))
    small = Engine(engine.root, manifest, engine.backend)
    with running(small) as base:
        status, _, resp = post(base, {"model": "jev-latest", "state": TICKET, "questions": QUESTIONS})
    assert status == 413 and "at most 64" in resp["error"]["message"] and resp["error"]["field"] == "state"


def test_health_ready_models_metrics(url, engine):
    assert get(url, "/healthz")[0] == 200
    status, _, body = get(url, "/readyz")
    assert status == 200 and json.loads(body)["status"] == "ready"
    assert json.loads(body)["backend"] == engine.backend.name in BACKENDS  # the table's name of the serving backend
    names = [m["name"] for m in json.loads(get(url, "/v1/models")[2])["models"]]
    assert names[0] == engine.name and "jev-latest" in names
    post(url, {"model": "jev-latest", "state": "metrics", "questions": {"q": QUESTIONS["refund"]}})
    text = get(url, "/metrics")[2].decode()
    for name in ("onepass_requests_total", "onepass_request_seconds_bucket", "onepass_queue_depth",
                 "onepass_state_cache_hits_total", "onepass_state_cache_bytes", "onepass_tokens_total"):
        assert name in text, name
    # the Server-Timing stages as histograms: every stage of the answered request was observed
    counts = dict(re.findall(r'^onepass_stage_seconds_count\{stage="(\w+)"\} (\S+)$', text, re.M))
    assert {k for k, v in counts.items() if float(v) >= 1} >= {"queue", "tokenize", "prefill", "pack", "score", "readout"}


# -- merging ----------------------------------------------------------------------------------------


def _probs(answer) -> dict:
    return getattr(answer, "probabilities", None) or {"yes": answer.noul}


def test_merged_requests_equal_each_request_alone(engine):
    from onepass.runtime.core.wire import parse_request

    bodies = [{"state": TICKET, "questions": {"a": QUESTIONS["refund"], "b": QUESTIONS["team"]}},
              {"state": TICKET, "questions": {"a": QUESTIONS["mood"]}},
              {"state": "another state entirely", "questions": {"x": QUESTIONS["team"]}},
              {"state": TICKET, "questions": {"bad": {"type": "score", "instructions": "x", "criteria": ["1"]}}}]
    from onepass.runtime.core.errors import OnepassError

    good = [parse_request(b) for b in bodies[:3]]
    with pytest.raises(OnepassError, match="criteria"):  # a one-level score is refused at parse time
        parse_request(bodies[3])
    merged = engine.run_many(good)
    assert len(merged) == len(good) == 3
    for (state, questions), result in zip(good, merged):
        alone = engine.run(state, questions)
        assert result.input_tokens == alone.input_tokens
        for qid, a in alone.answers.items():
            for k, p in _probs(a).items():
                assert abs(_probs(result.answers[qid])[k] - p) <= PROB_TOL, (qid, k)


def test_merged_pass_is_really_shared(engine):
    """Negative control for the test above: merging changes the packed pass (more tokens, one call)."""
    from onepass.runtime.core.wire import parse_request

    calls = []
    original = engine.backend.score_all

    def counting(kv, batch):
        calls.append(batch.num_tokens)
        return original(kv, batch)

    requests = [parse_request({"state": TICKET, "questions": {"a": QUESTIONS["refund"]}}),
                parse_request({"state": TICKET, "questions": {"b": QUESTIONS["team"]}})]
    engine.backend.score_all = counting
    try:
        engine.run_many(requests)
    finally:
        engine.backend.score_all = original
    alone = [engine.pack(engine.state(TICKET), engine.encode_questions(q)).num_tokens for _, q in requests]
    assert len(calls) == 1 and calls[0] > max(alone)


# -- fuzzing and load --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_url(tiny_engine_dir):
    """A real server of the tiny Llama (the real tokenizer and limits): for tests of the transport and the status
    mapping, where a request answered by SmolLM2 would only cost time."""
    from onepass import Engine

    with running(Engine.load(tiny_engine_dir, backend="onnxruntime")) as base:
        yield base


def test_a_request_is_parsed_grouped_and_packed_once(tiny_url, monkeypatch):
    """One HTTP request, one of each step: parse_request once, each question built once, the state made text once
    (then carried as a StateText: the dispatcher's grouping and the engine read it as it is) and tokenised once,
    grouped once (by the dispatcher's queue; the engine's run_group does not group again, run_many is not called) and
    packed once (its questions tokenised once and one tree mask for its one pass, when the set is compiled). A set
    compiled a second time is kept: the same body a third time is neither tokenised nor packed."""
    from onepass.runtime.backends import batch as batch_module
    from onepass.runtime.core import engine as engine_module
    from onepass.runtime.core import prompt
    from onepass.runtime.core import wire as wire_module
    from onepass.runtime.server import app as app_module

    calls: dict = {}

    def count(owner, name):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)

    class Counted(prompt.StateText):
        __slots__ = ()

        def __new__(cls, text):
            calls["state text"] = calls.get("state text", 0) + 1
            return super().__new__(cls, text)

    monkeypatch.setattr(prompt, "StateText", Counted)
    count(app_module, "parse_request")
    count(wire_module, "from_wire")
    count(prompt.PromptEncoder, "state")
    count(engine_module.Engine, "run_group")
    count(engine_module.Engine, "run_many")
    count(prompt.PromptEncoder, "question")
    count(batch_module, "interval_mask")
    body = {"state": {"ticket": "A parcel arrived late.", "id": 7},  # a JSON state: made text once
            "questions": {"a": {"type": "noul", "instructions": "Was this parcel counted once?"},
                          "b": QUESTIONS["team"]}}
    status, _, _ = post(tiny_url, body)
    assert status == 200
    assert calls == {"parse_request": 1, "from_wire": 2, "state text": 1, "state": 1, "question": 2,
                     "run_group": 1, "interval_mask": 1}, calls
    assert post(tiny_url, body)[0] == 200
    calls.clear()
    assert post(tiny_url, body)[0] == 200
    assert calls == {"parse_request": 1, "from_wire": 2, "state text": 1, "state": 1, "run_group": 1}, calls


def test_fuzzed_bodies_never_yield_5xx(tiny_url):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    text = st.text(max_size=40)
    json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
                              lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                              max_leaves=6)
    kinds = st.sampled_from(["noul", "choice", "score", "box", "other"])
    criteria = (st.dictionaries(text, st.none() | text, max_size=12) | st.lists(text, max_size=12) | json_value)
    question = st.fixed_dictionaries({"type": kinds}, optional={"instructions": text | json_value,
                                                                 "criteria": criteria})
    plausible = st.fixed_dictionaries({"model": st.sampled_from(["jev-latest", "nope"]), "state": text | json_value,
                                       "questions": st.dictionaries(text, question, min_size=1, max_size=3)},
                                      optional={"assets": st.none() | json_value})
    garbage = st.fixed_dictionaries({}, optional={
        "model": json_value, "state": json_value, "questions": st.dictionaries(text, json_value) | json_value})
    words = st.text(min_size=1, max_size=60).filter(str.strip)
    answerable = st.fixed_dictionaries({"model": st.just("jev-latest"), "state": words, "questions": st.dictionaries(
        text, st.fixed_dictionaries({"type": st.just("noul"), "instructions": words}), min_size=1, max_size=3)})
    body = plausible | answerable | garbage | json_value
    statuses = []

    # 500 over HTTP (the transport and status mapping); the 4,000-body fuzz of every check before inference
    # runs without sockets in test_hardening.py
    examples = fuzz_cases(500)

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body)
    def check(b):
        status, _, resp = post(tiny_url, b)
        statuses.append(status)
        assert status < 500, (b, resp)

    check()
    assert len(statuses) >= examples and get(tiny_url, "/healthz")[0] == 200
    assert {200, 404, 422} <= set(statuses), "the generator should reach every outcome"
    print("fuzz statuses:", {s: statuses.count(s) for s in sorted(set(statuses))})


def test_bounded_load_loses_nothing(url):
    body = {"model": "jev-latest", "state": TICKET, "questions": {"refund": QUESTIONS["refund"]}}
    post(url, body)  # the state is cached from here on

    def one(i):
        t0 = time.perf_counter()
        status, _, resp = post(url, {**body, "questions": {f"q{i}": QUESTIONS["refund"]}})
        return status, resp, time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(one, range(256)))
    assert [s for s, _, _ in results].count(200) == 256
    assert all(list(r["answers"]) == [f"q{i}"] for i, (_, r, _) in enumerate(results))
    lat = np.array([t for _, _, t in results]) * 1000
    print(f"load: 256 requests, 32 clients: p50 {np.percentile(lat, 50):.0f} ms, p99 {np.percentile(lat, 99):.0f} ms")


def test_full_queue_answers_429_with_retry_after(engine):
    body = {"model": "jev-latest", "state": TICKET, "questions": QUESTIONS}
    with running(engine, max_queue=1, batch_window_ms=0) as base:
        with ThreadPoolExecutor(max_workers=12) as pool:
            results = list(pool.map(lambda _: post(base, body), range(12)))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 1
    # the configured floor (1 s) or the queue's estimated wait, whichever is longer: a whole number of seconds
    assert all(h["Retry-After"].isdigit() and int(h["Retry-After"]) >= 1 for s, h, _ in results if s == 429)


# -- MCP -------------------------------------------------------------------------------------------


def test_mcp_tools_over_stdio(engine_dir, engine):
    import asyncio

    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    backend = os.environ.get("ONEPASS_TEST_BACKEND") or "onnxruntime"  # the engine fixture's: answers compared
    params = StdioServerParameters(command=sys.executable, args=["-m", "onepass", "mcp", "--engine",
                                                                 str(engine_dir), "--backend", backend])

    async def session():
        async with Client(params) as client:
            tools = {t.name for t in (await client.list_tools()).tools}
            picked = await client.call_tool("choice", {"state": TICKET, "instructions": "Which team?",
                                                       "options": {"billing": None, "technical": None}})
            bad = await client.call_tool("score", {"state": TICKET, "instructions": "How?", "levels": ["one"]})
            yes = await client.call_tool("noul", {"state": TICKET, "instructions": "Is a refund requested?",
                                                  "true": "the customer wants money back"})
            rated = await client.call_tool("score", {"state": TICKET, "instructions": "How frustrated?",
                                                     "levels": ["Calm", "Frustrated", "Very angry"]})
            return tools, picked.structured_content, bad.structured_content, yes.structured_content, \
                rated.structured_content

    tools, picked, bad, yes, rated = asyncio.run(asyncio.wait_for(session(), timeout=240))
    assert tools == {"noul", "choice", "score"}
    asked = {"q": Choice("Which team?", {"billing": None, "technical": None}),
             "y": Noul("Is a refund requested?", {"true": "the customer wants money back"}),
             "s": Score("How frustrated?", ["Calm", "Frustrated", "Very angry"])}
    want = {k: engine.ask(TICKET, {k: q})[k] for k, q in asked.items()}  # each alone, as each tool call is
    assert picked["choice"] == want["q"].choice
    assert picked["probabilities"] == pytest.approx(want["q"].probabilities, abs=1e-6)
    assert "2 to 10 levels" in bad["error"]
    assert yes["noul"] == pytest.approx(want["y"].noul, abs=1e-6)  # the criteria reach the prompt as asked alone
    assert rated["score"] == pytest.approx(want["s"].score, abs=1e-5)
    assert rated["probabilities"] == pytest.approx(want["s"].probabilities, abs=1e-6)
    assert rated["legend"] == {"0": "Calm", "1": "Frustrated", "2": "Very angry"}


def test_readyz_is_503_until_the_warm_up_ends_while_healthz_answers(engine, monkeypatch):
    """The server accepts connections at once and warms up in the background: /healthz 200 and /readyz 503 while
    warming, /readyz 200 after (the README's readiness claim, over real HTTP)."""
    from onepass.runtime.server import app as app_module

    release = threading.Event()
    real = app_module.Server.warm_up

    def slow_warm_up(self):
        release.wait(60)
        real(self)

    monkeypatch.setattr(app_module.Server, "warm_up", slow_warm_up)
    with running(engine, wait_ready=False) as base:
        assert get(base, "/healthz")[0] == 200
        status, _, body = get(base, "/readyz")
        assert status == 503 and json.loads(body)["status"] == "warming up"
        release.set()
        deadline = time.monotonic() + 60
        while get(base, "/readyz")[0] != 200:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.05)


def test_bench_against_a_real_server_and_in_process(url, engine_dir, tmp_path, capsys):
    """`onepass bench` over HTTP against the running server (open loop at 5 req/s and closed loop at 2 senders,
    one second each) and in process: every request answered, the report files written and parsed."""
    from onepass.cli import main

    questions = tmp_path / "q.json"
    questions.write_text(json.dumps(QUESTIONS))
    state = tmp_path / "state.txt"
    state.write_text(TICKET)
    assert main(["bench", "--url", url, "--state", str(state), "--questions", str(questions), "--rate", "5",
                 "--concurrency", "2", "--duration", "1", "--warmup", "1", "--report", str(tmp_path / "http")]) == 0
    report = json.loads((tmp_path / "http" / "bench.json").read_text())
    assert [r["mode"] for r in report["runs"]] == ["open", "closed"]
    assert all(r["requests"] > 0 and not r["failures"] and r["p50"] <= r["p99"] for r in report["runs"])
    assert "| open | 5 |" in (tmp_path / "http" / "bench.md").read_text()
    assert (tmp_path / "http" / "latency_cdf.png").stat().st_size > 0
    assert [p for p, _ in report["runs"][0]["cdf"]][:2] == [0.0, 1.0]
    old = str(tmp_path / "http" / "bench.json")
    assert main(["bench", "--url", url, "--state", str(state), "--questions", str(questions), "--rate", "5",
                 "--concurrency", "2", "--duration", "1", "--warmup", "1", "--compare", old]) == 0
    assert "open   5 req/s: new/old p50 " in capsys.readouterr().out
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"r": QUESTIONS["refund"]}))
    assert main(["bench", "--url", url, "--state", str(state), "--questions", str(other), "--duration", "1",
                 "--compare", old]) == 2
    assert "--compare refused: the workload differs" in capsys.readouterr().err
    assert main(["bench", "--engine", str(engine_dir), "--state", str(state), "--questions", str(questions),
                 "--backend", "onnxruntime", "--kind", "warm", "--duration", "1", "--warmup", "1"]) == 0
    assert "onnxruntime warm closed concurrency 1: " in capsys.readouterr().out


def test_bench_with_an_unreachable_url_is_a_one_line_error(tmp_path, capsys):
    from onepass.cli import main

    questions = tmp_path / "q.json"
    questions.write_text(json.dumps(QUESTIONS))
    assert main(["bench", "--url", f"http://127.0.0.1:{_free_port()}", "--state", str(questions),
                 "--questions", str(questions), "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach http://127.0.0.1:") and err.count("\n") == 1


def test_limits_endpoint_reports_the_effective_limits(url, engine):
    status, _, raw = get(url, "/v1/limits")
    limits = json.loads(raw)
    m = engine.manifest.limits
    assert status == 200 and limits["engine"] == engine.name
    assert (limits["max_state_tokens"], limits["max_packed_tokens"], limits["max_questions"], limits["max_options"]) \
        == (m.max_state_tokens, m.max_packed_tokens, m.max_questions, m.max_options)
    assert limits["max_levels"] == 10 and limits["max_body_bytes"] == ServerConfig().max_body_bytes


def test_server_timing_stages_and_cached_tokens(url, engine):
    """Every answer carries Server-Timing with queue, tokenize, prefill, pack, score, readout and total; the stages
    never add up to more than the total; a new state is prefilled (x-onepass-cached-tokens 0, prefill > 0), the
    same state again comes from the cache (its token count, prefill 0)."""
    state = f"A state never seen before: {time.time_ns()}. I want my money back."
    body = {"model": "jev-latest", "state": state, "questions": {"r": QUESTIONS["refund"]}}

    def timed():
        status, headers, _ = post(url, body)
        assert status == 200
        stages = dict(part.split(";dur=") for part in headers["Server-Timing"].split(", "))
        return {k: float(v) for k, v in stages.items()}, int(headers["x-onepass-cached-tokens"])

    first, cached_first = timed()
    second, cached_second = timed()
    for t in (first, second):
        assert list(t) == ["queue", "tokenize", "prefill", "pack", "score", "readout", "total"]
        assert sum(v for k, v in t.items() if k != "total") <= t["total"] + 0.05  # rounding of 6 values
    assert cached_first == 0 and first["prefill"] > 0
    assert cached_second == engine.state(state).num_tokens and second["prefill"] == 0.0


def test_a_server_cascade_re_asks_only_doubtful_questions_of_the_second_engine(engine):
    """--cascade: with the threshold between the two answers' confidences, the less certain question is answered
    by the second engine (here the same weights under another name, so its answer is that engine asked alone),
    the other by the first; the wire format is unchanged and x-onepass-answered-by says who answered what."""
    strong = Engine(engine.root, dataclasses.replace(engine.manifest, name="strong-engine"), engine.backend)
    questions = {"refund": QUESTIONS["refund"], "team": QUESTIONS["team"]}
    body = {"model": "jev-latest", "state": TICKET, "questions": questions}
    alone = engine.request(body)["answers"]
    conf = {"refund": abs(2 * alone["refund"]["noul"] - 1), "team": alone["team"]["confidence"]}
    low, high = sorted(conf, key=conf.get)
    assert conf[high] - conf[low] > 1e-3  # the threshold can sit between them
    threshold = (conf[low] + conf[high]) / 2
    with running(engine) as base:  # control: no cascade, no header
        _, headers, _ = post(base, body)
        assert "x-onepass-answered-by" not in headers
    from onepass.runtime.server.app import create_app

    config = ServerConfig(port=_free_port())
    server = uvicorn.Server(uvicorn.Config(create_app(engine, config, cascade=strong, min_confidence=threshold),
                                           host="127.0.0.1", port=config.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{config.port}"
        deadline = time.monotonic() + 60
        while not server.started or get(base, "/readyz")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status, headers, got = post(base, body)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert status == 200 and set(got["answers"]) == {"refund", "team"}
    by = dict(part.split("=") for part in headers["x-onepass-answered-by"].split(","))
    assert by == {low: "strong-engine", high: engine.name}
    strong_alone = strong.request({**body, "questions": {low: questions[low]}})["answers"][low]
    assert got["answers"][low] == strong_alone and got["answers"][high] == alone[high]


def test_serve_cascade_without_a_threshold_is_a_one_line_error(tmp_path, capsys):
    """Refused before any engine is loaded: the engine folders here hold nothing, and the error is the flags'."""
    from onepass.cli import main

    assert main(["serve", "--engine", str(tmp_path / "a"), "--cascade", str(tmp_path / "b"), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "--cascade DIR needs --min-confidence" in err and len(err.strip().splitlines()) == 1


def test_statuses_come_from_error_types_not_message_words():
    """A state that is not UTF-8 (NotText) is 400; any other invalid request is 422 even when its message says
    "UTF-8" about the state (the status was once chosen by matching those words); limits are 413."""
    from onepass.runtime.core.errors import InvalidRequest, LimitExceeded, NotText
    from onepass.runtime.server.errors import http_error

    assert http_error(NotText("the state is not valid UTF-8 (byte 3)", "state")).status == 400
    assert http_error(InvalidRequest("must be UTF-8 text of at most 10 lines", "state")).status == 422
    assert http_error(LimitExceeded("the state is 9000 tokens", "state")).status == 413
