"""An HTTP transport that protects itself without a proxy in front.

uvicorn already offers an idle keep-alive timeout (``timeout_keep_alive``) and a bound on h11's buffer
(``h11_max_incomplete_event_size``, answered 400). It has no timeout on reading a request's headers or body
(a client that sends one byte a second, or nothing, holds its connection forever), no 431, a connection cap
(``limit_concurrency``) that one client can fill and that refuses liveness probes and counts nothing, and it
parses a chunked body chunk by chunk in Python (1-byte chunks made a 1 MB body cost 7.7 s of the event loop).
hypercorn's ``read_timeout`` is per read (one byte every few seconds evades it) and granian's header timeout
comes without a body timeout and with a different server stack. So ``GuardedH11Protocol`` is uvicorn's own h11
protocol with what it lacks:

* **header timeout**: a connection must deliver a request's whole head within ``header_timeout_s`` of
  connecting (or of its first byte after a keep-alive pause), else 408 and the connection is closed;
* **body timeout**: once the head is in, the whole body within ``body_timeout_s`` (408; the app sees the
  client go away: a 499 in its log, never a 500);
* **431** for a head over ``max_header_bytes`` (checked before h11 parses it, so an 8 MB header costs 16 KiB
  of reading, not 8 MB of memory);
* **a body's cost follows its bytes, not its framing**: a body may come in ``FREE_CHUNKS`` chunks of any size (the
  parse time of ~10 ms of the event loop) and one more per ``MIN_CHUNK_BYTES`` of data (400 at once past that), and
  a chunked body's framing (chunk sizes, extensions, trailers) may add at most an eighth of the body limit (at least
  64 KiB) to its data (413);
* **400 for ambiguous framing**: Content-Length and Transfer-Encoding together (RFC 9112 6.3);
* **a penalty for abusive framing that reaches the abuser**: after chunks averaging under ``TINY_CHUNK_BYTES``,
  framing past its cap, or ambiguous framing, the connection is answered and closed, and for ``framing_penalty_s``
  (2 s; 0: off) the offender is penalised: by its client key where the server tells clients apart by a header
  (``client_header``: every request with that key is a 429, on any connection, other keys are served), else by its
  address: the address's other connections open at that moment are answered 429 on their next request (the
  abuser's keep-alive connections), and its requests in chunked framing (the abuse's way) are 429, while its new
  connections and requests that give a Content-Length are served (a neighbour behind the same address keeps
  service: it was refused 17 of 17 when the whole address was);
* **a refusal is read, not reset**: a refused connection is half-closed after its answer and what the client
  already sent is read and dropped (up to ``DRAIN_BYTES``, ``DRAIN_S``) before it is closed: closing with unread
  bytes made the kernel reset it, and the client saw a reset instead of the 429;
* **a fair connection cap**: one client address holds at most ``per_client()`` connections (a quarter of the
  cap by default; more are answered 503 and closed at once), beyond the cap a request is answered 503 unless it
  is a probe (``/healthz``, ``/readyz``, ``/metrics``): ``PROBE_RESERVE`` connections are admitted past the cap
  for them, each with ``PROBE_HEAD_S`` to send its head; a probe from an address over its share or penalised is
  refused as any request from it. Every refusal is counted by reason (:class:`TransportStats`, in ``/metrics``),
  uvicorn's own 400s for what h11 cannot parse too (``malformed``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import math
import socket
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..core.errors import OnepassError
from .config import PROBE_RESERVE, TransportLimits


PROBES = frozenset({"/healthz", "/readyz", "/metrics"})  # answered whatever the load: liveness, readiness, and the
# metrics that show the overload
PROBE_HEAD_S = 1.0  # ... each with this long to send its head (a probe sends it at once; a trickler loses its place)
# chunks a body may use whatever their size: h11 parses a chunk in 5-6 us (uvicorn's handling of each read adds to
# it), so 1,024 cost the event loop ~10 ms: a streaming JSON writer's small writes (a 4 KB body in 12-byte chunks,
# 341 of them) pass, a 1 MiB body in 1-byte chunks is refused after ~10 ms of parsing ...
FREE_CHUNKS = 1024
MIN_CHUNK_BYTES = 1024  # ... and one more per this many bytes of data: a 1 MiB body in 1 KiB chunks passes
TINY_CHUNK_BYTES = 4  # refused chunks averaging under this are an attack, not a writer's small writes: penalised
DRAIN_S, DRAIN_BYTES = 1.0, 1 << 16  # a refused connection is read (and dropped) this long, this much, then closed
MAX_DRAINING = 64  # connections draining at once; past it a refused one is closed at once
# the refusals of a client that may still be sending (its request or body), drained; a cap's or a timeout's are not
DRAINED = frozenset({"penalized", "small_chunks", "body_framing", "ambiguous_length", "head_too_large", "malformed"})


class TransportStats:
    """What the transport refused, by reason, the connections open by client address, the client keys and addresses
    penalised for abusive framing, and the connections draining after a refusal (read by ``/metrics``; touched on
    the event loop only)."""

    REASONS = ("per_client", "capacity", "penalized", "head_timeout", "body_timeout", "head_too_large",
               "small_chunks", "body_framing", "ambiguous_length", "malformed")

    def __init__(self, clock=time.monotonic):
        self.refused = dict.fromkeys(self.REASONS, 0)
        self.by_client: collections.Counter = collections.Counter()
        self.conns: dict = {}  # address -> its open connections (GuardedH11Protocol)
        self.draining = 0
        self._penalties: dict = {}  # ("key", digest) or ("address", host) -> monotonic time its penalty ends
        self._clock = clock

    @property
    def open(self) -> int:
        """Client connections open (those refused at once not counted)."""
        return sum(self.by_client.values())

    def penalize(self, who: tuple, seconds: float) -> None:
        """Penalise ``who`` (``("key", digest)`` or ``("address", host)``) for ``seconds``."""
        self._penalties[who] = self._clock() + seconds
        if len(self._penalties) > 10_000:  # bounded: drop the ended ones
            now = self._clock()
            self._penalties = {h: t for h, t in self._penalties.items() if t > now}

    def penalty(self, who: tuple) -> float:
        """Seconds left of ``who``'s penalty (0: none)."""
        until = self._penalties.get(who)
        if until is None:
            return 0.0
        left = until - self._clock()
        if left <= 0:
            del self._penalties[who]
        return max(0.0, left)

    def offended(self, conn: "GuardedH11Protocol", seconds: float) -> None:
        """``conn`` sent abusive framing: its client key (or, without one, its address) is penalised for ``seconds``,
        and the other connections open now of that key (or address) answer their next request 429."""
        who = conn.client_key or ("address", conn.host)
        self.penalize(who, seconds)
        until = self._clock() + seconds
        for other in self.conns.get(conn.host, ()):
            if other is not conn and other.client_key == conn.client_key:  # None == None: the address's unkeyed
                other.suspect = until


def client_digest(value: bytes) -> bytes:
    """What a client header's value is kept as (never the value itself: it may be a key): the transport's penalties
    and the engine queue's fair turns read the same digest."""
    return hashlib.blake2b(value, digest_size=16).digest()


def _error_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "field": None}}).encode()


def _raw_response(status: int, reason: str, message: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection (written before the app saw a request)."""
    body = _error_body(message)
    retry = f"retry-after: {retry_after}\r\n" if retry_after is not None else ""
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{retry}connection: close\r\n\r\n").encode()
    return head + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read timeouts, 431, a chunk budget, a cap on chunked framing, a refusal of
    ambiguous framing, and a connection cap shared fairly between client addresses (see the module docstring).
    ``protocol()`` binds the class to its limits and stats."""

    limits: TransportLimits
    stats: TransportStats

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._phase, self._host, self._received, self._head_s = None, None, 0, self.limits.header_timeout_s
        self._chunks = self._body_bytes = self._body_from = 0
        self._chunked = self._draining = False
        self._drained, self.client_key = 0, None  # client_key: ("key", digest) of the client header, once read
        self.suspect = 0.0  # monotonic time until which its next request is refused (its client offended)
        self._drain_timer: asyncio.TimerHandle | None = None
        # h11's events, counted and checked before uvicorn handles them (uvicorn <0.55 calls self.conn.next_event()
        # in handle_events; tests/test_transport.py fails if that changes)
        self.conn.next_event = self._next_event
        host = self.client[0] if self.client else ""
        refusal = self._refusal(host)
        if refusal is not None:
            self._refuse(*refusal)
            return
        self._host = host
        self.stats.by_client[host] += 1
        self.stats.conns.setdefault(host, set()).add(self)
        if len(self.connections) > self.limits.connections():  # admitted for the probes: a head at once, or out
            self._head_s = min(PROBE_HEAD_S, self._head_s)
        self.app = self._admit(self.app)
        self._arm("head")

    @property
    def host(self) -> str:
        """The client's address."""
        return self.client[0] if self.client else ""

    def _refusal(self, host: str) -> tuple | None:
        """The refusal of a new connection from ``host`` (``_refuse``'s arguments), or None to admit it."""
        held = self.stats.by_client[host]
        if held >= self.limits.per_client():
            return (503, "Service Unavailable", f"this client address holds {held} connections, the most one address "
                    "may hold; reuse them (keep-alive) or close some", "per_client", 1)
        if len(self.connections) > self.limits.connections() + PROBE_RESERVE:
            return (503, "Service Unavailable", f"the server holds its {self.limits.connections()} connections; "
                    "retry shortly", "capacity", 1)
        return None

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._draining:
            self._draining = False
            self.stats.draining -= 1
            self._drain_timer.cancel()
        if self._host is not None:
            self.stats.by_client[self._host] -= 1
            if not self.stats.by_client[self._host]:
                del self.stats.by_client[self._host]
            mine = self.stats.conns.get(self._host)
            if mine is not None:
                mine.discard(self)
                if not mine:
                    del self.stats.conns[self._host]
            self._host = None
        super().connection_lost(exc)

    def _admit(self, app):
        """The app behind the connection cap: over it, a request gets 503 (counted) unless it is a probe."""
        async def admitted(scope, receive, send):
            cap = self.limits.connections()
            if (len(self.connections) > cap or len(self.tasks) > cap) and scope.get("path") not in PROBES:
                self.stats.refused["capacity"] += 1
                body = _error_body(f"the server holds its {cap} connections; retry shortly")
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"retry-after", b"1"), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
            await app(scope, receive, send)

        return admitted

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 cannot parse, counted and in the error format every other refusal has
        (uvicorn's own is text/plain)."""
        self._refuse(400, "Bad Request", f"the request is not valid HTTP/1.1: {msg[:200]}", "malformed")

    def data_received(self, data: bytes) -> None:
        if self._draining:  # answered and half-closed: what still comes is read and dropped
            self._drained += len(data)
            if self._drained > DRAIN_BYTES:
                self.transport.close()
            return
        if self.conn.their_state is h11.IDLE and self._head_too_long(data):
            self._refuse(431, "Request Header Fields Too Large", f"the request's head is over "
                         f"{self.limits.max_header_bytes} bytes; send smaller headers", "head_too_large")
            return
        self._received += len(data)
        super().data_received(data)
        if self._chunked and self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            framing = self._received - self._body_from - self._body_bytes  # (bytes not parsed yet: at most a line)
            if framing > self.limits.framing_bytes():
                self._refuse(413, "Content Too Large", f"the body's chunk framing (sizes, extensions, trailers) takes "
                             f"over {self.limits.framing_bytes()} bytes beside its {self._body_bytes} bytes of data; "
                             "send fewer, larger chunks without extensions", "body_framing", penalize=True)
                return
        self._follow()

    def _next_event(self):
        """h11's next event, after the checks that need its parse: a request with both Content-Length and
        Transfer-Encoding is refused (RFC 9112 6.3: its length is ambiguous, a smuggling vector); a body in more
        chunks than ``FREE_CHUNKS`` plus one per ``MIN_CHUNK_BYTES`` of its data is refused (each chunk costs the
        event loop a parse: 1-byte chunks made a 1 MB body cost seconds of it)."""
        event = h11.Connection.next_event(self.conn)
        if type(event) is h11.Data:
            self._chunks += event.chunk_start
            self._body_bytes += len(event.data)
            if self._chunks > FREE_CHUNKS + self._body_bytes // MIN_CHUNK_BYTES:
                self._refuse(400, "Bad Request", f"the body came in {self._chunks} chunks for {self._body_bytes} bytes; "
                             f"send chunks of {MIN_CHUNK_BYTES} bytes or more on average (or a Content-Length)",
                             "small_chunks", penalize=self._body_bytes < TINY_CHUNK_BYTES * self._chunks)
                return h11.NEED_DATA
        elif type(event) is h11.Request:
            names = {name for name, _ in event.headers}  # h11 gives them lower-cased
            self.client_key = self._key_of(event.headers)
            if b"transfer-encoding" in names and b"content-length" in names:  # an offense, penalised or not
                self._refuse(400, "Bad Request", "the request has both Transfer-Encoding and Content-Length; send one",
                             "ambiguous_length", penalize=True)
                return h11.NEED_DATA
            if refusal := self._penalised(b"transfer-encoding" in names):
                self._refuse(*refusal)
                return h11.NEED_DATA
            self._chunks = self._body_bytes = 0
            self._chunked = b"transfer-encoding" in names
            self._body_from = self._received - len(self.conn.trailing_data[0])  # the bytes up to the body's first
        return event

    def _key_of(self, headers) -> tuple | None:
        """("key", a digest of the client header's value) where the server tells clients apart by a header and the
        request has it, else None."""
        name = self.limits.client_header
        if not name:
            return None
        wanted = name.lower().encode("latin-1")
        value = next((v for n, v in headers if n == wanted), None)
        return ("key", client_digest(value)) if value else None

    def _penalised(self, chunked: bool) -> tuple | None:
        """The refusal (``_refuse``'s arguments) of a request on a connection marked when its client offended, of a
        request whose client key is penalised, or of a ``chunked`` one from a penalised address without a key; None
        to go on."""
        key = self.stats.penalty(self.client_key) if self.client_key else 0.0
        address = self.stats.penalty(("address", self.host)) if chunked and self.client_key is None else 0.0
        suspect = self.suspect > time.monotonic()
        if not (suspect or key or address):
            return None
        if key or suspect:
            who = "this client key" if key else "a connection of this client address"
            message = f"{who} sent a body in abusive framing (counted in /metrics); retry in a moment"
        else:
            message = ("this client address sent a body in abusive chunked framing (counted in /metrics); for a "
                       "moment its requests must give a Content-Length")
        left = key or address or self.limits.framing_penalty_s
        return 429, "Too Many Requests", message, "penalized", max(1, math.ceil(left))

    def _head_too_long(self, data: bytes) -> bool:
        """Whether the head being received (up to its blank line; body bytes after it do not count) is over the
        limit. Looks at no more than the limit and one chunk."""
        buffered = self.conn.trailing_data[0] + data
        if len(buffered) <= self.limits.max_header_bytes:
            return False
        limit = self.limits.max_header_bytes + 4
        return buffered.find(b"\r\n\r\n", 0, limit) < 0 and buffered.find(b"\n\n", 0, limit) < 0  # h11 takes both

    def on_response_complete(self) -> None:
        if self._draining:  # refused: nothing more is read or answered on it
            return
        self._disarm()
        super().on_response_complete()  # may start a pipelined request already buffered: follow it
        if not self.transport.is_closing():
            self._follow()  # uvicorn's keep-alive timer covers an idle connection; a buffered head or body is ours

    def _follow(self) -> None:
        """Which read is under way now: a head (bytes of it buffered), a body, or none (the app's turn)."""
        if self.transport.is_closing() or self._draining:
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm("body")
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm("head")
        elif state is not h11.IDLE:
            self._disarm()

    def _arm(self, phase: str) -> None:
        if self._phase == phase or self._draining:  # a draining connection keeps its closing timer
            return
        self._disarm()
        seconds = self._head_s if phase == "head" else self.limits.body_timeout_s
        self._phase, self._timer = phase, self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _expired(self, phase: str) -> None:
        self._timer, self._phase = None, None
        seconds = self._head_s if phase == "head" else self.limits.body_timeout_s
        self._refuse(408, "Request Timeout", f"the request's {phase} did not arrive within {seconds:g} s",
                     f"{phase}_timeout")

    def _refuse(self, status: int, reason: str, message: str, why: str, retry_after: int | None = None,
                penalize: bool = False) -> None:
        """Answer ``status`` and close (counted as ``why``; with ``penalize``, the offender is penalised:
        ``TransportStats.offended``), unless the app already started its own response. A refusal of a client that may
        be sending still (``DRAINED``) is drained before it closes (``_drain``); the others (the connection cap, a
        client too slow to send) give their socket back at once."""
        if self.transport.is_closing() or self._draining:
            return
        self._disarm()
        self.stats.refused[why] += 1
        if penalize and self.client and self.limits.framing_penalty_s:
            self.stats.offended(self, self.limits.framing_penalty_s)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response byte sent yet (an app's early 413,
            # complete or under way, is left as it is)
            self.transport.write(_raw_response(status, reason, message, retry_after))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() now says the client is gone ...
            self.cycle.waiting_for_100_continue = False  # ... and sends no "100 Continue" on a half-closed socket
            self.cycle.message_event.set()
        if why in DRAINED:
            self._drain()
        else:
            self.transport.close()

    def _drain(self) -> None:
        """Close once what the client already sent is read: half-closed now (the client reads the answer, then the
        end), what still comes read and dropped up to ``DRAIN_BYTES`` and ``DRAIN_S``, then closed (at once when the
        client closes its side, or when ``MAX_DRAINING`` connections already drain)."""
        if self.stats.draining >= MAX_DRAINING or not self.transport.can_write_eof():
            self.transport.close()
            return
        try:
            self.transport.write_eof()
        except OSError:
            self.transport.close()
            return
        self._draining = True
        self.stats.draining += 1
        self._drain_timer = self.loop.call_later(DRAIN_S, self.transport.close)

    def shutdown(self) -> None:  # uvicorn's graceful shutdown: a refused connection is simply closed
        if self._draining:
            self.transport.close()
            return
        super().shutdown()

    def timeout_keep_alive_handler(self) -> None:
        if self._draining:
            self.transport.close()
            return
        super().timeout_keep_alive_handler()


def uvicorn_options(limits: TransportLimits, stats: "TransportStats") -> dict:
    """``uvicorn.Config``/``uvicorn.run`` keyword arguments that apply ``limits``, counting refusals into ``stats``
    (the connection cap is the protocol's own: uvicorn's would refuse the probes too, and count nothing)."""
    return {"http": protocol(limits, stats), "ws": "none", "timeout_keep_alive": limits.keep_alive_s,
            "limit_concurrency": None, "h11_max_incomplete_event_size": limits.max_header_bytes + 1}


def protocol(limits: TransportLimits, stats: TransportStats) -> type:
    """A ``GuardedH11Protocol`` class bound to ``limits`` and counting into ``stats`` (uvicorn instantiates the class
    per connection)."""
    return type("GuardedH11", (GuardedH11Protocol,), {"limits": limits, "stats": stats})


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
