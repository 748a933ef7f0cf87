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

from policies._util import compact_due
from policies.base import EntryInfo, EvictionPolicy


class PrefixAware(EvictionPolicy):
    name = "prefix"

    def __init__(self, capacity_hint: int | None = None) -> None:
        self._parent: dict[str, str | None] = {}
        self._tick_of: dict[str, int] = {}
        self._children: dict[str, int] = {}  # parent key -> tracked children
        self._heap: list[tuple[int, str]] = []
        self._tick = 0

    def is_leaf(self, key: str) -> bool:
        return key in self._parent and self._children.get(key, 0) == 0

    def _push_if_leaf(self, key: str) -> None:
        if key in self._tick_of and self._children.get(key, 0) == 0:
            heapq.heappush(self._heap, (self._tick_of[key], key))
            if compact_due(len(self._heap), len(self._tick_of)):
                self._heap = [
                    (t, k) for k, t in self._tick_of.items() if self._children.get(k, 0) == 0
                ]
                heapq.heapify(self._heap)

    def _link(self, key: str, parent: str | None) -> None:
        self._parent[key] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1

    def _unlink(self, key: str) -> None:
        parent = self._parent.pop(key)
        if parent is None:
            return
        left = self._children[parent] - 1
        if left:
            self._children[parent] = left
        else:
            del self._children[parent]
            self._push_if_leaf(parent)

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        parent = info.parent if info is not None else None
        if parent == key:
            parent = None
        if key in self._parent:
            if info is not None and parent != self._parent[key]:
                self._unlink(key)
                self._link(key, parent)
            self.on_access(key)
            return
        self._link(key, parent)
        self._tick += 1
        self._tick_of[key] = self._tick
        self._push_if_leaf(key)

    def on_access(self, key: str) -> None:
        if key in self._tick_of:
            self._tick += 1
            self._tick_of[key] = self._tick
            self._push_if_leaf(key)

    def on_remove(self, key: str) -> None:
        if key not in self._parent:
            return
        del self._tick_of[key]
        self._unlink(key)

    def victim(self) -> str | None:
        heap = self._heap
        while heap:
            t, key = heap[0]
            if self._tick_of.get(key) == t and self._children.get(key, 0) == 0:
                return key
            heapq.heappop(heap)
        if self._tick_of:  # only reachable with a parent cycle (malformed input)
            return min(self._tick_of, key=self._tick_of.__getitem__)
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def __len__(self) -> int:
        return len(self._parent)
