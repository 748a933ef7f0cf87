"""The tiered store: DRAM -> NVMe -> S3 with per-tier eviction, admission and write policy.

- ``put`` lands in the top tier (DRAM), then reaches lower tiers per their write mode:
  ``write_through`` (copied at put time, in the background) or ``write_back`` (copied when
  evicted from the tier above). An admission policy can refuse a tier.
- ``get`` reads from the nearest tier holding the chunk, verifies it (a failure is a miss:
  counted, removed, and the next tier is tried) and promotes hits to DRAM.
- Eviction is per tier through ``policies``. Pinned chunks are taken out of a tier's
  policy, so no policy can ever pick them.
- Concurrency: one asyncio lock per tier serialises make-room + insert; DRAM slots are
  leased, so a chunk evicted while being read is freed only after the read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from policies import EntryInfo
from tiered_cache.breaker import Breaker
from tiered_cache.directory import Directory, Pin
from tiered_cache.estimates import SourceEstimator
from tiered_cache.events import MetricsEvents, StoreEvents
from tiered_cache.hierarchy.aliases import AliasMap
from tiered_cache.hierarchy.background import DEFAULT_BACKGROUND_BYTES, CopyBudget
from tiered_cache.hierarchy.pins import PinsMixin
from tiered_cache.hierarchy.quotas import QuotasMixin
from tiered_cache.hierarchy.reads import ReadsMixin
from tiered_cache.hierarchy.remote import RemoteMixin
from tiered_cache.hierarchy.slots import SlotsMixin
from tiered_cache.hierarchy.types import (
    Hit,
    PeerFetch,
    Residency,
    TierSlot,
    header_info,
    header_tenant,
)
from tiered_cache.metrics import Metrics
from tiered_cache.tenancy import TenantBook, TenantQuota
from tiered_cache.tiers.base import SlotTier, TierError, TierFull

log = logging.getLogger("tiered_cache.hierarchy")  # one logger for the package, as before
REPUBLISH_BATCH = 1000  # keys per directory publish when refreshing them all


class TieredStore(PinsMixin, RemoteMixin, ReadsMixin, SlotsMixin, QuotasMixin):
    """The store of one node. Its parts: this class (tiers, eviction, the write path,
    admin), ``PinsMixin`` (pins), ``ReadsMixin`` (the read path), ``RemoteMixin`` (other
    nodes' copies), ``SlotsMixin`` (the DRAM slot protocol, prefetch) and ``QuotasMixin``
    (tenants' quotas)."""

    def __init__(
        self,
        tiers: Sequence[TierSlot],
        *,
        node_id: str = "local",
        directory: Directory | None = None,
        metrics: Metrics | None = None,
        events: StoreEvents | None = None,
        location_ttl_s: float = 3600.0,
        verify_dram_reads: bool = False,
        peer_fetch: PeerFetch | None = None,
        max_background: int = 16,
        mac_key: bytes | None = None,
        max_background_bytes: int = DEFAULT_BACKGROUND_BYTES,
        tenant_quotas: Mapping[str, TenantQuota] | None = None,
        residency: Residency | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tiers: {names}")
        self.slots = list(tiers)
        self.by_name = {s.name: s for s in self.slots}
        self._next_slot = {
            s.name: (self.slots[i + 1] if i + 1 < len(self.slots) else None)
            for i, s in enumerate(self.slots)
        }
        self.node_id = node_id
        self.directory = directory
        # What happened goes to ``events``; by default that is the Prometheus series of
        # ``metrics`` (the trace simulator passes a plain StoreEvents: no bookkeeping).
        self.metrics = metrics or Metrics()
        self.events = events if events is not None else MetricsEvents(self.metrics)
        # Which tier holds which key, as it changes (the agent's KV events); None: nobody.
        self.residency = residency
        self.location_ttl_s = location_ttl_s
        # DRAM contents were verified on the way in and live in trusted memory; re-hashing
        # them on every read would cost as much as the copy itself.
        self.verify_dram_reads = verify_dram_reads
        self.peer_fetch = peer_fetch
        # The cluster's chunk MAC key (codec.py): every copy read from NVMe, S3 or a peer
        # must carry its MAC. DRAM copies are not checked: only this node's own writers
        # (who hold the key) fill the pool, and those read from elsewhere were checked.
        self.mac_key = mac_key
        # Expected time per source (dram, nvme, peer:<node>, s3), from real transfers.
        self.estimates = SourceEstimator()
        self._typical_bytes = 0  # size of recent chunks, for ranking sources of unknown size
        self._locks = {s.name: asyncio.Lock() for s in self.slots}
        # tier -> victims being copied to the write-back tier below, without the lock
        self._demoting: dict[str, dict[str, asyncio.Event]] = {s.name: {} for s in self.slots}
        # Bytes held by queued write-through copies and promotions (background.py).
        self.background = CopyBudget(max_background_bytes, self.events)
        for s in self.slots:  # a tier that forgets keys on its own (S3's bounded index)
            s.tier.on_forget = functools.partial(self._tier_forgot, s)
        # The slot protocol (reserve/commit, leases) needs the top tier to be a pool.
        top = self.slots[0].tier
        self._pool: SlotTier | None = top if isinstance(top, SlotTier) else None
        self._bg: set[asyncio.Task[None]] = set()
        self._bg_sem = asyncio.Semaphore(max_background)
        self._fetch_sem = asyncio.Semaphore(8)  # prefetches (as many as a get loads at once)
        self._info: dict[str, EntryInfo] = {}
        self._dropped_logged: set[str] = set()
        self._prefetching: set[str] = set()  # keys being copied into DRAM
        self._located = {}  # directory answers a prefetch got for its batch (see prefetch)
        self._landed = asyncio.Event()  # set (and replaced) whenever a prefetch ends
        self._missed: dict[str, float] = {}  # key -> until when no remote copy is offered
        self._absent: dict[str, float] = {}  # key -> until when it is known missing (reads)
        self.aliases = AliasMap()  # prefixes of whole chunks (``present``)
        self._peer_breakers: dict[str, Breaker] = {}  # node -> its breaker (remote.py)
        self._probes: set[asyncio.Future[Any]] = set()
        # tier -> key -> ids of pins covering it
        self._pinned: dict[str, dict[str, set[str]]] = {s.name: {} for s in self.slots}
        self._pins: dict[str, Pin] = {}
        # Bytes per tenant per tier (from the tenant each chunk's header names) and quotas.
        self.tenants = TenantBook(names, tenant_quotas or {})
        self._tenants_seen: set[str] = set()  # reported in gauges (quotas.py)
        self._adopt()

    def _adopt(self) -> None:
        """Track what tiers already hold (after a restart) in their eviction policies,
        with the prefix information their chunk headers carry."""
        for s in self.slots:
            for key, (parent, position, tenant) in s.tier.take_recovered().items():
                if parent or position:
                    self._info.setdefault(key, EntryInfo(parent or None, position))
                if tenant:
                    self.tenants.add(s.name, key, tenant, s.tier.size_of(key) or 0)
            for key, size in s.tier.entries():
                if key not in s.eviction and not self._is_pinned(s.name, key):
                    s.eviction.on_insert(key, size, self._info.get(key))

    async def open(self) -> None:
        """Finish async tier set-up (e.g. S3 budget listing), then adopt their contents."""
        for s in self.slots:
            await s.tier.open()
        self._adopt()

    # ---------------------------------------------------------------- helpers

    def _track(self, slot: TierSlot, key: str, size: int) -> None:
        if not self._is_pinned(slot.name, key):
            slot.eviction.on_insert(key, size, self._info.get(key))

    def _spawn(
        self, coro: Awaitable[None], sem: asyncio.Semaphore | None = None, nbytes: int = 0
    ) -> None:
        """Run ``coro`` in the background; ``nbytes`` taken from ``background`` by the
        caller are given back when it ends."""

        async def run() -> None:
            async with sem or self._bg_sem:
                try:
                    await coro
                except Exception:
                    log.exception("background tier write failed")

        t = asyncio.ensure_future(run())
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)
        if nbytes:  # also when cancelled before it ran
            t.add_done_callback(lambda _: self.background.give(nbytes))

    async def _publish(self, tier: str, keys: Sequence[str], *, refresh: bool = False) -> None:
        # Every local write comes through here (``refresh``: a republish, not a write): a
        # key just stored is no longer missing.
        for k in keys:
            self._absent.pop(k, None)
        if self.residency is not None and keys and not refresh:
            self.residency.added(tier, list(keys))
        if self.directory is not None and keys:
            await self.directory.publish(self.node_id, tier, keys, self.location_ttl_s)

    async def _unpublish(self, tier: str, keys: Sequence[str]) -> None:
        # Every removal of a local copy comes through here.
        if self.residency is not None and keys:
            self.residency.removed(tier, list(keys))
        if self.directory is not None and keys:
            await self.directory.unpublish(self.node_id, tier, keys)

    def _below(self, slot: TierSlot) -> TierSlot | None:
        return self._next_slot[slot.name]

    def _observe(self, source: str, nbytes: int, seconds: float) -> None:
        self.estimates.observe(source, nbytes, seconds)
        self._typical_bytes = nbytes
        est = self.estimates.estimate(source)
        self.events.estimate(source, est.latency_s, est.bandwidth_bps)

    # ---------------------------------------------------------------- eviction

    async def _make_room(
        self, slot: TierSlot, nbytes: int, tenant: str = ""
    ) -> Callable[[], Awaitable[object]] | None:
        """Evict from ``slot`` until ``nbytes`` fit, and fit ``tenant``'s quota there; None
        once they do. Over the quota, only the tenant's own chunks are candidates (its
        least valuable by the tier's policy); for the tier's capacity, any. Caller holds the
        tier's lock. A victim the write-back tier below lacks is not copied down here:
        that is slow I/O (NVMe, S3), and every writer of this tier waits on the lock. What
        is returned instead, the caller runs after letting go of the lock (copy that
        victim down, or wait for another writer's copy to free room), then tries again."""
        tier = slot.tier
        below = self._below(slot)
        demoting = self._demoting[slot.name]
        while True:
            over = self.tenants.over(slot.name, tenant, nbytes)
            if not over and tier.has_room(nbytes):
                return None
            # A chunk a reader holds would free nothing until it is released: the policy
            # steps over it without counting a read, so its rank stays as it was.
            chosen = slot.eviction.evict(1, self._not_of(slot, tenant) if over else tier.leased())
            if not chosen:
                # Victims being copied down free their room soon (over a quota: the
                # tenant's own).
                soon = [
                    done.wait
                    for k, done in demoting.items()
                    if not over or self.tenants.owner(slot.name, k) == tenant
                ]
                if soon:
                    return soon[0]
                if over:
                    raise TierFull(
                        f"{tier.name}: tenant {tenant} is at its quota, its chunks there"
                        " pinned or in use"
                    )
                raise TierFull(f"{tier.name}: full of pinned or in-use chunks")
            key = chosen[0]
            if (
                below is not None
                and below.write_mode == "write_back"
                and below.tier.size_of(key) is None
            ):
                done = demoting[key] = asyncio.Event()
                return functools.partial(self._demote, slot, key, done)
            await self._drop(slot, key, "quota" if over else "capacity")

    async def _demote(self, slot: TierSlot, key: str, done: asyncio.Event) -> None:
        """Copy ``key``, a victim of ``slot`` (out of its policy already), to the
        write-back tier below, then drop it from ``slot``. Runs without ``slot``'s lock:
        meanwhile the victim stays readable in ``slot`` and other writers go on."""
        below = self._below(slot)
        assert below is not None
        try:
            with contextlib.suppress(TierError):
                if not (await below.tier.contains_many([key]))[0]:
                    raw = await slot.tier.get(key)
                    if raw is not None:
                        await self._write_tier(below, key, raw, demotion=True)
        finally:
            # Shielded: a victim left behind by a cancelled writer would stay resident
            # and out of the policy, never evicted.
            await asyncio.shield(self._demoted(slot, key, done))

    async def _demoted(self, slot: TierSlot, key: str, done: asyncio.Event) -> None:
        async with self._locks[slot.name]:
            demoting = self._demoting[slot.name]
            if demoting.get(key) is done:
                del demoting[key]
            try:
                # Pinned while it was copied (or pinned and unpinned: back in the
                # policy): it stays.
                if not self._is_pinned(slot.name, key) and key not in slot.eviction:
                    await self._drop(slot, key, "capacity")
            finally:
                done.set()

    async def _drop(self, slot: TierSlot, key: str, reason: str) -> None:
        """Remove ``key`` from ``slot``; the eviction policy has already let go of it."""
        removed = await slot.tier.delete(key)
        self.tenants.remove(slot.name, key)
        if removed:
            self.events.evicted(slot.name, reason)
            await self._unpublish(slot.name, [key])
        self._forget_info(key)

    async def _write_tier(
        self,
        slot: TierSlot,
        key: str,
        data: bytes | bytearray | memoryview,
        *,
        demotion: bool = False,
        force: bool = False,
        why: list[str] | None = None,
    ) -> bool:
        """Admit, make room and store into one tier. False when refused; then ``why``
        (when given) gets the reason: refused, too_large, full or io."""
        n = memoryview(data).nbytes
        name = slot.name
        tenant = header_tenant(data)
        why = why if why is not None else []
        if not force and key not in self._pinned[name] and not slot.admission.admit(key, n):
            self.events.refused(name)
            why.append("refused")
            return False
        if not slot.tier.fits(n) or not self.tenants.fits(name, tenant, n):
            self.events.write_failed(name, "too_large")
            why.append("too_large")
            return False
        t0 = time.perf_counter()
        while True:
            async with self._locks[name]:
                try:
                    if slot.tier.size_of(key) is not None:
                        # Content-addressed: the tier already holds these bytes. Rewriting
                        # would risk the copy (and a pinned one) for nothing.
                        slot.eviction.on_access(key)
                        return True
                    pending = await self._make_room(slot, n, tenant)
                    if pending is None:
                        await slot.tier.put(key, data)
                        # what the tier holds (an envelope's size differs), as a restart
                        # will read it back
                        held = slot.tier.size_of(key) or n
                        self.tenants.add(name, key, tenant, held)
                except TierFull as e:
                    if "full" not in slot.tier.counts_write_errors:
                        self.events.write_failed(slot.name, "full")
                    log.warning("%s refused %s: %s", slot.name, key, e)
                    why.append("full")
                    return False
                except TierError as e:
                    if "io" not in slot.tier.counts_write_errors:
                        self.events.write_failed(slot.name, "io")
                    log.warning("%s write of %s failed: %s", slot.name, key, e)
                    why.append("io")
                    return False
                if pending is None:
                    slot.eviction.on_remove(key)  # a replaced key is re-tracked once
                    self._track(slot, key, held)
                    break
            await pending()  # without the lock: a victim's copy down, or a wait for one
        self.events.stored(name, n, time.perf_counter() - t0)
        await self._publish(name, [key])
        return True

    # ---------------------------------------------------------------- write path

    async def put(
        self,
        key: str,
        data: bytes | bytearray | memoryview,
        *,
        info: EntryInfo | None = None,
        wait: bool = False,
    ) -> bool:
        """Store an encoded chunk. Returns once the top tier that admitted it holds it;
        with ``wait`` also after write-through copies land (durability). ``info``
        defaults to the prefix information in the chunk's header."""
        if info is None:
            info = header_info(data)
        if info is not None:
            self._info[key] = info
        top = self.slots[0]
        if top.tier.size_of(key) is not None:
            # Chunks are content-addressed (the key hashes the tokens and the model), so
            # a second put of a resident key is a touch, not a rewrite. Write-through
            # tiers that still lack it get another admission chance (frequency admission).
            top.eviction.on_access(key)
            lacking = [
                s
                for s in self.slots[1:]
                if (s.write_mode == "write_through" or self._is_pinned(s.name, key))
                and s.tier.size_of(key) is None
            ]
            if lacking:
                await self._copy_resident(top, key, lacking, wait)
            return True
        raw = bytes(data) if not isinstance(data, bytes) else data
        stored = False
        why: list[str] = []
        through: list[TierSlot] = []
        for i, slot in enumerate(self.slots):
            if i == 0 or not stored:
                stored = await self._write_tier(slot, key, raw, why=why) or stored
                continue
            if slot.write_mode == "write_through" or self._is_pinned(slot.name, key):
                through.append(slot)
        if not stored:
            self._dropped(key, len(raw), why)
            self._forget_info(key)  # held nowhere: nothing to remember it for
        if through and wait:
            await self._write_down(key, raw, through)
        elif through and self.background.take(len(raw), "write_through", _names(through)):
            self._spawn(self._write_down(key, raw, through), nbytes=len(raw))
        return stored

    async def _copy_resident(
        self, top: TierSlot, key: str, lacking: Sequence[TierSlot], wait: bool
    ) -> None:
        """Copy a chunk the top tier holds to write-through tiers that lack it; in the
        background within the byte budget unless ``wait``."""
        n = top.tier.size_of(key) or 0
        if not wait and not self.background.take(n, "write_through", _names(lacking)):
            return  # before copying it out of the tier
        resident = await top.tier.get(key)
        if resident is None:  # evicted meanwhile
            if not wait:
                self.background.give(n)
            return
        job = self._write_down(key, bytes(resident), lacking)
        if wait:
            await job
        else:
            self._spawn(job, nbytes=n)

    def _dropped(self, key: str, nbytes: int, why: Sequence[str]) -> None:
        """A put no tier took: counted, and logged once per reason (never silent). The
        reason is the most telling of the tiers' refusals."""
        reason = next((r for r in ("io", "full", "too_large", "refused") if r in why), "refused")
        self.events.dropped(reason)
        if reason not in self._dropped_logged:
            self._dropped_logged.add(reason)
            caps = ", ".join(
                f"{s.name} {s.tier.usage().capacity_bytes or 'unbounded'} B" for s in self.slots
            )
            log.warning(
                "chunk %s (%d B) stored in no tier (%s; tiers: %s); counted in "
                "tiered_cache_chunks_dropped_total{reason=%s}, logged once",
                key,
                nbytes,
                reason,
                caps,
                reason,
            )

    def _promote_bg(self, key: str, hit: Hit) -> None:
        """Copy a hit from below or from a peer into the top tier, in the background
        within the byte budget (skipped and counted over it: the reader has its copy)."""
        n = memoryview(hit.raw).nbytes if hit.raw is not None else hit.payload.nbytes
        if self.background.take(n, "promotion", [self.slots[0].name]):
            self._spawn(self._promote(key, hit), nbytes=n)

    async def _write_down(self, key: str, raw: bytes, slots: Sequence[TierSlot]) -> None:
        """Write-through copies of one chunk (one buffer for all ``slots``)."""
        await asyncio.gather(*(self._write_tier(s, key, raw) for s in slots))

    async def flush(self) -> None:
        """Wait for pending background writes (write-through, promotions)."""
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    async def delete(
        self, key: str, tiers: Iterable[str] | None = None, *, reason: str = "delete"
    ) -> None:
        """Remove ``key`` from ``tiers`` (default: all) and their directory entries;
        counted in ``tiered_cache_evictions_total{reason}``."""
        for slot in self.slots:
            if tiers is not None and slot.name not in tiers:
                continue
            async with self._locks[slot.name]:
                slot.eviction.on_remove(key)
                removed = await slot.tier.delete(key)
                self.tenants.remove(slot.name, key)
            if removed:
                self.events.evicted(slot.name, reason)
                await self._unpublish(slot.name, [key])
        self._forget_info(key)

    def _forget_info(self, key: str) -> None:
        """Drop ``key``'s prefix information once no tier here holds it (bounded memory)."""
        if key in self._info and all(s.tier.size_of(key) is None for s in self.slots):
            del self._info[key]

    def _tier_forgot(self, slot: TierSlot, key: str) -> None:
        """``slot``'s tier dropped ``key`` from its index on its own (S3's bounded index:
        the object lives on, found again by a HEAD): the policy and prefix info let go."""
        if not self._is_pinned(slot.name, key):
            slot.eviction.on_remove(key)
        self.tenants.remove(slot.name, key)
        self._forget_info(key)
        if self.residency is not None:
            self.residency.forgot(slot.name, key)

    # ---------------------------------------------------------------- admin

    def usage(self) -> dict[str, dict[str, int | None]]:
        out: dict[str, dict[str, int | None]] = {}
        for s in self.slots:
            u = s.tier.usage()
            out[s.name] = {
                "used_bytes": u.used_bytes,
                "capacity_bytes": u.capacity_bytes,
                "chunks": u.num_chunks,
                "pinned_bytes": self.pinned_bytes(s.name),
            }
            self.events.usage(s.name, u.used_bytes, u.capacity_bytes)
        self._report_tenants()
        return out

    async def republish(self) -> None:
        """Refresh this node's directory entries (their TTLs let dead nodes age out)."""
        for s in self.slots:
            keys = [k for k, _ in s.tier.entries()]  # bounded: S3's index is (index_max_entries)
            for i in range(0, len(keys), REPUBLISH_BATCH):
                await self._publish(s.name, keys[i : i + REPUBLISH_BATCH], refresh=True)
                await asyncio.sleep(0)  # a page at a time: requests are served in between

    async def close(self) -> None:
        for t in list(self._probes):  # a probe of a hung peer would outlive the loop
            t.cancel()
        await self.flush()
        for s in self.slots:
            await s.tier.close()


def _names(slots: Sequence[TierSlot]) -> list[str]:
    return [s.name for s in slots]
