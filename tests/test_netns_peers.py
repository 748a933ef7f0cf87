"""Peer pulls between nodes at different addresses, with the shipped multi-node configs.

Each agent runs in its own network namespace (``tiered_cache.netns``), as real nodes do:
node addresses ``10.231.x.1`` and ``.2``, and Redis (``redis.internal``) and an S3 server
(``minio.internal``, moto) on the bridge at ``.254``. The shipped configs are used as
shipped for everything network: ``peer_host: 0.0.0.0``, ports 7480/9480, the host
names; only sizes and paths are shrunk to fit this machine. Agents on one host that bind
127.0.0.1 would hide an agent that publishes an address only it can use. The shipped
configs take the peer secret from ``${TC_PEER_SECRET}``: every agent here gets ``SECRET``.
"""

from __future__ import annotations

import copy
import os
import selectors
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import yaml

from tiered_cache import codec, ipc
from tiered_cache.agent import spawn_agent
from tiered_cache.agent.peers import CLIENT, NONCE_BYTES, SERVER, peer_mac
from tiered_cache.client import AgentClient
from tiered_cache.directory import RedisDirectory
from tiered_cache.keys import ModelFingerprint, chunk_keys
from tiered_cache.netns import NetNodes, unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
FP = ModelFingerprint("netns-test", chunk_size=256, block_size=16)
N = 1 << 20  # a 1 MiB payload per chunk
SECRET = b"netns-test-peer-secret-0123456789"  # TC_PEER_SECRET for every agent
ADMIN_TOKEN = "netns-test-admin-token-0123"  # TC_ADMIN_TOKEN, for the shipped configs


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
                    "dram": {"shm_name": f"tcns_{uuid.uuid4().hex[:10]}", "keep_on_stop": False},
                    "agent": {"socket": sock},
                }},
            })  # fmt: skip
        else:
            cfg = merge(cfg, {
                "dram": {"capacity": "64MiB", "shm_name": f"tcns_{uuid.uuid4().hex[:10]}",
                         "keep_on_stop": False},
                "nvme": {"path": str(self.tmp / f"{tag}-nvme"), "capacity": "1GiB"},
                "agent": {"socket": sock},
            })  # fmt: skip
        cfg = merge(cfg, over or {})
        path = self.tmp / f"{tag}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = dict(os.environ, PYTHONPATH=str(ROOT), REDIS_PASSWORD="",
                   TC_PEER_SECRET=SECRET.decode(), TC_ADMIN_TOKEN=ADMIN_TOKEN,
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
    env = pytest.MonkeyPatch()
    env.setenv("TC_PEER_SECRET", SECRET.decode())  # spawn_agent reads the config here too
    env.setenv("TC_ADMIN_TOKEN", ADMIN_TOKEN)  # the shipped configs' agent.auth_token
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
        env.undo()


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
    port, byte-exact, through the handshake (both have the secret), and the prefill node
    published its own address (not 0.0.0.0)."""
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
            handshake(s, SECRET)
            chunk = peer_ask(s, keys[0], raw=True)
            assert chunk is not None and bytes(codec.decode(chunk)[1]) == payload(0)
            assert peer_ask(s, keys[1], raw=False) == peer_ask(s, keys[1], raw=True)
            assert peer_ask(s, "f" * 32, raw=True) is None
            assert peer_ask(s, "f" * 32, raw=False) is None
    finally:
        p.close()
        d.close()


def exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        assert part, "peer closed the connection"
        buf += part
    return buf


def frame(s: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack("!I", exact(s, 4))
    msg: dict[str, Any] = msgpack.unpackb(exact(s, n))
    return msg


def handshake(s: socket.socket, secret: bytes) -> None:
    """The puller's side of the peer handshake, as a blocking client."""
    nc = os.urandom(NONCE_BYTES)
    s.sendall(ipc.pack({"op": "auth", "v": 1, "nonce": nc}))
    reply = frame(s)
    assert reply["ok"] and reply["mac"] == peer_mac(secret, SERVER, nc, reply["nonce"])
    s.sendall(ipc.pack({"op": "auth_proof", "mac": peer_mac(secret, CLIENT, nc, reply["nonce"])}))


def peer_ask(s: socket.socket, key: str, *, raw: bool) -> bytes | None:
    """One fetch from a peer port, as a blocking client: the chunk's bytes or None."""
    s.sendall(ipc.pack({"op": "fetch", "key": key, **({"raw": True} if raw else {})}))
    head = frame(s)
    assert head["ok"]
    if raw:
        return None if head["len"] < 0 else exact(s, head["len"])
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


# ---------------------------------------------------------------- peer port security

WRONG = b"another-clusters-peer-secret-987654321"


@dataclass
class Guarded:
    """A serving agent on ``third`` (prefill-node.yaml, its own node id and port, S3 off
    so that a chunk can come from nowhere but its peer port) holding ``keys``."""

    cluster: Cluster
    addr: tuple[str, int]
    client: AgentClient
    keys: list[str]

    def closed(self, reason: str) -> float:
        m = self.client.admin("stats")["metrics"]
        return float(m.get(f"tiered_cache_peer_connections_closed_total{{reason={reason}}}", 0))

    @contextmanager
    def puller(self, secret: bytes | None) -> Iterator[AgentClient]:
        """An agent on ``decode`` (no peer port of its own) with ``secret``."""
        proc, sock = self.cluster.agent("decode", "decode-node.yaml", {
            "node_id": f"puller-{uuid.uuid4().hex[:6]}", "s3": {"enabled": False},
            "agent": {"peer_port": None, "metrics_port": None,
                      "peer_secret": None if secret is None else secret.decode()},
        })  # fmt: skip
        d = AgentClient(sock)
        try:
            yield d
        finally:
            d.close()
            proc.terminate()
            proc.wait(30)

    def pulls(self, secret: bytes | None) -> list[bytes | None]:
        """What a fresh puller with ``secret`` gets of ``keys`` (the directory names this
        agent as their only holder)."""
        with self.puller(secret) as d:
            assert d.lookup(self.keys) == ["peer"] * len(self.keys)
            got = d.get_many(self.keys, FP.digest)
            return [bytes(g[1]) if g else None for g in got]


@contextmanager
def guarded(cluster: Cluster, port: int, agent: dict[str, Any] | None = None) -> Iterator[Guarded]:
    proc, sock = cluster.agent("third", "prefill-node.yaml", {
        "node_id": f"guarded-{uuid.uuid4().hex[:6]}", "s3": {"enabled": False},
        "agent": {"peer_port": port, "metrics_port": None, **(agent or {})},
    })  # fmt: skip
    c = AgentClient(sock)
    keys = chunk_keys(np.arange(256 * 2) + port, FP)
    try:
        c.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)])
        yield Guarded(cluster, (cluster.net.addr("third"), port), c, keys)
    finally:
        c.close()
        proc.terminate()
        proc.wait(30)


def until_closed(s: socket.socket, timeout: float = 20.0) -> bytes:
    """Everything the server sends until it closes the connection. Times out (failing the
    test) if it keeps the connection open."""
    s.settimeout(timeout)
    got = b""
    while True:
        try:
            part = s.recv(1 << 16)
        except ConnectionResetError:  # closed with our unread bytes in its buffer
            return got
        if not part:
            return got
        got += part


def refusal(data: bytes) -> dict[str, Any]:
    """The one frame a refused client gets: an error, no chunk."""
    (n,) = struct.unpack("!I", data[:4])
    assert len(data) == 4 + n, "more than one frame"
    msg: dict[str, Any] = msgpack.unpackb(data[4:])
    assert msg["ok"] is False and "authentication" in msg["error"]
    return msg


def test_a_client_without_the_secret_reads_nothing(cluster: Cluster) -> None:
    """With agent.peer_secret (from ${TC_PEER_SECRET}), a client that skips the handshake
    or holds another secret gets no chunk, only a refusal, and the connection closed; an
    agent with another secret or none pulls nothing (a miss); each is counted."""
    with guarded(cluster, 7481) as g:
        with socket.create_connection(g.addr, timeout=10) as s:  # straight to a fetch
            s.sendall(ipc.pack({"op": "fetch", "key": g.keys[0], "raw": True}))
            refusal(until_closed(s))
        with socket.create_connection(g.addr, timeout=10) as s:  # another secret
            nc = os.urandom(NONCE_BYTES)
            s.sendall(ipc.pack({"op": "auth", "v": 1, "nonce": nc}))
            reply = frame(s)  # the server proves its key: not one the client knows
            assert reply["mac"] != peer_mac(WRONG, SERVER, nc, reply["nonce"])
            proof = peer_mac(WRONG, CLIENT, nc, reply["nonce"])
            s.sendall(ipc.pack({"op": "auth_proof", "mac": proof})
                      + ipc.pack({"op": "fetch", "key": g.keys[0], "raw": True}))  # fmt: skip
            refusal(until_closed(s))
        assert g.closed("auth_failed") == 2
        assert g.pulls(WRONG) == [None, None]
        assert g.pulls(None) == [None, None]
        assert g.closed("auth_failed") >= 4
        assert g.pulls(SECRET) == [payload(0), payload(1)]


def test_an_oversized_request_is_refused_unread(cluster: Cluster) -> None:
    """A frame announcing more than a request can be (1 MiB; 1 KiB in the handshake) is
    refused before its body is read: the connection closes at once, and the agent serves on."""
    with guarded(cluster, 7482) as g:
        with socket.create_connection(g.addr, timeout=10) as s:
            s.sendall(struct.pack("!I", 2**31 - 1))  # 2 GiB, before the handshake
            assert until_closed(s) == b""
        with socket.create_connection(g.addr, timeout=10) as s:
            handshake(s, SECRET)
            s.sendall(struct.pack("!I", 2**20 + 1) + b"\x80" * 1000)
            assert until_closed(s) == b""
        assert g.closed("frame_too_large") == 2
        assert g.pulls(SECRET) == [payload(0), payload(1)]


def test_idle_sockets_beyond_the_cap_do_not_lock_a_peer_out(cluster: Cluster) -> None:
    """1,000 sockets that never authenticate, against a cap of 8 and timeouts far longer
    than the test: all but 8 are closed at once, and a puller with the secret still gets
    its chunks (an unauthenticated connection makes room for a new one at the cap)."""
    import resource

    want = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want + 200:
        if hard != resource.RLIM_INFINITY and hard < want + 200:
            pytest.skip(f"needs {want + 200} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want + 200, hard))
    agent = {"peer_max_connections": 8, "peer_handshake_timeout_s": 300,
             "peer_idle_timeout_s": 300}  # fmt: skip
    with guarded(cluster, 7483, agent) as g:
        socks = [socket.create_connection(g.addr, timeout=10) for _ in range(want)]
        try:
            sel = selectors.DefaultSelector()
            for s in socks:
                sel.register(s, selectors.EVENT_READ)
            closed = 0
            while closed < want - 8:  # each EOF is the server closing one
                events = sel.select(timeout=30)
                assert events, f"only {closed} of {want} idle sockets closed"
                for key, _ in events:
                    assert until_closed(key.fileobj, 5) == b""  # type: ignore[arg-type]
                    sel.unregister(key.fileobj)
                    closed += 1
            assert g.pulls(SECRET) == [payload(0), payload(1)]
            assert g.closed("over_cap") >= want - 8
        finally:
            for s in socks:
                s.close()


def test_idle_connections_are_closed_after_their_timeout(cluster: Cluster) -> None:
    """No handshake within peer_handshake_timeout_s, or no complete request within
    peer_idle_timeout_s (idle, or half a frame sent): the server closes the connection."""
    agent = {"peer_handshake_timeout_s": 1, "peer_idle_timeout_s": 1.5}
    with guarded(cluster, 7484, agent) as g:
        cases = {"handshake": 0.9, "idle": 1.4, "half a frame": 1.4}
        for case, at_least in cases.items():
            with socket.create_connection(g.addr, timeout=10) as s:
                if case != "handshake":
                    handshake(s, SECRET)
                if case == "half a frame":
                    s.sendall(struct.pack("!I", 100) + b"\x80" * 10)
                t0 = time.monotonic()
                assert until_closed(s) == b""
                assert time.monotonic() - t0 >= at_least, case
        assert g.closed("handshake_timeout") == 1
        assert g.closed("idle_timeout") == 2


def test_an_agent_without_a_secret_warns_once_that_its_port_is_open(cluster: Cluster) -> None:
    """No peer_secret, a non-loopback peer port and a shared directory: the agent still
    serves anyone (as before), and says so once at start."""
    proc, sock = cluster.agent("third", "prefill-node.yaml", {
        "node_id": f"open-{uuid.uuid4().hex[:6]}", "s3": {"enabled": False},
        "agent": {"peer_port": 7485, "metrics_port": None, "peer_secret": None},
    })  # fmt: skip
    c = AgentClient(sock)
    try:
        (key,) = chunk_keys(np.arange(256) + 7485, FP)
        c.put_many([(meta(key), payload(0))])
        with socket.create_connection((cluster.net.addr("third"), 7485), timeout=10) as s:
            chunk = peer_ask(s, key, raw=True)
            assert chunk is not None and bytes(codec.decode(chunk)[1]) == payload(0)
    finally:
        c.close()
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert out.count("is unauthenticated") == 1, out
