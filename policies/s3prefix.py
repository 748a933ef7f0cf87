"""S3-FIFO's probation queue in front of a prefix-aware main queue: O(log n) per operation.

Two things matter on a prefix cache. One-hit wonders (scans, unique user suffixes) must
not push out chunks that are read again, and a chunk is worth keeping only while every
chunk before it is cached. The first part comes from S3-FIFO (Yang et al., SOSP'23), the
second from radix-tree prefix caches (SGLang):

- A new chunk enters the small FIFO queue S (``small_ratio`` of the capacity, 10% as in
  the paper). When S is over its share, its oldest *leaf* (a chunk with no resident
  child) leaves: to the main queue M if it was read while in S, otherwise out of the
  cache, with its key remembered in the ghost queue G.
- A chunk whose key is in G when it is inserted goes straight to M.
- M evicts leaves only, least recently used first (``PrefixAware``'s rule), so a
  document's deep chunks go before the chunks its later requests start with.
- A chunk that enters M takes its ancestors still in S along: a prefix hit on it reads
  them too, and S then holds no ancestor of an M chunk.

G holds ``ghost_ratio`` x capacity keys (default 4), where S3-FIFO keeps about |M|. G is
keys only (tens of bytes each, against MiBs per KV chunk), and KV reuse distances are
long: a document asked about again after thousands of other requests must still be
recognised as seen before, or it re-enters S and leaves before its next use.

Leaves sit in two min-heaps, ``(tick, key)``, with lazy deletion: an item is live if the
key is in that queue with that tick and has no tracked child. Ticks are insertion order
in S and last access in M. Moving a chunk to M happens once per residency, so the
promotions ``victim()`` performs are amortised O(log n). Pins: the hierarchy removes a
pinned chunk from the policy; it comes back on unpin with its queue and read bit.

Capacity (entries) is ``capacity_hint`` if given, else the largest resident count seen.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Set

from policies._util import (
    DEFAULT_DETACHED,
    Detached,
    PrefixTree,
    SmallMainGhost,
    compact_due,
    heap_top,
    parent_of,
)
from policies.base import NOTHING, EntryInfo, EvictionPolicy


class S3Prefix(SmallMainGhost, EvictionPolicy):
    name = "s3prefix"

    def __init__(
        self,
        capacity_hint: int | None = None,
        small_ratio: float = 0.1,
        ghost_ratio: float = 4.0,
    ) -> None:
        if capacity_hint is not None and capacity_hint < 1:
            raise ValueError("s3prefix capacity_hint must be >= 1")
        if not 0.0 < small_ratio < 1.0:
            raise ValueError("s3prefix small_ratio must be in (0, 1)")
        if ghost_ratio < 0.0:
            raise ValueError("s3prefix ghost_ratio must be >= 0")
        self.capacity_hint = capacity_hint
        self.small_ratio = small_ratio
        self.ghost_ratio = ghost_ratio
        self._small: dict[str, int] = {}  # key -> insertion tick
        self._main: dict[str, int] = {}  # key -> last access tick
        self._read: set[str] = set()  # S chunks read since insertion
        self._tree = PrefixTree()
        self._sheap: list[tuple[int, str]] = []
        self._mheap: list[tuple[int, str]] = []
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._tick = 0
        self._peak = 0
        # key -> (in M, read while in S)
        self._detached: Detached[tuple[bool, bool]] = Detached(
            max(DEFAULT_DETACHED, capacity_hint or 0)
        )

    # ------------------------------------------------------------ introspection

    @property
    def ghost_limit(self) -> int:
        return int(self.ghost_ratio * self.capacity)

    def is_leaf(self, key: str) -> bool:
        return self._tree.is_leaf(key)

    # ------------------------------------------------------------ heaps

    def _push(self, key: str | None) -> None:
        """Offer ``key`` to its queue's leaf heap (no-op unless it is a leaf)."""
        children = self._tree.children
        if key is None or children.get(key, 0):
            return
        if key in self._main:
            heap, queue = self._mheap, self._main
        elif key in self._small:
            heap, queue = self._sheap, self._small
        else:
            return
        heapq.heappush(heap, (queue[key], key))
        if compact_due(len(heap), len(queue)):
            heap[:] = [(t, k) for k, t in queue.items() if not children.get(k, 0)]
            heapq.heapify(heap)

    def _top(
        self, heap: list[tuple[int, str]], queue: dict[str, int], protected: Set[str]
    ) -> str | None:
        """The unprotected live leaf with the smallest tick, dropping stale items."""
        children = self._tree.children
        return heap_top(
            heap, lambda i: queue.get(i[1]) == i[0] and not children.get(i[1]), protected
        )

    # ------------------------------------------------------------ tree

    def _to_main(self, key: str) -> None:
        """Move ``key`` and its ancestors still in S to M."""
        while key in self._small:
            del self._small[key]
            self._read.discard(key)
            self._tick += 1
            self._main[key] = self._tick
            self._push(key)
            parent = self._tree.parent[key]
            if parent is None:
                return
            key = parent

    # ------------------------------------------------------------ interface

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        parent = parent_of(key, info)
        if key in self._tree:
            if info is not None:
                self._push(self._tree.relink(key, parent))
            self.on_access(key)
            return
        self._tree.link(key, parent)
        self._tick += 1
        state = self._detached.pop(key)
        if state is None and key in self._ghost:
            del self._ghost[key]
            state = (True, False)
        if state is not None and state[0]:
            self._small[key] = self._tick  # _to_main takes it (and S ancestors) to M
            self._to_main(key)
        else:
            self._small[key] = self._tick
            if state is not None and state[1]:
                self._read.add(key)
            self._push(key)
        self._peak = max(self._peak, len(self._tree))

    def on_access(self, key: str) -> None:
        if key in self._main:
            self._tick += 1
            self._main[key] = self._tick
            self._push(key)
        elif key in self._small:
            self._read.add(key)
        else:
            state = self._detached.get(key)
            if state is not None:  # read while pinned
                self._detached.put(key, (state[0], True))

    def on_remove(self, key: str) -> None:
        if key in self._small:
            del self._small[key]
            in_main = False
        elif key in self._main:
            del self._main[key]
            in_main = True
        else:
            return
        was_read = key in self._read
        self._read.discard(key)
        self._push(self._tree.unlink(key))
        if key != self._pending:
            self._detached.put(key, (in_main, was_read))
        elif not in_main and self.ghost_limit:
            self._ghost[key] = None
            self._ghost.move_to_end(key)
            while len(self._ghost) > self.ghost_limit:
                self._ghost.popitem(last=False)
        self._pending = None

    def victim(self, protected: Set[str] = NOTHING) -> str | None:
        small, main = self._small, self._main
        while small and (len(small) >= self.small_target or not main):
            key = self._top(self._sheap, small, protected)
            if key is None:
                break
            if key not in self._read:
                self._pending = key
                return key
            self._to_main(key)
        key = self._top(self._mheap, main, protected)
        if key is None:
            key = self._top(self._sheap, small, protected)
        if key is None and len(self._tree) > len(protected):
            # only reachable with a parent cycle (bad input)
            free = [k for k in self._tree.parent if k not in protected]
            key = min(free, key=lambda k: small.get(k, main.get(k, 0))) if free else None
        self._pending = key
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._tree

    def __len__(self) -> int:
        return len(self._tree)
