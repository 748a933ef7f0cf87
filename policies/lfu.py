"""LFU with dynamic aging (LFU-DA, Arlitt et al. 2000): O(log n) per operation.

Each entry has priority ``K = L + freq`` computed when it is inserted or read, where ``L``
is the priority of the last evicted entry. ``L`` only grows, so an entry that was popular
long ago but is no longer read keeps its old ``K`` while new entries start at the
current ``L``: old popularity decays instead of pinning the cache forever (plain LFU's
pollution problem). Ties go to the least recently used entry.

A min-heap with lazy deletion holds ``(K, tick, key)``; a heap item is live only if it
matches the entry's current ``(K, tick)``. The heap is rebuilt when stale items exceed
the live ones, so memory stays O(n).
"""

from __future__ import annotations

import heapq
from collections.abc import Set

from policies._util import DEFAULT_DETACHED, Detached, compact_due, heap_top
from policies.base import NOTHING, EntryInfo, EvictionPolicy


class LFU(EvictionPolicy):
    name = "lfu"

    def __init__(self, capacity_hint: int | None = None) -> None:
        self._freq: dict[str, int] = {}
        self._stamp: dict[str, tuple[int, int]] = {}  # key -> (K, tick)
        self._heap: list[tuple[int, int, str]] = []
        self._tick = 0
        self._age = 0  # L: priority of the last evicted entry
        self._detached: Detached[int] = Detached(max(DEFAULT_DETACHED, capacity_hint or 0))

    def _touch(self, key: str) -> None:
        self._tick += 1
        k = self._age + self._freq[key]
        self._stamp[key] = (k, self._tick)
        heapq.heappush(self._heap, (k, self._tick, key))
        if compact_due(len(self._heap), len(self._stamp)):
            self._heap = [(kk, t, k2) for k2, (kk, t) in self._stamp.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        if key in self._freq:
            self.on_access(key)
            return
        self._freq[key] = self._detached.pop(key) or 1
        self._touch(key)

    def on_access(self, key: str) -> None:
        if key in self._freq:
            self._freq[key] += 1
            self._touch(key)
        else:
            f = self._detached.get(key)
            if f is not None:  # read while pinned: keep counting
                self._detached.put(key, f + 1)

    def on_remove(self, key: str) -> None:
        freq = self._freq.pop(key, None)
        if freq is None:
            return
        k, _ = self._stamp.pop(key)
        if key == self._pending:
            self._age = max(self._age, k)
        else:
            self._detached.put(key, freq)
        self._pending = None

    def victim(self, protected: Set[str] = NOTHING) -> str | None:
        stamp = self._stamp
        self._pending = heap_top(self._heap, lambda i: stamp.get(i[2]) == (i[0], i[1]), protected)
        return self._pending

    def frequency(self, key: str) -> int:
        return self._freq.get(key, 0)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)
