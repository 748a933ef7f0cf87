"""A hung peer must not stall the engine (issue 15, item 7).

Each agent runs in its own network namespace (``tiered_cache.netns``), the hung peer in
another: ``tests/hung_peer.py``, a peer port that passes the handshake and then hangs
mid-reply (half a chunk sent, then nothing). The directory (Redis, on the bridge) names it
as the only holder of the test's chunks. Shown here: one read pays the fetch timeout once,
then the peer's breaker is open and reads and lookups skip it at once until a background
probe finds it healthy; and a save proceeds while a get of the same client is stuck.
"""

from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tiered_cache import codec
from tiered_cache.agent import spawn_agent
from tiered_cache.client import AgentClient
from tiered_cache.directory import RedisDirectory
from tiered_cache.keys import ModelFingerprint, chunk_keys
from tiered_cache.netns import NetNodes, unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
FP = ModelFingerprint("breaker-test", chunk_size=256, block_size=16)
N = 1 << 20
SECRET = "breaker-test-peer-secret-0123456789"
PEER_PORT = 7490


@dataclass
class Net:
    net: NetNodes
    tmp: Path
    redis_port: int


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"multi-node tests need network namespaces: {why}")
    from conftest import _spawn_redis, free_port

    tmp = tmp_path_factory.mktemp("breaker")
    nodes = NetNodes(["decode", "hung"], hosts={"redis.internal": "host"})
    redis = None
    try:
        port = free_port()
        redis = _spawn_redis(port, bind=nodes.host_ip)
        yield Net(nodes, tmp, port)
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait(10)
        nodes.close()


def meta(key: str) -> codec.ChunkMeta:
    return codec.ChunkMeta(key=key, fingerprint=FP.digest, num_tokens=256, dtype="uint8",
                           shape=(N,), kv_layout="LBHNC", block_size=16)  # fmt: skip


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 255, N, dtype=np.uint8).tobytes()


class HungPeer:
    """tests/hung_peer.py on the ``hung`` node, published in the directory as node
    ``node_id`` holding ``keys`` in its DRAM."""

    def __init__(self, n: Net, keys: list[str]) -> None:
        self.node_id = f"hung-{uuid.uuid4().hex[:6]}"
        chunks = n.tmp / self.node_id
        chunks.mkdir()
        for i, k in enumerate(keys):
            # Signed as a writer of this cluster signs (codec.py: a keyed MAC).
            blob = codec.encode(meta(k), payload(i), mac_key=codec.chunk_mac_key(SECRET.encode()))
            (chunks / k).write_bytes(blob)
        self.proc = subprocess.Popen(
            [*n.net.prefix("hung"), sys.executable, str(ROOT / "tests" / "hung_peer.py"),
             str(PEER_PORT), SECRET, str(chunks)],
            env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(ROOT), text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next_line() == "listening"
        url = f"redis://{n.net.host_ip}:{n.redis_port}/0"
        asyncio.run(self._publish(url, [n.net.addr("hung"), PEER_PORT], keys))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def next_line(self, timeout: float = 30.0) -> str:
        return self.lines.get(timeout=timeout)

    def wait_fetch(self, key: str) -> None:
        """Until the peer has received a fetch of ``key`` (it is now hanging on it)."""
        while self.next_line() != f"fetch {key}":
            pass

    def heal(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("heal\n")
        self.proc.stdin.flush()

    async def _publish(self, url: str, peer: list[Any], keys: list[str]) -> None:
        d = RedisDirectory.from_url(url)
        try:
            await d.heartbeat(self.node_id, {"peer": peer}, 600)
            await d.publish(self.node_id, "dram", keys, 600)
            await d.flush()
        finally:
            await d.close()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def hung(net: Net) -> Iterator[tuple[HungPeer, list[str]]]:
    keys = chunk_keys(np.arange(256 * 6) + int(uuid.uuid4().int % 10_000), FP)
    p = HungPeer(net, keys)
    try:
        yield p, keys
    finally:
        p.close()


@contextmanager
def decode_agent(n: Net, fetch_timeout_s: float) -> Iterator[str]:
    """An agent on the ``decode`` node (no peer port, no lower tiers: a chunk comes from
    its DRAM or the peer, else it is a miss). Yields its socket."""
    tag = uuid.uuid4().hex[:6]
    sock = str(n.tmp / f"decode-{tag}.sock")
    cfg = {
        "node_id": f"decode-{tag}",
        "redis_url": f"redis://redis.internal:{n.redis_port}/0",
        "dram": {"capacity": "64MiB", "shm_name": f"tcns_{tag}", "keep_on_stop": False},
        "agent": {"socket": sock, "peer_secret": SECRET,
                  "peer_fetch_timeout_s": fetch_timeout_s},
    }  # fmt: skip
    path = n.tmp / f"decode-{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = spawn_agent(path, timeout=60, prefix=n.net.prefix("decode"), cwd=str(ROOT),
                       env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        yield sock
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def load(c: AgentClient, keys: list[str]) -> tuple[list[bool], list[str], float]:
    t0 = time.monotonic()
    rep = c.load_report(keys, FP.digest, lambda *_: None)
    return rep.ok, rep.sources, time.monotonic() - t0


def stat(c: AgentClient, name: str) -> float:
    return float(c.admin("stats")["metrics"].get(name, 0))


def test_a_hung_peer_costs_one_timeout_then_reads_skip_it_until_it_heals(
    net: Net, hung: tuple[HungPeer, list[str]]
) -> None:
    peer, keys = hung
    timeout = 1.5
    with decode_agent(net, timeout) as sock:
        c = AgentClient(sock, timeout=60)
        try:
            assert c.lookup(keys[:1]) == ["peer"]
            ok, _, dt = load(c, keys[:1])
            print(f"first read: {dt:.3f} s")  # figures for docs/operations.md (pytest -s)
            # The fetch timeout once: no second try against a peer that let it pass.
            assert ok == [False] and timeout * 0.9 <= dt < 2 * timeout, dt
            assert stat(c, "tiered_cache_read_errors_total{tier=peer}") == 1
            # The breaker is open: lookups no longer offer the peer, reads skip it at once.
            assert c.lookup(keys) == []
            for k in keys[1:]:
                ok, _, dt = load(c, [k])
                print(f"read while the breaker is open: {dt * 1e3:.1f} ms")
                assert ok == [False] and dt < 0.3, dt
            assert stat(c, "tiered_cache_read_errors_total{tier=peer}") == 1
            assert stat(c, "tiered_cache_peer_fetches_skipped_total") >= len(keys)
            # Healed, the peer answers a probe, its breaker closes, and reads use it again.
            peer.heal()
            deadline = time.monotonic() + 90
            # Only asking shows the breaker closed (a lookup also starts a due probe).
            while c.lookup(keys) != ["peer"] * len(keys):
                assert time.monotonic() < deadline, "the breaker never closed"
                time.sleep(0.05)
            ok, sources, _ = load(c, keys)
            assert ok == [True] * len(keys) and sources == ["peer"] * len(keys)
        finally:
            c.close()


def test_a_save_proceeds_while_a_get_of_the_same_client_is_stuck(
    net: Net, hung: tuple[HungPeer, list[str]]
) -> None:
    """The forward pass saves layer by layer (reserve, copy, commit) while the loader
    thread's get waits on the hung peer: the save must not queue behind the get."""
    peer, keys = hung
    with decode_agent(net, 30.0) as sock:
        c = AgentClient(sock, timeout=60)
        other = AgentClient(sock, attach_pool=False)
        got: list[list[bool]] = []
        loader = threading.Thread(target=lambda: got.append(load(c, keys[:1])[0]))
        try:
            loader.start()
            peer.wait_fetch(keys[0])  # the agent is stuck in the fetch: so is the get
            mine = chunk_keys(np.arange(256 * 2) + 99_999, FP)
            c.put_many([(meta(mine[0]), payload(7))])  # the staged path
            res = c.reserve_payloads([N])  # the zero-copy, layer-wise path
            assert res is not None
            res.views[0][:] = payload(8)
            c.commit_payloads(res, [meta(mine[1])])
            assert loader.is_alive(), "the get ended first: nothing was shown"
            assert other.lookup(mine) == ["dram", "dram"]
            assert [bytes(g[1]) for g in other_get(sock, mine)] == [payload(7), payload(8)]
        finally:
            peer.close()  # ends the stuck fetch
            loader.join(60)
            c.close()
            other.close()
        assert got == [[False]]


def other_get(sock: str, keys: list[str]) -> list[Any]:
    c = AgentClient(sock)
    try:
        out = c.get_many(keys, FP.digest)
        assert all(g is not None for g in out)
        return out
    finally:
        c.close()
