"""The HTTP app: TypeSafe System One (`POST /v1/systemone`, `GET /v1/models`) plus health and metrics.

Status codes: 400 malformed body, 401 bad API key, 404 unknown model, 413 body or state over
the limits, 422 invalid questions (with the field path), 429 queue full (with Retry-After).
Error bodies are ``{"error": {"message", "field"}}`` (422 also carries a FastAPI-style
``detail`` list); bad input never yields a 5xx.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import time
import uuid
import zlib
from typing import Any

import zstandard
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import Engine, parse_request, response_body
from ..errors import InvalidRequest, LimitExceeded, OnepassError
from .config import ServerConfig
from .dispatch import Dispatcher, QueueFull
from .metrics import Metrics

access_log = logging.getLogger("onepass.access")
REQUEST_ID = "x-typesafe-request-id"


class QuestionBody(BaseModel):
    """One question of a request (semantics are checked by the engine)."""

    model_config = ConfigDict(extra="allow")
    type: str
    instructions: str | dict[str, Any] | list[Any] | None = None
    criteria: dict[str, Any] | list[Any] | None = None


class SystemOneBody(BaseModel):
    """The request body of POST /v1/systemone."""

    model: str
    state: str | dict[str, Any] | list[Any]
    questions: dict[str, QuestionBody] = Field(min_length=1)
    assets: dict[str, Any] | None = None


class HTTPError(Exception):
    """An error answer: status, message, optional field and headers."""

    def __init__(self, status: int, message: str, field: str | None = None, headers: dict | None = None,
                 detail: list | None = None):
        super().__init__(message)
        self.status, self.message, self.field, self.headers, self.detail = status, message, field, headers, detail

    def response(self) -> JSONResponse:
        """The JSON error response the SDK parses."""
        body: dict = {"error": {"message": self.message, "field": self.field}}
        if self.detail is not None:
            body["detail"] = self.detail
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _decode(raw: bytes, encoding: str, limit: int) -> bytes:
    """Undo Content-Encoding (zstd, gzip, identity) without ever producing more than ``limit`` bytes."""
    encoding = encoding.strip().lower()
    try:
        if encoding in ("", "identity"):
            return raw
        if encoding == "zstd":
            reader = zstandard.ZstdDecompressor().stream_reader(raw)
            out = reader.read(limit + 1)
        elif encoding in ("gzip", "x-gzip"):
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            out = d.decompress(raw, limit + 1)
        else:
            raise HTTPError(400, f"Content-Encoding {encoding!r} is not supported; use zstd, gzip or none")
    except (zstandard.ZstdError, zlib.error, gzip.BadGzipFile, OSError) as err:
        raise HTTPError(400, f"the body is not valid {encoding}: {err}") from None
    if len(out) > limit:
        raise HTTPError(413, f"the decompressed body exceeds {limit} bytes")
    return out


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"the body is {declared} bytes; this server accepts at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"the body exceeds {limit} bytes")
        chunks.append(chunk)
    return _decode(b"".join(chunks), request.headers.get("content-encoding", ""), limit)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|dict\[.*\]|list\[.*\])$")


def _validation_error(err: ValidationError) -> HTTPError:
    """422 with a FastAPI-style detail list; union-member tags (``str``, ``dict[...]``) leave the path."""
    detail = [{"loc": ["body", *(x for x in e["loc"] if not _UNION_TAG.match(str(x)))], "msg": e["msg"],
               "type": e["type"]} for e in err.errors()]
    first = detail[0]
    field = ".".join(str(x) for x in first["loc"][1:])
    return HTTPError(422, f"{field}: {first['msg']}" if field else first["msg"], field or None, detail=detail)


def _engine_error(err: OnepassError) -> HTTPError:
    field = getattr(err, "field", None)
    if isinstance(err, LimitExceeded):
        return HTTPError(413, str(err), field)
    if isinstance(err, InvalidRequest):
        status = 400 if field == "state" and "UTF-8" in str(err) else 422
        detail = [{"loc": ["body", *(field or "").split(".")], "msg": err.reason, "type": "value_error"}]
        return HTTPError(status, str(err), field, detail=detail if status == 422 else None)
    return HTTPError(500, f"engine error: {err}")


class Server:
    """The app's state: engine, settings, dispatcher, metrics."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.ready = False
        self.metrics = Metrics(engine, lambda: self.dispatcher.depth)
        self.dispatcher = Dispatcher(engine, config.max_queue, config.batch_window_ms / 1000.0, config.max_batch,
                                     on_batch=self.metrics.on_batch)
        self.names = {engine.name, *config.aliases}

    def warm_up(self) -> None:
        """Run one small request so the first user request does not pay for lazy initialisation."""
        from ..questions import Noul

        self.engine.run("Warm-up.", {"q": Noul("Is this a warm-up?")})
        self.ready = True

    def check_auth(self, request: Request) -> None:
        """401 unless the server has no key or the Bearer token matches it."""
        if self.config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != self.config.api_key:
            raise HTTPError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")

    async def systemone(self, request: Request) -> dict:
        """Parse, validate, queue and answer one System One request."""
        self.check_auth(request)
        raw = await _read_body(request, self.config.max_body_bytes)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise HTTPError(400, f"the body is not valid JSON: {err}") from None
        try:
            SystemOneBody.model_validate(data)
        except ValidationError as err:
            raise _validation_error(err) from None
        if data["model"] not in self.names:
            raise HTTPError(404, f"model {data['model']!r} is not served here; available: {sorted(self.names)}",
                            "model")
        try:
            state, questions = parse_request(data)
            future = self.dispatcher.submit(state, questions)
        except OnepassError as err:
            raise _engine_error(err) from None
        except QueueFull as err:
            retry = str(self.config.retry_after_s)
            raise HTTPError(429, f"the server is busy: {err}; retry later", headers={"Retry-After": retry}) from None
        result = await future
        if isinstance(result, OnepassError):
            raise _engine_error(result)
        if isinstance(result, Exception):
            raise HTTPError(500, f"engine failure: {type(result).__name__}")
        self.metrics.tokens.labels("input").inc(result.input_tokens)
        self.metrics.tokens.labels("packed").inc(result.packed_tokens)
        return response_body(data, self.engine.name, result)

    def models(self) -> dict:
        """The engine and its aliases."""
        created = self.engine.manifest.source.get("created", "")[:10] or time.strftime("%Y-%m-%d")
        desc = f"onepass decision engine {self.engine.name} ({self.engine.manifest.model.architecture})"
        names = [self.engine.name, *self.config.aliases]
        return {"models": [{"name": n, "release_date": created, "description": desc if n == self.engine.name
                            else f"alias of {self.engine.name}"} for n in names]}


def create_app(engine: Engine, config: ServerConfig | None = None, warm: bool = True) -> FastAPI:
    """The FastAPI app serving ``engine``."""
    server = Server(engine, config or ServerConfig())
    app = FastAPI(title="onepass", version="0.1.0",
                  description="TypeSafe System One compatible decision engine")
    app.state.server = server
    if warm:
        app.router.on_startup.append(server.warm_up)
    else:
        server.ready = True
    app.router.on_shutdown.append(server.dispatcher.close)

    @app.middleware("http")
    async def request_id_and_log(request: Request, call_next):
        rid = uuid.uuid4().hex
        start = time.perf_counter()
        try:
            response = await call_next(request)
        except HTTPError as err:
            response = err.response()
        ms = (time.perf_counter() - start) * 1000
        response.headers[REQUEST_ID] = rid
        server.metrics.requests.labels(request.url.path if request.url.path.startswith("/v1/") else "other",
                                       str(response.status_code)).inc()
        access_log.info(json.dumps({"request_id": rid, "method": request.method, "path": request.url.path,
                                    "status": response.status_code, "ms": round(ms, 2),
                                    "bytes": int(request.headers.get("content-length") or 0),
                                    "encoding": request.headers.get("content-encoding")}))
        return response

    @app.exception_handler(HTTPError)
    async def http_error(_: Request, err: HTTPError):
        return err.response()

    @app.post("/v1/systemone", openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": SystemOneBody.model_json_schema()}}}})
    async def systemone(request: Request):
        with server.metrics.latency.time():
            return JSONResponse(await server.systemone(request))

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return server.models()

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        if not server.ready:
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ready", "engine": engine.name}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
