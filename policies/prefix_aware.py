"""Prefix-aware eviction: only leaves of the prefix tree are candidates. O(log n) per op.

A chunk is only useful while every chunk before it in the prompt is cached, so a chunk's
value includes every chunk that extends it. The policy therefore never evicts a chunk
that still has a resident (tracked) child: candidates are the *leaves*, chunks with no
tracked child, ordered by recency (least recently inserted/read first). Evicting a leaf
may turn its parent into a leaf. This is the eviction rule of radix-tree prefix caches
(SGLang RadixAttention, vLLM's prefix cache free queue).

Children are counted per parent key from ``EntryInfo.parent``; a parent need not be
tracked (it may live in another tier or be pinned), its count waits for it. Only
tracked children count: a pinned child is removed from the policy by the hierarchy, so
its parent may become a leaf meanwhile and be evicted (pins are short-lived; a prefix
lookup then stops at the hole, which is safe).

Leaves sit in a min-heap of ``(tick, key)`` with lazy deletion: an item is live only if
the key is tracked, is a leaf and still has that tick. Stale items are purged by a
rebuild once they outnumber the live entries.
"""

from __future__ import annotations

import heapq
from collections.abc import Set

from policies._util import PrefixTree, compact_due, heap_top, parent_of
from policies.base import NOTHING, EntryInfo, EvictionPolicy


class PrefixAware(EvictionPolicy):
    name = "prefix"

    def __init__(self, capacity_hint: int | None = None) -> None:
        self._tree = PrefixTree()
        self._tick_of: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []
        self._tick = 0

    def is_leaf(self, key: str) -> bool:
        return self._tree.is_leaf(key)

    def _push_if_leaf(self, key: str | None) -> None:
        children = self._tree.children
        if key is None or key not in self._tick_of or children.get(key, 0):
            return
        heapq.heappush(self._heap, (self._tick_of[key], key))
        if compact_due(len(self._heap), len(self._tick_of)):
            self._heap = [(t, k) for k, t in self._tick_of.items() if children.get(k, 0) == 0]
            heapq.heapify(self._heap)

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        parent = parent_of(key, info)
        if key in self._tree:
            if info is not None:
                self._push_if_leaf(self._tree.relink(key, parent))
            self.on_access(key)
            return
        self._tree.link(key, parent)
        self._tick += 1
        self._tick_of[key] = self._tick
        self._push_if_leaf(key)

    def on_access(self, key: str) -> None:
        if key in self._tick_of:
            self._tick += 1
            self._tick_of[key] = self._tick
            self._push_if_leaf(key)

    def on_remove(self, key: str) -> None:
        if key not in self._tree:
            return
        del self._tick_of[key]
        self._push_if_leaf(self._tree.unlink(key))

    def victim(self, protected: Set[str] = NOTHING) -> str | None:
        tick_of, children = self._tick_of, self._tree.children
        key = heap_top(
            self._heap, lambda i: tick_of.get(i[1]) == i[0] and not children.get(i[1]), protected
        )
        if key is None and len(tick_of) > len(protected):
            # only reachable with a parent cycle (malformed input)
            free = [k for k in tick_of if k not in protected]
            key = min(free, key=tick_of.__getitem__) if free else None
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._tree

    def __len__(self) -> int:
        return len(self._tree)
