"""The backend interface: validate inputs once, then call the backend's implementation."""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .errors import BackendUnavailable
from .model import PRECISIONS as ENGINE_PRECISIONS  # what an engine's block GEMMs may be
from .model import EngineDescription, ModelInfo
from .batch import PackedBatch, causal



@dataclass(frozen=True)
class StateKV:
    """A state's K/V cache as backend values: ``layers[l] = (key, value)``, each [Hkv, S, D]."""

    layers: tuple
    length: int
    nbytes: int
    storage: Any = None  # the one buffer [2L, Hkv, S, D] the layers are views of, where the backend keeps one

    def __repr__(self) -> str:
        return f"StateKV({self.length} tokens, {len(self.layers)} layers, {self.nbytes / 2**20:.1f} MiB)"


class Backend(ABC):
    """Runs the decoder graph. Subclasses implement ``_run``; callers use prefill/score.

    One shape for every backend: built by ``open(root, manifest, threads, name=..., **options)`` (what the backend
    table calls), which refuses an engine whose precision the backend does not run (``runs``), then calls the
    constructor ``(root, manifest, threads=None, *, name=None, **options)``.

    ``concurrent``: whether passes may run from several threads at once. A backend with per-pass
    state of its own (device buffers, a stream, captured graphs) leaves it False, and callers run
    its passes one at a time under ``serial()``: that is what makes ``Engine.ask`` thread-safe.
    """

    concurrent = False
    # packed tokens per pass when a request is split into blocks of whole questions (None: the engine's
    # max_packed_tokens, i.e. as few passes as possible). CPU backends set what measures fastest
    # (benchmarks/results/blocks.md): attention is dense within a pass, so smaller blocks do less work.
    block_tokens: int | None = None
    name = "custom"  # the backend table's name of this backend, given to the constructor (``/readyz`` reports it)
    precisions = ENGINE_PRECISIONS  # the engine precisions this backend runs (``runs`` may narrow it per option)
    instead = ""  # what to use for an engine whose precision this backend does not run
    # device bytes of state K/V the backend holds beyond the engine's state cache (the GPU backends' graph slots):
    # the engine takes them out of the cache's budget, so the two together stay within it
    reserved_bytes = 0
    # the GPU backends' CUDA-graph cache and slot table (runtime/backends/graphs.py), used when cuda_graphs is on
    cuda_graphs = False
    graphs = None
    slots = None
    # a task-slot graph's feeds (``contract.TaskFeeds``): None where the graph has no task slots or the
    # backend does not feed them; the backend starts with no task (the base pass) and the engine sets its tasks here
    tasks = None
    runs_tasks = False  # whether the backend feeds a task-slot graph's task inputs at all
    # whether a pass reads the [N, N] tree mask (the ONNX graphs do); a pass that reads the tree in 2N numbers
    # (``tree_order``: the fused GPU pass) is handed batches without it, so none is built or joined for it
    reads_tree_mask = True

    def __init__(self, model: ModelInfo, name: str | None = None):
        self.model = model
        if name is not None:
            self.name = name
        self._serial = threading.RLock()
        self._local = threading.local()

    @classmethod
    def runs(cls, **options) -> tuple:
        """The engine precisions (``fp32``, ``fp16``, ``bf16``) this backend runs with ``options``."""
        return cls.precisions

    @classmethod
    def open(cls, root, manifest: EngineDescription, threads: int | None = None, *, name: str | None = None,
             **options) -> "Backend":
        """This backend for the engine directory ``root`` (the backend table's factory): BackendUnavailable when it
        does not run the engine's precision, else the constructor's backend."""
        runs = cls.runs(**options)
        if manifest.precision not in runs:
            raise BackendUnavailable(f"{root}: the {name or cls.__name__} backend runs {' and '.join(runs)} engines, "
                                     f"and this one is {manifest.precision}{'; ' + cls.instead if cls.instead else ''}")
        return cls(Path(root), manifest, threads, name=name, **options)

    @property
    def spans(self) -> list | None:
        """This thread's list of device milliseconds, one per ``device_span`` (None: not collecting). Per thread, so
        concurrent callers each collect the spans of their own passes."""
        return getattr(self._local, "spans", None)

    @spans.setter
    def spans(self, value: list | None) -> None:
        self._local.spans = value

    def serial(self):
        """A context in which one pass runs: the backend's lock, or nothing for a concurrent backend."""
        return contextlib.nullcontext() if self.concurrent else self._serial

    def close(self) -> None:
        """Release what the backend holds beyond Python memory (device buffers, graphs); idempotent."""

    def release_memory(self) -> bool:
        """Give back the working memory that past passes grew and kept (buffers sized to the largest pass seen),
        leaving answers unchanged; True if anything was released. A backend that keeps none returns False (the
        default); OpenVINO rebuilds its compiled model (about a second of CPU)."""
        return False

    def graph_stats(self) -> dict | None:
        """What the backend's CUDA-graph cache did (captures, replays, uncaptured passes, failures) and its slots'
        copies and hits, or None for a backend without graphs."""
        if not self.cuda_graphs:
            return None
        return self.graphs.stats.as_dict() | {"slot_copies": self.slots.copies, "slot_hits": self.slots.hits}

    @contextlib.contextmanager
    def device_span(self):
        """Around one stretch of device work only (a pass's kernels and its input copies; never host packing): while
        ``spans`` is a list, the span's device milliseconds (``device_timer``, synchronised at its end) are appended to
        it. How gpu_check separates GPU time from host time; a no-op otherwise, and on a backend without a device
        clock."""
        timer = self.device_timer() if self.spans is not None else None
        if timer is None:
            yield
            return
        timer.start()
        try:
            yield
        finally:  # stopped (its events released) even when the pass fails
            self.spans.append(timer.stop())

    def device_timer(self):
        """A new timer of the device work between its ``start()`` and ``stop() -> ms`` (CUDA events on the
        backend's stream, synchronised at ``stop``), or None on a backend without a device clock (CPU)."""
        return None

    def _joined(self, kv: StateKV, new: Sequence, n: int, join) -> StateKV:
        """``kv`` followed by a prefill chunk's K/V ``new`` (key and value per layer, ``n`` tokens): the first
        chunk is kept as it is, a later one joined to the old K/V layer by layer with ``join(old, new)``."""
        pairs = [(new[2 * i], new[2 * i + 1]) for i in range(self.model.num_layers)]
        if kv.length:
            pairs = [tuple(join(old, add) for old, add in zip(kv.layers[i], pair)) for i, pair in enumerate(pairs)]
        length = kv.length + n
        return StateKV(tuple(pairs), length, length * self.model.kv_bytes_per_token())

    def prefill(self, ids: Sequence[int], chunk: int, between: Callable[[], None] | None = None) -> StateKV:
        """K/V of a state, computed in causal chunks of at most ``chunk`` tokens (``between``: as :meth:`extend`)."""
        if len(ids) == 0:
            raise ValueError("a state needs at least one token")
        return self.extend(self.empty(), ids, chunk, between)

    def extend(self, kv: StateKV, ids: Sequence[int], chunk: int,
               between: Callable[[], None] | None = None) -> StateKV:
        """K/V of ``kv``'s tokens followed by ``ids`` (positions continue after ``kv``), in causal chunks of at
        most ``chunk``; ``kv`` itself is left as it is (a cached state stays valid). ``between`` is called before
        each chunk: the caller's check (a deadline), which stops the prefill by raising."""
        for start in range(0, len(ids), chunk):
            if between is not None:
                between()
            _, new, _ = self._run(causal(ids[start:start + chunk], kv.length), kv)
            kv = self._append(kv, new)
        return kv

    def score(self, kv: StateKV, batch: PackedBatch) -> np.ndarray:
        """[R] float32 log-probs of the batch's targets, given the state's K/V (read-only)."""
        return self.score_all(kv, batch)[0]

    def score_all(self, kv: StateKV, batch: PackedBatch) -> tuple[np.ndarray, np.ndarray | None]:
        """([R] target log-probs, [R] decision-head scores or None for a graph without a head)."""
        self.check(batch)
        logprob, _, head = self._run(batch, kv)
        return logprob, head

    @staticmethod
    def check(batch: PackedBatch) -> None:
        """Raise ValueError when the batch's arrays disagree in shape or a read-out points outside it."""
        n, r = batch.num_tokens, batch.readout_index.shape[0]
        if batch.tree_mask is None and batch.tree_order is None:
            raise ValueError("a packed batch needs its tree: a tree mask or its 2N numbers (tree_order)")
        mask = batch.tree_mask.shape if batch.tree_mask is not None else (n, n)
        if mask != (n, n) or batch.position_ids.shape != (n,) or batch.readout_target.shape != (r,):
            raise ValueError("packed batch arrays disagree in shape")
        if batch.tree_order is not None and batch.tree_order.shape != (n, 2):
            raise ValueError("packed batch arrays disagree in shape (tree_order)")
        if r and (batch.readout_index.min() < 0 or batch.readout_index.max() >= n):
            raise ValueError("read-out index outside the packed sequence")

    def to_host(self, value) -> np.ndarray:
        """One K/V tensor of a ``StateKV`` as a float32 numpy array (for checks, never on the answer path)."""
        return np.asarray(value.numpy(), dtype=np.float32)

    @abstractmethod
    def empty(self) -> StateKV:
        """A K/V of length 0."""

    @abstractmethod
    def _run(self, batch: PackedBatch, kv: StateKV) -> tuple[np.ndarray, Any, np.ndarray | None]:
        """One graph call: (target log-probs [R], the new tokens' K/V as backend values, head scores [R] or None)."""

    @abstractmethod
    def _append(self, kv: StateKV, new: Any) -> StateKV:
        """The K/V of ``kv`` followed by ``new`` (the first call may return ``new`` itself)."""
