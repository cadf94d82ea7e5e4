"""The state side of an engine: prefilled states, the cache that holds them by their token ids, and a long
question's trunk prefilled onto a state as a longer state of its own."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

from ..backends.base import Backend, StateKV
from .depths import Depths
from .errors import DeadlineExceeded
from .planner import Planner, ids_key, trunk_state_ids
from .state_cache import StateCache


def until(deadline: float | None, what: str):
    """The check a prefill calls before each chunk: DeadlineExceeded once ``deadline`` (monotonic seconds) has
    passed, so a long prefill nobody waits for stops within one chunk instead of running to its end (a 4,200-token
    state takes ~10 s on 2 cores). None without a deadline."""
    if deadline is None:
        return None

    def between() -> None:
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"every waiter's deadline passed while {what} was being prefilled; the rest of it "
                                   "was not computed")
    return between


@dataclass(frozen=True)
class State:
    """A prefilled state: its token ids and its K/V. Asking never changes it."""

    ids: tuple
    kv: StateKV

    @property
    def num_tokens(self) -> int:
        """Tokens of the state segment (template included)."""
        return len(self.ids)

    @cached_property
    def key(self) -> bytes:
        """The digest of its token ids (``planner.ids_key``), made once: what a request about it is grouped by."""
        return ids_key(self.ids)

    def __repr__(self) -> str:  # never the ids or the arrays: a state is thousands of numbers
        return f"State({self.num_tokens} tokens, K/V {self.kv.nbytes / 2**20:.1f} MiB)"


class States:
    """Prefills and cache lookups for one engine (and the engines :meth:`Engine.with_limits` makes of it)."""

    def __init__(self, backend: Backend, planner: Planner, cache: StateCache, prefill_chunk: int, depths: Depths):
        self.backend, self.planner, self.cache, self.prefill_chunk = backend, planner, cache, prefill_chunk
        self.depths = depths  # the graphs cut at the head tasks' depths (none: the full graph only)

    def get(self, state, clock: dict | None = None) -> tuple[State, bool]:
        """(the state of ``state``, a State or text to tokenise, whether it came from the cache); ``clock`` gets the
        tokenize and prefill milliseconds."""
        if isinstance(state, State):
            return state, True
        t0 = time.perf_counter()
        ids = self.planner.state_ids(state)
        if clock is not None:
            clock["tokenize"] = clock.get("tokenize", 0.0) + (time.perf_counter() - t0) * 1000
        return self.of_ids(ids, clock)

    def of_ids(self, ids: tuple, clock: dict | None = None, deadline: float | None = None,
               depth: int | None = None) -> tuple[State, bool]:
        """The state of token ids ``ids`` from the cache, or prefilled now and cached; whether it was cached.
        ``deadline`` (monotonic seconds): past it, the prefill stops before its next chunk (DeadlineExceeded).
        ``depth``: the blocks whose K/V the state needs (None: every block); a cached state of fewer is prefilled
        again by the graph that deep (``depths.Depths``), which replaces it in the cache."""
        t0 = time.perf_counter()
        cached = self.cache.get(ids)
        if clock is not None:
            clock["prefill"] = 0.0
        depth = self.backend.model.num_layers if depth is None else depth
        if cached is not None and len(cached.kv.layers) >= depth:
            return cached, True
        backend = self.depths.run_on(self.backend, depth)[0]
        with backend.serial():
            kv = backend.prefill(ids, self.prefill_chunk, until(deadline, "the state"))
        prefilled = State(ids, kv)
        # the deeper of two states prefilled at once stays (a shallower one never replaces it)
        self.cache.put(ids, prefilled, kv.nbytes, replace=lambda old: len(old.kv.layers) < len(kv.layers))
        if clock is not None:
            clock["prefill"] = (time.perf_counter() - t0) * 1000
        return prefilled, False

    def extended(self, state: State, question, deadline: float | None = None) -> State:
        """``state`` followed by a long ``question``'s trunk but its last token as a state of its own, from the
        cache or prefilled onto ``state``'s K/V (which stays as it is); ``deadline``: as :meth:`of_ids`'."""
        if len(state.kv.layers) < self.backend.model.num_layers:  # an untasked question needs a state of every block
            raise RuntimeError("a long question's trunk was to be prefilled onto a state of fewer blocks")
        joint = trunk_state_ids(state.ids, question)
        ids = joint[len(state.ids):]
        self.planner.check_state_length(len(joint))
        cached = self.cache.get(joint)
        if cached is not None:
            return cached
        with self.backend.serial():
            kv = self.backend.extend(state.kv, ids, self.prefill_chunk, until(deadline, "a long question's trunk"))
        longer = State(joint, kv)
        self.cache.put(joint, longer, kv.nbytes)
        return longer
