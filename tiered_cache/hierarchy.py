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
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from policies import AdmissionPolicy, EntryInfo, EvictionPolicy, make_admission, make_eviction
from tiered_cache import codec
from tiered_cache.api import NODE_TIERS
from tiered_cache.codec import ChunkMeta
from tiered_cache.directory import Directory, Pin
from tiered_cache.estimates import SourceEstimator, kind_of
from tiered_cache.events import MetricsEvents, StoreEvents
from tiered_cache.metrics import Metrics
from tiered_cache.tiers.base import SlotTier, Tier, TierError, TierFull

log = logging.getLogger(__name__)

WriteMode = Literal["write_through", "write_back"]
# Fetches an encoded chunk (not yet verified) from another node: (key, node_id) -> None when
# the peer lacks it, else (bytes, seconds the transfer itself took). The fetcher times only the
# request and reply, not its own queueing or connection set-up, which say nothing about the
# source's speed and would skew the estimates.
PeerFetch = Callable[[str, str], Awaitable[tuple[bytes | bytearray, float] | None]]


MISSED_S = 10.0  # how long a remote copy a fetch could not find is not offered again


class PinRefused(ValueError):
    """A pin does not fit the pin budget of one of its tiers."""


def header_info(data: bytes | bytearray | memoryview) -> EntryInfo | None:
    """The prefix information an encoded chunk's header carries, if any."""
    try:
        meta, _, _ = codec.parse_header(memoryview(data)[: codec.HEADER_SIZE])
    except (codec.ChunkError, ValueError):
        return None  # the write path rejects it with the reason
    if not meta.parent and not meta.position:
        return None
    return EntryInfo(meta.parent or None, meta.position)


@dataclass
class TierSlot:
    tier: Tier
    eviction: EvictionPolicy = field(default_factory=lambda: make_eviction("lru"))
    admission: AdmissionPolicy = field(default_factory=lambda: make_admission("always"))
    write_mode: WriteMode = "write_back"  # how chunks reach this tier (top tier: ignored)
    pin_budget_fraction: float = 0.5

    @property
    def name(self) -> str:
        return self.tier.name


@dataclass
class Hit:
    meta: ChunkMeta
    payload: memoryview
    source: str  # tier name, or "peer"
    # The verified encoded chunk ``payload`` points into, when the read produced one: it
    # can be stored in another tier as is, without re-encoding (a copy and a checksum).
    raw: bytes | bytearray | memoryview | None = None

    def encoded(self) -> bytes | bytearray | memoryview:
        """The chunk in its stored form (header + payload)."""
        return self.raw if self.raw is not None else codec.encode(self.meta, self.payload)


class TieredStore:
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
        self.location_ttl_s = location_ttl_s
        # DRAM contents were verified on the way in and live in trusted memory; re-hashing
        # them on every read would cost as much as the copy itself.
        self.verify_dram_reads = verify_dram_reads
        self.peer_fetch = peer_fetch
        # Expected time per source (dram, nvme, peer:<node>, s3), from real transfers.
        self.estimates = SourceEstimator()
        self._typical_bytes = 0  # size of recent chunks, for ranking sources of unknown size
        self._locks = {s.name: asyncio.Lock() for s in self.slots}
        # The slot protocol (reserve/commit, leases) needs the top tier to be a pool.
        top = self.slots[0].tier
        self._pool: SlotTier | None = top if isinstance(top, SlotTier) else None
        self._bg: set[asyncio.Task[None]] = set()
        self._bg_sem = asyncio.Semaphore(max_background)
        self._fetch_sem = asyncio.Semaphore(8)  # prefetches (as many as a get loads at once)
        self._info: dict[str, EntryInfo] = {}
        self._dropped_logged: set[str] = set()
        self._prefetching: set[str] = set()  # keys being copied into DRAM
        self._missed: dict[str, float] = {}  # key -> until when no remote copy is offered
        # tier -> key -> ids of pins covering it
        self._pinned: dict[str, dict[str, set[str]]] = {s.name: {} for s in self.slots}
        self._pins: dict[str, Pin] = {}
        self._adopt()

    def _adopt(self) -> None:
        """Track what tiers already hold (after a restart) in their eviction policies,
        with the prefix information their chunk headers carry."""
        for s in self.slots:
            for key, (parent, position) in s.tier.take_recovered().items():
                self._info.setdefault(key, EntryInfo(parent or None, position))
            for key, size in s.tier.entries():
                if key not in s.eviction and not self._is_pinned(s.name, key):
                    s.eviction.on_insert(key, size, self._info.get(key))

    async def open(self) -> None:
        """Finish async tier set-up (e.g. S3 budget listing), then adopt their contents."""
        for s in self.slots:
            await s.tier.open()
        self._adopt()

    # ---------------------------------------------------------------- helpers

    def _is_pinned(self, tier: str, key: str) -> bool:
        return key in self._pinned[tier]

    def _track(self, slot: TierSlot, key: str, size: int) -> None:
        if not self._is_pinned(slot.name, key):
            slot.eviction.on_insert(key, size, self._info.get(key))

    def _spawn(self, coro: Awaitable[None], sem: asyncio.Semaphore | None = None) -> None:
        async def run() -> None:
            async with sem or self._bg_sem:
                try:
                    await coro
                except Exception:
                    log.exception("background tier write failed")

        t = asyncio.ensure_future(run())
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _publish(self, tier: str, keys: Sequence[str]) -> None:
        if self.directory is not None and keys:
            await self.directory.publish(self.node_id, tier, keys, self.location_ttl_s)

    async def _unpublish(self, tier: str, keys: Sequence[str]) -> None:
        if self.directory is not None and keys:
            await self.directory.unpublish(self.node_id, tier, keys)

    def _below(self, slot: TierSlot) -> TierSlot | None:
        return self._next_slot[slot.name]

    # ---------------------------------------------------------------- eviction

    async def _make_room(self, slot: TierSlot, nbytes: int) -> None:
        """Evict from ``slot`` until ``nbytes`` fit. Caller holds the tier's lock."""
        tier = slot.tier
        while not tier.has_room(nbytes):
            # A chunk a reader holds would free nothing until it is released: the policy
            # steps over it without counting a read, so its rank stays as it was.
            chosen = slot.eviction.evict(1, tier.leased())
            if not chosen:
                raise TierFull(f"{tier.name}: full of pinned or in-use chunks")
            await self._evict(slot, chosen[0], reason="capacity")

    async def _evict(self, slot: TierSlot, key: str, reason: str) -> None:
        """Write ``key`` back below if that tier is write-back, then drop it from ``slot``.
        The eviction policy has already let go of it."""
        below = self._below(slot)
        if below is not None and below.write_mode == "write_back":
            with contextlib.suppress(TierError):
                if not (await below.tier.contains_many([key]))[0]:
                    raw = await slot.tier.get(key)
                    if raw is not None:
                        await self._write_tier(below, key, raw, demotion=True)
        if await slot.tier.delete(key):
            self.events.evicted(slot.name, reason)
            if self.directory is not None:
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
        why = why if why is not None else []
        if not force and key not in self._pinned[name] and not slot.admission.admit(key, n):
            self.events.refused(name)
            why.append("refused")
            return False
        if not slot.tier.fits(n):
            self.events.write_failed(name, "too_large")
            why.append("too_large")
            return False
        t0 = time.perf_counter()
        async with self._locks[name]:
            try:
                if slot.tier.size_of(key) is not None:
                    # Content-addressed: the tier already holds these bytes. Rewriting
                    # would risk the copy (and a pinned one) for nothing.
                    slot.eviction.on_access(key)
                    return True
                await self._make_room(slot, n)
                await slot.tier.put(key, data)
            except TierFull as e:
                self.events.write_failed(slot.name, "full")
                log.warning("%s refused %s: %s", slot.name, key, e)
                why.append("full")
                return False
            except TierError as e:
                self.events.write_failed(slot.name, "io")
                log.warning("%s write of %s failed: %s", slot.name, key, e)
                why.append("io")
                return False
            slot.eviction.on_remove(key)  # a replaced key is re-tracked once
            self._track(slot, key, n)
        self.events.stored(name, n, time.perf_counter() - t0)
        if self.directory is not None:
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
            resident = await top.tier.get(key) if lacking else None
            if resident is not None:
                pending = [self._write_tier_bg(s, key, bytes(resident)) for s in lacking]
                if wait:
                    await asyncio.gather(*pending)
                else:
                    for job in pending:
                        self._spawn(job)
            return True
        raw = bytes(data) if not isinstance(data, bytes) else data
        stored = False
        why: list[str] = []
        through: list[Awaitable[None]] = []
        for i, slot in enumerate(self.slots):
            if i == 0 or not stored:
                stored = await self._write_tier(slot, key, raw, why=why) or stored
                continue
            if slot.write_mode == "write_through" or self._is_pinned(slot.name, key):
                through.append(self._write_tier_bg(slot, key, raw))
        if not stored:
            self._dropped(key, len(raw), why)
        if wait:
            await asyncio.gather(*through)
        else:
            for c in through:
                self._spawn(c)
        return stored

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
                key, nbytes, reason, caps, reason,
            )

    async def _write_tier_bg(self, slot: TierSlot, key: str, raw: bytes) -> None:
        await self._write_tier(slot, key, raw)

    async def flush(self) -> None:
        """Wait for pending background writes (write-through, promotions)."""
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    async def delete(self, key: str, tiers: Iterable[str] | None = None) -> None:
        for slot in self.slots:
            if tiers is not None and slot.name not in tiers:
                continue
            async with self._locks[slot.name]:
                slot.eviction.on_remove(key)
                removed = await slot.tier.delete(key)
            if removed:
                self.events.evicted(slot.name, "delete")
                await self._unpublish(slot.name, [key])
        self._forget_info(key)

    def _forget_info(self, key: str) -> None:
        """Drop ``key``'s prefix information once no tier here holds it (bounded memory)."""
        if key in self._info and all(s.tier.size_of(key) is None for s in self.slots):
            del self._info[key]

    # ---------------------------------------------------------------- read path

    async def contains(self, keys: Sequence[str]) -> dict[str, list[bool]]:
        return {s.name: await s.tier.contains_many(keys) for s in self.slots}

    async def lookup(self, keys: Sequence[str]) -> list[str]:
        """Source label of each leading key that is loadable, nearest first."""
        out: list[str] = []
        for lab in await self._labels(keys):
            if lab is None:
                break
            out.append(lab)
            self.events.looked_up(lab)
        return out

    async def present(self, keys: Sequence[str], nbytes: int = 0) -> list[tuple[str, float] | None]:
        """For each key on its own (no prefix rule): its nearest source and the expected
        seconds to load it from there, or None. For alternatives, e.g. the partial
        chunks a longer prompt may share with an earlier one."""
        labels = await self._labels(keys)
        return [
            None if lab is None else (lab, self._expected_s(key, lab, nbytes))
            for key, lab in zip(keys, labels, strict=True)
        ]

    async def _labels(self, keys: Sequence[str]) -> list[str | None]:
        """Nearest source of each key (None: found nowhere), prefix rule not applied."""
        if not keys:
            return []
        local_slots = [s for s in self.slots if s.name != "s3"]
        labels: list[str | None] = [None] * len(keys)
        local = [await s.tier.contains_many(keys) for s in local_slots]
        for s, present in zip(reversed(local_slots), reversed(local), strict=True):
            name = s.name  # nearer tiers come later and overwrite: nearest wins
            for i, p in enumerate(present):
                if p:
                    labels[i] = name
        missing = [i for i, lab in enumerate(labels) if lab is None]
        if missing:
            # Only the chunks before the first one found nowhere matter; ask about every
            # missing one in one batch anyway (one round trip beats a second one).
            remote = await self._remote_sources([keys[i] for i in missing])
            for i, src in zip(missing, remote, strict=True):
                labels[i] = src
        now = time.monotonic()
        return [
            None if lab in ("peer", "s3") and self._missed.get(key, 0.0) > now else lab
            for key, lab in zip(keys, labels, strict=True)
        ]  # a remote copy a fetch just could not find is not offered

    async def lookup_priced(
        self, keys: Sequence[str], nbytes: int = 0
    ) -> tuple[list[str], list[float]]:
        """``lookup``, with the expected seconds to load each found chunk from its source
        (``estimates``; ``nbytes``: the chunk size to price chunks of unknown size at)."""
        sources = await self.lookup(keys)
        costs = [self._expected_s(k, src, nbytes) for k, src in zip(keys, sources, strict=False)]
        return sources, costs

    def _expected_s(self, key: str, source: str, nbytes: int) -> float:
        slot = self.by_name.get(source)
        size = (slot.tier.size_of(key) if slot is not None else None) or (
            nbytes or self._typical_bytes or 2**20
        )
        if source == "peer":
            return self._best_peer_s(size)
        return self.estimates.expected_s(source, size)

    async def prefetch(self, keys: Sequence[str], expect_fp: bytes | None = None) -> int:
        """Start copying ``keys`` that live below DRAM or on other nodes into DRAM, in the
        background (deduplicated, bounded like other background work), so a reader can
        then load them from local memory. Returns how many copies were started."""
        if self._pool is None:
            return 0
        top = self.slots[0]
        started = 0
        for key in keys:
            if key in self._prefetching or top.tier.size_of(key) is not None:
                continue
            self._prefetching.add(key)
            # Not behind write-through copies to a slow S3: a reader is waiting for these.
            self._spawn(self._prefetch_one(key, expect_fp), self._fetch_sem)
            started += 1
        return started

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

    def _directory_ok(self) -> bool:
        d = self.directory
        return d is not None and not getattr(d, "degraded", False)

    async def _remote_sources(self, keys: Sequence[str]) -> list[str | None]:
        res: list[str | None] = [None] * len(keys)
        if self.directory is not None:
            locs = await self.directory.locate(keys)
            for i, ls in enumerate(locs):
                if self.peer_fetch is not None and any(
                    loc.node_id != self.node_id and loc.tier in NODE_TIERS for loc in ls
                ):
                    res[i] = "peer"
                elif "s3" in self.by_name and any(loc.tier == "s3" for loc in ls):
                    res[i] = "s3"
        s3 = self.by_name.get("s3")
        if s3 is not None:
            # The directory may be down or behind: S3 itself is the truth for what it holds.
            # The directory may be down, or may have aged out the entries of a node that
            # died (its S3 objects live on): S3 itself is the truth for what it holds.
            # With a healthy directory, probe only the first unknown chunk (the prefix
            # walk stops there anyway) and the rest only if that probe hits.
            unknown = [i for i, r in enumerate(res) if r is None]
            if unknown and self._directory_ok():
                first = await s3.tier.contains_many([keys[unknown[0]]])
                if not first[0]:
                    unknown = []
            if unknown:
                hits = await s3.tier.contains_many([keys[i] for i in unknown])
                for i, h in zip(unknown, hits, strict=True):
                    if h:
                        res[i] = "s3"
        return res

    async def get(
        self,
        key: str,
        *,
        expect_fingerprint: bytes | None = None,
        promote: bool = True,
        num_tokens_hint: int = 0,
    ) -> Hit | None:
        """Nearest verified copy of ``key``, or None (miss, or every copy failed).

        Sources are tried by expected transfer time (``estimates``): with the priors that is
        this node's DRAM, its NVMe, a peer node's DRAM/NVMe, then S3; measured transfers can
        reorder them, e.g. a peer's DRAM ahead of a slow local disk."""
        return await self._get_planned(key, await self._plan(key), expect_fingerprint, promote)

    async def _get_planned(
        self, key: str, plan: list[str], expect_fp: bytes | None, promote: bool
    ) -> Hit | None:
        for src in plan:
            if src.startswith("peer:"):
                hit = await self._fetch_from_peer(key, src[5:], expect_fp)
                if hit is not None:
                    if promote:
                        self._spawn(self._promote(key, hit))
                    return hit
                continue
            slot = self.by_name[src]
            hit = await self._read_verified(slot.tier, key, expect_fp)
            if hit is not None:
                return self._on_hit(slot, key, hit, promote)
        self.events.miss()
        return None

    async def _plan(self, key: str) -> list[str]:
        """Sources that may hold ``key``, fastest expected first. Local tiers are listed
        only when they hold it; S3 always (a miss there costs one request); peers from the
        directory, asked only when a peer could beat the best local copy."""
        held: list[str] = []
        size = 0
        for slot in self.slots:
            if slot.name == "s3":
                continue
            if (await slot.tier.contains_many([key]))[0]:
                held.append(slot.name)
                size = size or (slot.tier.size_of(key) or 0)
        size = size or self._typical_bytes or 2**20
        cands = list(held)
        if self.peer_fetch is not None and self.directory is not None:
            best_local = min((self.estimates.expected_s(h, size) for h in held), default=None)
            if best_local is None or self._best_peer_s(size) < best_local:
                (locs,) = await self.directory.locate([key])
                for loc in locs:
                    p = f"peer:{loc.node_id}"
                    # A peer serves from all its tiers: list it once.
                    if (
                        loc.node_id != self.node_id
                        and loc.tier in NODE_TIERS
                        and p not in cands
                    ):
                        cands.append(p)
        if "s3" in self.by_name:
            cands.append("s3")
        return self.estimates.rank(cands, size)

    def _observe(self, source: str, nbytes: int, seconds: float) -> None:
        self.estimates.observe(source, nbytes, seconds)
        self._typical_bytes = nbytes
        est = self.estimates.estimate(source)
        self.events.estimate(source, est.latency_s, est.bandwidth_bps)

    def _best_peer_s(self, size: int) -> float:
        known = [s for s in self.estimates.snapshot() if kind_of(s) == "peer"]
        return min(self.estimates.expected_s(s, size) for s in [*known, "peer"])

    def _on_hit(self, slot: TierSlot, key: str, hit: Hit, promote: bool) -> Hit:
        slot.eviction.on_access(key)
        slot.admission.on_access(key)
        if promote and slot is not self.slots[0]:
            self._spawn(self._promote(key, hit))
        return hit

    async def _read_verified(
        self, tier: Tier, key: str, expect_fp: bytes | None, source: str | None = None
    ) -> Hit | None:
        name = tier.name
        t0 = time.perf_counter()
        try:
            raw = await tier.get(key)
        except TierError as e:
            self.events.read_failed(name)
            log.warning("%s read of %s failed: %s", name, key, e)
            return None
        if raw is None:
            return None
        try:
            meta, payload = codec.decode(
                raw,
                expect_key=key,
                expect_fingerprint=expect_fp,
                verify_payload=self.verify_dram_reads or name != "dram",
            )
        except codec.ChunkMismatch as e:
            log.warning("%s chunk %s unusable here: %s", name, key, e)
            self.events.verify_failed(name)
            return None
        except codec.ChunkError as e:
            log.warning("%s chunk %s failed verification (%s): removed", name, key, e)
            self.events.verify_failed(name)
            await self.delete(key, tiers=[name])
            return None
        n = len(raw)
        dt = time.perf_counter() - t0
        self._observe(source or name, n, dt)
        self.events.hit(source or name, meta.num_tokens, n, dt)
        return Hit(meta, payload, source or name, raw)

    async def _get_from_peer(self, key: str, expect_fp: bytes | None) -> Hit | None:
        """The first verified copy from any peer that the directory says holds ``key``."""
        if self.peer_fetch is None or self.directory is None:
            return None
        (locs,) = await self.directory.locate([key])
        nodes = [
            loc.node_id
            for loc in locs
            if loc.node_id != self.node_id and loc.tier in NODE_TIERS
        ]
        for node in dict.fromkeys(nodes):  # a peer serves from all its tiers: ask it once
            hit = await self._fetch_from_peer(key, node, expect_fp)
            if hit is not None:
                return hit
        return None

    async def _fetch_from_peer(self, key: str, node: str, expect_fp: bytes | None) -> Hit | None:
        if self.peer_fetch is None:
            return None
        try:
            got = await self.peer_fetch(key, node)
        except Exception as e:
            log.warning("peer %s fetch of %s failed: %s", node, key, e)
            return None
        if got is None:
            return None
        raw, dt = got
        try:
            meta, payload = codec.decode(raw, expect_key=key, expect_fingerprint=expect_fp)
        except codec.ChunkError as e:
            log.warning("peer %s sent a bad chunk %s: %s", node, key, e)
            self.events.verify_failed("peer")
            return None
        self._observe(f"peer:{node}", len(raw), dt)
        self.events.hit("peer", meta.num_tokens, len(raw), dt)
        self.events.peer_transfer("in")
        return Hit(meta, payload, "peer", raw)

    async def _promote(self, key: str, hit: Hit) -> None:
        top = self.slots[0]
        if (await top.tier.contains_many([key]))[0]:
            return
        raw = hit.encoded()
        await self._write_tier(top, key, raw)

    # ------------------------------------------------ shared-memory slot protocol
    # Used by the node agent so local clients copy chunk bytes straight into and out of
    # the DRAM pool; the agent only moves slot numbers.

    def _dram(self) -> tuple[TierSlot, SlotTier]:
        """The top tier when it is a slot pool (clients fill and read it themselves)."""
        if self._pool is None:
            raise TierError("no DRAM tier: shared-memory transfers are unavailable")
        return self.slots[0], self._pool

    async def reserve_dram(self, nbytes: int) -> int | None:
        """A free DRAM slot for a client to fill, evicting if needed; None when refused."""
        top, tier = self._dram()
        if not tier.fits(nbytes):
            return None
        async with self._locks[top.name]:
            try:
                await self._make_room(top, nbytes)
                return tier.reserve(nbytes)
            except TierFull:
                self.events.write_failed(top.name, "full")
                return None

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
        if info is not None:
            self._info[key] = info
        if tier.size_of(key) is not None:  # content-addressed: already here, keep it
            tier.abort(slot)
            top.eviction.on_access(key)
            return
        async with self._locks[top.name]:
            tier.commit(key, slot, length)
            top.eviction.on_remove(key)
            self._track(top, key, length)
        self.events.stored(top.name, length)
        await self._publish(top.name, [key])
        through = [
            s
            for s in self.slots[1:]
            if s.write_mode == "write_through" or self._is_pinned(s.name, key)
        ]
        if not through:
            return
        raw = bytes(tier.slot_view(slot)[:length])
        coros = [self._write_tier_bg(s, key, raw) for s in through]
        if wait:
            await asyncio.gather(*coros)
        else:
            for c in coros:
                self._spawn(c)

    async def lease(
        self,
        key: str,
        expect_fingerprint: bytes | None = None,
        *,
        served: list[str] | None = None,
    ) -> tuple[int, int] | Hit | None:
        """Lease ``key`` in DRAM as (slot, length), promoting it from a lower tier or a peer
        first. Returns the Hit itself when it cannot be placed in DRAM, None on a miss.
        On a hit, appends the source that served it (tier name or "peer") to ``served``."""
        top, tier = self._dram()
        got = tier.acquire(key)
        if got is not None:
            tokens = 0
            with contextlib.suppress(codec.ChunkError):
                head = tier.slot_view(got[0])[: codec.HEADER_SIZE]
                tokens = codec.parse_header(head)[0].num_tokens
            self._count_dram_hit(top, key, got[1], tokens)
            if served is not None:
                served.append("dram")
            return got
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
        top, tier = self._dram()  # only a slot pool has a shared index to read through
        for key, nbytes, tokens in hits:
            if tier.size_of(key) is not None:  # evicted since: nothing to refresh
                self._count_dram_hit(top, key, int(nbytes), int(tokens))

    async def _lease_from_nvme(
        self, top: TierSlot, dram: SlotTier, key: str, expect_fp: bytes | None
    ) -> tuple[int, int] | None:
        """Promote an NVMe chunk by reading the file straight into a DRAM slot and
        verifying it there: one copy instead of read + encode + copy."""
        slot = self.by_name.get("nvme")
        size = slot.tier.size_of(key) if slot is not None else None
        if slot is None or size is None or not dram.fits(size):
            return None
        t0 = time.perf_counter()
        s = await self.reserve_dram(size)
        if s is None:
            return None
        try:
            n = await slot.tier.get_into(key, dram.slot_view(s)[:size])
            if n is None:
                raise TierError("vanished")
            codec.decode(dram.slot_view(s)[:n], expect_key=key, expect_fingerprint=expect_fp)
        except codec.ChunkMismatch as e:
            dram.abort(s)
            log.warning("nvme chunk %s unusable here: %s", key, e)
            self.events.verify_failed("nvme")
            return None
        except (codec.ChunkError, TierError, ValueError) as e:
            dram.abort(s)
            if isinstance(e, codec.ChunkError):
                log.warning("nvme chunk %s failed verification (%s): removed", key, e)
                self.events.verify_failed("nvme")
                await self.delete(key, tiers=["nvme"])
            return None
        slot.eviction.on_access(key)
        slot.admission.on_access(key)
        self._observe("nvme", n, time.perf_counter() - t0)
        tokens = 0
        with contextlib.suppress(codec.ChunkError):
            tokens = codec.parse_header(dram.slot_view(s)[: codec.HEADER_SIZE])[0].num_tokens
        self.events.hit("nvme", tokens, n, time.perf_counter() - t0)
        async with self._locks[top.name]:
            if dram.size_of(key) is None:
                dram.commit(key, s, n)
                top.eviction.on_remove(key)
                self._track(top, key, n)
            else:
                dram.abort(s)  # promoted meanwhile by another reader
        await self._publish(top.name, [key])
        return dram.acquire(key)

    def release(self, slot: int) -> None:
        tier = self._dram()[1]
        tier.release(slot)

    # ---------------------------------------------------------------- pins

    def pin_budget(self, tier: str) -> int | None:
        slot = self.by_name[tier]
        cap = slot.tier.usage().capacity_bytes
        return None if cap is None else int(cap * slot.pin_budget_fraction)

    def pinned_bytes(self, tier: str) -> int:
        t = self.by_name[tier].tier
        return sum(t.size_of(k) or 0 for k in self._pinned[tier])

    def check_pin(self, pin: Pin, chunk_bytes: int) -> None:
        """Raise PinRefused when ``pin`` would exceed a tier's pin budget on this node."""
        for tier in pin.tiers:
            if tier not in self.by_name:
                continue  # a tier this node does not have: other nodes honour it
            budget = self.pin_budget(tier)
            if budget is None:
                continue
            others = {k for p in self._pins.values() if p.id != pin.id for k in p.keys}
            new = [k for k in pin.keys if k not in others]
            need = self.pinned_bytes_of(tier, others) + len(new) * chunk_bytes
            if need > budget:
                raise PinRefused(
                    f"pin needs {need} B in {tier} but its pin budget is {budget} B "
                    f"({self.by_name[tier].pin_budget_fraction:.0%} of capacity)"
                )

    def pinned_bytes_of(self, tier: str, keys: Iterable[str]) -> int:
        t = self.by_name[tier].tier
        return sum(t.size_of(k) or 0 for k in keys)

    def apply_pins(self, pins: Iterable[Pin]) -> None:
        """Make the pin set current: pinned keys leave their tiers' eviction policies;
        unpinned ones rejoin them."""
        now = time.time()
        self._pins = {p.id: p for p in pins if not p.expired(now)}
        want: dict[str, dict[str, set[str]]] = {s.name: {} for s in self.slots}
        for p in self._pins.values():
            for tier in p.tiers:
                if tier in want:
                    for k in p.keys:
                        want[tier].setdefault(k, set()).add(p.id)
        for slot in self.slots:
            old, new = self._pinned[slot.name], want[slot.name]
            self._pinned[slot.name] = new
            for k in new.keys() - old.keys():
                slot.eviction.on_remove(k)
            for k in old.keys() - new.keys():
                size = slot.tier.size_of(k)
                if size is not None:
                    slot.eviction.on_insert(k, size, self._info.get(k))
            self.events.pinned(slot.name, self.pinned_bytes(slot.name))

    def pinned_keys(self, tier: str) -> set[str]:
        return set(self._pinned[tier])

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
        return out

    async def republish(self) -> None:
        """Refresh this node's directory entries (their TTLs let dead nodes age out)."""
        for s in self.slots:
            keys = [k for k, _ in s.tier.entries()]
            for i in range(0, len(keys), 1000):
                await self._publish(s.name, keys[i : i + 1000])

    async def close(self) -> None:
        await self.flush()
        for s in self.slots:
            await s.tier.close()
