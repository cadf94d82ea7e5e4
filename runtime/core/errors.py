"""The typed errors of onepass. Every message says what was wrong, what is allowed and what to do."""

from __future__ import annotations

from ..backends.errors import BackendUnavailable, EngineFileError, ModelSourceError, OnepassError

__all__ = ["OnepassError", "InvalidRequest", "NotText", "LimitExceeded", "DeadlineExceeded", "EngineFileError",
           "ModelSourceError", "BackendUnavailable"]


def cut(text: str, limit: int) -> str:
    """``text`` as a message repeats a caller's value: at most ``limit`` characters, then how long it was (a 1 MB
    value is never sent back whole)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class InvalidRequest(OnepassError, ValueError):
    """A question, option or state is malformed (maps to HTTP 422/400).

    ``field`` is a dotted path to the offending part of the request, when known.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message if field is None else f"{field}: {message}")
        self.field = field
        self.reason = message


class NotText(InvalidRequest):
    """Bytes that are not UTF-8 where text is expected (maps to HTTP 400: the body, not a field's value, is wrong)."""


class LimitExceeded(InvalidRequest):
    """A state or request is larger than the engine's limits (maps to HTTP 413). Never truncated."""


class DeadlineExceeded(OnepassError):
    """Every waiter's deadline passed while a request's passes ran: the rest were not run (maps to HTTP 503)."""

