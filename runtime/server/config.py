"""Server settings: a frozen dataclass validated at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_ALIASES = ("jev-latest", "jev", "default")


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

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1..65535, got {self.port}")
        for name in ("max_body_bytes", "max_queue", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 <= self.batch_window_ms <= 1000:
            raise ValueError("batch_window_ms must be within 0..1000")
        if not 0 < self.request_timeout_s <= 600:
            raise ValueError("request_timeout_s must be within (0, 600]")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")

    @classmethod
    def from_env(cls, **overrides) -> "ServerConfig":
        """Settings from arguments, with ONEPASS_API_KEY as the default API key."""
        if overrides.get("api_key") is None and os.environ.get("ONEPASS_API_KEY", "").strip():
            overrides["api_key"] = os.environ["ONEPASS_API_KEY"].strip()
        return cls(**{k: v for k, v in overrides.items() if v is not None})
