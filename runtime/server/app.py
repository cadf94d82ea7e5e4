"""The HTTP app: TypeSafe System One (`POST /v1/systemone`, `GET /v1/models`) plus health and metrics.

Status codes: 400 malformed body, 401 bad API key, 404 unknown model, 413 body or state over
the limits or a request whose own work surely exceeds its deadline, 422 invalid questions or values (with the field
path), 429 busy (the work queued ahead would likely make it late), 503 deadline passed while queued (both with
Retry-After). Error bodies are
``{"error": {"message", "field"}}`` (422 also carries a FastAPI-style ``detail`` list); bad
input never yields a 5xx, and an unexpected fault is a logged 500 with the request id.

A request's deadline is the server's ``request_timeout_s`` or the client's ``X-Request-Timeout``
(seconds). Responses carry ``Server-Timing`` (engine: queue wait + pass, total; milliseconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.cascade import Gate
from ..core.config import EngineConfig
from ..core.engine import Engine
from ..core.wire import parse_request, response_body
from ..core.questions import MAX_LEVELS, without_task
from ..core.errors import OnepassError, cut
from .body import ECHO_CHARS, clip, decode, parse_json, read_raw
from .config import ServerConfig
from .dispatch import STUCK_S, Dispatcher
from .errors import (CLIENT_CLOSED, BodyTimeout, DeadlineExceeded, HTTPError, InternalError, MalformedBody, NeverFits,
                     NotFound, NotReady, QueueFull, Unauthorized, UnknownModel, error_response, http_error, status_of)
from .memory import MemoryFloor, release_free_memory
from .metrics import Metrics
from .teaching import TeacherLink, TeacherSetup
from .transport import client_digest

access_log = logging.getLogger("onepass.access")
REQUEST_ID = "x-typesafe-request-id"
CACHED_TOKENS = "x-onepass-cached-tokens"  # state tokens served from the state cache (0: prefilled now)
STATE_CACHE = "x-onepass-state-cache"  # "hit": the state's K/V came from the cache; "miss": prefilled now
ANSWERED_BY = "x-onepass-answered-by"  # with a cascade: "question id=engine name", comma-separated
STAGES = ("tokenize", "prefill", "pack", "score", "readout")  # Server-Timing, after "queue"; "total" last


class QuestionBody(BaseModel):
    """One question of a request (semantics are checked by the engine)."""

    model_config = ConfigDict(extra="allow")
    type: str
    instructions: str | dict[str, Any] | list[Any] | None = None
    criteria: dict[str, Any] | list[Any] | None = None


class SystemOneBody(BaseModel):
    """The request body of POST /v1/systemone."""

    model: str | None = None  # optional in the format: the default engine answers
    state: str | dict[str, Any] | list[Any]
    questions: dict[str, QuestionBody] = Field(min_length=1)
    assets: dict[str, Any] | None = None


TIMEOUT_HEADER = "x-request-timeout"
MAX_CLIENT_TIMEOUT_S = 600.0


def server_engine(engine: Engine, max_request_tokens: int | None = None) -> Engine:
    """``engine`` with the packed tokens one request may take when served: a server answers one request's passes
    back to back, so its batch mates wait for all of them. By default a request may pack what one pass holds (as
    before blocks existed); raise it where the hardware answers more within the deadline (a GPU), e.g. 262144 for
    5000 questions."""
    lim = engine.manifest.limits
    return engine.with_limits(max_request_tokens=max_request_tokens or min(lim.max_request_tokens,
                                                                           lim.max_packed_tokens))


def served_engine(engine_dir, settings: EngineConfig) -> Engine:
    """The engine in ``engine_dir`` loaded by ``settings`` as a server serves it (``onepass serve`` and each cluster
    replica): its limits lowered, and a request's packed tokens one pass's unless ``max_request_tokens`` says more."""
    limits = dict(settings.limits)
    per_request = limits.pop("max_request_tokens", None)
    return server_engine(dataclasses.replace(settings, limits=limits).load(engine_dir), per_request)


class Server:
    """The app's state: engine, settings, dispatcher, metrics."""

    def __init__(self, engine: Engine, config: ServerConfig, cascade: Engine | None = None,
                 min_confidence: float | None = None, teacher: TeacherSetup | None = None):
        self.engine, self.config = engine, config
        self.cascade = cascade  # questions the gate does not decide are asked again of it
        self.gate = Gate(min_confidence) if cascade is not None else None
        self.ready = False
        self._warm_lock, self._warm_thread = threading.Lock(), None
        self.metrics = Metrics(engine, lambda: self.dispatcher.depth)
        self.memory = MemoryFloor([engine, cascade], on_release=self.metrics.memory_releases.inc)
        self.dispatcher = Dispatcher(engine, config.max_queue, config.batch_window_ms / 1000.0, config.max_batch,
                                     on_batch=self.on_batch, on_drop=self.metrics.deadline_drops.inc,
                                     on_idle=self.memory.on_idle)
        # the cascade's questions go through the same admission, merging and deadlines, on an engine thread of its own
        self.cascade_dispatcher = None if cascade is None else Dispatcher(
            cascade, config.max_queue, config.batch_window_ms / 1000.0, config.max_batch, on_batch=self.on_batch,
            on_drop=self.metrics.deadline_drops.inc)
        self.metrics.watch_cost(self.dispatcher.cost)
        self.names = {engine.name, *config.aliases}
        self.teaching = None if teacher is None else TeacherLink(teacher, self.metrics)

    def warm_up(self) -> None:
        """Run small requests so the first user request does not pay for lazy initialisation, then time passes of
        several sizes into the dispatcher's cost model (a fixed cost per pass and a cost per token-equivalent: both
        known before the first request, so admission refuses at once what cannot fit its deadline, and a small
        request is not charged like a large one)."""
        from ..core.questions import Noul

        one = {"q": Noul("Is this a warm-up?")}
        eight = {f"q{i}": Noul(f"Is this warm-up number {i} about the text above?") for i in range(8)}
        self.engine.run("Warm-up.", one)
        # a state of some 300 tokens: about 15 tokens a sentence, as many as the engine's state limit leaves room for
        sentences = max(1, min(18, (self.engine.manifest.limits.max_state_tokens - 40) // 20))
        def long(word: str) -> str:
            return f"A {word} warm-up, long enough to time the work per token of a state. " * sentences
        # each new state is prefilled (its work counted); a shape's first pass may capture a CUDA graph: each size
        # is timed twice
        for text, questions in (("A second warm-up, about another state.", one), ("A third warm-up.", one),
                                ("A third warm-up.", eight), (long("fourth"), one), (long("fifth"), one),
                                (long("fifth"), eight)):
            prepared = self.engine.prepare(text, questions)
            fresh = not self.engine.cache.holds(prepared.ids)
            start = time.monotonic()
            self.engine.run_group([prepared])
            self.dispatcher.observe(prepared.passes, prepared.work + (prepared.state_work if fresh else 0.0),
                                    time.monotonic() - start, warm_up=True)
        self.memory.mark()  # the size the server returns to when idle after heavy requests
        self.ready = True

    def start_warm_up(self) -> threading.Thread:
        """Warm up in the background: the server accepts connections at once (``/healthz`` 200, ``/readyz``
        503 until warm), as orchestrators' liveness and readiness probes expect. Once: later calls return the same
        thread."""
        def run():
            try:
                self.warm_up()
            except Exception:  # noqa: BLE001 - never ready; the log says why
                access_log.exception("warm-up failed: the server stays not ready")

        with self._warm_lock:
            if self._warm_thread is None:
                self._warm_thread = threading.Thread(target=run, name="onepass-warm-up", daemon=True)
                self._warm_thread.start()
            return self._warm_thread

    def warm_up_if_never_started(self) -> None:
        """A request reached an app whose lifespan never ran (mounted in a host app that does not run it): warm up
        now, so ``/readyz`` still turns ready; the log says how to run the lifespan (docs/embedding.md)."""
        if self._warm_thread is None and not self.ready:
            access_log.warning("onepass's lifespan did not run (an app mounted without it?): warming up on the first "
                               "request; run it from the host's lifespan to warm up at start (docs/embedding.md)")
            self.start_warm_up()

    def on_batch(self, size: int) -> None:
        """After each engine batch: metrics, and free memory handed back to the system."""
        self.metrics.on_batch(size)
        release_free_memory()

    def check_auth(self, request: Request) -> None:
        """401 unless the server has no key or the header is exactly ``Bearer <key>`` (scheme in any case;
        compared in constant time)."""
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode("utf-8", "replace"),
                                                                 self.config.api_key.encode("utf-8")):
            raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")

    def client_of(self, request: Request) -> tuple:
        """Whose request it is, for the engine queue's fair turns: the configured header's value (``onepass serve
        --client-header``, e.g. an API key; kept as a digest) where the request has it, else the peer address."""
        name = self.config.client_header
        value = request.headers.get(name) if name else None
        if value:  # starlette decodes header values as latin-1: encoded back, the bytes the transport saw
            return "key", client_digest(value.encode("latin-1"))
        peer = getattr(request, "client", None)
        return "address", peer.host if peer else ""

    def deadline_source(self, request: Request) -> str:
        """Which deadline a request has, for the errors that say it was too short."""
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is not None:  # a valid number by now: deadline() refused anything else
            return f"the request's X-Request-Timeout: {float(raw):g} s"
        return f"the server's request timeout, {self.config.request_timeout_s:g} s (onepass serve --request-timeout)"

    def deadline(self, request: Request, arrived: float) -> float:
        """Monotonic deadline: the client's X-Request-Timeout (seconds) or the server's request timeout."""
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return arrived + self.config.request_timeout_s
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if not 0 < seconds <= MAX_CLIENT_TIMEOUT_S:
            raise MalformedBody(f"{TIMEOUT_HEADER} must be a number of seconds in (0, {MAX_CLIENT_TIMEOUT_S:g}]; "
                                 f"got {raw[:40]!r}")
        return arrived + seconds

    def parse_body(self, raw: bytes, encoding: str) -> tuple:
        """``parse`` of the body as sent (Content-Encoding undone first, within the body limit)."""
        return self.parse(decode(raw, encoding, self.config.max_body_bytes))

    def parse(self, raw: bytes) -> tuple:
        """(body, state, prepared request) of a decoded request body: parsed once, every check that needs no inference
        done, tokenised and sized once (``Engine.prepare``: a request over a limit is a 413 now, never a retryable
        429 at admission); the HTTPError of the error table otherwise. Never raises anything else (fuzzed in the
        tests)."""
        try:
            data = parse_json(raw)
            model = data.get("model") if isinstance(data, dict) else None
            if isinstance(model, str) and model not in self.names:
                raise UnknownModel(f"model {clip(model)} is not served here; available: {sorted(self.names)}", "model")
            self.engine.check_wire(data)  # counts and lengths first: a body refused for them costs little
            state, questions = parse_request(data)  # the one parse: form and values (SystemOneBody documents them)
            return data, state, self.engine.prepare(state, questions)
        except OnepassError as err:
            raise http_error(err) from None

    async def systemone(self, request: Request, arrived: float, timing: dict) -> dict:
        """Parse, validate, queue and answer one System One request."""
        self.check_auth(request)
        deadline = request.state.deadline = self.deadline(request, arrived)
        try:  # a body trickled past the deadline is refused at the deadline, not read to its end first
            raw = await asyncio.wait_for(read_raw(request, self.config.max_body_bytes),
                                         max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise BodyTimeout(f"the body did not arrive within the request's deadline "
                              f"({self.deadline_source(request)}); send it faster or allow more time") from None
        encoding = request.headers.get("content-encoding", "")
        # decompression, JSON and validation are linear but not free on a 1 MiB body: off the event loop
        data, state, prepared = await run_in_threadpool(self.parse_body, raw, encoding)
        questions = prepared.questions
        queued = time.monotonic()
        result = await self.answer(self.dispatcher, request, prepared, deadline, deadline - arrived)
        waited = (time.monotonic() - queued) * 1000  # queue, batch window, the pass and its neighbours
        self.metrics.tokens.labels("input").inc(result.input_tokens)
        self.metrics.tokens.labels("packed").inc(result.packed_tokens)
        for q in questions.values():  # the task names are the engine's (an unknown one was refused when parsed)
            self.metrics.task_answers.labels(q.task or "-").inc()
        stages = {k: result.timings.get(k, 0.0) for k in STAGES}
        timing["queue"] = max(0.0, waited - sum(stages.values()))  # waiting for the engine thread and batch
        timing.update(stages)
        request.state.cached_tokens = result.cached_tokens
        if self.cascade is not None:
            result = await self.escalate(request, state, questions, result, timing)
        if self.teaching is not None:  # the teacher gets the state as it was sent (a JSON state stays JSON)
            result = await self.teach(request, data["state"], questions, result, timing)
        return response_body(data, self.engine.name, result)

    async def teach(self, request: Request, state, questions: dict, result, timing: dict):
        """Gate mode: the doubtful questions answered by the teacher within the deadline (the local answers stand
        where it fails). Shadow mode: a share of the questions answered here queued for the teacher in the
        background, which neither changes nor delays this answer."""
        teaching, by_teacher = self.teaching, set()
        if teaching.gate is not None:
            start = time.monotonic()
            answers, by_teacher = await teaching.forward(self.engine, state, questions, result.answers,
                                                         request.state.deadline)
            if by_teacher:
                timing["teacher"] = (time.monotonic() - start) * 1000
                result = dataclasses.replace(result, answers=answers)
            request.state.answered_by = ",".join(
                f"{q}={teaching.teacher.name if q in by_teacher else self.engine.name}" for q in result.answers)
        local = [q for q in questions if q not in by_teacher]
        self.metrics.answered.labels("local").inc(len(local))
        self.metrics.answered.labels("teacher").inc(len(by_teacher))
        teaching.shadow(state, {q: questions[q] for q in local}, {q: result.answers[q] for q in local})
        return result

    async def answer(self, dispatcher: Dispatcher, request: Request, prepared, deadline: float,
                     budget: float | None = None):
        """Queue a prepared request on ``dispatcher`` and await its Result; every refusal and failure as its typed
        error (QueueFull, NeverFits, DeadlineExceeded, the engine's; InternalError for a fault, counted and logged)."""
        try:
            future = dispatcher.submit(prepared, deadline, budget=budget, client=self.client_of(request))
        except QueueFull as err:
            raise QueueFull(f"the server is busy: {err}; retry later (the deadline: {self.deadline_source(request)})",
                            err.retry_after_s) from None
        except NeverFits as err:  # no retry can help: the request itself is too slow for its deadline
            raise NeverFits(f"{err} (the deadline: {self.deadline_source(request)}): shorten the state or the "
                            f"questions, or allow more time with {TIMEOUT_HEADER} (at most "
                            f"{MAX_CLIENT_TIMEOUT_S:g} s)") from None
        try:  # the dispatcher answers by the deadline; this bounds a wait on an engine thread that died meanwhile
            result = await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()) + STUCK_S)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"no answer within the request's deadline (+{STUCK_S:g} s): is the engine thread "
                                   "alive? (/healthz says)") from None
        if isinstance(result, DeadlineExceeded):
            raise DeadlineExceeded(f"{result}; retry later or with a longer {TIMEOUT_HEADER}")
        if isinstance(result, OnepassError):
            raise result
        if isinstance(result, Exception):
            self.metrics.engine_failures.inc()
            access_log.error("engine failure: %r", result)
            raise InternalError(f"engine failure: {type(result).__name__}")
        return result

    async def escalate(self, request: Request, state, questions: dict, result, timing: dict):
        """Re-ask the cascade engine the questions answered below ``min_confidence``, about the same state; the
        response is unchanged in form, and ``x-onepass-answered-by`` names the engine of each question."""
        _, review = self.gate.split(result.answers)
        doubtful = {q: without_task(questions[q]) for q in review}  # a task is this engine's, not the cascade's
        by = {q: self.engine.name for q in result.answers}
        if doubtful:
            start = time.monotonic()  # the same deadline: the cascade cannot run past what the client waits for
            # its own tokenizer and limits: prepared off the event loop, as the request was
            prepared = await run_in_threadpool(self.cascade.prepare, state, doubtful)
            strong = (await self.answer(self.cascade_dispatcher, request, prepared, request.state.deadline)).answers
            timing["cascade"] = (time.monotonic() - start) * 1000
            result = dataclasses.replace(result, answers={**result.answers, **strong})
            by.update({q: self.cascade.name for q in strong})
        request.state.answered_by = ",".join(f"{q}={name}" for q, name in by.items())
        return result

    def models(self) -> dict:
        """The engine and its aliases."""
        created = self.engine.manifest.source.get("created", "")[:10] or time.strftime("%Y-%m-%d")
        desc = f"onepass decision engine {self.engine.name} ({self.engine.manifest.model.architecture})"
        names = [self.engine.name, *self.config.aliases]
        have = getattr(self.engine, "tasks", None)  # (a test double may not have any)
        tasks = {"tasks": list(have.names)} if have else {}  # a question's "task" names one of them
        return {"models": [{"name": n, "release_date": created, "description": desc if n == self.engine.name
                            else f"alias of {self.engine.name}", **tasks} for n in names]}


def _route_label(request: Request) -> str:
    """The metrics path label: the matched route's template (a fixed set), never the raw path."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def create_app(engine: Engine, config: ServerConfig | None = None, warm: bool = True, cascade: Engine | None = None,
               min_confidence: float | None = None, teacher: TeacherSetup | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; with ``cascade``, questions answered below ``min_confidence`` are
    asked again of that engine (same state, same wire format). With ``teacher``, a remote model shadows a share of
    the requests and/or answers the questions below its gate (:mod:`onepass.runtime.server.teaching`)."""
    if (cascade is None) != (min_confidence is None):
        raise ValueError("a cascade engine needs min_confidence (and the other way round)")
    if cascade is not None and teacher is not None and teacher.gate is not None:
        raise ValueError("one second opinion per server: a cascade engine or a teacher's gate, not both")
    server = Server(engine, config or ServerConfig(), cascade, min_confidence, teacher)
    docs = {} if server.config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}  # off unless asked
    if not warm:
        server.ready = True
    # redirect_slashes off: "/v1/systemone/" is a 404 in the error format, not a redirect built from the Host header
    app = FastAPI(title="onepass", version="0.1.0", lifespan=_lifespan(server, warm), redirect_slashes=False,
                  description="TypeSafe System One compatible decision engine", **docs)
    app.state.server = server

    @app.middleware("http")
    async def request_id_and_log(request: Request, call_next):
        if warm:
            server.warm_up_if_never_started()
        return await _observed(server, request, call_next)

    async def refused(_: Request, err: Exception):
        return error_response(err, server.config.retry_after_s)

    async def no_route(request: Request, err: StarletteHTTPException):
        """An unknown path (404) or method (405) answered in the error format the SDK parses, like every error;
        the client's method and path repeated at most ECHO_CHARS long."""
        method, path = request.method[:40], cut(request.url.path, ECHO_CHARS)
        if err.status_code == 404:
            where = request.scope.get("root_path", "") + "/v1/systemone"  # mounted (docs/embedding.md): its prefix
            return error_response(NotFound(f"nothing at {method} {path}; the service answers POST {where}"),
                                  server.config.retry_after_s)
        message = (f"{method} is not allowed on {path}; allowed: {(err.headers or {}).get('Allow')}"
                   if err.status_code == 405 else clip(err.detail))
        return error_response(HTTPError(err.status_code, message, headers=err.headers), server.config.retry_after_s)

    app.add_exception_handler(HTTPError, refused)
    app.add_exception_handler(OnepassError, refused)
    app.add_exception_handler(StarletteHTTPException, no_route)
    _routes(app, server)
    return app


def _lifespan(server: Server, warm: bool):
    """Warm up in the background at start; stop the engine threads and the teacher at the end. A host app that
    mounts this one runs it from its own lifespan (``async with onepass_app.router.lifespan_context(onepass_app):
    yield``)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if warm:
            server.start_warm_up()
        try:
            yield
        finally:
            await run_in_threadpool(server.dispatcher.close)
            if server.cascade_dispatcher is not None:
                await run_in_threadpool(server.cascade_dispatcher.close)
            if server.teaching is not None:
                await run_in_threadpool(server.teaching.close)

    return lifespan


async def _observed(server: Server, request: Request, call_next):
    """One request answered, whatever happens: its refusal from the error table, a fault as a logged 500 with the
    request id, an answer ready past its deadline as 503; then its headers, metrics and one access-log line."""
    rid = uuid.uuid4().hex
    start = request.state.arrived = time.monotonic()
    request.state.timing = {}
    try:
        _plain_path(request)
        response = await call_next(request)
    except (HTTPError, OnepassError) as err:
        response = error_response(err, server.config.retry_after_s)
    except Exception:  # noqa: BLE001 - any fault is a logged 500 with the request id, never a dropped socket
        access_log.exception("unexpected error in request %s", rid)
        server.metrics.engine_failures.inc()
        response = error_response(InternalError(f"internal error (request id {rid})"))
        response.headers["Connection"] = "close"
    deadline = getattr(request.state, "deadline", None)
    if response.status_code == 200 and deadline is not None and time.monotonic() > deadline:
        server.metrics.deadline_drops.inc()  # ready too late: nobody waits for it any more
        response = error_response(DeadlineExceeded(
            f"the answer was ready after the request's deadline; retry later or with a longer {TIMEOUT_HEADER}"),
            server.config.retry_after_s)
    _account(server, request, response, rid, (time.monotonic() - start) * 1000)
    return response


def _plain_path(request: Request) -> None:
    """NotFound for a path holding an encoded slash or backslash (%2F, %5C): routes match the decoded path, so
    "/v1%2Fsystemone" would be answered as the API, past a filter in front that matches paths as sent."""
    raw = (request.scope.get("raw_path") or b"").lower()
    if b"%2f" in raw or b"%5c" in raw:
        where = request.scope.get("root_path", "") + "/v1/systemone"
        raise NotFound(f"the path {cut(raw.decode('latin-1'), ECHO_CHARS)} has an encoded slash or backslash; paths "
                       f"are matched as sent: the service answers POST {where}")


def _account(server: Server, request: Request, response, rid: str, ms: float) -> None:
    """A response's headers (request id, cache, who answered, Server-Timing), its metrics and its log line."""
    response.headers[REQUEST_ID] = rid
    if hasattr(request.state, "cached_tokens"):
        response.headers[CACHED_TOKENS] = str(request.state.cached_tokens)
        response.headers[STATE_CACHE] = "hit" if request.state.cached_tokens else "miss"
    if hasattr(request.state, "answered_by"):
        response.headers[ANSWERED_BY] = request.state.answered_by
    response.headers["Server-Timing"] = ", ".join(
        [f"{k};dur={v:.2f}" for k, v in request.state.timing.items()] + [f"total;dur={ms:.2f}"])
    route, length = _route_label(request), request.headers.get("content-length") or ""
    server.metrics.requests.labels(route, str(response.status_code)).inc()
    if response.status_code == CLIENT_CLOSED:  # nobody reads it: one line, never an internal error
        access_log.info(json.dumps({"request_id": rid, "path": route, "status": CLIENT_CLOSED,
                                    "event": "client_closed", "ms": round(ms, 2)}))
        return
    if response.status_code == 200 and request.state.timing:
        server.metrics.on_timing(request.state.timing)
    access_log.info(json.dumps({"request_id": rid, "method": request.method, "path": route,
                                "status": response.status_code, "ms": round(ms, 2),
                                "bytes": int(length) if length.isdigit() and len(length) < 20 else None,
                                "encoding": (request.headers.get("content-encoding") or "")[:64] or None},
                               ensure_ascii=True))


def _routes(app: FastAPI, server: Server) -> None:
    """The app's routes: the System One wire, models, limits, the probes and the metrics."""
    engine = server.engine

    @app.post("/v1/systemone", openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": SystemOneBody.model_json_schema()}}}})
    async def systemone(request: Request):
        with server.metrics.latency.time():
            return JSONResponse(await server.systemone(request, request.state.arrived, request.state.timing))

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return server.models()

    @app.get("/v1/limits")
    async def limits(request: Request):
        """The effective limits a client must respect: the engine's (tokens, questions, options) and the server's."""
        server.check_auth(request)
        lim, cfg = engine.manifest.limits, server.config
        return {"engine": engine.name, "max_state_tokens": lim.max_state_tokens,
                "max_packed_tokens": lim.max_packed_tokens, "max_questions": lim.max_questions,
                "max_options": lim.max_options, "max_request_tokens": lim.max_request_tokens,
                "max_levels": MAX_LEVELS, "max_body_bytes": cfg.max_body_bytes,
                "max_queue": cfg.max_queue, "request_timeout_s": cfg.request_timeout_s}

    @app.api_route("/healthz", methods=["GET", "HEAD"])  # HEAD: a probe that wants the status alone
    async def healthz():
        return {"status": "ok"}

    @app.api_route("/readyz", methods=["GET", "HEAD"])  # HEAD: a probe that wants the status alone
    async def readyz():
        if not server.ready:  # a probe's answer, not a refusal: its own body, the table's status
            return JSONResponse({"status": "warming up"}, status_code=status_of(NotReady("warming up")))
        return {"status": "ready", "engine": engine.name, "backend": engine.backend.name}

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # HEAD: a probe that wants the status alone
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)
