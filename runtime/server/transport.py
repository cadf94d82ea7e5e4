"""An HTTP transport that protects itself without a proxy in front.

uvicorn already offers an idle keep-alive timeout (``timeout_keep_alive``), a cap on connections
and tasks answered with 503 beyond it (``limit_concurrency``) and a bound on h11's buffer
(``h11_max_incomplete_event_size``, answered 400). It has no timeout on reading a request's
headers or body (a client that sends one byte a second, or nothing, holds its connection
forever) and no 431; hypercorn's ``read_timeout`` is per read (one byte every few seconds
evades it) and granian's header timeout comes without a body timeout and with a different
server stack. So ``GuardedH11Protocol`` is uvicorn's own h11 protocol with what it lacks:

* **header timeout**: a connection must deliver a request's whole head within
  ``header_timeout_s`` of connecting (or of its first byte after a keep-alive pause), else 408
  and the connection is closed;
* **body timeout**: once the head is in, the whole body within ``body_timeout_s`` (408; the app
  sees the client go away: a 499 in its log, never a 500);
* **431** for a head over ``max_header_bytes`` (checked before h11 parses it, so an 8 MB header
  costs 16 KiB of reading, not 8 MB of memory).
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..core.errors import OnepassError


@dataclass(frozen=True)
class TransportLimits:
    """What one connection may take, with the defaults ``onepass serve`` uses."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: int = 5
    max_header_bytes: int = 16384
    max_connections: int | None = None  # None: 1000, or below the open-files limit where that is lower

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "max_header_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")

    def connections(self) -> int:
        """The connection cap: as given, else 1000 kept 64 below this process's open-files limit."""
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(16, min(1000, soft - 64)) if soft != resource.RLIM_INFINITY else 1000

    def uvicorn_options(self) -> dict:
        """``uvicorn.Config``/``uvicorn.run`` keyword arguments that apply these limits."""
        return {"http": protocol(self), "ws": "none", "timeout_keep_alive": self.keep_alive_s,
                "limit_concurrency": self.connections(), "h11_max_incomplete_event_size": self.max_header_bytes + 1}


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection (written before the app saw a request)."""
    body = json.dumps({"error": {"message": message, "field": None}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body read timeouts and 431 (see the module docstring)."""

    limits = TransportLimits()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._phase = None
        self._arm("head")

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_long(data):
            self._refuse(431, "Request Header Fields Too Large", f"the request's head is over "
                         f"{self.limits.max_header_bytes} bytes; send smaller headers")
            return
        super().data_received(data)
        self._follow()

    def _head_too_long(self, data: bytes) -> bool:
        """Whether the head being received (up to its blank line; body bytes after it do not count) is over the
        limit. Looks at no more than the limit and one chunk."""
        buffered = self.conn.trailing_data[0] + data
        if len(buffered) <= self.limits.max_header_bytes:
            return False
        limit = self.limits.max_header_bytes + 4
        return buffered.find(b"\r\n\r\n", 0, limit) < 0 and buffered.find(b"\n\n", 0, limit) < 0  # h11 takes both

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()  # may start a pipelined request already buffered: follow it
        if not self.transport.is_closing():
            self._follow()  # uvicorn's keep-alive timer covers an idle connection; a buffered head or body is ours

    def _follow(self) -> None:
        """Which read is under way now: a head (bytes of it buffered), a body, or none (the app's turn)."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm("body")
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm("head")
        elif state is not h11.IDLE:
            self._disarm()

    def _arm(self, phase: str) -> None:
        if self._phase == phase:
            return
        self._disarm()
        seconds = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        self._phase, self._timer = phase, self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _expired(self, phase: str) -> None:
        self._timer, self._phase = None, None
        seconds = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        self._refuse(408, "Request Timeout", f"the request's {phase} did not arrive within {seconds:g} s")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer ``status`` and close, unless the app already started its own response."""
        self._disarm()
        if self.transport.is_closing():
            return
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response byte sent yet (an app's early 413,
            # complete or under way, is left as it is)
            self.transport.write(_raw_response(status, reason, message))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() now says the client is gone
            self.cycle.message_event.set()
        self.transport.close()


def protocol(limits: TransportLimits) -> type:
    """A ``GuardedH11Protocol`` class bound to ``limits`` (uvicorn instantiates the class per connection)."""
    return type("GuardedH11", (GuardedH11Protocol,), {"limits": limits})


def listen(host: str, port: int) -> list[socket.socket]:
    """The server's listening sockets, bound now: a port already taken is one typed error before any engine is
    loaded (uvicorn binding it later logged a traceback, and the process died with "terminate called without an
    active exception", exit 134, while the backend's threads were up). One socket per address ``host`` resolves to,
    IPv6 ones IPv6-only, as asyncio's ``create_server(host=...)`` (what uvicorn did) binds them."""
    def refused(why) -> OnepassError:
        return OnepassError(f"cannot listen on {host}:{port}: {why}; choose another --port (or --host), or stop what "
                            "holds it")

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise refused(err.strerror) from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart while old connections linger
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as err:
        for sock in socks:
            sock.close()
        raise refused(err.strerror or err) from None
    return socks
