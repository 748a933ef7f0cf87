"""The one small async interface every storage tier implements.

Tiers store opaque encoded chunks (header + payload, see ``codec``) under chunk keys.
They do no eviction of their own: the hierarchy owns policy and calls ``delete``.
A tier that cannot take a chunk raises ``TierFull`` (capacity) or ``TierError`` (I/O).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class TierError(Exception):
    """An I/O failure in a tier. The hierarchy turns it into a miss or a refused write."""


class TierFull(TierError):
    """The tier has no room for this chunk (capacity, slot size or disk full)."""


@dataclass(frozen=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int | None  # None: unbounded
    num_chunks: int


class Tier(abc.ABC):
    #: "dram", "nvme" or "s3": also the name used in configs, metrics and the directory.
    name: str

    @abc.abstractmethod
    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Batched membership: one round trip for all keys."""

    async def longest_prefix(self, keys: Sequence[str]) -> int:
        """Number of leading keys present."""
        n = 0
        for hit in await self.contains_many(keys):
            if not hit:
                break
            n += 1
        return n

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | bytearray | None:
        """The stored bytes, unverified, or None when absent."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store atomically: readers see the whole chunk or nothing."""

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Remove; True when something was removed."""

    @abc.abstractmethod
    def usage(self) -> TierUsage: ...

    @abc.abstractmethod
    def entries(self) -> Iterator[tuple[str, int]]:
        """(key, stored size) for every chunk the tier holds, from its local index."""

    def size_of(self, key: str) -> int | None:
        """Stored size of ``key`` from the local index, or None."""
        for k, size in self.entries():
            if k == key:
                return size
        return None

    def fits(self, nbytes: int) -> bool:
        """Whether one chunk of this size could ever be stored (slot size, budget)."""
        cap = self.usage().capacity_bytes
        return cap is None or nbytes <= cap

    def has_room(self, nbytes: int) -> bool:
        """Whether a chunk of this size can be stored now without evicting."""
        u = self.usage()
        return u.capacity_bytes is None or u.used_bytes + nbytes <= u.capacity_bytes

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
