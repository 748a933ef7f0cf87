"""S3 storing chunks at rest (tiers.enveloped over a real moto S3 server): the bucket holds
envelopes, the store reads its chunks back, and a copy under a key this reader lacks is a
miss left in place while a damaged one is a miss removed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tiered_cache import at_rest, codec
from tiered_cache.agent.node import build_tiers
from tiered_cache.at_rest import AtRest, KeyRing
from tiered_cache.config import CacheConfig, ConfigError
from tiered_cache.directory import LocalDirectory
from tiered_cache.hierarchy import TieredStore, TierSlot
from tiered_cache.metrics import Metrics
from tiered_cache.tiers.enveloped import EnvelopedTier
from tiered_cache.tiers.s3 import S3Tier

FP = b"\x03" * 16
K1, K2 = bytes(range(32)), bytes(range(1, 33))


def key(i: int) -> str:
    return f"{i:032x}"


def blob(k: str, n: int = 200_000) -> bytes:
    m = codec.ChunkMeta(key=k, fingerprint=FP, num_tokens=16, dtype="uint8", shape=(n,),
                        tenant="acme")  # fmt: skip
    return codec.encode(m, bytes(range(256)) * (n // 256) + bytes(n % 256))


async def make_store(s3_server: Any, bucket: str, ar: AtRest) -> TieredStore:
    s3 = S3Tier(bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1")
    st = TieredStore([TierSlot(EnvelopedTier(s3, ar))], node_id="me",
                     directory=LocalDirectory(), metrics=Metrics())  # fmt: skip
    await st.open()
    return st


def rewrite(st: TieredStore, s3_server: Any, bucket: str, k: str, at: int,
            new: Callable[[int], int]) -> tuple[str, Any]:  # fmt: skip
    """Replace byte ``at`` of ``k``'s object with ``new(byte)``, behind the store's back:
    the object's name and the S3 client."""
    okey = st.by_name["s3"].tier.object_key(k)
    c = s3_server.client()
    stored = bytearray(c.get_object(Bucket=bucket, Key=okey)["Body"].read())
    stored[at] = new(stored[at])
    c.put_object(Bucket=bucket, Key=okey, Body=bytes(stored))
    return okey, c


def ring(secret: bytes) -> KeyRing:
    return KeyRing.parse("1 " + secret.hex(), "test")


async def test_the_bucket_holds_sealed_compressed_envelopes(s3_server: Any, s3_bucket: str) -> None:
    st = await make_store(s3_server, s3_bucket, AtRest(codec="zstd", keys=ring(K1)))
    try:
        b = blob(key(1))
        await st.put(key(1), b, wait=True)
        okey = st.by_name["s3"].tier.object_key(key(1))
        stored = s3_server.client().get_object(Bucket=s3_bucket, Key=okey)["Body"].read()
        assert stored[:4] == at_rest.MAGIC and len(stored) < len(b) // 4
        assert b[codec.HEADER_SIZE : codec.HEADER_SIZE + 256] not in stored
        hit = await st.get(key(1), expect_fingerprint=FP)
        assert hit is not None and bytes(hit.payload) == b[codec.HEADER_SIZE :]
    finally:
        await st.close()


async def misses_and_leaves(s3_server: Any, bucket: str, ar: AtRest, reason: str) -> None:
    """A reader with ``ar`` misses key 2, counts ``reason``, and leaves the copy."""
    st = await make_store(s3_server, bucket, ar)
    try:
        assert await st.get(key(2), expect_fingerprint=FP) is None
        tier = st.by_name["s3"].tier
        assert isinstance(tier, EnvelopedTier) and tier.unopened[reason] == 1
        assert (await st.contains([key(2)]))["s3"] == [True]
    finally:
        await st.close()


async def test_another_key_ring_misses_and_leaves_the_copy(s3_server: Any, s3_bucket: str) -> None:
    writer = await make_store(s3_server, s3_bucket, AtRest(keys=ring(K1)))
    await writer.put(key(2), blob(key(2)), wait=True)
    await writer.close()
    # another master key under the same id: the tag fails on intact bytes; a misconfigured
    # reader never deletes good copies
    await misses_and_leaves(s3_server, s3_bucket, AtRest(keys=ring(K2)), "tag")
    # a reader without keys: the copy stays for one that has them
    await misses_and_leaves(s3_server, s3_bucket, AtRest(codec="zstd"), "key")
    again = await make_store(s3_server, s3_bucket, AtRest(keys=ring(K1)))
    try:  # and the writer's ring still reads it
        hit = await again.get(key(2), expect_fingerprint=FP)
        assert hit is not None and bytes(hit.payload) == blob(key(2))[codec.HEADER_SIZE :]
    finally:
        await again.close()


async def test_a_damaged_envelope_is_a_miss_and_removed(s3_server: Any, s3_bucket: str) -> None:
    st = await make_store(s3_server, s3_bucket, AtRest(codec="zstd-planes"))
    try:
        await st.put(key(3), blob(key(3)), wait=True)
        okey, c = rewrite(st, s3_server, s3_bucket, key(3), -10, lambda b: b ^ 1)
        assert await st.get(key(3), expect_fingerprint=FP) is None
        listed = c.list_objects_v2(Bucket=s3_bucket).get("Contents", [])
        assert okey not in [o["Key"] for o in listed]
    finally:
        await st.close()


def test_encrypt_without_a_key_ring_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(at_rest.ENV_KEYS, raising=False)
    monkeypatch.delenv(at_rest.ENV_KEY_FILE, raising=False)
    cfg = CacheConfig.model_validate({"s3": {"enabled": True, "url": "s3://tc-bucket/p",
                                             "encrypt": True}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"s3\.encrypt: no key ring"):
        build_tiers(cfg, Metrics())
    monkeypatch.setenv(at_rest.ENV_KEYS, "1 " + K1.hex())
    slots = build_tiers(cfg, Metrics())
    assert isinstance(slots[-1].tier, EnvelopedTier) and slots[-1].tier.name == "s3"


async def test_fp8_copies_are_rebuilt_signed_and_served(s3_server: Any, s3_bucket: str) -> None:
    """A signed bf16 chunk stored as fp8: the bucket holds about half its bytes, and the
    store serves the rebuilt chunk, which passes the reader's MAC check."""
    mac = codec.chunk_mac_key(b"cluster secret")
    n = 64 * 1024
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32).view(np.uint32) >> 16
    m = codec.ChunkMeta(key=key(4), fingerprint=FP, num_tokens=16, dtype="bfloat16",
                        shape=(2, n // 2), tenant="acme")  # fmt: skip
    b = codec.encode(m, x.astype(np.uint16).tobytes(), mac_key=mac)
    s3 = S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1")
    st = TieredStore([TierSlot(EnvelopedTier(s3, AtRest(codec="fp8", mac_key=mac)))],
                     node_id="me", directory=LocalDirectory(), metrics=Metrics(),
                     mac_key=mac)  # fmt: skip
    await st.open()
    try:
        await st.put(key(4), b, wait=True)
        stored = s3_server.client().get_object(Bucket=s3_bucket, Key=s3.object_key(key(4)))
        assert len(stored["Body"].read()) < 0.52 * len(b)
        hit = await st.get(key(4), expect_fingerprint=FP)
        assert hit is not None and hit.source == "s3"
        got = np.frombuffer(hit.payload, dtype=np.uint16)
        want = (x.astype(np.uint32) << 16).view(np.float32)
        rebuilt = (got.astype(np.uint32) << 16).view(np.float32)
        assert np.abs(rebuilt - want).max() <= np.abs(want).max() / 16
        assert not np.array_equal(rebuilt, want)  # lossy: not the bytes written
    finally:
        await st.close()


async def test_an_unknown_envelope_version_is_a_miss_left_in_place(
    s3_server: Any, s3_bucket: str
) -> None:
    """A later release's envelope in a shared bucket (a rolling upgrade): a miss, and the
    object stays for the nodes that read it."""
    st = await make_store(s3_server, s3_bucket, AtRest(codec="zstd"))
    try:
        await st.put(key(7), blob(key(7)), wait=True)
        okey, c = rewrite(st, s3_server, s3_bucket, key(7), 4, lambda _: at_rest.VERSION + 1)
        assert await st.get(key(7), expect_fingerprint=FP) is None
        tier = st.by_name["s3"].tier
        assert isinstance(tier, EnvelopedTier) and tier.unopened["unknown"] == 1
        listed = c.list_objects_v2(Bucket=s3_bucket).get("Contents", [])
        assert okey in [o["Key"] for o in listed]
    finally:
        await st.close()
