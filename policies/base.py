"""Eviction and admission interfaces (libCacheSim style: one small interface per kind).

The hierarchy and the trace simulator drive the same classes. A policy only tracks
*evictable* entries: the hierarchy removes pinned chunks from a tier's policy, so pins
override every policy by construction.

Callers evict with ``evict(n, protected)`` (vLLM's ``CachePolicy.evict`` contract):
``protected`` holds chunks that are resident and tracked but cannot go right now (a
reader holds them); they are stepped over without touching their recency or frequency,
as CacheLib's eviction iterator skips in-use items. Policy authors implement
``victim(protected)``, which names the next chunk without removing it.
"""

from __future__ import annotations

import abc
from collections.abc import Set
from dataclasses import dataclass
from typing import ClassVar

NOTHING: frozenset[str] = frozenset()


@dataclass(frozen=True)
class EntryInfo:
    """What a policy may know about a chunk beyond its key and size."""

    parent: str | None = None  # previous chunk in the prefix chain
    position: int = 0  # chunk index in the prompt (0 = first)


class EvictionPolicy(abc.ABC):
    name: ClassVar[str]
    # The key the next on_remove evicts (rather than detaches, as a pin or delete does):
    # policies that keep ghosts, an aging floor or a history act on it.
    _pending: str | None = None

    @abc.abstractmethod
    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        """A chunk became resident (evictable)."""

    @abc.abstractmethod
    def on_access(self, key: str) -> None:
        """A resident chunk was read. Unknown keys are ignored."""

    @abc.abstractmethod
    def on_remove(self, key: str) -> None:
        """A chunk left (evicted, deleted or pinned). Unknown keys are ignored."""

    @abc.abstractmethod
    def victim(self, protected: Set[str] = NOTHING) -> str | None:
        """The next chunk to evict, not in ``protected``, without removing it; None when
        there is none. It may do the policy's own queue moves (S3-FIFO's promotions), which
        never change what is resident and which the next call would do anyway, and must
        not change any state of a protected entry. ``on_remove`` of the returned key right
        after counts as its eviction."""

    def evict(self, n: int, protected: Set[str] = NOTHING) -> list[str] | None:
        """Evict exactly ``n`` chunks, none of them in ``protected``, and return them.

        Atomic: when fewer than ``n`` can go now, returns None and nothing leaves the
        policy. Chunks are chosen among those that can go *now*, so a prefix-aware
        policy's parent becomes a candidate only in a later call, once its leaf is gone;
        when such a policy falls short for that reason its ``victim()`` walks may have
        done their residency-neutral moves (which the next call would do anyway).
        """
        if n == 1 and not protected:  # the common call: no copies
            key = self.victim()
            if key is None:
                return None
            self._pending = key
            self.on_remove(key)
            return [key]
        if n <= 0:
            return []
        if len(self) - sum(1 for k in protected if k in self) < n:
            return None  # decided before any victim() walk moves a queue or a hand
        picked: list[str] = []
        skip = set(protected)
        for _ in range(n):
            key = self.victim(skip)
            if key is None:
                self._pending = None
                return None
            picked.append(key)
            skip.add(key)
        for key in picked:
            self._pending = key
            self.on_remove(key)
        return picked

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


class AdmissionPolicy(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def admit(self, key: str, size: int) -> bool:
        """Whether to write this chunk into the tier now."""

    def on_access(self, key: str) -> None:  # noqa: B027 - optional hook
        """A lookup or read touched this key (hit or miss)."""
