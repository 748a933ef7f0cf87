"""Cost-aware eviction: GreedyDual-Size-Frequency over prefix leaves. O(log n) per operation.

Losing a chunk costs the prefill needed to recompute it. For the chunk at ``position``
``i`` (``B`` tokens each) causal attention touches about ``B * (i*B + B/2)`` token pairs,
so the cost grows like ``2*i + 1`` (in units of ``B**2 / 2``); deep chunks of long prompts
are the expensive ones. GDSF (Cherkasova 1998) weighs that cost by how often the chunk is
read, per byte: each entry gets ``H = L + freq * cost / size`` when inserted or read. ``L``
is raised to the victim's ``H`` on each eviction, so an entry not read for a while is
overtaken by fresh ones however expensive it was (the aging).

Only *leaves* (chunks with no tracked child, as in ``PrefixAware``) are candidates: a
chunk is useless once a chunk before it is gone, so its value includes every chunk that
extends it, and a parent (cheaper, and read whenever a child is) must not go first.
Among leaves the lowest ``H`` goes, ties to the least recently used.

``freq`` counts inserts and reads, and survives eviction in a bounded history
(``history_ratio`` x capacity keys, oldest dropped): a chunk recomputed and stored again
comes back with its count, which is what tells a reused prefix from a one-off.

A min-heap of ``(H, tick, key)`` over leaves, with lazy deletion (an item is live only
if it matches the key's current ``(H, tick)`` and the key is a leaf), rebuilt when stale
items outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Set

from policies._util import (
    DEFAULT_DETACHED,
    Detached,
    PrefixTree,
    Sized,
    compact_due,
    heap_top,
    parent_of,
)
from policies.base import NOTHING, EntryInfo, EvictionPolicy


def attention_cost(position: int) -> float:
    """Relative prefill cost of the chunk at ``position`` (0 = first): ``2*position + 1``."""
    return 2.0 * max(0, position) + 1.0


class CostAware(Sized, EvictionPolicy):
    name = "cost"

    def __init__(
        self,
        capacity_hint: int | None = None,
        cost_fn: Callable[[int], float] = attention_cost,
        history_ratio: float = 4.0,
    ) -> None:
        if capacity_hint is not None and capacity_hint < 1:
            raise ValueError("cost capacity_hint must be >= 1")
        if history_ratio < 0.0:
            raise ValueError("cost history_ratio must be >= 0")
        self.capacity_hint = capacity_hint
        self.cost_fn = cost_fn
        self.history_ratio = history_ratio
        self._weight: dict[str, float] = {}  # cost / size
        self._freq: dict[str, int] = {}
        self._stamp: dict[str, tuple[float, int]] = {}  # key -> (H, tick)
        self._tree = PrefixTree()
        self._heap: list[tuple[float, int, str]] = []
        self._tick = 0
        self._inflation = 0.0  # L
        self._peak = 0
        self._history: OrderedDict[str, int] = OrderedDict()  # evicted key -> freq
        self._detached: Detached[int] = Detached(max(DEFAULT_DETACHED, capacity_hint or 0))

    @property
    def inflation(self) -> float:
        return self._inflation

    def priority(self, key: str) -> float | None:
        stamp = self._stamp.get(key)
        return None if stamp is None else stamp[0]

    def frequency(self, key: str) -> int:
        return self._freq.get(key, 0)

    def is_leaf(self, key: str) -> bool:
        return self._tree.is_leaf(key)

    def _push(self, key: str | None) -> None:
        children = self._tree.children
        if key is None or children.get(key, 0) or key not in self._stamp:
            return
        h, t = self._stamp[key]
        heapq.heappush(self._heap, (h, t, key))
        if compact_due(len(self._heap), len(self._stamp)):
            self._heap = [
                (hh, tt, k) for k, (hh, tt) in self._stamp.items() if not children.get(k, 0)
            ]
            heapq.heapify(self._heap)

    def _touch(self, key: str) -> None:
        self._tick += 1
        self._stamp[key] = (self._inflation + self._freq[key] * self._weight[key], self._tick)
        self._push(key)

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        parent = parent_of(key, info)
        if key in self._weight:
            if info is not None:
                self._weight[key] = self.cost_fn(info.position) / max(1, size)
                self._push(self._tree.relink(key, parent))
            self.on_access(key)
            return
        position = info.position if info is not None else 0
        self._weight[key] = self.cost_fn(position) / max(1, size)
        pinned = self._detached.pop(key)
        if pinned is not None:
            self._freq[key] = pinned
        else:
            self._freq[key] = self._history.pop(key, 0) + 1
        self._tree.link(key, parent)
        self._touch(key)
        self._peak = max(self._peak, len(self._weight))

    def on_access(self, key: str) -> None:
        if key in self._weight:
            self._freq[key] += 1
            self._touch(key)
        else:
            f = self._detached.get(key)
            if f is not None:  # read while pinned: keep counting
                self._detached.put(key, f + 1)

    def on_remove(self, key: str) -> None:
        if self._weight.pop(key, None) is None:
            return
        freq = self._freq.pop(key)
        h, _ = self._stamp.pop(key)
        self._push(self._tree.unlink(key))
        if key == self._pending:
            self._inflation = max(self._inflation, h)
            limit = int(self.history_ratio * self.capacity)
            if limit:
                self._history[key] = freq
                self._history.move_to_end(key)
                while len(self._history) > limit:
                    self._history.popitem(last=False)
        else:
            self._detached.put(key, freq)
        self._pending = None

    def victim(self, protected: Set[str] = NOTHING) -> str | None:
        stamp, children = self._stamp, self._tree.children
        key = heap_top(
            self._heap,
            lambda i: stamp.get(i[2]) == (i[0], i[1]) and not children.get(i[2]),
            protected,
        )
        if key is None and len(stamp) > len(protected):
            # only reachable with a parent cycle (malformed input)
            free = [k for k in stamp if k not in protected]
            key = min(free, key=stamp.__getitem__) if free else None
        self._pending = key
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._weight

    def __len__(self) -> int:
        return len(self._weight)
