"""A hostile request can only fail itself — limits before work, parsing that cannot crash,
deadline-aware admission, bounded metrics, memory that returns.

* a parser-level fuzz of 10,000+ bodies (no inference): every outcome is an answerable request or
  a typed 4xx, never another exception;
* hostile requests (deep nesting, huge numbers, broken compression, over-limit texts) against a real ``onepass serve`` process over loopback, under
  an address-space cap: each gets its 4xx while valid requests beside it get 200 with unchanged
  answers; the process lives, its RSS stays bounded, every response is counted and logged;
* 1,000 unknown paths leave /metrics bounded; a burst past capacity never answers after a deadline.
"""

from __future__ import annotations

import gzip
import json
import random
import resource
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
zstandard = pytest.importorskip("zstandard")

from onepass.runtime.core.errors import OnepassError  # noqa: E402
from onepass.runtime.server.app import Server  # noqa: E402
from onepass.runtime.server.body import MAX_DEPTH, decode, nesting_depth, parse_json  # noqa: E402
from onepass.runtime.server.errors import HTTPError, status_of  # noqa: E402
from onepass.runtime.server.config import ServerConfig  # noqa: E402
from onepass.runtime.server.memory import rss_bytes  # noqa: E402
from conftest import fuzz_cases, serve_process  # noqa: E402
from test_server import _free_port  # noqa: E402

pytestmark = pytest.mark.slow
NOUL = {"type": "noul", "instructions": "Does the customer ask for a refund?"}
TICKET = "I was charged twice for my subscription this month. Please refund the second payment."
ADDRESS_SPACE_CAP = 4 << 30  # the server process may not map more than this (it needs about 1.5 GiB)
RSS_RATIO = 1.2  # RSS after 100 hostile requests / RSS after warm-up (the bound held)


def body(state=TICKET, questions=None, **extra) -> bytes:
    return json.dumps({"model": "jev-latest", "state": state, "questions": questions or {"r": NOUL},
                       **extra}).encode()


def hostile() -> dict:
    """name -> (raw body, headers, expected status): the requests that took the old server down or got 500."""
    nested = b'{"a": ' * 960 + b"1" + b"}" * 960  # written out: json.dumps itself would recurse too deeply
    deep = body(questions={"q": {"type": "noul", "instructions": "N"}}).replace(b'"N"', nested)
    gz = gzip.compress(body())
    zs = zstandard.ZstdCompressor(write_checksum=True).compress(body())
    surrogate = b'{"model": "jev-latest", "state": "hi", "questions": {"\\ud800": ' + json.dumps(NOUL).encode() + b"}}"
    return {
        "instructions_40k_tokens": (body(questions={"q": {"type": "noul", "instructions": "x " * 40000}}), {}, 413),
        "instructions_200k_tokens": (body(questions={"q": {"type": "noul", "instructions": "x " * 200000}}), {}, 413),
        "state_200k_tokens": (body(state="x " * 200000), {}, 413),
        # about 14,000 tokens of work with half a second to do it: refused at admission as never fitting (413), at
        # any speed this machine could have; under the server's 10 s default the status would depend on the
        # machine's load (429 with the valid requests queued beside it)
        "many_questions_small_mask": (body(questions={f"q{i}": {"type": "noul", "instructions": f"Is it {i} " * 40}
                                                      for i in range(64)}), {"X-Request-Timeout": "0.5"}, 413),
        "nested_10000_brackets": (b'{"model": "jev-latest", "state": ' + b"[" * 10000 + b"]" * 10000
                                  + b', "questions": {}}', {}, 400),
        "instructions_nested_960": (deep, {}, 400),
        "integer_5000_digits": (b'{"model": "jev-latest", "state": ' + b"9" * 5000 + b', "questions": {"r": '
                                + json.dumps(NOUL).encode() + b"}}", {}, 422),
        "lone_surrogate_question_id": (surrogate, {}, 422),
        "gzip_without_trailer": (gz[:-8], {"Content-Encoding": "gzip"}, 400),
        "gzip_trailing_garbage": (gz + b"garbage", {"Content-Encoding": "gzip"}, 400),
        "zstd_truncated": (zs[:-6], {"Content-Encoding": "zstd"}, 400),
    }


# -- parsing that cannot crash (no inference) ------------------------------------------------------------


def test_compressed_bodies_are_verified_to_the_end():
    raw = body()
    gz, zs = gzip.compress(raw), zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    assert decode(gz, "gzip", 1 << 20) == raw and decode(zs, "zstd", 1 << 20) == raw
    corrupt_crc = gz[:-8] + bytes([gz[-8] ^ 1]) + gz[-7:]
    for bad, enc in [(gz[:-8], "gzip"), (gz + b"x", "gzip"), (corrupt_crc, "gzip"), (zs[:-6], "zstd"),
                     (zs + zs, "zstd"), (zs[:-1] + bytes([zs[-1] ^ 1]), "zstd")]:
        with pytest.raises(OnepassError) as err:
            decode(bad, enc, 1 << 20)
        assert status_of(err.value) == 400, (enc, str(err.value))
    bomb = zstandard.ZstdCompressor().compress(b" " * (64 << 20))  # 64 MiB of spaces in a few KiB
    with pytest.raises(OnepassError) as err:
        decode(bomb, "zstd", 1 << 20)
    assert status_of(err.value) == 413


def test_nesting_depth_ignores_brackets_in_strings():
    assert nesting_depth(b'{"a": [1, {"b": "[[[[\\" [[["}]}') == 3
    assert nesting_depth(b'"[[[["') == 0 and nesting_depth(b"1") == 0
    deep = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    with pytest.raises(OnepassError, match="more than 32 deep"):
        parse_json(deep)
    assert parse_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None  # the limit itself is allowed


@pytest.mark.parametrize("raw, field", [
    (b'{"state": 1' + b"0" * 100 + b"}", "state"),
    (b'{"questions": {"q": {"criteria": [NaN]}}}', "questions.q.criteria.0"),
    (b'{"x": 1e400}', "x"),
    (b'{"questions": {"q": {"instructions": "\\udc00"}}}', "questions.q.instructions"),
])
def test_refused_values_name_their_field(raw, field):
    with pytest.raises(OnepassError) as err:
        parse_json(raw)
    assert status_of(err.value) == 422 and err.value.field == field


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    pieces = [b"{", b"}", b"[", b"]", b'"', b":", b",", b"\\", b"\\ud800", b"\\u0000", b"null", b"1e999", b"-0",
              b"9" * 80, b"NaN", b"true", "😀".encode(), b"\xff", b"\xc3", b'"type": "choice"', b'"criteria": {}',
              b'"questions": []', b"[" * 40, b'{"a": ' * 40]
    data = bytearray(raw)
    for _ in range(rng.randint(1, 3)):
        op, at = rng.random(), rng.randrange(len(data) + 1)
        if op < 0.3 and data:
            del data[at:at + rng.randint(1, 8)]
        elif op < 0.8:
            data[at:at] = rng.choice(pieces) if rng.random() < 0.8 else bytes(rng.randrange(256) for _ in range(3))
        else:
            data[at:at] = data[at:at + rng.randint(1, 30)]
    return bytes(data)


def _value(rng: random.Random, depth: int = 0):
    makers = [lambda: None, lambda: True, lambda: rng.randint(-10**30, 10**30), lambda: rng.random() * 1e300,
              lambda: "x" * rng.choice([0, 1, 5000]), lambda: "\ud800" if rng.random() < 0.2 else "é",
              lambda: [_value(rng, depth + 1) for _ in range(rng.randrange(3))],
              lambda: {f"k{i}": _value(rng, depth + 1) for i in range(rng.randrange(3))},
              lambda: {"type": rng.choice(["noul", "choice", "score", "box"]), "instructions": _value(rng, depth + 1),
                       "criteria": _value(rng, depth + 1)}]
    return makers[rng.randrange(len(makers) if depth < 4 else 6)]()


def _structured(rng: random.Random) -> bytes:
    q = {"r": dict(NOUL), "t": {"type": "choice", "instructions": "Which team?",
                                "criteria": {f"o{i}": None for i in range(rng.choice([2, 5, 33]))}},
         "s": {"type": "score", "instructions": "How angry?", "criteria": ["Calm", "Angry"]}}
    doc = {"model": rng.choice(["jev-latest", "nope", None]), "state": TICKET, "questions": q}
    for _ in range(rng.randint(1, 3)):
        target = rng.choice(["model", "state", "questions", "q", "field"])
        if target == "q":
            q[rng.choice(list(q))] = _value(rng)
        elif target == "field":
            question = q[rng.choice(list(q))]
            if isinstance(question, dict):
                question[rng.choice(["type", "instructions", "criteria"])] = _value(rng)
        elif target == "questions" and rng.random() < 0.3:
            doc["questions"] = {f"q{i}": dict(NOUL) for i in range(rng.choice([0, 65, 70]))}
        else:
            doc[target] = _value(rng)
    return json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")


def test_parser_fuzz_bodies_never_raise_anything_but_4xx(engine):
    """Every check before inference — JSON limits, schema, model, questions, limits, tokenising — on 4,000 bodies
    (ONEPASS_FUZZ=2.5 runs 10,000; the suite's time on 2 cores sets the default): the outcome is either a request the
    engine can run or a typed 4xx."""
    server = Server(engine, ServerConfig())
    try:
        rng = random.Random(10)
        seeds = [body(), body(questions={"t": {"type": "choice", "instructions": "Team?",
                                               "criteria": {"billing": "money", "tech": None}}}),
                 *(raw for raw, _, _ in hostile().values() if not raw.startswith(b"\x1f\x8b"))]
        outcomes: dict = {}
        cases, wanted = 0, fuzz_cases(4_000)
        while cases < wanted:
            raw = _structured(rng) if rng.random() < 0.5 else _mutate(rng.choice(seeds), rng)
            try:
                server.parse(raw)  # parsed, checked, tokenised and sized: what remains is the pass
                outcome = "runnable"
            except HTTPError as err:
                assert 400 <= err.status < 500 and err.message, raw[:300]
                outcome = err.status
            except OnepassError as err:  # the engine's typed refusals (mapped to 413/422 by the server)
                outcome = type(err).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            cases += 1
    finally:
        server.dispatcher.close()
    print("parser fuzz outcomes:", outcomes)
    assert sum(outcomes.values()) >= wanted
    assert {"runnable", 400, 404, 422} <= set(outcomes), outcomes


# -- a real server process under a memory cap ---------------------------------------------------------


def _rss_mb(pid: int) -> float:
    return rss_bytes(pid) / 2**20


def post(url: str, raw: bytes, headers: dict | None = None, timeout: float = 120):
    """(status, headers, body bytes); raises only if the connection fails (a dead or hung server)."""
    req = urllib.request.Request(url + "/v1/systemone", data=raw, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


@pytest.fixture(scope="module")
def capped_server(engine_dir, tmp_path_factory):
    """``onepass serve`` in its own process with RLIMIT_AS = 4 GiB; yields (url, pid, access log path)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "access.log"

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_CAP, ADDRESS_SPACE_CAP))

    url, proc = serve_process(engine_dir, port, log, "--max-queue", "200", preexec_fn=cap)
    yield url, proc, log
    proc.terminate()
    proc.wait(timeout=30)


def _valid(url: str, n: int) -> list:
    def one(i):
        status, _, raw = post(url, body(questions={f"v{i}": NOUL}))
        return status, json.loads(raw)["answers"] if status == 200 else raw
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _metric(url: str, name: str) -> dict:
    page = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in page.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")}


def test_hostile_requests_fail_only_themselves(capped_server):
    url, proc, log = capped_server
    for _ in range(3):
        post(url, body())
    reference = _valid(url, 4)
    assert all(s == 200 for s, _ in reference)
    rss_warm = _rss_mb(proc.pid)
    seen: dict = {}
    cases = list(hostile().items())
    for i in range(100):
        name, (raw, headers, expected) = cases[i % len(cases)]
        if i < len(cases):  # the first round with valid requests in flight beside each hostile one
            with ThreadPoolExecutor(2) as pool:
                bad = pool.submit(post, url, raw, headers)
                mates = pool.submit(_valid, url, 4)
                status, _, resp = bad.result()
                assert mates.result() == reference, f"{name} harmed its batch mates"
        else:
            status, _, resp = post(url, raw, headers)
        assert status == expected, (name, status, resp[:300])
        assert json.loads(resp)["error"]["message"], name
        seen[status] = seen.get(status, 0) + 1
        assert proc.poll() is None, f"the server died on {name}"
    assert _valid(url, 4) == reference
    rss_after = _rss_mb(proc.pid)
    print(f"server RSS: {rss_warm:.0f} MB after warm-up, {rss_after:.0f} MB after 100 hostile requests")
    assert rss_after <= RSS_RATIO * rss_warm
    counted = _metric(url, "onepass_requests_total")
    for status, n in seen.items():
        assert counted.get(f'onepass_requests_total{{path="/v1/systemone",status="{status}"}}', 0) >= n
    logged = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"request_id"')]
    for status, n in seen.items():
        assert sum(1 for r in logged if r["status"] == status) >= n


def test_metrics_stay_bounded_after_1000_unknown_paths(capped_server):
    url, _, _ = capped_server
    for i in range(1000):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}/v1/probe-{i}", timeout=30)
        assert err.value.code == 404
    series = _metric(url, "onepass_requests_total")
    assert not any("probe" in k for k in series)
    assert series['onepass_requests_total{path="unmatched",status="404"}'] >= 1000
    assert len(series) <= 20, sorted(series)


def test_model_is_optional_and_the_key_compared_exactly(engine):
    from test_server import running

    with running(engine, api_key="s3cret") as url:
        ok = {"Authorization": "Bearer s3cret"}
        status, _, raw = post(url, json.dumps({"state": TICKET, "questions": {"r": NOUL}}).encode(), ok)
        assert status == 200 and json.loads(raw)["model"] == engine.name
        assert post(url, body(), {"Authorization": "bearer s3cret"})[0] == 200
        for bad in ("Bearer  s3cret", "Bearer s3cre", "Bearer s3cret2", "s3cret", "Basic s3cret", "Bearer"):
            assert post(url, body(), {"Authorization": bad})[0] == 401, bad


def test_burst_never_answers_after_the_deadline(capped_server):
    """120 concurrent requests, each about its own state, with a 1 s deadline (X-Request-Timeout): more work
    than fits. Accepted requests are answered within their deadline (the server's own clock, Server-Timing);
    the rest are refused with 429 (on arrival) or 503 (dropped from the queue), both with Retry-After."""
    url, proc, _ = capped_server
    deadline_ms = 1000.0
    burst = [body(state=f"Ticket {i}: {TICKET}", questions={f"q{j}": NOUL for j in range(4)}) for i in range(120)]
    with ThreadPoolExecutor(120) as pool:
        results = list(pool.map(lambda raw: post(url, raw, {"X-Request-Timeout": "1"}), burst))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429, 503}, statuses
    assert statuses.count(200) >= 1 and statuses.count(200) < 120, statuses
    for status, headers, _ in results:
        if status == 200:
            total = float(headers["Server-Timing"].split("total;dur=")[1])
            assert total <= deadline_ms + 1, total  # the server's last check is where it measures its total
        else:
            assert int(headers["Retry-After"]) >= 1
    print("burst of 120 with a 1 s deadline:", {s: statuses.count(s) for s in sorted(set(statuses))})
    assert proc.poll() is None
    bad = post(url, body(), {"X-Request-Timeout": "soon"})
    assert bad[0] == 400 and b"X-Request-Timeout".lower() in bad[2].lower()


def test_a_state_too_long_for_its_deadline_is_refused_at_once_and_the_next_request_is_served(capped_server):
    """A legal 5,500-word state (~33 KB, under the engine's token limit) with a 2 s deadline needs ~10 s of
    prefill on this CPU: it was admitted (estimated as no work) and held the engine 23 s, turning the requests
    behind it into 503s. Admission now refuses it at once (413: no retry can meet that deadline), and a small
    request sent right after it is answered."""
    url, proc, _ = capped_server
    words = ("The customer writes again about the duplicate charge and the crashing reports page. " * 400).split()
    state = " ".join(words[:5500])
    t0 = time.monotonic()
    status, _, resp = post(url, body(state=state), {"X-Request-Timeout": "2"})
    refused_after = time.monotonic() - t0
    assert status == 413 and b"its deadline allows" in resp, (status, resp[:300])
    assert refused_after < 5, refused_after  # at admission, not after a pass (it took 23 s)
    status, _, resp = post(url, body(), {"X-Request-Timeout": "10"})
    assert status == 200, resp[:300]
    print(f"5,500-word state, 2 s deadline: 413 after {refused_after:.3f} s; the next request 200")


# -- a request can only fail itself ---------------------------------------------------------------------


def test_a_failing_merged_pass_is_rerun_request_by_request(engine):
    """The backend fails every pass that contains the 'poison' question (as an out-of-memory would): the
    merged pass fails, its members are re-run alone, and only the poisoned request gets the error; the
    others equal their requests run alone."""
    from onepass.runtime.core.wire import parse_request

    poison = engine.encode_questions(parse_request({"state": TICKET, "questions": {
        "p": {"type": "noul", "instructions": "Poison?"}}})[1])[0]
    requests = [parse_request({"state": TICKET, "questions": {"a": NOUL}}),
                parse_request({"state": TICKET, "questions": {"p": {"type": "noul", "instructions": "Poison?"}}}),
                parse_request({"state": TICKET, "questions": {"b": {"type": "choice", "instructions": "Team?",
                                                                    "criteria": {"billing": None, "tech": None}}}})]
    alone = [engine.run(s, q) for s, q in (requests[0], requests[2])]
    others = {t for s, q in (requests[0], requests[2]) for e in engine.encode_questions(q) for t in e.trunk}
    marker = set(poison.trunk) - others
    assert marker, "the poison question needs tokens of its own"
    original, calls = engine.backend.score_all, []

    def failing(kv, batch):
        calls.append(batch.num_tokens)
        if marker <= set(batch.input_ids.tolist()):
            raise MemoryError("injected: this pass does not fit")
        return original(kv, batch)

    engine.backend.score_all = failing
    try:
        results = engine.run_many(requests)
    finally:
        engine.backend.score_all = original
    assert len(calls) == 4  # the merged pass, then each request alone
    assert isinstance(results[1], MemoryError)
    for got, want in zip((results[0], results[2]), alone):
        assert got.answers == want.answers and got.input_tokens == want.input_tokens


def test_the_access_log_holds_one_line_per_request_and_never_the_body(capped_server):
    """The README's claim, on the real server process's log: a request whose state, question and id carry a
    marker is logged (one JSON line with its request id), and the marker appears nowhere in the log."""
    url, _, log = capped_server
    marker = "zq7-SECRET-STATE-MARKER"
    status, headers, _ = post(url, body(state=f"My card number is {marker}.", questions={marker: NOUL}))
    rid = headers["X-TypeSafe-Request-Id"]
    assert status == 200 and rid
    deadline = time.monotonic() + 10
    while rid not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the request was not logged"
        time.sleep(0.1)
    text = log.read_text(errors="replace")
    lines = [json.loads(line) for line in text.splitlines() if rid in line]
    assert len(lines) == 1 and lines[0]["path"] == "/v1/systemone" and lines[0]["status"] == 200
    assert marker not in text
