"""A stored chunk whose header names another key is a miss and is deleted from the tier
that held it (and this node's directory entry), counted as
``tiered_cache_evictions_total{reason="wrong_key"}``; before, it stayed and every later
read paid for it again (issue 15, remaining findings). Real tiers: shared-memory DRAM,
files, moto S3, and a real agent process for the client's read through the shared index."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers_agent import meta, payload, socket_of, start_agent, write_cfg

from tiered_cache import codec
from tiered_cache.client import AgentClient
from tiered_cache.directory import LocalDirectory, Location
from tiered_cache.hierarchy import TieredStore, TierSlot
from tiered_cache.metrics import Metrics
from tiered_cache.tiers.dram import DRAMTier
from tiered_cache.tiers.nvme import NVMeTier
from tiered_cache.tiers.s3 import S3Tier

FP = b"\x02" * 16
SLOT = 8192


def key(i: int) -> str:
    return f"{i:032x}"


def blob(k: str, n: int = 4000) -> bytes:
    m = codec.ChunkMeta(key=k, fingerprint=FP, num_tokens=16, dtype="uint8", shape=(n,))
    return codec.encode(m, bytes([7]) * n)


def wrong_key(m: Metrics, tier: str) -> float:
    return m.value("tiered_cache_evictions_total", tier=tier, reason="wrong_key")


@pytest.fixture
async def store(nvme_dir: Path, s3_server: Any, s3_bucket: str) -> Any:
    m = Metrics()
    d = LocalDirectory()
    s3 = S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1")
    st = TieredStore(
        [
            TierSlot(DRAMTier(8 * SLOT, SLOT, shm_name=f"tc_wk_{uuid.uuid4().hex[:10]}")),
            TierSlot(NVMeTier(nvme_dir, None)),
            TierSlot(s3),
        ],
        node_id="me",
        directory=d,
        metrics=m,
    )
    await st.open()
    await d.heartbeat("me", {}, ttl_s=600)  # a live node: the directory answers with it
    yield st, m, d
    await st.close()


async def test_wrong_key_on_nvme_is_deleted_once(store: Any) -> None:
    st, m, d = store
    nvme = st.by_name["nvme"].tier
    await nvme.put(key(1), blob(key(2)))  # a file under key 1 holding key 2's chunk
    await st.republish()
    assert Location("me", "nvme") in (await d.locate([key(1)]))[0]

    assert await st.get(key(1), expect_fingerprint=FP) is None
    assert (await st.contains([key(1)]))["nvme"] == [False]
    assert Location("me", "nvme") not in (await d.locate([key(1)]))[0]
    assert wrong_key(m, "nvme") == 1
    # The next read finds nothing to pay for.
    assert await st.get(key(1), expect_fingerprint=FP) is None
    assert m.value("tiered_cache_verification_failures_total", tier="nvme") == 1


async def test_wrong_key_on_the_lease_path(store: Any) -> None:
    """The agent's path: a chunk leased into DRAM straight from NVMe, and one in DRAM."""
    st, m, _ = store
    await st.by_name["nvme"].tier.put(key(3), blob(key(4)))
    assert await st.lease(key(3), FP) is None
    assert (await st.contains([key(3)]))["nvme"] == [False]
    assert wrong_key(m, "nvme") == 1

    await st.by_name["dram"].tier.put(key(5), blob(key(6)))
    assert await st.lease(key(5), FP) is None
    assert (await st.contains([key(5)]))["dram"] == [False]
    assert wrong_key(m, "dram") == 1


async def test_wrong_key_in_s3_is_deleted(store: Any, s3_server: Any, s3_bucket: str) -> None:
    st, m, _ = store
    s3 = st.by_name["s3"].tier
    await s3.put(key(7), blob(key(8)))
    okey = s3.object_key(key(7))
    assert await st.get(key(7), expect_fingerprint=FP) is None
    listed = s3_server.client().list_objects_v2(Bucket=s3_bucket).get("Contents", [])
    assert okey not in [o["Key"] for o in listed]
    assert wrong_key(m, "s3") == 1


async def test_another_fingerprint_is_left_in_place(store: Any) -> None:
    """Not deleted: the same key under another fingerprint may serve another reader."""
    st, m, _ = store
    await st.by_name["nvme"].tier.put(key(9), blob(key(9)))
    assert await st.get(key(9), expect_fingerprint=b"\x09" * 16) is None
    assert (await st.contains([key(9)]))["nvme"] == [True]
    assert wrong_key(m, "nvme") == 0


def test_client_read_through_the_shared_index_hands_it_to_the_agent(tmp_path: Path) -> None:
    """A DRAM slot rewritten after its commit with another key's chunk: the client's read
    through the shared index sees the wrong header and asks the agent, which drops it."""
    proc = start_agent(write_cfg(tmp_path))
    c = AgentClient(socket_of(tmp_path / "cfg.yaml"))
    try:
        k, other = key(11), key(12)
        n = 4096
        c.put_many([(meta(k, n), payload(1, n))])
        assert c.lookup([k]) == ["dram"]
        assert c._index is not None and c._buf is not None
        found = c._index.find(k)
        assert found is not None
        slot, _, length = found
        off = slot * c.slot_bytes
        c._buf[off : off + length] = codec.encode(meta(other, n), payload(2, n))

        got: list[Any] = []
        ok = c.load_many([k], None, lambda i, m, p: got.append(bytes(p)))
        assert ok == [False] and not got
        assert c.lookup([k]) == []  # gone, not read and refused again by every request
    finally:
        c.close()
        proc.kill()
        proc.wait()
