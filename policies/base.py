"""Eviction and admission interfaces (libCacheSim style: one small interface per kind).

The hierarchy and the trace simulator drive the same classes. A policy only tracks
*evictable* entries: the hierarchy removes pinned chunks from a tier's policy, so pins
override every policy by construction.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class EntryInfo:
    """What a policy may know about a chunk beyond its key and size."""

    parent: str | None = None  # previous chunk in the prefix chain
    position: int = 0  # chunk index in the prompt (0 = first)


class EvictionPolicy(abc.ABC):
    name: ClassVar[str]

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
    def victim(self) -> str | None:
        """The next chunk to evict, without removing it; None when empty."""

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
