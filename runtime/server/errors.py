"""One table from errors to HTTP answers. Every refusal of `onepass serve`, the cluster's router and the MCP tools
is an error type (an ``OnepassError``); its status, its headers and its body are chosen here and nowhere else
(``tests/test_error_table.py`` holds that: no status literal in another module of the app's layer; the transport,
which answers before any app exists, writes its own raw responses).

Bodies are ``{"error": {"message", "field"}}`` (the SDK parses them); a 422 also carries a FastAPI-style
``detail`` list. 429 and 503 carry ``Retry-After``; refusals that leave a body unread close the connection.
"""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

from ..core.errors import DeadlineExceeded, InvalidRequest, LimitExceeded, NotText, OnepassError

CLIENT_CLOSED = 499  # the client went away before its request was read (nginx's code): never a server error


class MalformedBody(InvalidRequest):
    """The body is not what it says it is: not JSON, not UTF-8, nested too deep, a key twice, bad compression (400)."""


class BodyTooLarge(LimitExceeded):
    """The body is over the server's limit, on the wire or decompressed (413; the rest is never read)."""


class ClientClosed(OnepassError):
    """The client went away before its whole body arrived (499: logged, never a server error)."""


class Unauthorized(OnepassError):
    """A server with an API key got none, or another one (401)."""


class UnknownModel(InvalidRequest):
    """The request names a model this server does not serve (404)."""


class BodyTimeout(OnepassError):
    """The body was still arriving at the request's deadline (408; the rest is never read)."""


class NeverFits(LimitExceeded):
    """The request alone needs more time than its deadline allows: no retry can help (413)."""


class QueueFull(OnepassError):
    """The queue is full, or the work ahead makes the deadline unreachable: retry after ``retry_after_s`` (429)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineStopped(OnepassError, RuntimeError):
    """The dispatcher was closed or its engine thread is gone: nothing can be queued (503)."""


class NotFound(OnepassError):
    """A path this server has nothing at (404)."""


class NotReady(OnepassError):
    """The server is warming up, or no replica could answer (503)."""


class InternalError(OnepassError):
    """A fault of the server's own: logged with the request id, answered 500 without its details."""



# (type, status), the first that matches decides: subclasses before their bases
STATUSES = ((ClientClosed, CLIENT_CLOSED), (Unauthorized, 401), (UnknownModel, 404), (NotFound, 404),
            (NotText, 400), (MalformedBody, 400), (BodyTimeout, 408), (LimitExceeded, 413), (InvalidRequest, 422),
            (QueueFull, 429), (DeadlineExceeded, 503), (EngineStopped, 503), (NotReady, 503), (OnepassError, 500))
CLOSES = (BodyTooLarge, BodyTimeout)  # the body is left unread: the connection cannot be reused


class HTTPError(Exception):
    """An error answer: status, message, optional field, headers and 422 detail (made by :func:`http_error`)."""

    def __init__(self, status: int, message: str, field: str | None = None, headers: dict | None = None,
                 detail: list | None = None):
        super().__init__(message)
        self.status, self.message, self.field, self.headers, self.detail = status, message, field, headers, detail


def status_of(err: BaseException) -> int:
    """The HTTP status of an error (500 for anything that is not an OnepassError)."""
    return next((status for kind, status in STATUSES if isinstance(err, kind)), 500)


def http_error(err: BaseException, retry_after_s: int = 1) -> HTTPError:
    """The answer to ``err``: its status from the table, its field and detail, Retry-After (at least
    ``retry_after_s``, the server's setting) and Connection: close where they apply. An HTTPError is returned as
    it is; an error that is not an OnepassError is an internal fault (its message is not shown)."""
    if isinstance(err, HTTPError):
        return err
    status = status_of(err)
    if not isinstance(err, OnepassError):
        return HTTPError(500, f"internal error: {type(err).__name__}")
    field = getattr(err, "field", None)
    headers: dict = {}
    if status in (429, 503):
        headers["Retry-After"] = str(max(retry_after_s, math.ceil(getattr(err, "retry_after_s", 0))))
    if isinstance(err, CLOSES):
        headers["Connection"] = "close"
    detail = None
    if status == 422:
        loc = getattr(err, "loc", None) or (field or "").split(".")  # a body's path keeps its list indices
        detail = [{"loc": ["body", *loc], "msg": getattr(err, "reason", str(err)), "type": "value_error"}]
    return HTTPError(status, str(err), field, headers or None, detail)


def error_response(err: BaseException, retry_after_s: int = 1) -> JSONResponse:
    """The JSON error response the SDK parses, for any error (see :func:`http_error`)."""
    answer = http_error(err, retry_after_s)
    body: dict = {"error": {"message": answer.message, "field": answer.field}}
    if answer.detail is not None:
        body["detail"] = answer.detail
    return JSONResponse(body, status_code=answer.status, headers=answer.headers)
