"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03): O(1) per operation.

Residents live in T1 (seen once recently) or T2 (seen at least twice); ghosts of
entries evicted from them are kept in B1 / B2 (keys only). A re-insert that hits B1
means T1 was too small, so the target size ``p`` of T1 grows; a hit in B2 shrinks it.
``victim()`` takes T1's LRU entry while ``|T1| > p`` (or T2 is empty), else T2's.

Capacity ``c`` (in entries) is ``capacity_hint`` when given, else the largest resident
count seen so far (the hierarchy evicts by bytes, so with uniform chunks the resident
count at eviction time is the capacity). Ghost lists obey ARC's bounds
``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c``, so ``|B1| + |B2| <= 2c``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from policies._util import DEFAULT_DETACHED, Detached, first_free
from policies.base import NOTHING, EntryInfo, EvictionPolicy


class ARC(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity_hint: int | None = None) -> None:
        if capacity_hint is not None and capacity_hint < 1:
            raise ValueError("arc capacity_hint must be >= 1")
        self.capacity_hint = capacity_hint
        self._t1: OrderedDict[str, None] = OrderedDict()
        self._t2: OrderedDict[str, None] = OrderedDict()
        self._b1: OrderedDict[str, None] = OrderedDict()
        self._b2: OrderedDict[str, None] = OrderedDict()
        self.p = 0.0  # target size of T1
        self._peak = 0
        # key -> "was in T2 (or read while detached)"
        self._detached: Detached[bool] = Detached(max(DEFAULT_DETACHED, capacity_hint or 0))

    @property
    def capacity(self) -> int:
        return self.capacity_hint if self.capacity_hint is not None else max(1, self._peak)

    def ghost_sizes(self) -> tuple[int, int]:
        return len(self._b1), len(self._b2)

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        if key in self._t1 or key in self._t2:
            self.on_access(key)
            return
        c = self.capacity
        frequent = self._detached.pop(key)
        if frequent is not None:
            (self._t2 if frequent else self._t1)[key] = None
        elif key in self._b1:
            self.p = min(float(c), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._peak = max(self._peak, len(self))
        self._trim_ghosts()

    def on_access(self, key: str) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)
        elif key in self._detached:
            self._detached.put(key, True)

    def on_remove(self, key: str) -> None:
        evicted = key == self._pending
        if key in self._t1:
            del self._t1[key]
            if evicted:
                self._b1[key] = None
            else:
                self._detached.put(key, False)
        elif key in self._t2:
            del self._t2[key]
            if evicted:
                self._b2[key] = None
            else:
                self._detached.put(key, True)
        else:
            return
        self._pending = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self) + len(self._b1) + len(self._b2) > 2 * c and (self._b1 or self._b2):
            (self._b2 if self._b2 else self._b1).popitem(last=False)

    def victim(self, protected: Set[str] = NOTHING) -> str | None:
        t1 = first_free(self._t1, protected)
        t2 = first_free(self._t2, protected)
        key = t1 if t1 is not None and (len(self._t1) > self.p or t2 is None) else t2
        self._pending = key
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
