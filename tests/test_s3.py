"""S3 tier against moto's S3 server over real HTTP, with faults from a local proxy."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from conftest import S3Server  # tests/ is on sys.path (rootdir conftest)
from fault_proxy import FaultProxy

from tiered_cache import codec
from tiered_cache.metrics import Metrics
from tiered_cache.tiers.base import TierError, TierFull
from tiered_cache.tiers.s3 import S3Tier

MiB = 2**20


def key(i: int) -> str:
    return f"{i:032x}"


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_server.endpoint_url)
    yield p
    p.close()


MakeTier = Callable[..., S3Tier]


@pytest.fixture
async def make_tier(s3_server: S3Server, s3_bucket: str) -> AsyncIterator[MakeTier]:
    """Build tiers on the test's bucket (straight to moto unless endpoint_url is given)."""
    made: list[S3Tier] = []

    def make(**kw: Any) -> S3Tier:
        kw.setdefault("endpoint_url", s3_server.endpoint_url)
        kw.setdefault("region", "us-east-1")
        t = S3Tier(kw.pop("bucket", s3_bucket), **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        await t.close()


def faulty(make_tier: MakeTier, proxy: FaultProxy, **kw: Any) -> S3Tier:
    """A tier behind the fault proxy with short timeouts, so failures resolve quickly."""
    kw.setdefault("read_timeout", 0.5)
    kw.setdefault("connect_timeout", 0.5)
    kw.setdefault("max_attempts", 3)
    return make_tier(endpoint_url=proxy.url, **kw)


# -- round trips -------------------------------------------------------------------------


async def test_small_round_trip(make_tier: MakeTier) -> None:
    m = Metrics()
    t = make_tier(metrics=m)
    data = os.urandom(1000)
    assert await t.get(key(1)) is None
    await t.put(key(1), data)
    assert await t.get(key(1)) == data
    assert await t.contains_many([key(1), key(2)]) == [True, False]
    assert list(t.entries()) == [(key(1), 1000)]
    assert t.size_of(key(1)) == 1000
    u = t.usage()
    assert (u.used_bytes, u.capacity_bytes, u.num_chunks) == (1000, None, 1)
    assert m.value("tiered_cache_written_bytes_total", tier="s3") == 1000
    assert m.value("tiered_cache_read_bytes_total", tier="s3") == 1000
    # memoryview and bytearray inputs
    await t.put(key(2), memoryview(bytearray(data)))
    await t.put(key(3), bytearray(data))
    assert await t.get(key(2)) == data
    assert await t.get(key(3)) == data


async def test_multipart_round_trip(
    make_tier: MakeTier, s3_server: S3Server, s3_bucket: str
) -> None:
    t = make_tier(multipart_threshold=5 * MiB, part_size=5 * MiB, max_concurrency=4)
    data = os.urandom(12 * MiB + 123)
    await t.put(key(7), data)
    head = s3_server.client().head_object(Bucket=s3_bucket, Key=t.object_key(key(7)))
    assert head["ETag"].strip('"').endswith("-3")  # three parts: went up as multipart
    got = await t.get(key(7))
    assert got is not None and bytes(got) == data
    # Another node (no local index entry) reads it with parallel ranged GETs too.
    other = make_tier(multipart_threshold=5 * MiB, part_size=5 * MiB)
    got2 = await other.get(key(7))
    assert got2 is not None and bytes(got2) == data


async def test_contains_many_sees_other_nodes(make_tier: MakeTier) -> None:
    prefill = make_tier(prefix="kv")
    decode = make_tier(prefix="/kv/", max_concurrency=4)
    for i in range(5):
        await prefill.put(key(i), b"x" * (i + 1))
    keys = [key(i) for i in range(8)]
    assert await decode.contains_many(keys) == [True] * 5 + [False] * 3
    assert await decode.contains_many([key(1), key(1), key(9)]) == [True, True, False]
    assert await decode.longest_prefix(keys) == 5
    assert await decode.longest_prefix([key(9), *keys]) == 0
    assert await decode.longest_prefix(keys[:5] * 3) == 15  # more than one probe window
    assert await decode.get(key(3)) == b"xxxx"
    assert list(decode.entries()) == []  # the local index holds only this node's writes


async def test_contains_many_is_bounded_and_local_first(
    make_tier: MakeTier, proxy: FaultProxy
) -> None:
    writer = make_tier()
    for i in range(0, 24, 2):
        await writer.put(key(i), b"even")
    t = make_tier(endpoint_url=proxy.url, max_concurrency=4)
    await t.put(key(100), b"mine")
    proxy.requests, proxy.methods_seen, proxy.max_in_flight = 0, [], 0
    got = await t.contains_many([key(100)] + [key(i) for i in range(24)])
    assert got == [True] + [i % 2 == 0 for i in range(24)]
    assert proxy.methods_seen == ["HEAD"] * 24  # none for the key this node wrote
    assert 1 < proxy.max_in_flight <= 4


async def test_delete(make_tier: MakeTier) -> None:
    a = make_tier()
    b = make_tier()
    await a.put(key(1), b"one")
    await a.put(key(2), b"two")
    assert await a.delete(key(1)) is True
    assert await a.get(key(1)) is None
    assert await a.delete(key(1)) is False
    assert a.usage().num_chunks == 1
    # A node can delete what another wrote (the hierarchy removes corrupt chunks).
    assert await b.delete(key(2)) is True
    assert await b.contains_many([key(2)]) == [False]
    # The writer's index entry goes once it notices the object is gone.
    assert await a.get(key(2)) is None
    assert a.usage().used_bytes == 0


async def test_prefix_isolation_and_layout(
    make_tier: MakeTier, s3_server: S3Server, s3_bucket: str
) -> None:
    a = make_tier(prefix="tenant-a/")
    b = make_tier(prefix="tenant-b")
    bare = make_tier()
    k = "ab" + "0" * 30
    await a.put(k, b"a-data")
    assert a.object_key(k) == f"tenant-a/ab/{k}.kvc"
    assert bare.object_key(k) == f"ab/{k}.kvc"
    assert make_tier(prefix="//x//y/").object_key(k) == f"x/y/ab/{k}.kvc"
    assert await b.contains_many([k]) == [False]
    assert await b.get(k) is None
    assert await bare.contains_many([k]) == [False]
    await b.put(k, b"b-data")
    assert await a.get(k) == b"a-data"
    assert await b.get(k) == b"b-data"
    listed = s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert sorted(o["Key"] for o in listed) == [f"tenant-a/ab/{k}.kvc", f"tenant-b/ab/{k}.kvc"]


async def test_invalid_keys_rejected(make_tier: MakeTier) -> None:
    t = make_tier()
    for bad in ("", "../etc/passwd", "A" * 32, key(1) + "0"):
        with pytest.raises(ValueError):
            await t.put(bad, b"x")
        with pytest.raises(ValueError):
            await t.get(bad)
        with pytest.raises(ValueError):
            await t.contains_many([bad])


async def test_flipped_byte_is_detected_by_codec(
    make_tier: MakeTier, s3_server: S3Server, s3_bucket: str
) -> None:
    t = make_tier()
    meta = codec.ChunkMeta(key=key(5), fingerprint=b"f" * 16, num_tokens=4)
    chunk = codec.encode(meta, os.urandom(4096))
    await t.put(key(5), chunk)
    raw = s3_server.client()
    okey = t.object_key(key(5))
    stored = bytearray(raw.get_object(Bucket=s3_bucket, Key=okey)["Body"].read())
    stored[codec.HEADER_SIZE + 100] ^= 0x01
    raw.put_object(Bucket=s3_bucket, Key=okey, Body=bytes(stored))
    got = await t.get(key(5))
    assert got is not None and bytes(got) == bytes(stored)
    with pytest.raises(codec.ChunkCorrupt):
        codec.decode(got, expect_key=key(5))


# -- budget ------------------------------------------------------------------------------


async def test_budget_and_rebuild_from_listing(make_tier: MakeTier) -> None:
    t = make_tier(prefix="node1", capacity_bytes=3000)
    await t.open()
    for i in range(3):
        await t.put(key(i), b"z" * 1000)
    with pytest.raises(TierFull):
        await t.put(key(3), b"z" * 1)
    assert t.fits(3000) and not t.fits(3001)
    await t.put(key(1), b"y" * 1000)  # overwriting a key reuses its bytes
    assert await t.delete(key(0))
    await t.put(key(3), b"w" * 500)
    assert t.usage().used_bytes == 2500
    # A fresh instance (restart) rebuilds usage by listing the prefix, lazily on first put.
    fresh = make_tier(prefix="node1", capacity_bytes=3000)
    with pytest.raises(TierFull):
        await fresh.put(key(9), b"v" * 501)
    u = fresh.usage()
    assert (u.used_bytes, u.num_chunks) == (2500, 3)
    assert dict(fresh.entries()) == {key(1): 1000, key(2): 1000, key(3): 500}
    # Other prefixes do not count; unbounded tiers never list.
    other = make_tier(prefix="node2", capacity_bytes=10)
    await other.open()
    assert other.usage().used_bytes == 0
    unbounded = make_tier(prefix="node1")
    await unbounded.open()
    assert unbounded.usage().num_chunks == 0


# -- faults ------------------------------------------------------------------------------


async def test_transient_500_and_slowdown_are_retried(
    make_tier: MakeTier, proxy: FaultProxy
) -> None:
    m = Metrics()
    t = faulty(make_tier, proxy, metrics=m)
    proxy.fail_next(2, 500, methods=["PUT"])
    await t.put(key(1), b"payload")
    assert proxy.faults_injected == 2
    assert m.value("tiered_cache_s3_retries_total") == 2
    proxy.slow_down_next(1, methods=["GET"])
    assert await t.get(key(1)) == b"payload"
    assert m.value("tiered_cache_s3_retries_total") == 3
    proxy.fail_next(1, 503, methods=["HEAD"])
    assert await t.contains_many([key(2)]) == [False]  # other node's key: HEAD retried
    assert m.value("tiered_cache_s3_retries_total") == 4
    assert m.value("tiered_cache_read_errors_total", tier="s3") == 0


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_persistent_500_fails_fast_and_a_background_probe_finds_s3_again(
    make_tier: MakeTier, proxy: FaultProxy
) -> None:
    """The first call that finds S3 down pays botocore's retries; after it, reads, writes
    and lookups fail at once without touching S3 (counted), until a background HEAD on
    the backoff schedule finds it back. No call waits for that probe."""
    m = Metrics()
    t = faulty(make_tier, proxy, metrics=m, max_attempts=2)
    clock = _Clock()
    t.guard.clock = clock
    await t.put(key(1), b"ok")
    proxy.fail_next(-1, 500)
    with pytest.raises(TierError):
        await t.get(key(1))
    assert t.guard.down and m.value("tiered_cache_s3_retries_total") >= 1
    reached = proxy.faults_injected
    with pytest.raises(TierError, match="unavailable"):
        await t.put(key(2), b"nope")
    with pytest.raises(TierError, match="unavailable"):
        await t.put(key(3), os.urandom(6 * MiB))  # multipart path
    assert await t.contains_many([key(4), key(5)]) == [False, False]
    assert await t.contains_many([key(1)]) == [False]  # even what it holds: unreadable now
    assert proxy.faults_injected == reached  # none of those reached S3
    assert m.value("tiered_cache_read_errors_total", tier="s3") == 1
    assert t.size_of(key(2)) is None and t.usage().used_bytes == 2  # failed puts not indexed
    proxy.clear()
    clock.t += 1.0  # the backoff is over: the next call starts a probe and does not wait
    assert await t.contains_many([key(1)]) == [False]
    assert t._probe is not None
    await t._probe
    assert not t.guard.down
    assert await t.get(key(1)) == b"ok"


async def test_stalls_time_out(make_tier: MakeTier, proxy: FaultProxy) -> None:
    m = Metrics()
    # A read timeout that a loaded 2-core CI host answers well within (0.5 s was not).
    t = faulty(make_tier, proxy, metrics=m, max_attempts=2, read_timeout=1.5)
    await t.put(key(1), b"stall me")
    # One stalled answer: botocore's read timeout fires and the retry succeeds.
    proxy.stall_next(1, 30, methods=["GET"])
    assert await t.get(key(1)) == b"stall me"
    assert m.value("tiered_cache_s3_retries_total") == 1
    # Stalls every time: TierError after max_attempts read timeouts; then S3 counts as
    # down and the put fails at once, without another round of timeouts.
    proxy.stall_next(-1, 30)
    start = time.monotonic()
    with pytest.raises(TierError):
        await t.get(key(1))
    with pytest.raises(TierError, match="unavailable"):
        await t.put(key(2), b"x")
    assert time.monotonic() - start < 6
    assert m.value("tiered_cache_s3_retries_total") == 2


async def test_stall_mid_body_is_retried(make_tier: MakeTier, proxy: FaultProxy) -> None:
    m = Metrics()
    t = faulty(make_tier, proxy, metrics=m, multipart_threshold=5 * MiB, part_size=5 * MiB,
               read_timeout=1.2)  # fmt: skip
    small = os.urandom(64 * 1024)
    big = os.urandom(11 * MiB)
    await t.put(key(1), small)
    await t.put(key(2), big)
    # Headers and half the body, then silence: botocore has returned, so the tier retries.
    proxy.stall_body_next(1, 30, methods=["GET"])
    assert await t.get(key(1)) == small
    assert m.value("tiered_cache_s3_retries_total") == 1
    proxy.stall_body_next(1, 30, methods=["GET"])  # the first ranged GET of three
    got = await t.get(key(2))
    assert got is not None and bytes(got) == big
    assert m.value("tiered_cache_s3_retries_total") == 2
    proxy.stall_body_next(-1, 30, methods=["GET"])
    start = time.monotonic()
    with pytest.raises(TierError):
        await t.get(key(1))
    assert time.monotonic() - start < 6


async def test_object_replaced_mid_read(
    make_tier: MakeTier, proxy: FaultProxy, s3_server: S3Server, s3_bucket: str
) -> None:
    """Ranged GETs are pinned to the first response's ETag: a concurrent overwrite makes the
    read start over instead of stitching two versions together."""
    t = make_tier(endpoint_url=proxy.url, multipart_threshold=5 * MiB, part_size=5 * MiB)
    old, new = os.urandom(11 * MiB), os.urandom(11 * MiB)
    await t.put(key(1), old)
    raw = s3_server.client()
    okey = t.object_key(key(1))
    pinned: list[str] = []

    def overwrite_once(method: str, path: str, headers: Any) -> None:
        if method == "GET" and headers.get("If-Match"):
            pinned.append(headers["If-Match"])
            if len(pinned) == 1:
                raw.put_object(Bucket=s3_bucket, Key=okey, Body=new)

    proxy.on_request = overwrite_once
    got = await t.get(key(1))
    assert got is not None and bytes(got) == new
    assert len(set(pinned)) == 2  # the second pass pinned the new ETag


# -- secrets, construction, lifecycle ----------------------------------------------------


async def test_no_secrets_in_repr_errors_or_logs(
    s3_server: S3Server,
    s3_bucket: str,
    proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key_id, secret, token = "AKIANEVERLOGTHIS0001", "s3cr3t/Never+Log+Me", "tok-Never-Log-Me"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    caplog.set_level(logging.DEBUG)
    t = S3Tier.from_url(
        f"s3://{s3_bucket}/p", endpoint_url=proxy.url, read_timeout=0.5, max_attempts=2
    )
    try:
        await t.put(key(1), b"data")
        proxy.fail_next(-1, 500)
        with pytest.raises(TierError) as ei:
            await t.get(key(1))
        assert await t.contains_many([key(2)]) == [False]
        ours = "\n".join(
            r.getMessage() for r in caplog.records if r.name.startswith("tiered_cache")
        )
        assert "s3 get" in ours  # the failure was logged
        for s in (key_id, secret, token):
            assert s not in repr(t) and s not in str(t)
            assert s not in str(ei.value)
            assert s not in ours
        assert any(r.name.startswith("botocore") for r in caplog.records)
        assert secret not in caplog.text  # nor in botocore's own debug logs
    finally:
        await t.close()
    with pytest.raises(ValueError) as ve:
        S3Tier("b", endpoint_url=f"http://{key_id}:{secret}@127.0.0.1:1")
    assert secret not in str(ve.value)
    with pytest.raises(ValueError):
        S3Tier.from_url(f"s3://{key_id}:{secret}@bucket/p")


def test_from_url_and_validation() -> None:
    t = S3Tier.from_url("s3://my-bucket/a//b/", endpoint_url="http://127.0.0.1:1", region="x")
    assert (t.bucket, t.prefix) == ("my-bucket", "a/b/")
    assert S3Tier.from_url("s3://my-bucket", endpoint_url="http://127.0.0.1:1").prefix == ""
    assert "my-bucket" in repr(t) and "a/b/" in repr(t)
    for bad in ("http://b/p", "s3:///p"):
        with pytest.raises(ValueError):
            S3Tier.from_url(bad)
    with pytest.raises(ValueError):
        S3Tier("b", part_size=MiB)  # S3 rejects multipart parts under 5 MiB


async def test_close(make_tier: MakeTier) -> None:
    t = make_tier()
    await t.put(key(1), b"x")
    await t.close()
    await t.close()  # idempotent
    with pytest.raises(TierError):
        await t.get(key(1))
