"""Directory tests: one semantic suite over LocalDirectory, Redis and Redis Cluster, plus
Redis-only tests for round trips, AUTH, credential hygiene and outage degradation."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline

from tiered_cache.directory import (
    Directory,
    DirectoryUnavailable,
    LocalDirectory,
    Location,
    ModelRegistration,
    Pin,
    RedisDirectory,
    redact_url,
)
from tiered_cache.metrics import Metrics

FP = "ab" * 16
ERRORS = "tiered_cache_directory_errors_total"
DROPPED = "tiered_cache_directory_dropped_updates_total"

MakeDir = Callable[[], Awaitable[Directory]]


def key(i: int, tag: str = "") -> str:
    return hashlib.md5(f"{tag}/{i}".encode()).hexdigest()


def keys(n: int, tag: str = "") -> list[str]:
    return [key(i, tag) for i in range(n)]


async def eventually(cond: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


@pytest.fixture(params=["local", "redis", "cluster"])
async def make_dir(request: pytest.FixtureRequest) -> AsyncIterator[MakeDir]:
    """Factory of directory handles onto one shared backend (a fresh namespace per test).

    Local: every call returns the same in-process instance (that is what "shared" means
    for a single process)."""
    made: list[Directory] = []
    ns = "t" + uuid.uuid4().hex[:10]
    local = LocalDirectory()
    url = ""
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
    elif request.param == "cluster":
        url = request.getfixturevalue("redis_cluster").url

    async def make() -> Directory:
        if request.param == "local":
            return local
        d = RedisDirectory.from_url(url, namespace=ns, metrics=Metrics())
        made.append(d)
        return d

    yield make
    for d in made:
        await d.close()


# ------------------------------------------------------------------ shared semantics


async def test_publish_locate_unpublish_round_trip(make_dir: MakeDir) -> None:
    d = await make_dir()
    ks = keys(5, "rt")
    await d.heartbeat("n1", {"addr": "10.0.0.1:7000"}, ttl_s=30)
    await d.heartbeat("n2", {}, ttl_s=30)
    await d.publish("n1", "nvme", ks[:3], ttl_s=30)
    await d.publish("n1", "dram", ks[1:2], ttl_s=30)
    await d.publish("n2", "dram", ks[2:4], ttl_s=30)

    got = await d.locate(ks)
    assert got == [
        [Location("n1", "nvme")],
        [Location("n1", "dram"), Location("n1", "nvme")],  # nearest tier first
        [Location("n2", "dram"), Location("n1", "nvme")],
        [Location("n2", "dram")],
        [],
    ]
    await d.unpublish("n1", "nvme", ks[:3])
    got = await d.locate(ks[:3])
    assert got == [[], [Location("n1", "dram")], [Location("n2", "dram")]]
    assert await d.locate([]) == []


async def test_invalid_input_is_rejected(make_dir: MakeDir) -> None:
    d = await make_dir()
    with pytest.raises(ValueError):
        await d.publish("n1", "dram", ["not-a-chunk-key}"], ttl_s=5)
    with pytest.raises(ValueError):
        await d.publish("n1", "gpu", [key(0)], ttl_s=5)
    with pytest.raises(ValueError):
        await d.heartbeat("bad\x1fnode", {}, ttl_s=5)


async def test_location_ttl_expires_and_republish_extends(make_dir: MakeDir) -> None:
    d = await make_dir()
    ks = keys(2, "ttl")
    await d.heartbeat("n1", {}, ttl_s=30)
    await d.publish("n1", "dram", ks, ttl_s=0.5)
    assert await d.locate(ks) == [[Location("n1", "dram")]] * 2
    await asyncio.sleep(0.3)
    await d.publish("n1", "dram", ks[:1], ttl_s=30)  # refresh one of them
    await asyncio.sleep(0.4)
    assert await d.locate(ks) == [[Location("n1", "dram")], []]


async def test_dead_node_is_filtered_but_shared_s3_stays(make_dir: MakeDir) -> None:
    d = await make_dir()
    ks = keys(1, "dead")
    # Long enough that a loaded host (a Redis cluster, CI) still sees it alive below.
    await d.heartbeat("short", {"role": "decode"}, ttl_s=2.0)
    await d.heartbeat("long", {"role": "prefill"}, ttl_s=30)
    for node in ("short", "long"):
        await d.publish(node, "dram", ks, ttl_s=30)
    await d.publish("short", "s3", ks, ttl_s=30)
    # A node that never sent a heartbeat is not routable either.
    await d.publish("ghost", "dram", ks, ttl_s=30)
    assert await d.locate(ks) == [
        [Location("long", "dram"), Location("short", "dram"), Location("short", "s3")]
    ]
    assert set(await d.nodes()) == {"short", "long"}
    deadline = time.monotonic() + 15
    while "short" in await d.nodes():  # its heartbeat expires
        assert time.monotonic() < deadline, "the short heartbeat never expired"
        await asyncio.sleep(0.1)
    # The dead node's DRAM is gone with it; its S3 object is still readable by anyone.
    assert await d.locate(ks) == [[Location("long", "dram"), Location("short", "s3")]]
    nodes = await d.nodes()
    assert set(nodes) == {"long"}
    assert nodes["long"]["role"] == "prefill"
    assert abs(nodes["long"]["last_seen"] - time.time()) < 5


async def test_pins_lifecycle_and_version(make_dir: MakeDir) -> None:
    d = await make_dir()
    v0 = await d.pins_version()
    hard = Pin(name="system prompt", keys=keys(3, "pin"), fingerprint=FP, num_tokens=768)
    await d.add_pin(hard)
    v1 = await d.pins_version()
    assert v1 > v0
    assert await d.pins_version() == v1  # polling alone does not move it
    got = await d.get_pin(hard.id)
    assert got is not None and got.keys == hard.keys and got.ttl_s is None
    assert [p.id for p in await d.list_pins()] == [hard.id]

    soft = Pin(name="ttl", keys=keys(1, "pin2"), fingerprint=FP, ttl_s=0.5, tiers=["nvme"])
    await d.add_pin(soft)
    v2 = await d.pins_version()
    assert v2 > v1
    assert {p.id for p in await d.list_pins()} == {hard.id, soft.id}
    await asyncio.sleep(0.7)
    # Expiry alone moves the version, so pollers reload without calling list_pins.
    v3 = await d.pins_version()
    assert v3 > v2
    assert [p.id for p in await d.list_pins()] == [hard.id]
    assert await d.get_pin(soft.id) is None

    assert await d.remove_pin(hard.id) is True
    v4 = await d.pins_version()
    assert v4 > v3
    assert await d.remove_pin(hard.id) is False
    assert await d.pins_version() == v4
    assert await d.list_pins() == []


async def test_two_nodes_see_each_other(make_dir: MakeDir) -> None:
    a, b = await make_dir(), await make_dir()
    ks = keys(4, "two")
    await a.heartbeat("node-a", {"n": 1}, ttl_s=30)
    await b.heartbeat("node-b", {"n": 2}, ttl_s=30)
    await a.publish("node-a", "dram", ks[:2], ttl_s=30)
    await b.publish("node-b", "nvme", ks[2:], ttl_s=30)
    want = [[Location("node-a", "dram")]] * 2 + [[Location("node-b", "nvme")]] * 2
    assert await a.locate(ks) == want
    assert await b.locate(ks) == want
    assert set(await a.nodes()) == set(await b.nodes()) == {"node-a", "node-b"}

    pin = Pin(keys=ks, fingerprint=FP, owner="alice")
    await b.add_pin(pin)
    assert [p.id for p in await a.list_pins()] == [pin.id]
    assert await a.pins_version() == await b.pins_version()


async def test_counters(make_dir: MakeDir) -> None:
    a, b = await make_dir(), await make_dir()
    await a.incr_counters("n1", {"dram:hits": 3, "dram:misses": 1})
    await a.incr_counters("n1", {"dram:hits": 2, "zero": 0})
    await b.incr_counters("n2", {"s3:hits": 7})
    assert await b.counters() == {
        "n1": {"dram:hits": 5, "dram:misses": 1},
        "n2": {"s3:hits": 7},
    }


async def test_model_registrations(make_dir: MakeDir, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = await make_dir(), await make_dir()
    reg = ModelRegistration(model_id="/m/llama", dtype="bfloat16", kv_layout="NHD@cuda/X",
                            block_size=16, chunk_size=256, aliases=["llama"])  # fmt: skip
    rank1 = reg.model_copy(update={"tp_rank": 1, "tp_world_size": 2})
    await a.register_models("n1", [reg])
    await a.register_models("n2", [rank1, reg])  # n2 refreshed reg last
    got = await b.models()
    assert sorted(r.hex for r in got) == sorted([reg.hex, rank1.hex])
    assert {r.node_id for r in got} == {"n2"} and got[0].names() == {"/m/llama", "llama"}
    assert all(time.time() - r.last_seen < 60 for r in got)
    # Not refreshed within MODEL_KEEP_S: a retired deployment, dropped.
    monkeypatch.setattr("tiered_cache.directory.records.MODEL_KEEP_S", 0.05)
    await asyncio.sleep(0.1)
    await a.register_models("n1", [reg])
    assert [r.hex for r in await b.models()] == [reg.hex]
    with pytest.raises(ValueError, match="multiple of block_size"):
        ModelRegistration.model_validate({**reg.model_dump(), "chunk_size": 100})


# ------------------------------------------------------------------ pins / urls (no I/O)


def test_pin_model() -> None:
    p = Pin(keys=keys(2), fingerprint=FP.upper(), ttl_s=10, created_at=1000.0)
    assert p.expires_at == 1010.0 and p.fingerprint == FP
    assert not p.expired(1009.9) and p.expired(1010.0)
    assert Pin.from_json(p.to_json()) == p
    assert len(p.id) == 12 and Pin(keys=[], fingerprint=FP).id != p.id
    assert not Pin(keys=[], fingerprint=FP).expired(1e12)  # hard pin
    bads: list[dict[str, Any]] = [
        {"keys": ["xyz"]},
        {"tiers": ["gpu"]},
        {"tiers": []},
        {"ttl_s": 0},
        {"id": "a b"},
        {"fingerprint": "zz"},
    ]
    for bad in bads:
        with pytest.raises(ValueError):
            Pin.model_validate({"keys": [], "fingerprint": FP, **bad})
    # Unknown fields from a newer writer are ignored.
    assert Pin.from_json(p.to_json()[:-1] + ', "future": 1}') == p


def test_redact_url() -> None:
    assert redact_url("redis://:pw@h:6379/0") == "redis://h:6379/0"
    assert redact_url("rediss://bob:pw@h:6380/2?password=x") == "rediss://bob@h:6380/2"
    assert redact_url("unix://:pw@/run/redis.sock?db=1") == "unix:///run/redis.sock"
    assert redact_url("redis+cluster://u:p@h:7000") == "redis+cluster://u@h:7000"


# ------------------------------------------------------------------ redis specifics


def _count_executes(monkeypatch: pytest.MonkeyPatch, cls: type[Any]) -> list[int]:
    sizes: list[int] = []
    orig = cls.execute

    async def counting(self: Any, *a: Any, **kw: Any) -> Any:
        sizes.append(len(self))
        return await orig(self, *a, **kw)

    monkeypatch.setattr(cls, "execute", counting)
    return sizes


@pytest.mark.parametrize("backend", ["redis", "cluster"])
async def test_batch_locate_is_one_round_trip(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = request.getfixturevalue("redis_server" if backend == "redis" else "redis_cluster")
    d = RedisDirectory.from_url(srv.url, namespace="t" + uuid.uuid4().hex[:8])
    ks = keys(200, "batch")
    await d.heartbeat("n1", {}, ttl_s=30)
    await d.publish("n1", "dram", ks[::2], ttl_s=30)
    sizes = _count_executes(monkeypatch, Pipeline if backend == "redis" else ClusterPipeline)
    direct: list[Any] = []
    orig_cmd = d._r.execute_command

    async def spy(*a: Any, **kw: Any) -> Any:
        direct.append(a)
        return await orig_cmd(*a, **kw)

    monkeypatch.setattr(d._r, "execute_command", spy)
    got = await d.locate(ks)
    assert sizes == [201]  # one pipeline: the live-node set + one read per key
    assert direct == []
    assert got == [[Location("n1", "dram")] if i % 2 == 0 else [] for i in range(200)]
    await d.close()


async def test_key_schema(redis_server: Any) -> None:
    d = RedisDirectory.from_url(redis_server.url, namespace="tc")
    k = key(1)
    await d.heartbeat("n1", {}, ttl_s=30)
    await d.publish("n1", "nvme", [k], ttl_s=20)
    await d.add_pin(Pin(id="p1", keys=[k], fingerprint=FP))
    await d.incr_counters("n1", {"dram:hits": 1})
    r = aredis.Redis.from_url(redis_server.url, decode_responses=True)
    assert await r.zrange(f"tc:loc:{{{k}}}", 0, -1) == ["n1\x1fnvme"]
    assert 15_000 < await r.pttl(f"tc:loc:{{{k}}}") <= 20_000
    # A shorter publish by another node never shortens the key's life.
    await d.publish("n2", "dram", [k], ttl_s=2)
    assert await r.pttl(f"tc:loc:{{{k}}}") > 15_000
    assert set(await r.keys("{tc}:*")) >= {
        "{tc}:alive",
        "{tc}:nodes",
        "{tc}:pins",
        "{tc}:pinver",
        "{tc}:stats:n1",
        "{tc}:statnodes",
    }
    await r.aclose()
    await d.close()


async def test_pin_changes_are_published(redis_server: Any) -> None:
    d = RedisDirectory.from_url(redis_server.url, namespace="ps")
    r = aredis.Redis.from_url(redis_server.url, decode_responses=True)
    ps = r.pubsub()
    await ps.subscribe(d.pins_channel)
    await ps.get_message(timeout=1)  # subscribe confirmation
    await d.add_pin(Pin(id="p1", keys=[], fingerprint=FP))
    msg = await ps.get_message(ignore_subscribe_messages=True, timeout=2)
    assert msg is not None and msg["data"] == "add p1"
    await ps.aclose()
    await r.aclose()
    await d.close()


async def test_auth_and_no_credentials_in_messages(
    redis_server_auth: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    pw = redis_server_auth.password
    port = redis_server_auth.port
    good = RedisDirectory.from_url(redis_server_auth.url)
    await good.check()
    await good.heartbeat("n1", {}, ttl_s=30)
    await good.publish("n1", "dram", [key(0)], ttl_s=30)
    assert await good.locate([key(0)]) == [[Location("n1", "dram")]]
    assert pw not in repr(good)
    await good.close()

    for url in (f"redis://:wrong-{pw}@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
        m = Metrics()
        bad = RedisDirectory.from_url(url, metrics=m)
        with pytest.raises(DirectoryUnavailable) as ei:
            await bad.check()
        msg = str(ei.value)
        assert msg.startswith(f"cannot reach Redis at redis://127.0.0.1:{port}/0: ")
        assert "Authentication" in msg or "NOAUTH" in msg or "auth" in msg.lower()
        with pytest.raises(DirectoryUnavailable) as ei2:
            await bad.add_pin(Pin(keys=[], fingerprint=FP))
        # Reads degrade instead of raising.
        assert await bad.locate([key(0)]) == [[]]
        assert m.value(ERRORS, op="add_pin") == 1
        for text in (msg, str(ei2.value), repr(bad), repr(ei.value.__cause__)):
            assert pw not in text
        await bad.close()
    assert caplog.records, "expected the outage to be logged"
    for rec in caplog.records:
        assert pw not in rec.getMessage()


async def test_unix_socket_url(tmp_path: Path) -> None:
    exe = shutil.which("redis-server")
    assert exe is not None
    sock = tmp_path / "r.sock"
    args = [exe, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        d = RedisDirectory.from_url(f"unix://{sock}?db=3")
        await d.heartbeat("n1", {}, ttl_s=30)
        await d.publish("n1", "dram", [key(0)], ttl_s=30)
        assert await d.locate([key(0)]) == [[Location("n1", "dram")]]
        r = aredis.Redis(unix_socket_path=str(sock), db=3)
        assert await r.exists("{tc}:alive") == 1
        await r.aclose()
        await d.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_outage_degrades_queues_and_replays(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = Metrics()
    d = RedisDirectory.from_url(redis_server.url, metrics=m, retry_interval_s=0.3)
    before, during = keys(2, "before"), keys(3, "during")
    await d.heartbeat("n1", {"v": 1}, ttl_s=30)
    await d.publish("n1", "dram", before, ttl_s=30)
    await d.add_pin(Pin(id="keep", keys=before, fingerprint=FP))
    assert await d.pins_version() == 1
    assert [p.id for p in await d.list_pins()] == ["keep"]
    assert set(await d.nodes()) == {"n1"}

    redis_server.stop()
    t0 = time.monotonic()
    assert await d.locate(before) == [[], []]
    await d.publish("n1", "nvme", during, ttl_s=30)
    await d.heartbeat("n1", {"v": 2}, ttl_s=30)
    await d.incr_counters("n1", {"dram:hits": 4})
    await d.unpublish("n1", "dram", before[:1])
    assert time.monotonic() - t0 < 1.0  # fail fast, no per-call connect attempts
    # Last known values while down.
    assert set(await d.nodes()) == {"n1"}
    assert [p.id for p in await d.list_pins()] == ["keep"]
    assert (await d.get_pin("keep")) is not None
    assert await d.pins_version() == 1
    with pytest.raises(DirectoryUnavailable, match=r"redis://127\.0\.0\.1:\d+/0"):
        await d.add_pin(Pin(keys=[], fingerprint=FP))
    with pytest.raises(DirectoryUnavailable):
        await d.remove_pin("keep")
    assert d.pending_updates == 4
    for op in ("locate", "publish", "heartbeat", "incr_counters", "unpublish", "add_pin"):
        assert m.value(ERRORS, op=op) >= 1, op
    assert m.value(DROPPED) == 0

    # Inside the back-off window nothing touches the network.
    sizes = _count_executes(monkeypatch, Pipeline)
    assert await d.locate(during) == [[], [], []]
    assert sizes == []
    monkeypatch.undo()

    # Redis comes back empty (no persistence); the queue replays by itself, in order.
    redis_server.restart()

    async def replayed() -> bool:
        return d.pending_updates == 0 and (await d.locate(during))[0] != []

    await eventually(replayed)
    assert await d.locate(during) == [[Location("n1", "nvme")]] * 3
    assert (await d.nodes())["n1"]["v"] == 2
    assert await d.counters() == {"n1": {"dram:hits": 4}}
    await d.close()


async def test_queue_overflow_drops_oldest(redis_server: Any) -> None:
    m = Metrics()
    d = RedisDirectory.from_url(redis_server.url, metrics=m, max_pending=3, retry_interval_s=0.2)
    await d.heartbeat("n1", {}, ttl_s=30)
    redis_server.stop()
    ks = keys(5, "ovf")
    for k in ks:
        await d.publish("n1", "dram", [k], ttl_s=30)
    assert d.pending_updates == 3
    assert m.value(DROPPED) == 2
    redis_server.restart()

    async def drained() -> bool:
        return d.pending_updates == 0

    await eventually(drained)  # replayed by the background task, no call needed
    await d.heartbeat("n1", {}, ttl_s=30)  # the restarted Redis lost the old heartbeat
    got = await d.locate(ks)
    assert got == [[], []] + [[Location("n1", "dram")]] * 3
    await d.close()


async def test_close_with_redis_down_does_not_raise(redis_server: Any) -> None:
    m = Metrics()
    d = RedisDirectory.from_url(redis_server.url, metrics=m)
    redis_server.stop()
    await d.publish("n1", "dram", [key(0)], ttl_s=30)
    await d.close()
    await d.close()
    assert m.value(DROPPED) == 1
