"""LRU caches bounded by bytes: prefilled states by their token ids (``StateCache``, bounded by their K/V) and compiled
question sets by their content (``Planner``'s, bounded by their arrays)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable

DEFAULT_CACHE_MIB = 512  # the state cache's default budget: Engine.load, onepass serve and the cluster alike


class ByteLru:
    """Maps keys to values of known size; evicts the least recently used past ``max_bytes``. Thread-safe."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable):
        """The cached value or None; counts a hit or a miss."""
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return entry[0]

    def holds(self, key: Hashable) -> bool:
        """Whether ``key`` is cached now, counting neither a hit nor a miss (admission asks, nothing is used)."""
        with self._lock:
            return key in self._items

    def put(self, key: Hashable, value, nbytes: int, replace=None) -> None:
        """Insert (values larger than the whole budget are not kept); ``replace(cached)``: whether a value cached
        under ``key`` gives way to this one (None: the cached one stays)."""
        with self._lock:
            if replace is not None and key in self._items and replace(self._items[key][0]):
                self.bytes -= self._items.pop(key)[1]
            if key in self._items or nbytes > self.max_bytes:
                return
            self._items[key] = (value, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self.bytes -= size

    def clear(self) -> None:
        """Drop every cached state (counters are kept)."""
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)


class StateCache(ByteLru):
    """Maps a state's token ids to its prefilled state; evicts least recently used past ``max_bytes`` of K/V."""
