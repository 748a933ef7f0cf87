"""Least-recently-used eviction: O(1) per operation on an ordered dict."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from policies._util import first_free
from policies.base import NOTHING, EntryInfo, EvictionPolicy


class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._od: OrderedDict[str, int] = OrderedDict()

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        self._od[key] = size
        self._od.move_to_end(key)

    def on_access(self, key: str) -> None:
        if key in self._od:
            self._od.move_to_end(key)

    def on_remove(self, key: str) -> None:
        self._od.pop(key, None)

    def victim(self, protected: Set[str] = NOTHING) -> str | None:
        return first_free(self._od, protected)

    def __contains__(self, key: object) -> bool:
        return key in self._od

    def __len__(self) -> int:
        return len(self._od)
