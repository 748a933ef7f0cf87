"""The one small async interface every storage tier implements.

Tiers store opaque encoded chunks (header + payload, see ``codec``) under chunk keys.
They do no eviction of their own: the hierarchy owns policy and calls ``delete``.
A tier that cannot take a chunk raises ``TierFull`` (capacity) or ``TierError`` (I/O).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence, Set
from dataclasses import dataclass
from typing import Any


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
    #: Set by the tiered store: called with each key a tier drops from its local index on
    #: its own (S3's bounded index), so what is kept per key elsewhere goes too.
    on_forget: Callable[[str], None] | None = None
    #: Write-error reasons the tier counts in ``write_errors`` itself (it also runs alone,
    #: in benches and tests); the tiered store counts the others, so none counts twice.
    counts_write_errors: frozenset[str] = frozenset()
    #: The stored bytes are the encoded chunk itself, so ``size_of`` is its size and
    #: ``get_into`` can fill a DRAM slot with it directly (false under an at-rest envelope).
    stores_chunks_as_is: bool = True

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

    def take_recovered(self) -> dict[str, tuple[str, int, str]]:
        """``key -> (parent, position, tenant)`` read from the headers of chunks found at
        start-up (left by a previous run), handed over once: the hierarchy gives them to its
        eviction policies so a restart keeps the prefix tree, and to its tenant accounts."""
        return {}

    def leased(self) -> Set[str]:
        """Keys a reader holds now: evicting them would free nothing yet, so eviction
        passes over them (``EvictionPolicy.evict``'s ``protected``)."""
        return frozenset()

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Finish set-up that needs the event loop (e.g. S3's budget listing)."""

    async def get_into(self, key: str, out: memoryview) -> int | None:
        """Read ``key``'s stored bytes into ``out``; their length, or None when absent.
        Tiers that can read straight into the buffer (NVMe) override this."""
        raw = await self.get(key)
        if raw is None:
            return None
        out[: len(raw)] = raw
        return len(raw)

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""


class SlotTier(Tier):
    """A tier in shared memory that clients fill and read themselves (the DRAM pool).

    The slot protocol: ``reserve(nbytes)`` gives a writer a run of slots (named by its
    first), ``commit(key, slot, length)`` publishes it, ``abort(slot)`` returns it.
    Readers in the owner ``acquire`` a lease and ``release`` it; a run dropped while
    leased is freed on its last release. Clients find published runs without the owner
    through ``shared_index`` (a seqlock generation per slot, ``shm_index``).
    """

    slot_bytes: int  # the allocation unit; a run is ceil(size / slot_bytes) slots
    num_slots: int
    pool_bytes: int
    shared_index: Any  # ``tiered_cache.tiers.shm_index.SlotIndex``

    @property
    @abc.abstractmethod
    def shm_name(self) -> str:
        """The pool's shared-memory segment, for clients to attach."""

    @property
    @abc.abstractmethod
    def free_slots(self) -> int: ...

    @abc.abstractmethod
    def reserve(self, nbytes: int = 1) -> int:
        """A free run for ``nbytes``; ``TierFull`` when none is long enough."""

    @abc.abstractmethod
    def abort(self, slot: int) -> None: ...

    @abc.abstractmethod
    def commit(self, key: str, slot: int, length: int) -> None: ...

    @abc.abstractmethod
    def acquire(self, key: str) -> tuple[int, int] | None:
        """Lease the run holding ``key``: (slot, length)."""

    @abc.abstractmethod
    def release(self, slot: int) -> None: ...

    @abc.abstractmethod
    def slot_view(self, slot: int) -> memoryview:
        """The bytes of the run that starts at ``slot``."""
