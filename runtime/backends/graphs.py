"""CUDA graphs a service can live with: keyed by shape and slot, never by which state is asked about.

Shared by the GPU backends (PyTorch CUDA and TensorRT); torch-free, device-free bookkeeping:

* ``bucketed`` pads a score pass to bucketed (packed, read-out) sizes, capped at the engine's
  ``max_packed_tokens`` (a limit that is not a power of two still ends the buckets: a TensorRT
  profile refuses anything past it), so a few shapes repeat;
* ``SlotTable`` says which state sits in which of a fixed number of device *slots*. A slot is
  K/V memory allocated once: its address never moves, so a graph captured over a slot stays
  valid for every later state copied into it. A state asked about again while it is still in
  its slot is not copied again;
* ``GraphCache`` holds the captured graphs by key (slot, state-length bucket, packed bucket,
  read-out bucket), captures on demand (optionally only for a key seen ``capture_after``
  times), evicts the least recently used past ``limit`` and remembers keys whose capture
  failed (they run without a graph from then on). It counts captures, replays, uncaptured
  runs and failures for reports.

In a service every request may bring a new state: the number of captures is bounded by
slots x buckets, whatever the number of distinct states, and graphs hold no state's memory
(the slots are fixed, and their bytes are counted in the engine's state-cache budget:
``Backend.reserved_bytes``).
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

from .batch import PackedBatch, bucket, pad_batch

log = logging.getLogger("onepass.graphs")

MAX_GRAPHS = 64  # graphs kept per backend (least recently used evicted); each holds only its inputs' buffers
SLOTS = 2  # device slots of state K/V per backend, by default
# rows of state K/V per slot, by default (at most the engine's max_state_tokens): a longer state runs without a graph
# (its pass is long enough that launch overheads do not matter). Two slots of SmolLM2 at fp32: 189 MB of the cache's
# 512 MiB default; slots of the engine's 7,168 rows would take 630 MiB, more than the whole default budget.
SLOT_TOKENS = 2048


def padded(n: int, cap: int) -> int:
    """The size ``n`` tokens (or read-outs) pad to: its bucket, never above ``cap`` (``max_packed_tokens``); past the
    cap, ``n`` itself (nothing there is worth padding to)."""
    return bucket(n, max(cap, n))


def bucketed(batch: PackedBatch, cap: int) -> PackedBatch:
    """``batch`` padded to its (packed, read-out) buckets, none above ``cap`` tokens (``max_packed_tokens``)."""
    return pad_batch(batch, padded(batch.num_tokens, cap), padded(batch.readout_index.shape[0], cap))


class CaptureFailed(Exception):
    """A pass could not be captured as a graph (an operation stream capture refuses): run it without one."""


class SlotTable:
    """Which owner (a state's K/V object) sits in which of ``count`` slots; least recently used slot reused.

    Owners are held by weak reference: a slot never keeps a state alive, and a state that died is never
    mistaken for a new one that happens to reuse its memory.
    """

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"a slot table needs at least one slot, got {count}")
        self.count = count
        self._owners: OrderedDict[int, weakref.ref | None] = OrderedDict((i, None) for i in range(count))
        self.copies = 0  # states copied into a slot
        self.hits = 0  # passes whose state was already in its slot

    def place(self, owner: object) -> tuple[int, bool]:
        """(the slot that holds ``owner``, whether it must be copied in first). The caller copies when told."""
        for index, ref in self._owners.items():
            if ref is not None and ref() is owner:
                self._owners.move_to_end(index)
                self.hits += 1
                return index, False
        index = next(iter(self._owners))  # the least recently used
        self._owners[index] = weakref.ref(owner)
        self._owners.move_to_end(index)
        self.copies += 1
        return index, True

    def fill(self, owner: object, copy_in: Callable[[int], None]) -> int:
        """The slot holding ``owner``, after ``copy_in(index)`` when it must be copied in; a copy that fails leaves
        the slot vacated (a half-filled slot must never be read as that owner's) and raises."""
        index, fresh = self.place(owner)
        if fresh:
            try:
                copy_in(index)
            except BaseException:
                self.vacate(index)
                raise
        return index

    def hold(self, owner: object) -> int:
        """The least recently used slot now holds ``owner``, whose K/V were written into it in place (a prefill into
        the slot): no copy is counted. Returns its index."""
        index = next(iter(self._owners))
        self._owners[index] = weakref.ref(owner)
        self._owners.move_to_end(index)
        return index

    def vacate(self, index: int) -> None:
        """Slot ``index`` holds no state (its copy failed half-way: it must never count as a hit)."""
        self._owners[index] = None
        self._owners.move_to_end(index, last=False)

    def forget(self) -> None:
        """Every slot empty (e.g. after its memory was freed)."""
        for index in self._owners:
            self._owners[index] = None


@dataclass
class GraphStats:
    """What a backend's graph cache did: for reports (``gpu_check``) and tests."""

    captures: int = 0
    replays: int = 0
    uncaptured: int = 0  # passes run without a graph: a key not yet seen enough, or one whose capture failed
    capture_failures: int = 0
    evictions: int = 0
    held: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class GraphCache:
    """Captured graphs by key; see the module docstring.

    ``release(entry)`` frees a graph's resources when it is evicted or cleared. A key is captured the
    ``capture_after``-th time it is run (1: at once); before that its passes run uncaptured.
    """

    def __init__(self, limit: int = MAX_GRAPHS, release: Callable[[object], None] = lambda entry: None,
                 capture_after: int = 1):
        if limit < 1 or capture_after < 1:
            raise ValueError("a graph cache keeps at least one graph and captures after at least one sighting")
        self.limit, self.release, self.capture_after = limit, release, capture_after
        self._graphs: OrderedDict[Hashable, object] = OrderedDict()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()  # sightings of keys not yet captured (bounded)
        self._uncapturable: set = set()
        self.stats = GraphStats()

    def run(self, key: Hashable, capture: Callable[[], object], replay: Callable[[object], object],
            plain: Callable[[], object]):
        """The pass of ``key``: replayed from its graph (captured now if due), else run by ``plain()``.

        ``capture()`` returns the graph entry (it may run the pass itself to warm up; ``replay`` then runs it) or
        raises ``CaptureFailed``, after which the key always runs ``plain``."""
        entry = self._graphs.get(key)
        if entry is None:
            if key in self._uncapturable or not self._due(key):
                self.stats.uncaptured += 1
                return plain()
            try:
                entry = capture()
            except CaptureFailed as err:
                self._uncapturable.add(key)
                self.stats.capture_failures += 1
                self.stats.uncaptured += 1
                log.warning("CUDA graph capture failed for %s (%s); this shape runs without a graph from now on",
                            key, err)
                return plain()
            self.stats.captures += 1
            self._graphs[key] = entry
            while len(self._graphs) > self.limit:
                self.release(self._graphs.popitem(last=False)[1])
                self.stats.evictions += 1
        else:
            self._graphs.move_to_end(key)
        self.stats.replays += 1
        self.stats.held = len(self._graphs)
        return replay(entry)

    def _due(self, key: Hashable) -> bool:
        """Count a sighting of an uncaptured key; True when it should be captured now."""
        seen = self._seen.pop(key, 0) + 1
        if seen >= self.capture_after:
            return True
        self._seen[key] = seen
        while len(self._seen) > 16 * self.limit:
            self._seen.popitem(last=False)
        return False

    def clear(self) -> None:
        """Release every graph (e.g. before the memory they point into is freed)."""
        while self._graphs:
            self.release(self._graphs.popitem(last=False)[1])
        self.stats.held = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs
