"""Per-source transfer-time estimates, and the source order they give a read."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_cache import codec
from tiered_cache.directory import LocalDirectory
from tiered_cache.estimates import PRIORS, SourceEstimator
from tiered_cache.hierarchy import TieredStore, TierSlot
from tiered_cache.tiers.dram import DRAMTier
from tiered_cache.tiers.nvme import NVMeTier

MiB = 2**20
FP = b"\x03" * 16


def test_priors_give_the_static_order() -> None:
    e = SourceEstimator()
    for n in (4096, 2 * MiB, 32 * MiB):
        assert e.rank(["s3", "peer:b", "nvme", "dram"], n) == ["dram", "nvme", "peer:b", "s3"]
        lat, bw = PRIORS["nvme"]
        assert e.expected_s("nvme", n) == pytest.approx(lat + n / bw, rel=1e-6)


def test_estimates_follow_measured_transfers() -> None:
    e = SourceEstimator()
    for _ in range(30):  # a slow disk and a fast peer
        e.observe("nvme", 2 * MiB, 0.020)
        e.observe("peer:b", 2 * MiB, 0.002)
    assert e.expected_s("nvme", 2 * MiB) == pytest.approx(0.020, rel=0.05)
    assert e.expected_s("peer:b", 2 * MiB) == pytest.approx(0.002, rel=0.05)
    # An unmeasured peer keeps its prior (~3 ms for 2 MiB): ahead of a 20 ms disk.
    assert e.rank(["nvme", "peer:b", "peer:c"], 2 * MiB) == ["peer:b", "peer:c", "nvme"]
    assert e.estimate("nvme").samples == 30
    # Old measurements fade: the disk recovers and is preferred again.
    for _ in range(60):
        e.observe("nvme", 2 * MiB, 0.0005)
    assert e.rank(["nvme", "peer:b"], 2 * MiB) == ["nvme", "peer:b"]


def test_one_stall_does_not_reorder_sources_but_a_slow_source_loses_its_place() -> None:
    """A busy host stalls a single peer transfer for 200 ms: the peer stays ahead of S3's
    prior. A peer that stays that slow falls behind S3 within a few transfers."""
    e = SourceEstimator()
    n = 512 * 1024
    e.observe("peer:b", n, 0.200)  # the first transfer, stalled
    assert e.rank(["peer:b", "s3"], n) == ["peer:b", "s3"]
    e.observe("peer:b", n, 0.0015)  # back to normal
    assert e.rank(["peer:b", "s3"], n) == ["peer:b", "s3"]
    slow = 0
    while e.rank(["peer:b", "s3"], n)[0] == "peer:b" and slow < 10:
        e.observe("peer:b", n, 0.200)
        slow += 1
    assert e.rank(["peer:b", "s3"], n) == ["s3", "peer:b"] and slow <= 3


def test_latency_and_bandwidth_separate_with_mixed_sizes() -> None:
    e = SourceEstimator(forget=0.05)
    lat, bw = 0.004, 0.5e9  # an S3-like source: 4 ms first byte, 500 MB/s
    for i in range(200):
        n = (64 * 1024, 2 * MiB, 8 * MiB, 32 * MiB)[i % 4]
        e.observe("s3", n, lat + n / bw)
    est = e.estimate("s3")
    assert est.latency_s == pytest.approx(lat, rel=0.1)
    assert est.bandwidth_bps == pytest.approx(bw, rel=0.1)


@given(
    obs=st.lists(
        st.tuples(st.integers(1, 64 * MiB), st.floats(1e-6, 10.0)), min_size=0, max_size=40
    ),
    n=st.integers(0, 64 * MiB),
)
def test_estimates_are_positive_and_grow_with_size(obs: list[tuple[int, float]], n: int) -> None:
    e = SourceEstimator()
    for nb, t in obs:
        e.observe("peer:x", nb, t)
    est = e.estimate("peer:x")
    assert est.latency_s >= 0 and est.bandwidth_bps > 0
    assert e.expected_s("peer:x", n) <= e.expected_s("peer:x", n + MiB)


def test_bad_forget_is_refused() -> None:
    with pytest.raises(ValueError, match="forget"):
        SourceEstimator(forget=1.5)


def _blob(k: str, n: int = 64 * 1024) -> bytes:
    meta = codec.ChunkMeta(key=k, fingerprint=FP, num_tokens=16, dtype="uint8", shape=(n,))
    return codec.encode(meta, b"\x07" * n)


async def test_a_fast_peer_beats_a_slow_local_disk(tmp_path: Path) -> None:
    """Node a holds the chunk on NVMe, node b in DRAM. With priors a reads its own disk and
    never asks the directory; once transfers show the disk slow and the peer fast, a pulls
    from the peer instead, and falls back to its disk when the peer is gone."""
    directory = LocalDirectory()
    stores: dict[str, TieredStore] = {}

    async def fetch(key: str, node: str) -> tuple[bytes, float] | None:
        peer = stores.get(node)
        if peer is None:
            raise ConnectionError(f"{node} is down")
        t0 = time.perf_counter()
        raw = await peer.slots[0].tier.get(key)
        return None if raw is None else (bytes(raw), time.perf_counter() - t0)

    def node(name: str) -> TieredStore:
        slots = [
            TierSlot(DRAMTier(8 * 128 * 1024, 128 * 1024, shm_name=f"tc_e_{uuid.uuid4().hex[:10]}"))
        ]
        slots.append(TierSlot(NVMeTier(tmp_path / name, 64 * MiB)))
        return TieredStore(slots, node_id=name, directory=directory, peer_fetch=fetch)

    a, b = node("a"), node("b")
    stores.update(a=a, b=b)
    for n in ("a", "b"):
        await directory.heartbeat(n, {}, 30)
    k = f"{1:032x}"
    raw = _blob(k)
    await b.put(k, raw, wait=True)
    await a.slots[1].tier.put(k, raw)  # a has it on disk only
    a._adopt()
    assert await a._plan(k) == ["nvme"]  # the directory is not even asked

    for _ in range(20):
        a.estimates.observe("nvme", len(raw), 0.050)
        a.estimates.observe("peer:b", len(raw), 0.001)
    assert await a._plan(k) == ["peer:b", "nvme"]
    hit = await a.get(k, expect_fingerprint=FP, promote=False)
    assert (
        hit is not None and hit.source == "peer" and bytes(hit.payload) == raw[codec.HEADER_SIZE :]
    )

    # The real transfer fed the estimate, and operators see it.
    assert a.estimates.estimate("peer:b").samples == 21
    bw = a.metrics.value("tiered_cache_source_bandwidth_bytes_per_second", source="peer:b")
    assert bw == pytest.approx(a.estimates.estimate("peer:b").bandwidth_bps)

    del stores["b"]  # b dies: the read falls back to the local disk
    hit = await a.get(k, expect_fingerprint=FP, promote=False)
    assert hit is not None and hit.source == "nvme"
    await a.close()
    await b.close()
