"""Cost-aware eviction: GreedyDual-Size (Cao & Irani 1997) with a recompute-cost model.

Losing a chunk costs the prefill needed to recompute it. For the chunk at ``position``
``i`` (``B`` tokens each) causal attention touches about ``B * (i*B + B/2)`` token pairs,
so the cost grows like ``2*i + 1`` (in units of ``B**2 / 2``); deep chunks of long prompts
are the expensive ones. Each entry gets ``H = L + cost / size`` when inserted or read, the
victim is the entry with the lowest ``H`` (ties: least recently used), and ``L`` is raised
to the victim's ``H`` on eviction. ``L`` is the aging: an entry not read for a while is
overtaken by fresh entries, however expensive it was.

O(log n) per operation: a min-heap of ``(H, tick, key)`` with lazy deletion (an item is
live only if it matches the key's current ``(H, tick)``), rebuilt when stale items
outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from policies._util import compact_due
from policies.base import EntryInfo, EvictionPolicy


def attention_cost(position: int) -> float:
    """Relative prefill cost of the chunk at ``position`` (0 = first): ``2*position + 1``."""
    return 2.0 * max(0, position) + 1.0


class CostAware(EvictionPolicy):
    name = "cost"

    def __init__(
        self,
        capacity_hint: int | None = None,
        cost_fn: Callable[[int], float] = attention_cost,
    ) -> None:
        self.cost_fn = cost_fn
        self._weight: dict[str, float] = {}  # cost / size
        self._stamp: dict[str, tuple[float, int]] = {}  # key -> (H, tick)
        self._heap: list[tuple[float, int, str]] = []
        self._tick = 0
        self._inflation = 0.0  # L
        self._pending: str | None = None

    @property
    def inflation(self) -> float:
        return self._inflation

    def priority(self, key: str) -> float | None:
        stamp = self._stamp.get(key)
        return None if stamp is None else stamp[0]

    def _touch(self, key: str) -> None:
        self._tick += 1
        h = self._inflation + self._weight[key]
        self._stamp[key] = (h, self._tick)
        heapq.heappush(self._heap, (h, self._tick, key))
        if compact_due(len(self._heap), len(self._stamp)):
            self._heap = [(hh, t, k) for k, (hh, t) in self._stamp.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        position = info.position if info is not None else 0
        if key in self._weight and info is None:
            self.on_access(key)
            return
        self._weight[key] = self.cost_fn(position) / max(1, size)
        self._touch(key)

    def on_access(self, key: str) -> None:
        if key in self._weight:
            self._touch(key)

    def on_remove(self, key: str) -> None:
        if self._weight.pop(key, None) is None:
            return
        h, _ = self._stamp.pop(key)
        if key == self._pending:
            self._inflation = max(self._inflation, h)
        self._pending = None

    def victim(self) -> str | None:
        heap = self._heap
        while heap:
            h, t, key = heap[0]
            if self._stamp.get(key) == (h, t):
                self._pending = key
                return key
            heapq.heappop(heap)
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._weight

    def __len__(self) -> int:
        return len(self._weight)
