"""onepass inside a user's service (docs/embedding.md), as a user would embed it, on the tiny Llama's engine:

* ``Engine.ask`` is thread-safe: 16 threads asking at once get exactly the answers each gets alone;
* ``create_app`` mounted in the user's FastAPI app, served by uvicorn over loopback: with the host's lifespan
  running onepass's, ``/onepass/readyz`` turns ready and requests about one state merge into shared passes
  (``/onepass/metrics``); mounted without it (what a host does by default: a mounted app's lifespan never runs),
  it still turns ready, warmed up by its first request;
* ``AsyncEngine``: concurrent ``await ask(...)`` about one state share one pass and answer as alone; typed errors;
* reprs of a state and of answers stay one short line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from onepass import Choice, Engine, Noul, Score
from onepass.runtime.core.errors import LimitExceeded

TICKET = "I was charged twice for my subscription this month. Please refund the second payment."
QUESTIONS = {"refund": Noul("Does the customer ask for a refund?"),
             "team": Choice("Which team?", {"billing": "payments and refunds", "technical": None, "sales": None}),
             "mood": Score("How frustrated?", ["Calm", "Frustrated", "Very angry"])}
TOL = 1e-6  # merged or concurrent vs alone: packed == separate, same backend


def _wire(answers) -> dict:
    return {k: a.to_wire() for k, a in answers.items()}


def _close(a: dict, b: dict) -> bool:
    for k in a:
        x, y = a[k], b[k]
        for field in ("noul", "score"):
            if field in x and abs(x[field] - y[field]) > TOL:
                return False
        for name, p in x.get("probabilities", {}).items():
            if abs(p - y["probabilities"][name]) > TOL:
                return False
    return True


@pytest.fixture(scope="module", params=["onnxruntime", "openvino-cpu"])
def tiny(request, tiny_engine_dir):
    if request.param == "openvino-cpu":
        pytest.importorskip("openvino")
    with Engine.load(tiny_engine_dir, backend=request.param, verify=False) as engine:
        yield engine


def test_engine_ask_is_thread_safe_under_concurrent_callers(tiny):
    tickets = [f"{TICKET} Order number {i}." for i in range(8)]
    alone = {t: _wire(tiny.ask(t, QUESTIONS)) for t in tickets}
    tiny.cache.clear()
    work = [tickets[i % len(tickets)] for i in range(64)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda t: (t, _wire(tiny.ask(t, QUESTIONS))), work))
    assert all(_close(alone[t], answer) for t, answer in got)


# -- mounted in a user's FastAPI app ------------------------------------------------------------------------------


@contextlib.contextmanager
def _uvicorn(app):
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(300):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _ready(base: str, seconds: float = 60) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if _get(base + "/onepass/readyz")[0] == 200:
            return True
        time.sleep(0.1)
    return False


def _metric(base: str, name: str) -> float:
    page = _get(base + "/onepass/metrics")[1].decode()
    return sum(float(line.split()[-1]) for line in page.splitlines() if line.startswith(name + " "))


BODY = {"state": TICKET, "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}


def test_mounted_with_the_hosts_lifespan_it_is_ready_and_merges_requests(tiny):
    pytest.importorskip("fastapi")
    from fastapi import FastAPI

    from onepass.runtime.server.app import create_app
    from onepass.runtime.server.config import ServerConfig

    onepass_app = create_app(tiny, ServerConfig(batch_window_ms=300))

    @contextlib.asynccontextmanager
    async def lifespan(host):
        async with onepass_app.router.lifespan_context(onepass_app):
            yield

    host = FastAPI(lifespan=lifespan)

    @host.get("/hello")
    def hello():
        return {"hello": "world"}

    host.mount("/onepass", onepass_app)
    with _uvicorn(host) as base:
        assert _ready(base)
        assert _get(base + "/hello") == (200, b'{"hello":"world"}')
        before = (_metric(base, "onepass_engine_batches_total"), _metric(base, "onepass_engine_batched_requests_total"))
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _post(base + "/onepass/v1/systemone", BODY), range(8)))
        batches = _metric(base, "onepass_engine_batches_total") - before[0]
        requests = _metric(base, "onepass_engine_batched_requests_total") - before[1]
    assert all(status == 200 for status, _ in answers)
    alone = tiny.ask(TICKET, {"refund": Noul("Does the customer ask for a refund?")})["refund"].noul
    assert all(abs(body["answers"]["refund"]["noul"] - alone) <= TOL for _, body in answers)
    assert requests == 8 and batches < 8  # merged: fewer engine batches than requests


def test_mounted_without_its_lifespan_it_still_turns_ready(tiny):
    """A host app that mounts onepass and runs no lifespan of its own: the first request starts the warm-up."""
    pytest.importorskip("fastapi")
    from fastapi import FastAPI

    from onepass.runtime.server.app import create_app

    host = FastAPI()
    onepass_app = create_app(tiny)
    host.mount("/onepass", onepass_app)
    with _uvicorn(host) as base:
        assert _ready(base)
        status, body = _post(base + "/onepass/v1/systemone", BODY)
    assert status == 200 and 0.0 <= body["answers"]["refund"]["noul"] <= 1.0
    onepass_app.state.server.dispatcher.close()


# -- AsyncEngine -------------------------------------------------------------------------------------------------


def test_async_engine_merges_concurrent_asks_about_one_state_and_answers_as_alone(tiny, monkeypatch):
    from onepass.runtime.server.embed import AsyncEngine

    alone = _wire(tiny.ask(TICKET, QUESTIONS))
    batches = []
    real = tiny.run_group
    monkeypatch.setattr(tiny, "run_group", lambda prepared, *a, **k: batches.append(len(prepared)) or
                        real(prepared, *a, **k))

    async def main():
        async with AsyncEngine(tiny, window_ms=300) as engine:
            return await asyncio.gather(*(engine.ask(TICKET, QUESTIONS) for _ in range(6)))

    got = asyncio.run(main())
    assert len(got) == 6 and all(_close(alone, _wire(a)) for a in got)
    assert sum(batches) == 6 and len(batches) < 6


def test_async_engine_raises_the_typed_errors(tiny):
    from onepass.runtime.server.embed import AsyncEngine, DeadlineExceeded, NeverFits

    async def main():
        async with AsyncEngine(tiny.with_limits(max_questions=2)) as engine:
            with pytest.raises(LimitExceeded, match="at most 2"):
                await engine.ask(TICKET, QUESTIONS)
            with pytest.raises((DeadlineExceeded, NeverFits)):
                await engine.ask(TICKET + " A new one.", {"q": Noul("Is it urgent?")}, timeout_s=1e-6)
            return await engine.ask(TICKET, {"q": Noul("Is it urgent?")})

    assert 0.0 <= asyncio.run(main())["q"].noul <= 1.0


# -- reprs ---------------------------------------------------------------------------------------------------------


def test_reprs_are_one_short_line(tiny):
    state = tiny.state(TICKET * 20)
    assert repr(state).startswith("State(") and "tokens" in repr(state) and len(repr(state)) < 80
    many = tiny.ask(TICKET, {"c": Choice("Which?", {f"option {i}": None for i in range(300)})})["c"]
    text = repr(many)
    assert len(text) < 300 and "295 more" in text and "\n" not in text
    answers = tiny.ask(TICKET, QUESTIONS)
    assert all(len(repr(a)) < 200 for a in answers.values())
    assert repr(answers["refund"]) == f"NoulAnswer(noul={answers['refund'].noul:.3f})"


def test_async_engine_after_close_refuses_at_once(tiny):
    from onepass.runtime.server.embed import AsyncEngine, EngineStopped

    async def main():
        engine = AsyncEngine(tiny)
        engine.close()
        with pytest.raises(EngineStopped, match="stopped"):
            await asyncio.wait_for(engine.ask(TICKET, {"q": Noul("Is it urgent?")}, timeout_s=1.0), 10)

    asyncio.run(main())
