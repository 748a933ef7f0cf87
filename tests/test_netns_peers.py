"""Peer pulls between nodes at different addresses, with the shipped multi-node configs.

Each agent runs in its own network namespace (``tiered_cache.netns``), as real nodes do:
node addresses ``10.231.x.1`` and ``.2``, and Redis (``redis.internal``) and an S3 server
(``minio.internal``, moto) on the bridge at ``.254``. The shipped configs are used as
shipped for everything network: ``peer_host: 0.0.0.0``, ports 7480/9480, the host
names; only sizes and paths are shrunk to fit this machine. Agents on one host that bind
127.0.0.1 would hide an agent that publishes an address only it can use.
"""

from __future__ import annotations

import copy
import os
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import yaml

from tiered_cache import codec, ipc
from tiered_cache.agent import spawn_agent
from tiered_cache.client import AgentClient
from tiered_cache.directory import RedisDirectory
from tiered_cache.keys import ModelFingerprint, chunk_keys
from tiered_cache.netns import NetNodes, unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
FP = ModelFingerprint("netns-test", chunk_size=256, block_size=16)
N = 1 << 20  # a 1 MiB payload per chunk


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class Cluster:
    net: NetNodes
    tmp: Path
    redis_url: str  # as the root namespace reaches it
    procs: list[subprocess.Popen[str]]

    def agent(
        self, node: str, shipped: str, over: dict[str, Any] | None = None, *, wait: bool = True
    ) -> tuple[subprocess.Popen[str], str]:
        """Start an agent on ``node`` from the shipped config ``configs/<shipped>``, with
        sizes and paths shrunk (and ``over`` applied). Returns (process, socket)."""
        cfg = yaml.safe_load((ROOT / "configs" / shipped).read_text())
        tag = f"{node}-{uuid.uuid4().hex[:6]}"
        sock = str(self.tmp / f"{tag}.sock")
        if "extra_config" in cfg:  # LMCache's format: our settings under tiered_cache
            cfg = merge(cfg, {
                "max_local_cpu_size": 1, "max_local_disk_size": 1,
                "local_disk": f"file://{self.tmp / tag}-nvme/",
                "extra_config": {"tiered_cache": {
                    "dram": {"shm_name": f"tcns_{uuid.uuid4().hex[:10]}"},
                    "agent": {"socket": sock},
                }},
            })  # fmt: skip
        else:
            cfg = merge(cfg, {
                "dram": {"capacity": "64MiB", "shm_name": f"tcns_{uuid.uuid4().hex[:10]}"},
                "nvme": {"path": str(self.tmp / f"{tag}-nvme"), "capacity": "1GiB"},
                "agent": {"socket": sock},
            })  # fmt: skip
        cfg = merge(cfg, over or {})
        path = self.tmp / f"{tag}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = dict(os.environ, PYTHONPATH=str(ROOT), REDIS_PASSWORD="",
                   AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")  # fmt: skip
        if not wait:
            p = subprocess.Popen(
                [*self.net.prefix(node), sys.executable, "-m", "tiered_cache.cli", "agent",
                 "-c", str(path)], env=env, cwd=str(ROOT), text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )  # fmt: skip
        else:
            p = spawn_agent(path, timeout=60, prefix=self.net.prefix(node), env=env,
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
        self.procs.append(p)
        return p, sock


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"multi-node tests need network namespaces: {why}")
    from conftest import _spawn_redis
    from moto.server import ThreadedMotoServer

    tmp = tmp_path_factory.mktemp("netns")
    net = NetNodes(["prefill", "decode", "third"],
                   hosts={"redis.internal": "host", "minio.internal": "host"})  # fmt: skip
    procs: list[subprocess.Popen[str]] = []
    redis = moto = None
    try:
        redis = _spawn_redis(6379, bind=net.host_ip)  # redis.internal:6379, as shipped
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        moto = ThreadedMotoServer(ip_address=net.host_ip, port=9000, verbose=False)
        moto.start()  # minio.internal:9000, as shipped
        import boto3

        boto3.client(
            "s3", endpoint_url=f"http://{net.host_ip}:9000", region_name="us-east-1"
        ).create_bucket(Bucket="kv-cache")
        yield Cluster(net, tmp, f"redis://{net.host_ip}:6379/0", procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        if moto is not None:
            moto.stop()
        if redis is not None:
            redis.terminate()
            redis.wait(10)
        net.close()


def meta(key: str) -> codec.ChunkMeta:
    return codec.ChunkMeta(key=key, fingerprint=FP.digest, num_tokens=256, dtype="uint8",
                           shape=(N,), kv_layout="LBHNC", block_size=16)  # fmt: skip


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 255, N, dtype=np.uint8).tobytes()


def heartbeat_peer(redis_url: str, node_id: str) -> list[Any] | None:
    import asyncio

    async def go() -> Any:
        d = RedisDirectory.from_url(redis_url)
        try:
            return (await d.nodes()).get(node_id, {}).get("peer")
        finally:
            await d.close()

    return asyncio.run(go())  # type: ignore[no-any-return]


def test_decode_node_pulls_every_chunk_from_its_peer(cluster: Cluster) -> None:
    """Prefill and decode agents from configs/prefill-node.yaml and decode-node.yaml, each
    in its own namespace: the decode node pulls all 6 chunks from the prefill node's peer
    port, byte-exact, and the prefill node published its own address (not 0.0.0.0)."""
    net = cluster.net
    _, psock = cluster.agent("prefill", "prefill-node.yaml")
    _, dsock = cluster.agent("decode", "decode-node.yaml")
    assert heartbeat_peer(cluster.redis_url, "prefill-0") == [net.addr("prefill"), 7480]
    assert heartbeat_peer(cluster.redis_url, "decode-0") == [net.addr("decode"), 7480]
    keys = chunk_keys(np.arange(256 * 6) + 11, FP)
    p = AgentClient(psock)
    d = AgentClient(dsock)
    try:
        p.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)])
        assert d.lookup(keys) == ["peer"] * 6
        rep = d.load_report(keys, FP.digest, lambda *_: None)
        assert rep.ok == [True] * 6 and rep.sources == ["peer"] * 6
        got = d.get_many(keys, FP.digest)  # now from its own DRAM (promoted)
        assert [bytes(g[1]) if g else None for g in got] == [payload(i) for i in range(6)]
        ds = d.admin("stats")["metrics"]
        assert ds["tiered_cache_hits_total{tier=peer}"] == 6
        assert p.admin("stats")["metrics"]["tiered_cache_peer_transfers_total{direction=out}"] == 6
        # The wire, from another address: a chunk as raw bytes after its reply frame, or
        # (for a puller from before raw replies) inside it; a chunk it lacks is no bytes.
        with socket.create_connection((net.addr("prefill"), 7480), timeout=10) as s:
            chunk = peer_ask(s, keys[0], raw=True)
            assert chunk is not None and bytes(codec.decode(chunk)[1]) == payload(0)
            assert peer_ask(s, keys[1], raw=False) == peer_ask(s, keys[1], raw=True)
            assert peer_ask(s, "f" * 32, raw=True) is None
            assert peer_ask(s, "f" * 32, raw=False) is None
    finally:
        p.close()
        d.close()


def peer_ask(s: socket.socket, key: str, *, raw: bool) -> bytes | None:
    """One fetch from a peer port, as a blocking client: the chunk's bytes or None."""

    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            part = s.recv(n - len(buf))
            assert part, "peer closed the connection"
            buf += part
        return buf

    s.sendall(ipc.pack({"op": "fetch", "key": key, **({"raw": True} if raw else {})}))
    (n,) = struct.unpack("!I", exact(4))
    head = msgpack.unpackb(exact(n))
    assert head["ok"]
    if raw:
        return None if head["len"] < 0 else exact(head["len"])
    data = head["data"]
    return None if data is None else bytes(data)


@pytest.mark.parametrize(
    "shipped", ["multi-node.yaml", "lmcache-multi-node.yaml", "lmcache-prefill-node.yaml",
                "lmcache-decode-node.yaml"],
)  # fmt: skip
def test_shipped_multinode_configs_publish_a_reachable_address(
    cluster: Cluster, shipped: str
) -> None:
    """Every shipped multi-node config, started as shipped (peer_host 0.0.0.0), publishes
    the node's own address. multi-node.yaml's Redis is TLS with a password, which this
    machine's redis-server does not serve: only its redis_url is replaced."""
    over: dict[str, Any] = {}
    if shipped == "multi-node.yaml":
        over = {"redis_url": "redis://redis.internal:6379/0", "s3": {"enabled": False}}
    elif shipped == "lmcache-multi-node.yaml":
        over = {"remote_url": None, "extra_config": {
            "tiered_cache": {"redis_url": "redis://redis.internal:6379/0"}}}  # fmt: skip
    proc, sock = cluster.agent("third", shipped, over)
    node_id = AgentClient(sock, attach_pool=False).node_id
    try:
        assert heartbeat_peer(cluster.redis_url, node_id) == [cluster.net.addr("third"), 7480]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"agent": {"peer_host": "127.0.0.1"}}, "loopback address"),
        ({"agent": {"advertise_host": "127.0.0.1"}}, "loopback address"),
        ({"agent": {"advertise_host": "0.0.0.0"}}, "wildcard"),
    ],
    ids=["loopback-bind", "loopback-advertised", "wildcard-advertised"],
)
def test_unreachable_address_is_a_startup_error(
    cluster: Cluster, over: dict[str, Any], says: str
) -> None:
    """With a directory other hosts share, an agent refuses to publish an address only
    it could use, with one clear error at start-up."""
    proc, _ = cluster.agent("third", "prefill-node.yaml", over, wait=False)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert says in out and "advertise_host" in out
    assert "Traceback" not in out


def test_advertised_address_can_be_set(cluster: Cluster) -> None:
    proc, _ = cluster.agent(
        "third", "decode-node.yaml",
        {"node_id": "decode-9", "agent": {"advertise_host": cluster.net.addr("third")}},
    )  # fmt: skip
    try:
        assert heartbeat_peer(cluster.redis_url, "decode-9") == [cluster.net.addr("third"), 7480]
    finally:
        proc.terminate()
        proc.wait(30)
