"""Bounded memory (issue 15, item 5) and demotions that do not hold the tier lock.

Real tiers: a shared-memory DRAM pool, moto S3 behind the fault proxy (which holds PUTs
until the test releases them: a lower tier as slow as the test needs, no timing)."""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
from fault_proxy import FaultProxy

from policies import EVICTION_POLICIES, EvictionPolicy, make_admission, make_eviction
from policies._util import Detached, PrefixTree
from tiered_cache import codec
from tiered_cache.directory import LocalDirectory
from tiered_cache.hierarchy import TieredStore, TierSlot
from tiered_cache.metrics import Metrics
from tiered_cache.tiers.dram import DRAMTier
from tiered_cache.tiers.s3 import S3Tier

FP = b"\x05" * 16
SLOT = 8192
PAY = 4000


def key(i: int) -> str:
    return f"{i:032x}"


def blob(i: int, prompt: int = 8) -> bytes:
    """Chunk ``i``, the ``i % prompt``-th of its prompt (parent: chunk ``i - 1``)."""
    pos = i % prompt
    meta = codec.ChunkMeta(
        key=key(i),
        fingerprint=FP,
        num_tokens=16,
        dtype="uint8",
        shape=(PAY,),
        parent=key(i - 1) if pos else "",
        position=pos,
    )
    return codec.encode(meta, bytes([i % 256]) * PAY)


CHUNK = len(blob(0))


def dram(slots: int) -> DRAMTier:
    return DRAMTier(slots * SLOT, SLOT, shm_name=f"tc_bm_{uuid.uuid4().hex[:10]}")


@pytest.fixture
def proxy(s3_server: Any) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint_url) as p:
        yield p


def slow_s3(bucket: str, proxy: FaultProxy, **kw: Any) -> S3Tier:
    # A held request must outlast no client timeout: the test releases it.
    return S3Tier(bucket, endpoint_url=proxy.url, region="us-east-1", read_timeout=120, **kw)


async def test_write_through_copies_bounded_by_bytes(s3_bucket: str, proxy: FaultProxy) -> None:
    """S3 slower than the writers: the bytes queued for it stay under the bound, the
    copies over it are skipped and counted, puts never wait, DRAM serves every chunk."""
    m = Metrics()
    bound = 4 * CHUNK
    store = TieredStore(
        [TierSlot(dram(64)), TierSlot(slow_s3(s3_bucket, proxy), write_mode="write_through")],
        metrics=m,
        max_background_bytes=bound,
    )
    n = 40
    proxy.hold_next(-1, methods=["PUT"])
    try:
        for i in range(n):
            assert await asyncio.wait_for(store.put(key(i), blob(i)), 10)
        assert await asyncio.to_thread(proxy.wait_held, 1)  # S3 is stuck on the first copy
        queued = bound // CHUNK
        assert len(store._bg) == queued  # the rest were never queued (before: 40)
        assert store.background.peak <= bound
        assert m.value("tiered_cache_background_bytes") == queued * CHUNK
        dropped = m.value("tiered_cache_background_dropped_total", kind="write_through", tier="s3")
        assert dropped == n - queued
        for i in range(n):
            hit = await asyncio.wait_for(store.get(key(i), expect_fingerprint=FP), 10)
            assert hit is not None and hit.source == "dram"
            assert bytes(hit.payload) == bytes([i % 256]) * PAY
    finally:
        proxy.release()
    await store.flush()
    assert m.value("tiered_cache_background_bytes") == 0
    assert store.background.bytes == 0
    assert sum((await store.contains([key(i) for i in range(n)]))["s3"]) == queued
    await store.close()


async def test_promotions_bounded_by_bytes(s3_server: Any, s3_bucket: str) -> None:
    """Promotions share the budget: with it spent, an S3 hit is served, not promoted."""
    m = Metrics()
    s3 = S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1")
    store = TieredStore(
        [TierSlot(dram(8)), TierSlot(s3, write_mode="write_through")],
        metrics=m,
        max_background_bytes=CHUNK,
    )
    for i in range(3):
        await store.put(key(i), blob(i), wait=True)
        await store.delete(key(i), tiers=["dram"])
    assert store.background.take(CHUNK, "test", [])  # the whole budget, held
    hit = await store.get(key(0), expect_fingerprint=FP)
    assert hit is not None and hit.source == "s3"
    assert m.value("tiered_cache_background_dropped_total", kind="promotion", tier="dram") == 1
    store.background.give(CHUNK)
    hit = await store.get(key(1), expect_fingerprint=FP)  # budget free again: promoted
    assert hit is not None and hit.source == "s3"
    await store.flush()
    assert (await store.contains([key(0), key(1)]))["dram"] == [False, True]
    await store.close()


async def test_demotion_io_does_not_hold_the_tier_lock(s3_bucket: str, proxy: FaultProxy) -> None:
    """While a victim's copy down to S3 is stalled, other writers of DRAM go on (a commit,
    a put that finds room), the victim is still served from DRAM, and a put that needs
    room while every victim is being copied waits for them rather than failing."""
    m = Metrics()
    store = TieredStore([TierSlot(dram(3)), TierSlot(slow_s3(s3_bucket, proxy))], metrics=m)
    top = store.slots[0].tier
    assert isinstance(top, DRAMTier)
    reserved = await store.reserve_dram(CHUNK)  # a client's slot, filled below
    assert reserved is not None
    for i in (0, 1):
        assert await store.put(key(i), blob(i))
    proxy.hold_next(-1, methods=["PUT"])
    try:
        demoting = asyncio.ensure_future(store.put(key(2), blob(2)))  # evicts chunk 0
        assert await asyncio.to_thread(proxy.wait_held, 1)
        top.slot_view(reserved)[:CHUNK] = blob(9)
        await asyncio.wait_for(store.commit_dram(key(9), reserved, CHUNK), 10)
        hit = await asyncio.wait_for(store.get(key(0), expect_fingerprint=FP), 10)
        assert hit is not None and hit.source == "dram"  # the victim, while it is copied
        # Each evicts a victim of its own to copy down, until none is left: then chunk 5
        # waits for a copy to free room.
        more = [asyncio.ensure_future(store.put(key(i), blob(i))) for i in (3, 4, 5)]
        await asyncio.sleep(0)
        assert not demoting.done()
    finally:
        proxy.release()
    assert await asyncio.wait_for(demoting, 60)
    assert all(await asyncio.wait_for(asyncio.gather(*more), 60))
    await store.flush()
    assert m.value("tiered_cache_chunks_dropped_total", reason="full") == 0
    ids = (0, 1, 2, 3, 4, 5, 9)
    keys = [key(i) for i in ids]
    c = await store.contains(keys)
    assert all(d or s for d, s in zip(c["dram"], c["s3"], strict=True)), c  # none lost
    for k, i in zip(keys, ids, strict=True):
        hit = await store.get(k, expect_fingerprint=FP)
        assert hit is not None and bytes(hit.payload) == bytes([i % 256]) * PAY
    await store.close()


async def test_per_chunk_state_stays_bounded(s3_server: Any, s3_bucket: str) -> None:
    """Far more chunks than the tiers hold: the prefix info, the S3 index and the S3
    tier's policy keep a bounded number of entries, and republish pushes that many."""
    limit = 16
    s3 = S3Tier(
        s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1",
        index_max_entries=limit,
    )  # fmt: skip
    store = TieredStore(
        [
            TierSlot(dram(4), eviction=make_eviction("s3prefix")),
            TierSlot(s3, eviction=make_eviction("s3prefix"), write_mode="write_through"),
        ]
    )
    n = 120
    for i in range(n):
        await store.put(key(i), blob(i), wait=True)
    assert s3.usage().num_chunks == limit
    assert len(store.slots[1].eviction) <= limit
    assert len(store._info) <= 4 + limit
    directory = LocalDirectory()
    store.directory = directory
    await store.republish()
    published = await directory.locate([key(i) for i in range(n)])
    assert sum(1 for locs in published if any(x.tier == "s3" for x in locs)) == limit
    hit = await store.get(key(0), expect_fingerprint=FP)  # forgotten by the index, not by S3
    assert hit is not None and hit.source == "s3"
    await store.close()


async def test_refused_put_leaves_no_prefix_info() -> None:
    """A chunk no tier takes is not remembered."""
    store = TieredStore([TierSlot(dram(4), admission=make_admission("frequency", k=1000))])
    for i in range(50):
        assert not await store.put(key(i), blob(i))
    assert store._info == {}
    await store.close()


def _entries(obj: Any, seen: set[int] | None = None) -> int:
    """Entries held in ``obj``'s containers (dicts, lists, sets, and the helpers holding
    them), recursively; byte arrays (fixed-size sketches) are not per-key state."""
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict | OrderedDict | list | set | frozenset):
        return len(obj)
    if isinstance(obj, Detached | PrefixTree) or hasattr(obj, "__dict__"):
        attrs = vars(obj) if hasattr(obj, "__dict__") else {}
        if isinstance(obj, PrefixTree):
            attrs = {"parent": obj.parent, "children": obj.children}
        if isinstance(obj, Detached):
            attrs = {"od": obj._od}
        return sum(_entries(v, seen) for v in attrs.values())
    return 0


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
async def test_policy_state_bounded_by_capacity(name: str) -> None:
    """Every policy forgets evicted chunks (ghosts and histories are bounded by the
    capacity): its state after 1,000 distinct chunks through 8 slots is that of a few
    times 8 chunks, not of 1,000."""
    store = TieredStore([TierSlot(dram(8), eviction=make_eviction(name))])
    for i in range(1000):
        await store.put(key(i), blob(i))
        if i % 3 == 0:
            await store.get(key(i), expect_fingerprint=FP)  # some reads, for frequencies
    policy: EvictionPolicy = store.slots[0].eviction
    assert len(policy) <= 8
    assert _entries(policy) <= 300, _entries(policy)
    assert len(store._info) <= 8
    await store.close()


async def test_lookup_does_not_wait_on_a_slow_s3_head(s3_bucket: str, proxy: FaultProxy) -> None:
    """A chunk the healthy directory does not list (written by a node whose entries aged
    out) is confirmed by a HEAD while S3 answers; when S3 is stuck (HEADs held), the
    lookup answers a miss without waiting for it, counts it, and later lookups still work."""
    writer = S3Tier(s3_bucket, endpoint_url=proxy.url, region="us-east-1")
    for i in (0, 1):
        await writer.put(key(i), blob(i))  # in S3, unknown to the directory
    await writer.close()
    m = Metrics()
    store = TieredStore(
        [TierSlot(dram(4)), TierSlot(slow_s3(s3_bucket, proxy))],
        metrics=m, directory=LocalDirectory(),
    )  # fmt: skip
    assert await store.lookup([key(0)]) == ["s3"]
    proxy.hold_next(-1, methods=["HEAD"])
    try:
        assert await asyncio.wait_for(store.lookup([key(1)]), 10) == []
        assert await asyncio.to_thread(proxy.wait_held, 1)  # the HEAD was sent, and is stuck
        assert m.value("tiered_cache_s3_probes_late_total") == 1
    finally:
        proxy.release()
    assert await store.lookup([key(0)]) == ["s3"]
    await store.close()
