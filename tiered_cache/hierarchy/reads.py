"""The read path: which sources hold a chunk and at what price, and reading the nearest
verified copy (local tiers, peers, S3) with promotion of hits to DRAM."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING

from tiered_cache import codec
from tiered_cache.api import NODE_TIERS
from tiered_cache.directory import Directory, Location
from tiered_cache.estimates import SourceEstimator
from tiered_cache.events import StoreEvents
from tiered_cache.hierarchy.aliases import AliasMap
from tiered_cache.hierarchy.types import Hit, PeerFetch, TierSlot
from tiered_cache.tiers.base import Tier, TierError

log = logging.getLogger("tiered_cache.hierarchy")  # one logger for the package, as before

# How long a key found nowhere (no local tier, the directory and S3) is answered "missing"
# without asking the directory and S3 again. One request asks about its missing chunk up
# to four times within a second (the router, the prefill's lookup, its partial probe, the
# decode); each time a Redis round trip and an S3 HEAD. A local put forgets the miss at
# once (``TieredStore._publish``); another node's put is seen after at most this long, or
# at once by a ``fresh`` lookup (a decode waiting for its prefill's chunks).
ABSENT_S = 2.0
ABSENT_MAX = 20_000  # keys remembered at most (then forgotten all at once)


class ReadsMixin:
    """Owns a ``TieredStore``'s reads: lookups (prefix rule, prices), the read plan of a
    key, verified reads from a tier, and promotion of hits into the top tier."""

    # TieredStore's attributes this part uses.
    slots: list[TierSlot]
    by_name: dict[str, TierSlot]
    node_id: str
    directory: Directory | None
    peer_fetch: PeerFetch | None
    events: StoreEvents
    estimates: SourceEstimator
    verify_dram_reads: bool
    mac_key: bytes | None
    _typical_bytes: int
    _missed: dict[str, float]
    _absent: dict[str, float]  # key -> until when it is known to be held nowhere
    _located: dict[str, list[Location]]  # directory answers a prefetch got for its batch
    aliases: AliasMap

    if TYPE_CHECKING:  # defined by TieredStore and RemoteMixin

        async def _remote_sources(
            self, keys: Sequence[str], *, alternatives: bool = False
        ) -> list[str | None]: ...
        def _best_peer_s(self, size: int) -> float: ...
        def peer_usable(self, node: str) -> bool: ...
        async def _forged(self, source: str, key: str, e: codec.ChunkForged) -> None: ...
        async def _fetch_from_peer(
            self, key: str, node: str, expect_fp: bytes | None
        ) -> Hit | None: ...
        def _spawn(self, coro: Awaitable[None], sem: asyncio.Semaphore | None = None) -> None: ...
        async def delete(
            self, key: str, tiers: Iterable[str] | None = None, *, reason: str = "delete"
        ) -> None: ...
        def _observe(self, source: str, nbytes: int, seconds: float) -> None: ...
        async def _write_tier(
            self, slot: TierSlot, key: str, data: bytes | bytearray | memoryview
        ) -> bool: ...
        def _promote_bg(self, key: str, hit: Hit) -> None: ...

    async def contains(self, keys: Sequence[str]) -> dict[str, list[bool]]:
        return {s.name: await s.tier.contains_many(keys) for s in self.slots}

    async def lookup(self, keys: Sequence[str], fresh: bool = False) -> list[str]:
        """Source label of each leading key that is loadable, nearest first. ``fresh``:
        ask the directory and S3 about recent misses too (``ABSENT_S``)."""
        out: list[str] = []
        for lab in await self._labels(keys, prefix=True, fresh=fresh):
            if lab is None:
                break
            out.append(lab)
            self.events.looked_up(lab)
        return out

    async def present(
        self, keys: Sequence[str], nbytes: int = 0
    ) -> list[tuple[str, float, str] | None]:
        """For each key on its own (no prefix rule): its nearest source, the expected
        seconds to load it from there and the key to load, or None. For alternatives,
        e.g. the partial chunks a longer prompt may share with an earlier one. A key found
        nowhere that is an alias (``aliases``) is answered with its whole chunk."""
        labels = await self._labels(keys)
        to_load = list(keys)
        via = [(i, t) for i, lab in enumerate(labels)
               if lab is None and (t := self.aliases.target(keys[i])) is not None]  # fmt: skip
        if via:
            found = await self._labels([t for _, t in via])
            for (i, t), lab in zip(via, found, strict=True):
                labels[i], to_load[i] = lab, t
                if lab is None:  # its chunk is gone
                    self.aliases.drop(keys[i])
                else:
                    self.aliases.used(keys[i])
        return [
            None if lab is None else (lab, self._expected_s(k, lab, nbytes), k)
            for k, lab in zip(to_load, labels, strict=True)
        ]

    async def _labels(
        self, keys: Sequence[str], *, prefix: bool = False, fresh: bool = False
    ) -> list[str | None]:
        """Nearest source of each key (None: found nowhere). ``prefix``: the caller stops
        at the first key found nowhere, so keys after a known miss are not asked about.
        Keys found nowhere recently are not asked about again (``ABSENT_S``) unless
        ``fresh``."""
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
        now = time.monotonic()
        if missing and not fresh:
            absent = self._absent
            known = [i for i in missing if absent.get(keys[i], 0.0) > now]
            if known:
                self.events.absent_skipped(len(known))
                cut = known[0] if prefix else len(keys)  # nothing after it matters
                missing = [i for i in missing if i < cut and absent.get(keys[i], 0.0) <= now]
        if missing:
            # Only the chunks before the first one found nowhere matter; ask about every
            # missing one in one batch anyway (one round trip beats a second one).
            remote = await self._remote_sources(
                [keys[i] for i in missing], alternatives=not prefix
            )
            until = time.monotonic() + ABSENT_S
            if len(self._absent) > ABSENT_MAX:
                self._absent.clear()
            for i, src in zip(missing, remote, strict=True):
                labels[i] = src
                if src is None:
                    self._absent[keys[i]] = until
        now = time.monotonic()
        return [
            None if lab in ("peer", "s3") and self._missed.get(key, 0.0) > now else lab
            for key, lab in zip(keys, labels, strict=True)
        ]  # a remote copy a fetch just could not find is not offered

    async def lookup_priced(
        self, keys: Sequence[str], nbytes: int = 0, fresh: bool = False
    ) -> tuple[list[str], list[float]]:
        """``lookup``, with the expected seconds to load each found chunk from its source
        (``estimates``; ``nbytes``: the chunk size to price chunks of unknown size at)."""
        sources = await self.lookup(keys, fresh=fresh)
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
                        self._promote_bg(key, hit)
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
                # A prefetch asked the directory for its whole batch at once.
                locs = self._located.pop(key, None)
                if locs is None:
                    (locs,) = await self.directory.locate([key])
                for loc in locs:
                    p = f"peer:{loc.node_id}"
                    # A peer serves from all its tiers: list it once.
                    if (
                        loc.node_id != self.node_id
                        and loc.tier in NODE_TIERS
                        and p not in cands
                        and self.peer_usable(loc.node_id)  # not while its breaker is open
                    ):
                        cands.append(p)
        if "s3" in self.by_name:
            cands.append("s3")
        return self.estimates.rank(cands, size)

    def _on_hit(self, slot: TierSlot, key: str, hit: Hit, promote: bool) -> Hit:
        slot.eviction.on_access(key)
        slot.admission.on_access(key)
        if promote and slot is not self.slots[0]:
            self._promote_bg(key, hit)
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
                mac_key=None if name == "dram" else self.mac_key,
            )
        except codec.ChunkForged as e:
            await self._forged(name, key, e)
            return None
        except codec.ChunkError as e:
            await self._unusable(name, key, e)
            return None
        n = len(raw)
        dt = time.perf_counter() - t0
        self._observe(source or name, n, dt)
        self.events.hit(source or name, meta.num_tokens, n, dt)
        return Hit(meta, payload, source or name, raw)

    async def _unusable(self, tier: str, key: str, e: codec.ChunkError) -> None:
        """A chunk of ``tier`` that failed its checks is a miss. Damaged bytes, or a header
        naming another key, are wrong for every reader: delete the copy (and this node's
        directory entry), or each later read pays for it again. A chunk of another
        fingerprint or layout is left: it may serve another reader of that key."""
        self.events.verify_failed(tier)
        if isinstance(e, codec.ChunkMismatch) and not isinstance(e, codec.ChunkWrongKey):
            log.warning("%s chunk %s unusable here: %s", tier, key, e)
            return
        wrong = isinstance(e, codec.ChunkWrongKey)
        log.warning("%s chunk %s failed verification (%s): removed", tier, key, e)
        await self.delete(key, tiers=[tier], reason="wrong_key" if wrong else "corrupt")

    async def _promote(self, key: str, hit: Hit) -> None:
        top = self.slots[0]
        if (await top.tier.contains_many([key]))[0]:
            return
        raw = hit.encoded()
        await self._write_tier(top, key, raw)
