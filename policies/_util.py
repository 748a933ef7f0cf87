"""Small helpers shared by the eviction policies (not part of the public API)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Set
from typing import Generic, TypeVar

from policies.base import EntryInfo

V = TypeVar("V")

# How many detached (pinned or deleted) entries a policy remembers when it has no hint.
DEFAULT_DETACHED = 4096


class Detached(Generic[V]):
    """Bounded memory of per-key state for entries removed *without* being evicted.

    The hierarchy calls ``on_remove`` both when it evicts a chunk (after ``victim()``
    returned it) and when it pins one; on unpin it calls ``on_insert`` again. A policy
    that keeps per-key history (frequency, queue membership) stores it here on a
    non-eviction removal so the chunk comes back with its history instead of looking
    brand new. Oldest entries are dropped beyond ``limit``.
    """

    def __init__(self, limit: int = DEFAULT_DETACHED) -> None:
        self.limit = max(1, limit)
        self._od: OrderedDict[str, V] = OrderedDict()

    def put(self, key: str, state: V) -> None:
        self._od[key] = state
        self._od.move_to_end(key)
        while len(self._od) > self.limit:
            self._od.popitem(last=False)

    def pop(self, key: str) -> V | None:
        return self._od.pop(key, None)

    def get(self, key: str) -> V | None:
        return self._od.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._od

    def __len__(self) -> int:
        return len(self._od)


def compact_due(heap_len: int, live: int) -> bool:
    """Whether a lazy-deletion heap holds enough stale entries to be rebuilt.

    Rebuilding costs O(live) and happens only after more than ``live + 64`` stale pushes,
    so it is amortised O(1) per operation and the heap stays O(live) in size.
    """
    return heap_len > 2 * live + 64


Item = TypeVar("Item", bound=tuple[object, ...])


def heap_top(heap: list[Item], live: Callable[[Item], bool], protected: Set[str]) -> str | None:
    """The key (last field) of the smallest live item whose key is not protected.

    Stale items on top are dropped (lazy deletion). Protected ones are set aside and
    pushed back unchanged, so skipping them leaves their rank as it was.
    """
    held: list[Item] = []
    found: str | None = None
    while heap:
        item = heap[0]
        if not live(item):
            heapq.heappop(heap)
        elif protected and item[-1] in protected:
            held.append(heapq.heappop(heap))
        else:
            found = item[-1]  # type: ignore[assignment]
            break
    for item in held:
        heapq.heappush(heap, item)
    return found


def first_free(keys: Iterable[str], protected: Set[str]) -> str | None:
    """The first key not in ``protected`` (queues are iterated oldest first)."""
    if not protected:
        return next(iter(keys), None)
    return next((k for k in keys if k not in protected), None)


def parent_of(key: str, info: EntryInfo | None) -> str | None:
    """The chunk's parent from ``info``; a self-parent (malformed input) counts as none."""
    parent = info.parent if info is not None else None
    return None if parent == key else parent


class PrefixTree:
    """Parent links and tracked-child counts of the chunks a prefix-aware policy holds.

    A chunk is a *leaf* while no tracked chunk names it as parent. A parent need not be
    tracked itself (it may live in another tier, or be pinned): its count waits for it.
    ``children`` is public so that hot loops can test ``children.get(key)`` directly.
    O(1) per operation.
    """

    __slots__ = ("children", "parent")

    def __init__(self) -> None:
        self.parent: dict[str, str | None] = {}
        self.children: dict[str, int] = {}  # parent key -> tracked children

    def __contains__(self, key: object) -> bool:
        return key in self.parent

    def __len__(self) -> int:
        return len(self.parent)

    def is_leaf(self, key: str) -> bool:
        return key in self.parent and self.children.get(key, 0) == 0

    def link(self, key: str, parent: str | None) -> None:
        self.parent[key] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1

    def unlink(self, key: str) -> str | None:
        """Forget ``key``; returns its parent when that has just lost its last child."""
        parent = self.parent.pop(key)
        if parent is None:
            return None
        left = self.children[parent] - 1
        if left:
            self.children[parent] = left
            return None
        del self.children[parent]
        return parent

    def relink(self, key: str, parent: str | None) -> str | None:
        """Re-parent a tracked ``key``; returns the old parent if it has just become a leaf."""
        if parent == self.parent[key]:
            return None
        freed = self.unlink(key)
        self.link(key, parent)
        return freed


class Sized:
    """A policy whose bookkeeping scales with the tier's capacity in entries."""

    capacity_hint: int | None
    _peak: int  # the largest resident count seen

    @property
    def capacity(self) -> int:
        """Entries: ``capacity_hint`` if given, else the largest resident count seen."""
        return self.capacity_hint if self.capacity_hint is not None else max(1, self._peak)


class SmallMainGhost(Sized):
    """The queue shape that S3-FIFO and S3Prefix share: a small probation queue S, a main
    queue M and a ghost queue G of evicted keys, sized from ``capacity``."""

    small_ratio: float
    _small: Mapping[str, object]
    _main: Mapping[str, object]
    _ghost: Mapping[str, object]

    @property
    def small_target(self) -> int:
        return max(1, int(self.small_ratio * self.capacity))

    def queue_of(self, key: str) -> str | None:
        """'small', 'main' or 'ghost' (for tests and introspection)."""
        if key in self._small:
            return "small"
        if key in self._main:
            return "main"
        if key in self._ghost:
            return "ghost"
        return None

    def ghost_size(self) -> int:
        return len(self._ghost)
