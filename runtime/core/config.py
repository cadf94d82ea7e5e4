"""How an engine directory is loaded and limited, every default in one place: ``EngineConfig``. ``Engine.load``'s
defaults, ``onepass serve``, the cluster's replicas and the command's flags take theirs from here (the server's
own: ``server.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends import AUTO, BACKENDS
from .state_cache import DEFAULT_CACHE_MIB

#: the engine limits a deployment may lower (``Engine.with_limits``; never raise past the export's)
LIMITS = ("max_state_tokens", "max_packed_tokens", "max_questions", "max_options", "max_request_tokens")
#: the least each limit may be lowered to: below it every request is refused (a state's template alone is some 30
#: tokens, a question some 10 plus its options, a choice has two options at least)
USABLE = {"max_state_tokens": 64, "max_packed_tokens": 64, "max_questions": 1, "max_options": 2,
          "max_request_tokens": 64}


@dataclass(frozen=True)
class EngineConfig:
    """The backend, its threads, the state cache's budget and the limits lowered for this deployment."""

    backend: str = AUTO  # "auto": OpenVINO where it reproduces the golden file here, else ONNX Runtime
    threads: int | None = None  # the backend's intra-op threads (None or 0: its own choice)
    cache_mib: int = DEFAULT_CACHE_MIB  # the state cache's budget
    limits: dict = field(default_factory=dict)  # LIMITS -> a lower value
    verify: bool = True  # every file's sha256 checked on load

    def __post_init__(self):
        if self.backend not in (AUTO, *BACKENDS):
            raise ValueError(f"backend must be one of {', '.join((AUTO, *BACKENDS))}, got {self.backend!r}")
        if self.threads == 0:  # what --threads 0 has always meant
            object.__setattr__(self, "threads", None)
        if self.threads is not None and self.threads < 0:
            raise ValueError(f"threads must be at least 1 (or 0: the backend's own choice), got {self.threads}")
        if self.cache_mib < 0:
            raise ValueError(f"cache_mib must be at least 0, got {self.cache_mib}")
        unknown = sorted(set(self.limits) - set(LIMITS))
        if unknown:
            raise ValueError(f"unknown limits {unknown}; known: {', '.join(LIMITS)}")
        for name, value in self.limits.items():
            if value is not None and (not isinstance(value, int) or value < USABLE[name]):
                raise ValueError(f"{name} must be an integer of at least {USABLE[name]} (below it every request is "
                                 f"refused), got {value!r}")

    @property
    def cache_bytes(self) -> int:
        return self.cache_mib << 20

    def load(self, path):
        """The engine in ``path`` on this backend, with these threads, cache and limits."""
        from .engine import Engine

        engine = Engine.load(path, threads=self.threads, cache_bytes=self.cache_bytes, backend=self.backend,
                             verify=self.verify)
        return engine.with_limits(**self.limits)  # None values are left as they are
