"""NVMe storing chunks at rest (tiers.enveloped over real files, under a real DRAM pool):
the files hold envelopes, a restart rebuilds the index, prefix chains and tenants from the
envelopes' clear headers without a key, a promotion to DRAM opens them (never copies an
envelope into a slot as if it were a chunk), and a copy another ring sealed is a miss left
in place."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tiered_cache import at_rest, codec
from tiered_cache.agent.node import build_tiers
from tiered_cache.at_rest import AtRest, KeyRing
from tiered_cache.config import CacheConfig, ConfigError
from tiered_cache.directory import LocalDirectory
from tiered_cache.hierarchy import TieredStore, TierSlot
from tiered_cache.metrics import Metrics
from tiered_cache.tiers.dram import DRAMTier
from tiered_cache.tiers.enveloped import EnvelopedTier
from tiered_cache.tiers.nvme import NVMeTier

FP = b"\x04" * 16
K1, K2 = bytes(range(32)), bytes(range(1, 33))


def key(i: int) -> str:
    return f"{i + 16:032x}"


def blob(i: int, n: int = 200_000) -> bytes:
    m = codec.ChunkMeta(key=key(i), fingerprint=FP, num_tokens=16, dtype="uint8", shape=(n,),
                        parent=key(i - 1) if i else "", position=i, tenant="acme")  # fmt: skip
    return codec.encode(m, bytes(range(256)) * (n // 256) + bytes(n % 256))


def ring(secret: bytes) -> KeyRing:
    return KeyRing.parse("1 " + secret.hex(), "test")


async def make_store(root: Path, ar: AtRest) -> TieredStore:
    dram = DRAMTier(4 * 2**20, 2**16, shm_name=f"tc_env_{uuid.uuid4().hex[:10]}")
    m = Metrics()
    nvme = EnvelopedTier(NVMeTier(root, 64 * 2**20), ar, m)
    st = TieredStore([TierSlot(dram), TierSlot(nvme, write_mode="write_through")],
                     node_id="me", directory=LocalDirectory(), metrics=m)  # fmt: skip
    await st.open()
    return st


async def test_files_hold_envelopes_and_promotion_opens_them(nvme_dir: Path) -> None:
    st = await make_store(nvme_dir, AtRest(codec="zstd", keys=ring(K1)))
    try:
        for i in range(3):
            await st.put(key(i), blob(i), wait=True)
        files = sorted(nvme_dir.glob("*/*.kvc"))
        assert len(files) == 3
        for f in files:
            stored = f.read_bytes()
            assert stored[:4] == at_rest.MAGIC and len(stored) < len(blob(0)) // 4
            assert blob(0)[codec.HEADER_SIZE : codec.HEADER_SIZE + 256] not in stored
        m, labels = st.metrics, {"tier": "nvme"}
        raw = m.value("tiered_cache_at_rest_bytes_total", form="raw", **labels)
        assert raw == 3 * len(blob(0))
        assert m.value("tiered_cache_at_rest_bytes_total", form="stored", **labels) < raw / 4
        await st.delete(key(1), tiers=["dram"])
        served: list[str] = []
        got = await st.lease(key(1), FP, served=served)
        assert served == ["nvme"] and isinstance(got, tuple)
        dram = st.by_name["dram"].tier
        assert isinstance(dram, DRAMTier)
        try:
            assert bytes(dram.slot_view(got[0])[: got[1]]) == blob(1)
        finally:
            st.release(got[0])
    finally:
        await st.close()


async def test_a_restart_rebuilds_the_index_from_the_clear_headers(nvme_dir: Path) -> None:
    st = await make_store(nvme_dir, AtRest(codec="zstd-planes", keys=ring(K1)))
    for i in range(4):
        await st.put(key(i), blob(i), wait=True)
    sizes = {k: st.by_name["nvme"].tier.size_of(k) for k in map(key, range(3))}
    await st.close()

    def path(i: int) -> Path:
        return nvme_dir / key(i)[:2] / f"{key(i)}.kvc"

    path(9).write_bytes(path(2).read_bytes())  # under another key's name: dropped
    path(3).write_bytes(path(3).read_bytes()[:-5])  # torn: dropped
    tier = NVMeTier(nvme_dir, 64 * 2**20)  # no keys: the scan needs none
    try:
        assert dict(tier.entries()) == sizes
        rec = tier.take_recovered()
        assert rec[key(2)] == (key(1), 2, "acme") and rec[key(1)] == (key(0), 1, "acme")
        assert not path(9).exists() and not path(3).exists()
    finally:
        await tier.close()


async def test_a_copy_another_ring_sealed_is_a_miss_and_gives_way(nvme_dir: Path) -> None:
    """This node's own disk: nobody else reads it, so a copy it cannot open is removed
    and the chunk can be stored there again (left, the tier would answer "held")."""
    st = await make_store(nvme_dir, AtRest(keys=ring(K1)))
    await st.put(key(5), blob(5), wait=True)
    await st.close()
    other = await make_store(nvme_dir, AtRest(keys=ring(K2)))
    try:
        assert await other.lease(key(5), FP) is None
        tier = other.by_name["nvme"].tier
        assert isinstance(tier, EnvelopedTier) and tier.unopened["tag"] == 1
        m = other.metrics
        assert m.value("tiered_cache_at_rest_unopened_total", tier="nvme", reason="tag") == 1
        assert (await other.contains([key(5)]))["nvme"] == [False]
        await other.put(key(5), blob(5), wait=True)  # stored again, under this ring
        await other.delete(key(5), tiers=["dram"])
        got = await other.lease(key(5), FP)
        assert isinstance(got, tuple)
        other.release(got[0])
    finally:
        await other.close()


async def test_a_damaged_envelope_is_a_miss_and_removed(nvme_dir: Path) -> None:
    st = await make_store(nvme_dir, AtRest(codec="zstd", keys=ring(K1)))
    try:
        await st.put(key(6), blob(6), wait=True)
        await st.delete(key(6), tiers=["dram"])
        f = nvme_dir / key(6)[:2] / f"{key(6)}.kvc"
        stored = bytearray(f.read_bytes())
        stored[-10] ^= 1
        f.write_bytes(bytes(stored))
        assert await st.lease(key(6), FP) is None
        assert not f.exists()
    finally:
        await st.close()


def test_nvme_encrypt_without_a_key_ring_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, nvme_dir: Path
) -> None:
    monkeypatch.delenv(at_rest.ENV_KEYS, raising=False)
    monkeypatch.delenv(at_rest.ENV_KEY_FILE, raising=False)
    cfg = CacheConfig.model_validate({"dram": {"enabled": False}, "nvme": {
        "enabled": True, "path": str(nvme_dir), "encrypt": True, "codec": "zstd"}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"nvme\.encrypt: no key ring"):
        build_tiers(cfg, Metrics())
    assert not list(nvme_dir.iterdir())  # refused before the tier took the directory
    monkeypatch.setenv(at_rest.ENV_KEYS, "1 " + K1.hex())
    (slot,) = build_tiers(cfg, Metrics())
    assert isinstance(slot.tier, EnvelopedTier) and slot.tier.name == "nvme"
