"""The peer port's guard, in one process over loopback (no root needed): the handshake
between a puller and a peer server with the same secret, another one or none; refusals
logged once a minute however many; pooled connections the peer closed are not reused; the
secret's config checks. The same over real network namespaces: tests/test_netns_peers.py."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import yaml
from helpers_agent import meta, payload

from tiered_cache import codec
from tiered_cache.agent.node import NodeAgent
from tiered_cache.agent.peers import PeerAuthError, PeerGate, _pooled
from tiered_cache.config import AgentConfig, ConfigError, load_config
from tiered_cache.metrics import Metrics

SECRET = "peer-auth-test-secret-0123456789"


@asynccontextmanager
async def started(
    tmp: Path, secret: str | None, serve: bool, nvme: bool = False
) -> AsyncIterator[NodeAgent]:
    tag = uuid.uuid4().hex[:8]
    port = 0 if serve else None
    cfg: dict[str, object] = {
        "node_id": f"pa-{tag}",
        "dram": {"capacity": "4MiB", "shm_name": f"tcpa_{tag}"},
        "agent": {"socket": str(tmp / f"{tag}.sock"), "peer_port": port, "peer_secret": secret},
    }
    if nvme:
        cfg["nvme"] = {"enabled": True, "path": str(tmp / f"nvme-{tag}"), "capacity": "16MiB"}
    agent = NodeAgent(load_config(cfg))
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()


@asynccontextmanager
async def pair(
    tmp: Path, server: str | None, puller: str | None
) -> AsyncIterator[tuple[NodeAgent, NodeAgent, str]]:
    """A serving agent (holding chunk ``k``, returned) and a puller that knows its address."""
    async with started(tmp, server, True) as srv, started(tmp, puller, False) as pul:
        key = "ab" * 16
        await srv.store.put(key, codec.encode(meta(key), payload(1)))
        assert srv.peer_address is not None
        pul._peer_addrs[srv.cfg.node_id] = srv.peer_address
        yield srv, pul, key


def closed(agent: NodeAgent, reason: str) -> float:
    return agent.metrics.value("tiered_cache_peer_connections_closed_total", reason=reason)


async def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Until ``cond()`` (the other side of a connection runs on this loop too)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_puller_with_the_secret_gets_the_chunk_over_one_pooled_connection(
    tmp_path: Path,
) -> None:
    async with pair(tmp_path, SECRET, SECRET) as (srv, pul, key):
        for _ in range(3):
            got = await pul._peer_fetch(key, srv.cfg.node_id)
            assert got is not None
            assert bytes(codec.decode(got[0], expect_key=key)[1]) == payload(1)
        assert len(pul._peer_idle[srv.cfg.node_id]) == 1  # one handshake for the three
        assert closed(srv, "auth_failed") == 0


@pytest.mark.parametrize(
    ("server", "puller", "says"),
    [
        (SECRET, "x" * 32, "its agent.peer_secret differs"),
        (SECRET, None, "peer authentication failed"),
        (None, SECRET, "has no agent.peer_secret"),
    ],
    ids=["another-secret", "puller-without", "server-without"],
)
async def test_a_failed_handshake_is_a_failed_fetch_never_data(
    tmp_path: Path, server: str | None, puller: str | None, says: str
) -> None:
    async with pair(tmp_path, server, puller) as (srv, pul, key):
        with pytest.raises(PeerAuthError, match=says):
            await pul._peer_fetch(key, srv.cfg.node_id)
        assert not pul._peer_idle[srv.cfg.node_id]  # the connection is not pooled
        if server is not None:  # one attempt: no retry against the same secret
            await eventually(lambda: closed(srv, "auth_failed") > 0)
            assert closed(srv, "auth_failed") == 1


def test_a_flood_of_refusals_is_counted_each_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = Metrics()
    gate = PeerGate(AgentConfig.model_validate({"peer_secret": SECRET}), m)
    with caplog.at_level(logging.WARNING, logger="tiered_cache.agent"):
        for i in range(500):
            gate.closed("auth_failed", f"10.0.0.9:{i}")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "10.0.0.9:0" in lines[0] and "handshake" in lines[0]
    assert m.value("tiered_cache_peer_connections_closed_total", reason="auth_failed") == 500


def test_a_pooled_connection_the_peer_closed_is_dropped_not_reused() -> None:
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    for s in (a, c):
        s.setblocking(False)
    b.close()  # the peer closed a (its idle timeout)
    try:
        assert _pooled([c, a]) is c  # a (taken first) is dropped; c is open and in step
        assert a.fileno() == -1
        d.sendall(b"x")  # bytes nobody asked for: out of step
        assert _pooled([c]) is None and c.fileno() == -1
    finally:
        for s in (a, c, d):
            s.close()


@pytest.mark.parametrize(
    ("value", "says"),
    [("${TC_PEER_SECRET_UNSET}", "TC_PEER_SECRET_UNSET"), ("short", "at least 16 characters")],
)
def test_a_bad_peer_secret_is_a_config_error_naming_the_key(
    tmp_path: Path, value: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TC_PEER_SECRET_UNSET", raising=False)
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"agent": {"peer_secret": value}}))
    with pytest.raises(ConfigError, match=says) as e:
        load_config(p)
    assert "peer_secret" in str(e.value)


def test_the_secret_stays_out_of_reprs(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config({"agent": {"peer_secret": SECRET}})
    assert SECRET not in repr(cfg) and SECRET not in str(cfg.agent)
    assert cfg.agent.peer_secret is not None
    assert cfg.agent.peer_secret.get_secret_value() == SECRET


@pytest.mark.parametrize("bad", ["zz", "AB" * 16, "ab" * 16 + "\n", "ab" * 17])
async def test_a_fetch_of_a_malformed_key_is_a_miss_on_a_connection_that_serves_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: str
) -> None:
    """An authenticated peer asking for a malformed key gets a miss, not a dropped
    connection with a logged traceback (one bad frame, at most one log line)."""
    from tiered_cache.agent.peers import _connect, _read_chunk, peer_handshake
    from tiered_cache.ipc import pack

    loop = asyncio.get_running_loop()
    async with started(tmp_path, SECRET, True, nvme=True) as srv:  # NVMe checks keys
        key = "ab" * 16
        await srv.store.put(key, codec.encode(meta(key), payload(1)))
        assert srv.peer_address is not None
        sock = await _connect(loop, srv.peer_address)
        try:
            await peer_handshake(loop, sock, SECRET.encode())
            with caplog.at_level(logging.WARNING):
                await loop.sock_sendall(sock, pack({"op": "fetch", "key": bad, "raw": True}))
                assert await _read_chunk(loop, sock) is None
                await loop.sock_sendall(sock, pack({"op": "fetch", "key": key, "raw": True}))
                got = await _read_chunk(loop, sock)
        finally:
            sock.close()
        assert got is not None and bytes(codec.decode(got, expect_key=key)[1]) == payload(1)
        assert not [r for r in caplog.records if r.name.startswith("tiered_cache")]
