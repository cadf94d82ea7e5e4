"""The server's settings, every default in one place: ``ServerConfig`` (HTTP, queue, batching, deadline) and
``TransportLimits`` (what one connection and one client address may take). Frozen dataclasses validated at
construction; ``onepass serve``, ``onepass cluster``, ``AsyncEngine`` and the command's flags take their defaults
from here (the engine's own: ``core.config.EngineConfig``)."""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass, field

DEFAULT_ALIASES = ("jev-latest", "jev", "default")
MIN_BODY_BYTES = 1024  # the least --max-body-bytes
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'+*.^_`|~-]+")  # an HTTP header name (RFC 9110 token)


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP server accepts and how it queues work."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: any key (or none) is accepted
    max_body_bytes: int = 1 << 20  # after decompression too
    max_queue: int = 64  # requests waiting for the engine; beyond: 429
    batch_window_ms: float = 2.0  # requests about one state arriving within it share a pass
    max_batch: int = 16
    aliases: tuple = field(default=DEFAULT_ALIASES)
    retry_after_s: int = 1
    request_timeout_s: float = 10.0  # default deadline (the official SDK's timeout); clients may send their own
    docs: bool = False  # /docs and /openapi.json (served without the API key): off unless asked for
    # the header that tells clients apart for the engine queue's fair turns (e.g. "authorization", "x-api-key");
    # None: the peer address (clients behind one proxy address then share one turn)
    client_header: str | None = None

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1..65535, got {self.port}")
        for name in ("max_body_bytes", "max_queue", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_body_bytes < MIN_BODY_BYTES:
            raise ValueError(f"max_body_bytes must be at least {MIN_BODY_BYTES} (a one-question request takes a few "
                             f"hundred bytes: below it every request is refused), got {self.max_body_bytes}")
        if not 0 <= self.batch_window_ms <= 1000:
            raise ValueError("batch_window_ms must be within 0..1000")
        if not 0 < self.request_timeout_s <= 600:
            raise ValueError("request_timeout_s must be within (0, 600]")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.client_header is not None and not _TOKEN.fullmatch(self.client_header):
            raise ValueError(f"client_header must be an HTTP header name (letters, digits, '-'), got "
                             f"{self.client_header!r}")

    @classmethod
    def from_env(cls, **overrides) -> "ServerConfig":
        """Settings from arguments, with ONEPASS_API_KEY as the default API key."""
        if overrides.get("api_key") is None and os.environ.get("ONEPASS_API_KEY", "").strip():
            overrides["api_key"] = os.environ["ONEPASS_API_KEY"].strip()
        return cls(**{k: v for k, v in overrides.items() if v is not None})


PROBE_RESERVE = 8  # connections admitted past the cap for the probes alone (/healthz, /readyz, /metrics)
MIN_HEADER_BYTES = 1024  # the least --max-header-bytes: the official SDK's heads are some 400 bytes


@dataclass(frozen=True)
class TransportLimits:
    """What one connection, and one client address, may take, with the defaults ``onepass serve`` uses."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: int = 5
    max_header_bytes: int = 16384
    max_connections: int | None = None  # None: 1000, or below the open-files limit where that is lower
    max_connections_per_client: int | None = None  # None: a quarter of the cap (at least 1)
    max_body_bytes: int = 1 << 20  # the server's body limit; a chunked body's framing is held near it
    framing_penalty_s: float = 2.0  # an address that sent abusive framing is refused (429) this long; 0: never
    client_header: str | None = None  # the header that tells clients apart (ServerConfig's): penalties reach its key

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "max_header_bytes", "max_body_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_header_bytes < MIN_HEADER_BYTES:
            raise ValueError(f"max_header_bytes must be at least {MIN_HEADER_BYTES} (a client's request line and "
                             f"usual headers take a few hundred bytes: below it every request is refused), got "
                             f"{self.max_header_bytes}")
        for name in ("max_connections", "max_connections_per_client"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.framing_penalty_s <= 3600:
            raise ValueError(f"framing_penalty_s must be within 0..3600, got {self.framing_penalty_s}")

    def connections(self) -> int:
        """The connection cap: as given, else 1000 kept 64 below this process's open-files limit."""
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(16, min(1000, soft - 64 - PROBE_RESERVE)) if soft != resource.RLIM_INFINITY else 1000

    def per_client(self) -> int:
        """Connections one client address may hold at once."""
        return self.max_connections_per_client or max(1, self.connections() // 4)

    def framing_bytes(self) -> int:
        """The most bytes a chunked body's framing (chunk sizes, extensions, trailers) may add to its data: room for
        ``FREE_CHUNKS`` chunks with extensions, or an eighth of the body limit."""
        return max(65536, self.max_body_bytes // 8)
