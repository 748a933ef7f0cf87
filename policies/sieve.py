"""SIEVE (Zhang et al., NSDI'24): one FIFO queue, a visited bit and a moving hand.

New entries go to the head; a read only sets the entry's visited bit. The hand walks from
the tail (oldest) towards the head: a visited entry has its bit cleared and is skipped
(it stays where it is, unlike CLOCK-style reinsertion), the first unvisited entry is the
victim. After an eviction the hand continues from the victim's newer neighbour, wrapping
to the tail at the head. Amortised O(1): each skip clears a bit set by an earlier read.
"""

from __future__ import annotations

from collections.abc import Set

from policies._util import DEFAULT_DETACHED, Detached
from policies.base import NOTHING, EntryInfo, EvictionPolicy


class _Node:
    __slots__ = ("key", "newer", "older", "visited")

    def __init__(self, key: str) -> None:
        self.key = key
        self.visited = False
        self.newer: _Node | None = None
        self.older: _Node | None = None


class SIEVE(EvictionPolicy):
    name = "sieve"

    def __init__(self, capacity_hint: int | None = None) -> None:
        self._nodes: dict[str, _Node] = {}
        self._head: _Node | None = None  # newest
        self._tail: _Node | None = None  # oldest
        self._hand: _Node | None = None
        self._detached: Detached[bool] = Detached(max(DEFAULT_DETACHED, capacity_hint or 0))

    def visited(self, key: str) -> bool:
        node = self._nodes.get(key)
        return node is not None and node.visited

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        if key in self._nodes:
            self.on_access(key)
            return
        node = _Node(key)
        node.visited = bool(self._detached.pop(key))
        node.older = self._head
        if self._head is not None:
            self._head.newer = node
        self._head = node
        if self._tail is None:
            self._tail = node
        self._nodes[key] = node

    def on_access(self, key: str) -> None:
        node = self._nodes.get(key)
        if node is not None:
            node.visited = True
        elif key in self._detached:
            self._detached.put(key, True)

    def on_remove(self, key: str) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        if key != self._pending:
            self._detached.put(key, node.visited)
        self._pending = None
        if self._hand is node:
            self._hand = node.newer
        if node.newer is not None:
            node.newer.older = node.older
        else:
            self._head = node.older
        if node.older is not None:
            node.older.newer = node.newer
        else:
            self._tail = node.newer
        node.newer = node.older = None

    def victim(self, protected: Set[str] = NOTHING) -> str | None:
        node = self._hand or self._tail
        if node is None or (
            len(self._nodes) <= len(protected) and all(k in protected for k in self._nodes)
        ):
            return None
        # Protected nodes are passed with their visited bit as it was. Two laps at most:
        # the first clears every unprotected bit.
        while node.visited or node.key in protected:
            if node.key not in protected:
                node.visited = False
            node = node.newer or self._tail
            assert node is not None
        self._hand = node
        self._pending = node.key
        return node.key

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)
