"""Eviction policies: which entry a full tier gives up first.

* ``LRUPolicy``: least recently used, size-blind (the baseline).
* ``GreedyDualSizePolicy`` (GreedyDual-Size-Frequency): an entry's priority is
  ``clock + hits * cost(size) / size``; the lowest priority goes first and the clock rises to
  it, so untouched entries age. ``cost(size)`` is the time to bring the entry back from the
  tier below (``CostModel``: a fixed per-fetch latency plus bytes over bandwidth), hence
  ``cost / size`` is the time saved per byte held: small, often-used blocks are kept over a
  large block touched once.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Protocol


@dataclass(frozen=True)
class CostModel:
    """Seconds to refill an entry of ``size`` bytes from the next tier down."""

    latency_s: float
    bytes_per_s: float

    def __call__(self, size: int) -> float:
        return self.latency_s + size / self.bytes_per_s


class EvictionPolicy(Protocol):
    def admit(self, key: Hashable, size: int, hits: int = 1) -> None: ...

    def touch(self, key: Hashable) -> None: ...

    def remove(self, key: Hashable) -> None: ...

    def victim(self) -> Hashable:
        """The entry to evict next (it stays tracked until ``remove``)."""


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def admit(self, key: Hashable, size: int, hits: int = 1) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self) -> Hashable:
        return next(iter(self._order))


class GreedyDualSizePolicy:
    """GreedyDual-Size-Frequency with a lazily invalidated heap (O(log n) per operation)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.clock = 0.0
        self._entries: dict[Hashable, tuple[float, int, int, int]] = {}
        """key -> (priority, size, hits, sequence number of its live heap item)"""
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = itertools.count()

    def _push(self, key: Hashable, size: int, hits: int) -> None:
        priority = self.clock + hits * self.cost(size) / max(size, 1)
        seq = next(self._seq)
        self._entries[key] = (priority, size, hits, seq)
        heapq.heappush(self._heap, (priority, seq, key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [(p, s, k) for k, (p, _, _, s) in self._entries.items()]
            heapq.heapify(self._heap)

    def admit(self, key: Hashable, size: int, hits: int = 1) -> None:
        self._push(key, size, hits)

    def touch(self, key: Hashable) -> None:
        _, size, hits, _ = self._entries[key]
        self._push(key, size, hits + 1)

    def remove(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def victim(self) -> Hashable:
        while True:
            priority, seq, key = self._heap[0]
            entry = self._entries.get(key)
            if entry is not None and entry[3] == seq:
                self.clock = priority
                return key
            heapq.heappop(self._heap)


def make_policy(name: str, cost: CostModel) -> EvictionPolicy:
    """``"gds"`` (GreedyDual-Size-Frequency) or ``"lru"``."""
    if name == "gds":
        return GreedyDualSizePolicy(cost)
    if name == "lru":
        return LRUPolicy()
    raise ValueError(f"unknown eviction policy {name!r}; expected 'gds' or 'lru'")
