"""Let no one in: a peer without the cluster secret reads nothing (the agent in a network
namespace of its own, asked from another address); an admin write without the token is
refused over the socket and from the CLI, and changes nothing; a chunk planted in NVMe or
S3 that fails its checks is never served."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import soak
from conftest import S3Server

from tiered_cache.netns import NetNodes


@pytest.mark.timeout(60)
def test_a_peer_without_the_secret_reads_nothing(tmp_path: Path, node: NetNodes) -> None:
    secret = b"faults-auth-peer-secret-0123456789"
    agent = soak.Agent(tmp_path, "peer", {
        "agent": {"peer_port": 7490, "peer_host": node.addr("agent"),
                  "peer_secret": secret.decode()},
    }, prefix=node.prefix("agent"))  # fmt: skip
    with soak.running(agent):
        key = soak.key_of("auth-peer", 0)
        c = agent.client()
        try:
            c.put_many([soak.item(key)])
        finally:
            c.close()
        addr = (node.addr("agent"), 7490)
        tries = soak.unauthorized_peer_reads(addr, key, secret)
        assert tries == dict.fromkeys(tries, 0)
        with contextlib.closing(soak.peer_connect(addr, secret)) as p:  # the control
            got = soak.peer_fetch(p, key)
        assert got is not None and bytes(soak.codec.decode(got)[1]) == soak.payload_of(key)


@pytest.mark.timeout(60)
def test_admin_writes_without_the_token_are_refused_and_change_nothing(tmp_path: Path) -> None:
    agent = soak.Agent(tmp_path, "admin", {"agent": {"auth_token": soak.ADMIN_TOKEN}})
    with soak.running(agent):
        key = soak.key_of("auth-admin", 0)
        c = agent.client()
        try:
            c.put_many([soak.item(key)])
            refused = soak.unauthorized_admin(agent, key)
            assert refused == dict.fromkeys(refused, 0)
            got = c.get_many([key], soak.FP.digest)[0]
            assert got is not None and bytes(got[1]) == soak.payload_of(key)
            c.admin("evict", key=key, token=soak.ADMIN_TOKEN)  # the control: with it, done
            assert c.get_many([key], soak.FP.digest)[0] is None
        finally:
            c.close()


@pytest.mark.timeout(60)
def test_damaged_or_misplaced_chunks_in_nvme_and_s3_are_never_served(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """Chunks planted with a payload that fails its checksum, or another key's genuine
    chunk under a key: refused from NVMe and from S3, and counted."""
    r = soak.phase_auth(tmp_path, s3_server.endpoint_url)
    for where in ("nvme", "s3"):
        for kind in ("bad_checksum", "other_key"):
            assert r["forged"][f"{where}_{kind}"] == 0, (where, kind)
    assert sum(r["refused_counts"].values()) >= 4  # each was read, and refused
    assert r["unauthorized_accepted"] == 0, (r["peer"], r["admin"])
    assert r["peer_with_secret_ok"] and r["admin_refused_chunk_still_there"]
