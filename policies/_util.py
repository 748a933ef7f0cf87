"""Small helpers shared by the eviction policies (not part of the public API)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

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
