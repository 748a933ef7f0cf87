"""TieredStore across real tiers: shared-memory DRAM, files, moto S3, Redis."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from policies import LFU, PrefixAware, make_admission
from tiered_cache import codec
from tiered_cache.directory import Pin, RedisDirectory
from tiered_cache.hierarchy import PinRefused, TieredStore, TierSlot
from tiered_cache.metrics import Metrics
from tiered_cache.tiers.dram import DRAMTier
from tiered_cache.tiers.nvme import NVMeTier
from tiered_cache.tiers.s3 import S3Tier

FP = b"\x02" * 16
SLOT = 8192
PAY = 4000


def key(i: int) -> str:
    return f"{i:032x}"


def blob(k: str, fill: int = 1, n: int = PAY) -> bytes:
    meta = codec.ChunkMeta(key=k, fingerprint=FP, num_tokens=16, dtype="uint8", shape=(n,))
    return codec.encode(meta, bytes([fill % 256]) * n)


def dram(slots: int) -> DRAMTier:
    return DRAMTier(slots * SLOT, SLOT, shm_name=f"tc_h_{uuid.uuid4().hex[:10]}")


@pytest.fixture
async def three_tier(nvme_dir: Path, s3_server, s3_bucket):  # type: ignore[no-untyped-def]
    m = Metrics()
    store = TieredStore(
        [
            TierSlot(dram(2)),
            TierSlot(NVMeTier(nvme_dir, 4 * len(blob(key(0))), metrics=m)),
            TierSlot(
                S3Tier(
                    s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1", metrics=m
                )
            ),
        ],
        metrics=m,
    )
    await store.open()
    yield store
    await store.close()


async def test_write_back_demotes_and_promotes(three_tier: TieredStore) -> None:
    s = three_tier
    for i in range(7):
        assert await s.put(key(i), blob(key(i), i))
    await s.flush()
    c = await s.contains([key(i) for i in range(7)])
    assert c["dram"] == [False] * 5 + [True] * 2  # LRU kept the last two
    assert c["nvme"] == [False, True, True, True, True, False, False]  # holds four
    assert c["s3"] == [True] + [False] * 6  # chunk 0 demoted again, from NVMe
    assert await s.lookup([key(i) for i in range(7)]) == ["s3"] + ["nvme"] * 4 + ["dram"] * 2
    hit = await s.get(key(0), expect_fingerprint=FP)
    assert hit is not None and hit.source == "s3" and bytes(hit.payload) == bytes([0]) * PAY
    await s.flush()
    assert (await s.contains([key(0)]))["dram"] == [True]  # promoted on hit
    assert s.metrics.value("tiered_cache_evictions_total", tier="dram", reason="capacity") >= 5


async def test_capacity_never_exceeded(three_tier: TieredStore) -> None:
    for i in range(20):
        await three_tier.put(key(i), blob(key(i), i))
    await three_tier.flush()
    for name, u in three_tier.usage().items():
        cap = u["capacity_bytes"]
        assert cap is None or (u["used_bytes"] or 0) <= cap, name


async def test_write_through_and_corruption_falls_through(
    nvme_dir: Path,
    s3_server,
    s3_bucket,  # type: ignore[no-untyped-def]
) -> None:
    m = Metrics()
    s3 = S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1")
    store = TieredStore(
        [
            TierSlot(dram(4)),
            TierSlot(NVMeTier(nvme_dir, None), write_mode="write_through"),
            TierSlot(s3, write_mode="write_through"),
        ],
        metrics=m,
    )
    await store.put(key(1), blob(key(1), 9), wait=True)
    c = await store.contains([key(1)])
    assert c == {"dram": [True], "nvme": [True], "s3": [True]}
    await store.delete(key(1), tiers=["dram"])
    # Flip a payload byte in the NVMe file: a miss there (counted, removed), then S3 serves.
    f = next(nvme_dir.rglob(f"{key(1)}.kvc"))
    raw = bytearray(f.read_bytes())
    raw[codec.HEADER_SIZE + 5] ^= 0x40
    f.write_bytes(raw)
    hit = await store.get(key(1), expect_fingerprint=FP)
    assert hit is not None and hit.source == "s3" and bytes(hit.payload) == bytes([9]) * PAY
    assert m.value("tiered_cache_verification_failures_total", tier="nvme") == 1
    assert (await store.contains([key(1)]))["nvme"] == [False]
    # Now flip a byte in the S3 object too: with DRAM dropped, it is a clean miss.
    await store.flush()
    await store.delete(key(1), tiers=["dram", "nvme"])
    okey = s3.object_key(key(1))
    cli = s3_server.client()
    body = bytearray(cli.get_object(Bucket=s3_bucket, Key=okey)["Body"].read())
    body[-1] ^= 1
    cli.put_object(Bucket=s3_bucket, Key=okey, Body=bytes(body))
    assert await store.get(key(1), expect_fingerprint=FP) is None
    assert m.value("tiered_cache_verification_failures_total", tier="s3") == 1
    await store.close()


async def test_fingerprint_mismatch_is_a_miss_not_data(nvme_dir: Path) -> None:
    store = TieredStore([TierSlot(dram(2))])
    await store.put(key(3), blob(key(3)))
    assert await store.get(key(3), expect_fingerprint=b"\x09" * 16) is None
    assert store.metrics.value("tiered_cache_verification_failures_total", tier="dram") == 1
    await store.close()


async def test_pins_survive_pressure_and_budget() -> None:
    store = TieredStore([TierSlot(dram(4), pin_budget_fraction=0.5)])
    for i in range(2):
        await store.put(key(i), blob(key(i)))
    pin = Pin(keys=[key(0), key(1)], tiers=["dram"], fingerprint="ab")
    store.check_pin(pin, len(blob(key(0))))
    store.apply_pins([pin])
    for i in range(2, 30):
        await store.put(key(i), blob(key(i)))
    assert (await store.contains([key(0), key(1)]))["dram"] == [True, True]
    too_big = Pin(keys=[key(i) for i in range(100, 103)], tiers=["dram"], fingerprint="ab")
    with pytest.raises(PinRefused, match="pin budget"):
        store.check_pin(too_big, len(blob(key(0))))
    store.apply_pins([])  # unpinned: evictable again
    for i in range(30, 40):
        await store.put(key(i), blob(key(i)))
    assert (await store.contains([key(0), key(1)]))["dram"] == [False, False]
    await store.close()


async def test_a_failed_tier_write_is_counted_once(nvme_dir: Path) -> None:
    """The NVMe tier counts its own write errors (it also runs alone); the store must not
    count them again."""
    m = Metrics()
    store = TieredStore([TierSlot(NVMeTier(nvme_dir, 1 << 20, metrics=m))], metrics=m)
    await store.open()
    k = key(7)
    # The chunk's directory is a file: ENOTDIR, an I/O error.
    shutil.rmtree(nvme_dir / k[:2], ignore_errors=True)
    (nvme_dir / k[:2]).write_bytes(b"")
    assert not await store.put(k, blob(k))
    assert m.value("tiered_cache_write_errors_total", tier="nvme", reason="io") == 1
    await store.close()


async def test_full_of_pins_refuses_cleanly() -> None:
    store = TieredStore([TierSlot(dram(2), pin_budget_fraction=1.0)])
    await store.put(key(0), blob(key(0)))
    await store.put(key(1), blob(key(1)))
    store.apply_pins([Pin(keys=[key(0), key(1)], tiers=["dram"], fingerprint="ab")])
    assert not await store.put(key(2), blob(key(2)))
    assert store.metrics.value("tiered_cache_write_errors_total", tier="dram", reason="full") == 1
    assert await store.get(key(0)) is not None
    await store.close()


async def test_frequency_admission_spares_nvme(nvme_dir: Path) -> None:
    store = TieredStore(
        [
            TierSlot(dram(1)),
            TierSlot(
                NVMeTier(nvme_dir, None),
                write_mode="write_through",
                admission=make_admission("frequency", k=2),
            ),
        ]
    )
    await store.put(key(1), blob(key(1)), wait=True)
    assert (await store.contains([key(1)]))["nvme"] == [False]
    assert store.metrics.value("tiered_cache_admission_rejects_total", tier="nvme") == 1
    await store.put(key(1), blob(key(1)), wait=True)
    assert (await store.contains([key(1)]))["nvme"] == [True]
    await store.close()


async def test_concurrent_readers_and_writers_never_tear() -> None:
    store = TieredStore([TierSlot(dram(3))])

    async def writer(i: int) -> None:
        await store.put(key(i % 4), blob(key(i % 4), fill=i))

    async def reader(i: int) -> None:
        hit = await store.get(key(i % 4), expect_fingerprint=FP)
        if hit is not None:
            p = bytes(hit.payload)
            assert p == bytes([p[0]]) * PAY  # one writer's bytes, whole

    await asyncio.gather(*[writer(i) if i % 2 else reader(i) for i in range(200)])
    await store.close()


async def test_two_nodes_share_s3_through_redis(
    tmp_path: Path,
    redis_server,
    s3_server,
    s3_bucket,  # type: ignore[no-untyped-def]
) -> None:
    dirs = [RedisDirectory.from_url(redis_server.url) for _ in range(2)]

    def node(name: str, d: RedisDirectory) -> TieredStore:
        return TieredStore(
            [
                TierSlot(dram(2)),
                TierSlot(
                    S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1"),
                    write_mode="write_through",
                ),
            ],
            node_id=name,
            directory=d,
        )

    a, b = node("a", dirs[0]), node("b", dirs[1])
    for n, d in (("a", dirs[0]), ("b", dirs[1])):
        await d.heartbeat(n, {}, 30)
    keys = [key(i) for i in range(3)]
    for k in keys:
        await a.put(k, blob(k, 5), wait=True)
    assert await b.lookup([*keys, key(99)]) == ["s3", "s3", "s3"]
    hit = await b.get(keys[0], expect_fingerprint=FP)
    assert hit is not None and hit.source == "s3"
    # Redis goes away: node b keeps serving what it holds and still finds S3 chunks.
    redis_server.stop()
    await b.flush()
    assert await b.lookup(keys[:1]) == ["dram"]
    assert await b.lookup(keys[1:]) == ["s3", "s3"]
    assert (await b.get(keys[1], expect_fingerprint=FP)) is not None
    for s in (a, b):
        await s.close()
    for d in dirs:
        await d.close()


# --------------------------------------------------------------- property-based


class StoreMachine(RuleBasedStateMachine):
    """Random put/get/pin/unpin/evict across DRAM + NVMe (write-back) with tiny capacities."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = Path(tempfile.mkdtemp(prefix="tc-prop-"))
        self.nvme_cap = 3 * len(blob(key(0)))
        self.store = TieredStore(
            [
                TierSlot(dram(2), pin_budget_fraction=1.0),
                TierSlot(NVMeTier(self.tmp, self.nvme_cap), pin_budget_fraction=1.0),
            ]
        )
        # key -> fills put. Chunks are content-addressed: a put of a key that is already
        # resident keeps the resident copy, so a hit may return any version put.
        self.model: dict[str, set[int]] = {}
        self.pinned: dict[str, set[str]] = {"dram": set(), "nvme": set()}

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    @rule(i=st.integers(0, 7), fill=st.integers(0, 255))
    def put(self, i: int, fill: int) -> None:
        if self.run(self.store.put(key(i), blob(key(i), fill))):
            self.model.setdefault(key(i), set()).add(fill)

    @rule(i=st.integers(0, 7))
    def get(self, i: int) -> None:
        hit = self.run(self.store.get(key(i), expect_fingerprint=FP))
        if hit is not None:
            assert key(i) in self.model
            p = bytes(hit.payload)
            assert p[0] in self.model[key(i)] and p == bytes([p[0]]) * PAY
        self.run(self.store.flush())

    @rule(i=st.integers(0, 7))
    def evict(self, i: int) -> None:
        if key(i) in self.pinned["dram"] or key(i) in self.pinned["nvme"]:
            return
        self.run(self.store.delete(key(i)))
        self.model.pop(key(i), None)

    @precondition(lambda self: len(self.pinned["dram"]) < 1)
    @rule(i=st.integers(0, 7), tier=st.sampled_from(["dram", "nvme"]))
    def pin(self, i: int, tier: str) -> None:
        if not (self.run(self.store.contains([key(i)])))[tier][0]:
            return
        self.pinned[tier].add(key(i))
        self._apply()

    @rule()
    def unpin_all(self) -> None:
        self.pinned = {"dram": set(), "nvme": set()}
        self._apply()

    def _apply(self) -> None:
        pins = [
            Pin(keys=sorted(ks), tiers=[t], fingerprint="ab") for t, ks in self.pinned.items() if ks
        ]
        self.store.apply_pins(pins)

    @invariant()
    def capacity_and_pins(self) -> None:
        u = self.store.usage()
        for _name, v in u.items():
            assert v["capacity_bytes"] is None or (v["used_bytes"] or 0) <= v["capacity_bytes"]
        c = self.run(self.store.contains(sorted(self.pinned["dram"] | self.pinned["nvme"])))
        for tier in ("dram", "nvme"):
            ks = sorted(self.pinned["dram"] | self.pinned["nvme"])
            for k, present in zip(ks, c[tier], strict=True):
                if k in self.pinned[tier]:
                    assert present, f"pinned {k} left {tier}"

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.store.close())
        self.loop.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


TestStoreProperties = StoreMachine.TestCase
TestStoreProperties.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


async def test_leasing_more_chunks_than_dram_holds(nvme_dir: Path) -> None:
    store = TieredStore(
        [TierSlot(dram(2)), TierSlot(NVMeTier(nvme_dir, None), write_mode="write_through")]
    )
    for i in range(4):
        await store.put(key(i), blob(key(i), i), wait=True)
    for i in range(4):  # only NVMe has them now
        await store.delete(key(i), tiers=["dram"])
    ev = "tiered_cache_evictions_total"
    before = store.metrics.value(ev, tier="dram", reason="capacity")
    got = [await store.lease(key(i), expect_fingerprint=FP) for i in range(4)]
    # Two are leased in DRAM; the rest come back inline instead of evicting leased slots.
    leased = [g for g in got if isinstance(g, tuple)]
    inline = [g for g in got if g is not None and not isinstance(g, tuple)]
    assert len(leased) == 2 and len(inline) == 2
    assert all(bytes(h.payload) == bytes([h.payload[0]]) * PAY for h in inline)
    assert store.usage()["dram"]["chunks"] == 2
    # Nothing was evicted to make room: leased chunks are passed over.
    assert store.metrics.value(ev, tier="dram", reason="capacity") == before
    for slot, _ in leased:
        store.release(slot)
    await store.close()


async def test_restart_keeps_the_prefix_tree(nvme_dir: Path) -> None:
    """Chunks found at start-up enter the policy with the parent their header names, so a
    prefix-aware policy still evicts the deepest chunk first after a restart."""
    a, b = key(1), key(2)
    blobs = {
        a: codec.encode(codec.ChunkMeta(key=a, fingerprint=FP, num_tokens=16), b"a" * PAY),
        b: codec.encode(
            codec.ChunkMeta(key=b, fingerprint=FP, num_tokens=16, parent=a, position=1),
            b"b" * PAY,
        ),
    }
    first = TieredStore([TierSlot(NVMeTier(nvme_dir, None))])
    for k in (a, b):  # inline puts: the info comes from the header
        assert await first.put(k, blobs[k], wait=True)
    await first.close()
    policy = PrefixAware()
    again = TieredStore([TierSlot(NVMeTier(nvme_dir, None), eviction=policy)])
    await again.open()
    assert len(policy) == 2 and not policy.is_leaf(a) and policy.is_leaf(b)
    assert policy.evict(1) == [b]
    await again.delete(b)
    await again.delete(a)
    assert not again._info  # forgotten once no tier holds them
    await again.close()


async def test_eviction_steps_over_a_leased_chunk_without_counting_a_read() -> None:
    lfu = LFU()
    store = TieredStore([TierSlot(dram(2), eviction=lfu)])
    a, b, c = key(1), key(2), key(3)
    for k in (a, b):
        await store.put(k, blob(k), wait=True)
    for _ in range(2):
        assert await store.get(b, expect_fingerprint=FP) is not None
    got = await store.lease(a, expect_fingerprint=FP)  # a real read: a's count is 2
    assert isinstance(got, tuple) and lfu.frequency(a) == 2
    # a is the LFU victim but leased: b goes, and a's count is what its reads made it.
    await store.put(c, blob(c), wait=True)
    assert (await store.contains([a, b, c]))["dram"] == [True, False, True]
    assert lfu.frequency(a) == 2
    store.release(got[0])
    await store.close()


async def test_chunk_stored_nowhere_is_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A put that no tier takes is never silent: a metric per reason, one log line."""
    m = Metrics()
    store = TieredStore([TierSlot(dram(2))], metrics=m)
    try:
        with caplog.at_level("WARNING", logger="tiered_cache.hierarchy"):
            for i in range(3):
                assert not await store.put(key(i), blob(key(i), n=3 * SLOT))
        assert m.value("tiered_cache_chunks_dropped_total", reason="too_large") == 3
        assert sum("stored in no tier" in r.message for r in caplog.records) == 1
        # A chunk of two slots (a run) is stored.
        assert await store.put(key(9), blob(key(9), n=SLOT + 100))
        assert (await store.get(key(9))) is not None
    finally:
        await store.close()


async def test_a_copy_the_directory_names_but_nobody_has_stops_being_offered(
    s3_server, s3_bucket  # type: ignore[no-untyped-def]
) -> None:
    """A dead node's S3 entry in the directory, for an object that is not in this node's
    bucket: after one prefetch finds nothing, lookups stop offering it, so a reader
    waiting for it recomputes at once instead of at its deadline."""
    from tiered_cache.directory import LocalDirectory

    m = Metrics()
    d = LocalDirectory()
    store = TieredStore(
        [TierSlot(dram(4)), TierSlot(S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url,
                                             region="us-east-1", metrics=m))],
        node_id="me", directory=d, metrics=m,
    )  # fmt: skip
    try:
        await d.publish("gone-node", "s3", [key(1)], 60)
        assert await store.lookup([key(1)]) == ["s3"]
        assert await store.prefetch([key(1)]) == 1
        await store.flush()
        assert await store.lookup([key(1)]) == []
        # A real copy is still found and fetched.
        await store.slots[1].tier.put(key(2), blob(key(2)))
        assert await store.prefetch([key(2)]) == 1
        await store.flush()
        assert await store.lookup([key(2)]) == ["dram"]
    finally:
        await store.close()


async def test_a_prefetch_asks_the_directory_once_and_its_waiter_wakes_when_chunks_land() -> None:
    """A batch prefetched from a peer costs one directory round trip, not one per chunk;
    ``wait_prefetched`` returns when the copies end (not at its timeout, nor on a poll),
    and says whether DRAM holds them all."""
    from tiered_cache.directory import LocalDirectory

    directory = LocalDirectory()
    calls: list[int] = []
    locate = directory.locate

    async def counted(keys):  # type: ignore[no-untyped-def]
        calls.append(len(keys))
        return await locate(keys)

    directory.locate = counted  # type: ignore[method-assign]
    gate, both = asyncio.Event(), asyncio.Event()
    fetching: list[str] = []

    async def fetch(k: str, node: str) -> tuple[bytes, float] | None:
        fetching.append(k)
        if len(fetching) == 2:
            both.set()
        await gate.wait()  # the bytes are on their way until the test lets them land
        return (blob(k), 0.001) if k != key(3) else None  # key(3): the peer lost it

    store = TieredStore([TierSlot(dram(8))], node_id="me", directory=directory, peer_fetch=fetch)
    try:
        keys = [key(1), key(2)]
        await directory.heartbeat("peer", {}, 60)
        await directory.publish("peer", "dram", [*keys, key(3)], 60)
        assert await store.prefetch(keys, FP) == 2
        assert calls == [2]  # one batch, and no read plan asked again
        waiter = asyncio.ensure_future(store.wait_prefetched(keys, 60.0))
        await asyncio.wait_for(both.wait(), 10.0)  # both copies under way, neither landed
        assert not waiter.done()
        gate.set()
        assert await asyncio.wait_for(waiter, 10.0) is True  # woke on landing, not at 60 s
        assert await store.lookup(keys) == ["dram", "dram"]
        # A copy that fails ends the wait too, with False.
        assert await store.prefetch([key(3)], FP) == 1
        assert await asyncio.wait_for(store.wait_prefetched([key(3)], 60.0), 10.0) is False
    finally:
        gate.set()  # a failed assertion must not leave close() waiting on held copies
        await store.close()


async def test_a_missing_key_is_asked_about_once_until_a_local_put(
    s3_server, s3_bucket, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """One request asks about its missing chunk several times within a second (router,
    prefill lookup, partial probe, decode): only the first costs a directory round trip
    and an S3 HEAD. A local put is found at once; another node's write is found by a
    ``fresh`` lookup (a decode waiting for its prefill's chunks) or once the miss ages."""
    from tiered_cache.directory import LocalDirectory
    from tiered_cache.hierarchy import reads

    m = Metrics()
    d = LocalDirectory()
    s3 = S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1", metrics=m)
    store = TieredStore([TierSlot(dram(4)), TierSlot(s3, write_mode="write_through")],
                        node_id="me", directory=d, metrics=m)  # fmt: skip
    other = S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1")
    locates: list[int] = []
    heads: list[str] = []
    locate, head = d.locate, s3._head

    async def counted_locate(keys):  # type: ignore[no-untyped-def]
        locates.append(len(keys))
        return await locate(keys)

    def counted_head(okey: str) -> bool | BaseException:
        heads.append(okey)
        return head(okey)

    d.locate = counted_locate  # type: ignore[method-assign]
    s3._head = counted_head  # type: ignore[method-assign]

    def asked() -> tuple[int, int]:
        n = (len(locates), len(heads))
        locates.clear()
        heads.clear()
        return n

    k0, k1 = key(10), key(11)
    try:
        assert await store.lookup([k0, k1]) == []
        assert asked() == (1, 1)  # one round trip, one HEAD (the prefix stops at k0)
        assert await store.lookup([k0, k1]) == []
        assert await store.lookup_priced([k0, k1], 100) == ([], [])
        assert await store.present([k0]) == [None]
        assert asked() == (0, 0)
        assert m.value("tiered_cache_absent_skipped_total") >= 3
        assert await store.lookup([k0], fresh=True) == []
        assert asked() == (1, 1)
        # A local put: found at once, no remote query for it.
        assert await store.put(k0, blob(k0))
        assert await store.lookup([k0]) == ["dram"]
        assert asked() == (0, 0)
        # Another node writes k1 (to S3, and says so in the directory).
        await other.put(k1, blob(k1))
        await d.publish("other", "s3", [k1], 60)
        assert await store.lookup([k0, k1]) == ["dram"]  # still the remembered miss
        assert asked() == (0, 0)
        assert await store.lookup([k0, k1], fresh=True) == ["dram", "s3"]
        assert asked()[0] == 1
        # A miss remembered for no time is asked about every time.
        monkeypatch.setattr(reads, "ABSENT_S", 0.0)
        k2 = key(12)
        assert await store.lookup([k2]) == []
        assert await store.lookup([k2]) == []
        assert asked() == (2, 2)
    finally:
        await store.close()
        await other.close()


async def test_alternatives_cost_a_bounded_number_of_s3_heads_without_a_directory(
    s3_server, s3_bucket  # type: ignore[no-untyped-def]
) -> None:
    """A partial-chunk probe asks about every tail length (255 keys for a 256-token
    chunk). While the directory is unreachable S3 is asked directly, but only about the
    longest ``BLIND_S3_PROBES``: one round of HEADs, not one per length."""
    from tiered_cache.directory import LocalDirectory
    from tiered_cache.hierarchy.remote import BLIND_S3_PROBES

    class Down(LocalDirectory):
        @property
        def degraded(self) -> bool:
            return True

    s3 = S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1")
    store = TieredStore([TierSlot(dram(4)), TierSlot(s3, write_mode="write_through")],
                        node_id="me", directory=Down())  # fmt: skip
    other = S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1")
    heads: list[str] = []
    head = s3._head

    def counted_head(okey: str) -> bool | BaseException:
        heads.append(okey)
        return head(okey)

    s3._head = counted_head  # type: ignore[method-assign]
    cands = [key(1000 + i) for i in range(255)]
    try:
        await other.put(cands[3], blob(cands[3]))  # another node's write, unknown here
        got = await store.present(cands)
        assert len(heads) == BLIND_S3_PROBES
        assert got[3] is not None and got[3][0] == "s3"
        assert [i for i, g in enumerate(got) if g is not None] == [3]
        # A prefix lookup is not capped: the walk stops at its first miss anyway.
        heads.clear()
        assert await store.lookup([cands[3]]) == ["s3"]
    finally:
        await store.close()
        await other.close()
