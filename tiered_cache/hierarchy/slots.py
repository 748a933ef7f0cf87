"""The DRAM slot protocol and prefetch: used by the node agent so local clients copy chunk
bytes straight into and out of the DRAM pool (the agent only moves slot numbers), and so
chunks below DRAM or on other nodes can be copied into it ahead of a read."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from policies import EntryInfo
from tiered_cache import codec
from tiered_cache.directory import Directory, Location
from tiered_cache.events import StoreEvents
from tiered_cache.hierarchy.background import CopyBudget
from tiered_cache.hierarchy.types import Hit, TierSlot, header_tenant
from tiered_cache.tenancy import TenantBook
from tiered_cache.tiers.base import SlotTier, TierError, TierFull

log = logging.getLogger("tiered_cache.hierarchy")  # one logger for the package, as before

MISSED_S = 10.0  # how long a remote copy a fetch could not find is not offered again


class SlotsMixin:
    """Owns a ``TieredStore``'s DRAM slots: reserve -> commit or abort, leases (promoting
    from NVMe straight into a slot, or from any other source), release, hits clients read
    through the shared index, and prefetch into DRAM."""

    # TieredStore's attributes this part uses.
    slots: list[TierSlot]
    by_name: dict[str, TierSlot]
    events: StoreEvents
    _pool: SlotTier | None
    _locks: dict[str, asyncio.Lock]
    _fetch_sem: asyncio.Semaphore
    _info: dict[str, EntryInfo]
    _prefetching: set[str]
    _located: dict[str, list[Location]]
    _landed: asyncio.Event
    _missed: dict[str, float]
    background: CopyBudget
    tenants: TenantBook
    directory: Directory | None

    mac_key: bytes | None

    if TYPE_CHECKING:  # defined by TieredStore, PinsMixin, ReadsMixin and RemoteMixin

        async def _forged(self, source: str, key: str, e: codec.ChunkForged) -> None: ...

        async def _make_room(
            self, slot: TierSlot, nbytes: int
        ) -> Callable[[], Awaitable[object]] | None: ...
        def _track(self, slot: TierSlot, key: str, size: int) -> None: ...
        async def _enforce_quota(self, slot: TierSlot, tenant: str) -> None: ...
        async def _publish(self, tier: str, keys: Sequence[str]) -> None: ...
        def _is_pinned(self, tier: str, key: str) -> bool: ...
        async def _write_down(self, key: str, raw: bytes, slots: Sequence[TierSlot]) -> None: ...
        def _spawn(
            self, coro: Awaitable[None], sem: asyncio.Semaphore | None = None, nbytes: int = 0
        ) -> None: ...
        async def _plan(self, key: str) -> list[str]: ...
        async def _get_planned(
            self, key: str, plan: list[str], expect_fp: bytes | None, promote: bool
        ) -> Hit | None: ...
        async def _write_tier(
            self, slot: TierSlot, key: str, data: bytes | bytearray | memoryview
        ) -> bool: ...
        async def _unusable(self, tier: str, key: str, e: codec.ChunkError) -> None: ...
        def _observe(self, source: str, nbytes: int, seconds: float) -> None: ...

    def _dram(self) -> tuple[TierSlot, SlotTier]:
        """The top tier when it is a slot pool (clients fill and read it themselves)."""
        if self._pool is None:
            raise TierError("no DRAM tier: shared-memory transfers are unavailable")
        return self.slots[0], self._pool

    async def reserve_dram(self, nbytes: int) -> int | None:
        """A free DRAM slot for a client to fill, evicting if needed; None when refused
        (and always without a DRAM pool: the client then sends the chunk inline)."""
        if self._pool is None:
            return None
        top, tier = self._dram()
        if not tier.fits(nbytes):
            return None
        while True:
            async with self._locks[top.name]:
                try:
                    pending = await self._make_room(top, nbytes)
                    if pending is None:
                        return tier.reserve(nbytes)
                except TierFull:
                    self.events.write_failed(top.name, "full")
                    return None
            await pending()  # without the lock: a victim's copy down, or a wait for one

    def abort_dram(self, slot: int) -> None:
        tier = self._dram()[1]
        tier.abort(slot)

    async def commit_dram(
        self,
        key: str,
        slot: int,
        length: int,
        *,
        info: EntryInfo | None = None,
        wait: bool = False,
    ) -> None:
        """Publish a client-filled slot, then copy it down per the lower tiers' write modes."""
        top, tier = self._dram()
        if tier.size_of(key) is not None:  # content-addressed: already here, keep it
            if info is not None:
                self._info[key] = info
            tier.abort(slot)
            top.eviction.on_access(key)
            return
        async with self._locks[top.name]:
            tier.commit(key, slot, length)
            if info is not None:  # only once held: a refused commit leaves nothing behind
                self._info[key] = info
            top.eviction.on_remove(key)
            self._track(top, key, length)
            # Room was made at reserve, before the client wrote the header naming the
            # tenant: its quota is checked now (below, once the copies are taken).
            tenant = header_tenant(tier.slot_view(slot)[: codec.HEADER_SIZE])
            self.tenants.add(top.name, key, tenant, length)
        through = [
            s
            for s in self.slots[1:]
            if s.write_mode == "write_through" or self._is_pinned(s.name, key)
        ]
        raw = None
        # Copied before any await: once published the chunk may be evicted and its slot
        # reused. Without ``wait`` only within the byte budget (skipped and counted over).
        if through and (
            wait or self.background.take(length, "write_through", [s.name for s in through])
        ):
            raw = bytes(tier.slot_view(slot)[:length])
            if not wait:
                self._spawn(self._write_down(key, raw, through), nbytes=length)
        self.events.stored(top.name, length)
        await self._publish(top.name, [key])
        if raw is not None and wait:
            await self._write_down(key, raw, through)
        await self._enforce_quota(top, tenant)

    async def lease(
        self,
        key: str,
        expect_fingerprint: bytes | None = None,
        *,
        served: list[str] | None = None,
    ) -> tuple[int, int] | Hit | None:
        """Lease ``key`` in DRAM as (slot, length), promoting it from a lower tier or a peer
        first. Returns the Hit itself when it cannot be placed in DRAM, None on a miss.
        On a hit, appends the source that served it (tier name or "peer") to ``served``.
        Without a DRAM pool (NVMe and/or S3 only) it is always the Hit: the agent hands
        its bytes to the client inline, a reply's worth at a time (``agent.local``)."""
        if self._pool is None:
            # Promoted as any read is: an S3 hit lands in the top tier (NVMe) for the next.
            hit = await self._get_planned(
                key, await self._plan(key), expect_fingerprint, promote=True
            )
            if hit is not None and served is not None:
                served.append(hit.source)
            return hit
        top, tier = self._dram()
        got = tier.acquire(key)
        if got is not None:
            tokens = 0
            head_key = key
            with contextlib.suppress(codec.ChunkError):
                head = codec.parse_header(tier.slot_view(got[0])[: codec.HEADER_SIZE])[0]
                tokens, head_key = head.num_tokens, head.key
            if head_key == key:
                self._count_dram_hit(top, key, got[1], tokens)
                if served is not None:
                    served.append("dram")
                return got
            # Committed under a key its header does not name: never serve it (the header
            # was parsed anyway, so this costs nothing), drop it, try the lower tiers.
            tier.release(got[0])
            await self._unusable(
                "dram", key, codec.ChunkWrongKey(f"chunk is for key {head_key}, expected {key}")
            )
        plan = await self._plan(key)
        if plan and plan[0] == "nvme":
            got = await self._lease_from_nvme(top, tier, key, expect_fingerprint)
            if got is not None:
                if served is not None:
                    served.append("nvme")
                return got
            # else (no room in DRAM, or it failed verification): go on down the plan
        hit = await self._get_planned(key, plan, expect_fingerprint, promote=False)
        if hit is None:
            return None
        if served is not None:
            served.append(hit.source)
        await self._write_tier(top, key, hit.encoded())
        got = tier.acquire(key)
        return got if got is not None else hit

    def _count_dram_hit(self, top: TierSlot, key: str, nbytes: int, tokens: int) -> None:
        top.eviction.on_access(key)
        self.events.hit("dram", tokens, nbytes)

    def note_dram_hits(self, hits: Sequence[Sequence[Any]]) -> None:
        """Account for ``(key, bytes, tokens)`` a client read straight from the pool through
        the shared index (no lease): recency for eviction, and the hit metrics."""
        if self._pool is None:  # only a slot pool has a shared index to read through
            return
        top, tier = self._dram()
        for key, nbytes, tokens in hits:
            if tier.size_of(key) is not None:  # evicted since: nothing to refresh
                self._count_dram_hit(top, key, int(nbytes), int(tokens))

    async def _lease_from_nvme(
        self, top: TierSlot, dram: SlotTier, key: str, expect_fp: bytes | None
    ) -> tuple[int, int] | None:
        """Promote an NVMe chunk by reading the file straight into a DRAM slot and
        verifying it there: one copy instead of read + encode + copy."""
        slot = self.by_name.get("nvme")
        if slot is None or not slot.tier.stores_chunks_as_is:  # an envelope: read, open, copy
            return None
        size = slot.tier.size_of(key)
        if size is None or not dram.fits(size):
            return None
        t0 = time.perf_counter()
        s = await self.reserve_dram(size)
        if s is None:
            return None
        try:
            n = await slot.tier.get_into(key, dram.slot_view(s)[:size])
            if n is None:
                raise TierError("vanished")
            codec.decode(
                dram.slot_view(s)[:n],
                expect_key=key,
                expect_fingerprint=expect_fp,
                mac_key=self.mac_key,
            )
        except codec.ChunkForged as e:
            dram.abort(s)
            await self._forged("nvme", key, e)
            return None
        except (codec.ChunkError, TierError, ValueError) as e:
            dram.abort(s)
            if isinstance(e, codec.ChunkError):
                await self._unusable("nvme", key, e)
            return None
        slot.eviction.on_access(key)
        slot.admission.on_access(key)
        self._observe("nvme", n, time.perf_counter() - t0)
        tokens = 0
        with contextlib.suppress(codec.ChunkError):
            tokens = codec.parse_header(dram.slot_view(s)[: codec.HEADER_SIZE])[0].num_tokens
        self.events.hit("nvme", tokens, n, time.perf_counter() - t0)
        async with self._locks[top.name]:
            tenant = header_tenant(dram.slot_view(s)[: codec.HEADER_SIZE])
            if dram.size_of(key) is None:
                dram.commit(key, s, n)
                top.eviction.on_remove(key)
                self._track(top, key, n)
                self.tenants.add(top.name, key, tenant, n)
            else:
                dram.abort(s)  # promoted meanwhile by another reader
        await self._publish(top.name, [key])
        got = dram.acquire(key)  # leased: the quota's evictions pass over it
        await self._enforce_quota(top, tenant)
        return got

    def release(self, slot: int) -> None:
        tier = self._dram()[1]
        tier.release(slot)

    async def prefetch(self, keys: Sequence[str], expect_fp: bytes | None = None) -> int:
        """Start copying ``keys`` that live below DRAM or on other nodes into DRAM, in the
        background (deduplicated, bounded like other background work), so a reader can
        then load them from local memory. Returns how many copies were started."""
        if self._pool is None:
            return 0
        top = self.slots[0]
        todo = [k for k in dict.fromkeys(keys)
                if k not in self._prefetching and top.tier.size_of(k) is None]  # fmt: skip
        if not todo:
            return 0
        self._prefetching.update(todo)
        if self.directory is not None:
            # One directory round trip for the whole batch: each copy's read plan would
            # otherwise ask for its key on its own (nine chunks: nine round trips, each
            # queued behind the others on the agent's loop before any byte moves).
            try:
                for key, locs in zip(todo, await self.directory.locate(todo), strict=True):
                    self._located[key] = locs
            except Exception as e:  # each read plan asks again
                log.debug("prefetch: batch locate failed: %s", e)
        for key in todo:
            # Not behind write-through copies to a slow S3: a reader is waiting for these.
            self._spawn(self._prefetch_one(key, expect_fp), self._fetch_sem)
        return len(todo)

    async def _prefetch_one(self, key: str, expect_fp: bytes | None) -> None:
        try:
            got = await self.lease(key, expect_fp)
            if isinstance(got, tuple):
                self.release(got[0])
            elif got is None:
                # The directory named a copy that is not there (a dead node's, a bucket
                # emptied since): lookups stop offering it for a while, so a reader
                # waiting for it recomputes at its next look instead of at its deadline.
                if len(self._missed) > 10_000:
                    self._missed.clear()
                self._missed[key] = time.monotonic() + MISSED_S
        finally:
            self._prefetching.discard(key)
            self._located.pop(key, None)
            # Wake every ``wait_prefetched``: each checks its own keys.
            landed, self._landed = self._landed, asyncio.Event()
            landed.set()

    async def wait_prefetched(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait until none of ``keys`` is still being copied into DRAM (each landed, or its
        copy failed), at most ``timeout`` seconds; whether DRAM holds them all. Wakes
        when a copy ends, not on a poll: a reader loads as soon as its chunks land."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(k in self._prefetching for k in keys):
            left = deadline - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._landed.wait(), left)
        top = self.slots[0]
        return all(top.tier.size_of(k) is not None for k in keys)
