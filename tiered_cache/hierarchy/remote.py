"""Reads from other nodes: where the directory (or S3 itself) says a chunk lives, and
fetching a verified copy from a peer.

Each peer has a circuit breaker (``breaker.Breaker``): a fetch that fails or times out
opens it, counts in the peer's estimate as the slowest a transfer may count, and from then
on reads and lookups skip that peer (S3, or a miss and a recompute) until a probe, a fetch
of a key nobody holds run in the background once per back-off period (0.25 s doubling to
30 s), gets an answer. No read waits for a probe."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tiered_cache import codec
from tiered_cache.api import NODE_TIERS
from tiered_cache.breaker import Breaker
from tiered_cache.directory import Directory
from tiered_cache.estimates import SourceEstimator, kind_of
from tiered_cache.events import StoreEvents
from tiered_cache.hierarchy.types import Hit, PeerFetch, PeerSkipped, TierSlot

log = logging.getLogger("tiered_cache.hierarchy")  # one logger for the package, as before
# S3 HEADs one ``present`` of alternative keys may cost while the directory cannot say
# which exist: one S3 round trip of concurrent HEADs, the longest candidates first.
BLIND_S3_PROBES = 16
# How long a lookup waits for S3 to confirm a chunk a healthy directory does not list (a
# node that died, its entries aged out): a HEAD on S3 takes 10-50 ms, but one queued behind
# write-through uploads on a busy server takes 100-400 ms (moto beside two vLLMs on two
# cores), more than the load it could find saves. Past it the chunk counts as a miss.
DIRECTORY_MISS_S3_WAIT_S = 0.05
PROBE_KEY = "0" * 32  # what a breaker's probe asks a peer for: held by nobody, answered fast


class RemoteMixin:
    """Owns a ``TieredStore``'s view of copies held elsewhere: the remote sources of keys,
    fetches from peers (verified, timed into the estimates) and the best peer's price."""

    # TieredStore's attributes this part uses.
    node_id: str
    directory: Directory | None
    peer_fetch: PeerFetch | None
    by_name: dict[str, TierSlot]
    events: StoreEvents
    estimates: SourceEstimator
    mac_key: bytes | None
    _typical_bytes: int
    _peer_breakers: dict[str, Breaker]
    _probes: set[asyncio.Future[Any]]  # off the read path: cancelled at close

    if TYPE_CHECKING:  # defined by TieredStore

        def _observe(self, source: str, nbytes: int, seconds: float) -> None: ...
        async def delete(self, key: str, tiers: Iterable[str] | None = None) -> None: ...

    async def _forged(self, source: str, key: str, e: codec.ChunkForged) -> None:
        """A copy from ``source`` failed the MAC: a miss, counted, never loaded. This
        node's NVMe copy is deleted (so a good copy can take its place); an S3 object is
        left: a node with the wrong secret must not delete the cluster's chunks."""
        log.warning("%s chunk %s refused (%s)", source, key, e)
        self.events.forged(source)
        if source == "nvme":
            await self.delete(key, tiers=[source])

    def _peer_breaker(self, node: str) -> Breaker:
        b = self._peer_breakers.get(node)
        if b is None:
            b = self._peer_breakers[node] = Breaker(f"peer {node}", log)
        return b

    def peer_down(self, node: str) -> bool:
        """Whether ``node``'s breaker is open (a fetch queued for it should not start)."""
        b = self._peer_breakers.get(node)
        return b is not None and b.down

    def peer_usable(self, node: str) -> bool:
        """Whether reads may ask ``node`` now. While its breaker is open: no, and once per
        back-off period this starts the probe that closes it."""
        b = self._peer_breakers.get(node)
        if b is None or not b.down:
            return True
        if not b.blocked and b.allow():  # due: probe off the read path
            t = asyncio.ensure_future(self._probe_peer(node, b))
            self._probes.add(t)
            t.add_done_callback(self._probes.discard)
        self.events.peer_skipped()
        return False

    async def _probe_peer(self, node: str, b: Breaker) -> None:
        assert self.peer_fetch is not None
        try:
            await self.peer_fetch(PROBE_KEY, node)
        except Exception as e:
            b.failed(e)
        else:
            b.ok()

    def _directory_ok(self) -> bool:
        d = self.directory
        return d is not None and not getattr(d, "degraded", False)

    async def _remote_sources(
        self, keys: Sequence[str], *, alternatives: bool = False
    ) -> list[str | None]:
        """Where other than here each key is: ``peer``, ``s3`` or None. ``alternatives``:
        the keys are candidates of which at most a few exist (every length of a partial
        chunk, longest first), so without a healthy directory only the first
        ``BLIND_S3_PROBES`` unknown ones are asked of S3: a HEAD for each of 255 lengths
        would cost more than the recompute it saves."""
        res: list[str | None] = [None] * len(keys)
        if self.directory is not None:
            locs = await self.directory.locate(keys)
            for i, ls in enumerate(locs):
                if self.peer_fetch is not None and any(
                    loc.node_id != self.node_id
                    and loc.tier in NODE_TIERS
                    and self.peer_usable(loc.node_id)
                    for loc in ls
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
                head = asyncio.ensure_future(s3.tier.contains_many([keys[unknown[0]]]))
                done, _ = await asyncio.wait({head}, timeout=DIRECTORY_MISS_S3_WAIT_S)
                if not done:  # it finishes in the background; its answer is dropped
                    self._probes.add(head)
                    head.add_done_callback(self._probes.discard)
                    self.events.s3_probe_late()
                    unknown = []
                elif not head.result()[0]:
                    unknown = []
            elif alternatives:
                unknown = unknown[:BLIND_S3_PROBES]
            if unknown:
                hits = await s3.tier.contains_many([keys[i] for i in unknown])
                for i, h in zip(unknown, hits, strict=True):
                    if h:
                        res[i] = "s3"
        return res

    def _best_peer_s(self, size: int) -> float:
        known = [s for s in self.estimates.snapshot() if kind_of(s) == "peer"]
        return min(self.estimates.expected_s(s, size) for s in [*known, "peer"])

    async def _get_from_peer(self, key: str, expect_fp: bytes | None) -> Hit | None:
        """The first verified copy from any peer that the directory says holds ``key``."""
        if self.peer_fetch is None or self.directory is None:
            return None
        (locs,) = await self.directory.locate([key])
        nodes = [
            loc.node_id
            for loc in locs
            if loc.node_id != self.node_id
            and loc.tier in NODE_TIERS
            and self.peer_usable(loc.node_id)
        ]
        for node in dict.fromkeys(nodes):  # a peer serves from all its tiers: ask it once
            hit = await self._fetch_from_peer(key, node, expect_fp)
            if hit is not None:
                return hit
        return None

    async def _fetch_from_peer(self, key: str, node: str, expect_fp: bytes | None) -> Hit | None:
        if self.peer_fetch is None:
            return None
        b = self._peer_breaker(node)
        try:
            got = await self.peer_fetch(key, node)
        except PeerSkipped:
            self.events.peer_skipped()
            return None
        except Exception as e:
            log.warning("peer %s fetch of %s failed: %s", node, key, e)
            self.events.read_failed("peer")
            # A failure costs what the slowest transfer may count (estimates._CLIP) in the
            # peer's estimate, so that other sources rank first even once it is back.
            self._observe(f"peer:{node}", self._typical_bytes or 2**20, float("inf"))
            b.failed(e)
            return None
        b.ok()
        if got is None:
            return None
        raw, dt = got
        try:
            meta, payload = codec.decode(
                raw, expect_key=key, expect_fingerprint=expect_fp, mac_key=self.mac_key
            )
        except codec.ChunkForged as e:
            await self._forged("peer", key, e)
            return None
        except codec.ChunkError as e:
            log.warning("peer %s sent a bad chunk %s: %s", node, key, e)
            self.events.verify_failed("peer")
            return None
        self._observe(f"peer:{node}", len(raw), dt)
        self.events.hit("peer", meta.num_tokens, len(raw), dt)
        self.events.peer_transfer("in")
        return Hit(meta, payload, "peer", raw)
