"""Forged KV is refused (issue 15, item 3): with ``agent.peer_secret`` set, a writer signs
each chunk with the cluster's chunk key (HMAC-SHA256 over header and payload), and
every copy read from NVMe, S3 or a peer must carry a valid MAC. A forger who knows the
format (and recomputes both checksums) gets nothing loaded: the copy is a miss, counted in
``tiered_cache_forged_chunks_total{tier}``. Real agents (in-process), a real NVMe
directory and moto's S3 server; nodes share the bucket as a cluster does."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import xxhash
from conftest import S3Server
from helpers_agent import FP, meta, payload

from tiered_cache import codec
from tiered_cache.agent import EmbeddedAgent
from tiered_cache.agent.node import NodeAgent
from tiered_cache.client import AgentClient
from tiered_cache.config import load_config
from tiered_cache.keys import chunk_keys

X = "cluster-x-secret-0123456789abcdef"
Y = "cluster-y-secret-fedcba9876543210"
KX = codec.chunk_mac_key(X.encode())
_SUM_AT = codec._FIXED.size - 8  # payload_xxh3: the last field of the fixed part
_TOKENS_AT = 44  # num_tokens: after magic, version, header_len, flags, fingerprint, key


def forge(blob: bytes, *, payload_byte: int | None = None, tokens: int | None = None) -> bytes:
    """What a writer without the key can do: change the payload or a header field, then
    recompute the payload checksum and the header checksum (the MAC it cannot)."""
    b = bytearray(blob)
    if payload_byte is not None:
        b[codec.HEADER_SIZE + payload_byte] ^= 0xFF
        struct.pack_into("<Q", b, _SUM_AT, xxhash.xxh3_64_intdigest(bytes(b[codec.HEADER_SIZE :])))
    if tokens is not None:
        struct.pack_into("<I", b, _TOKENS_AT, tokens)
    body = bytes(b[: codec.HEADER_SIZE - 4])
    struct.pack_into("<I", b, codec.HEADER_SIZE - 4, xxhash.xxh32_intdigest(body))
    return bytes(b)


# ---------------------------------------------------------------- the format


def test_a_signed_chunk_reads_with_its_key_and_is_refused_with_another() -> None:
    k = chunk_keys(range(32), FP)[0]
    blob = codec.encode(meta(k), payload(1), mac_key=KX)
    assert codec.parse_header(blob)[0].key == k
    assert bytes(codec.decode(blob, expect_key=k, mac_key=KX)[1]) == payload(1)
    assert bytes(codec.decode(blob, expect_key=k)[1]) == payload(1)  # no key: no MAC check
    with pytest.raises(codec.ChunkForged, match="MAC mismatch"):
        codec.decode(blob, mac_key=codec.chunk_mac_key(Y.encode()))
    with pytest.raises(codec.ChunkForged, match="no MAC"):  # the old format, unsigned
        codec.decode(codec.encode(meta(k), payload(1)), mac_key=KX)


@pytest.mark.parametrize("change", [{"payload_byte": 7}, {"tokens": 1}], ids=["payload", "header"])
def test_a_forged_chunk_passes_the_checksums_but_not_the_mac(change: dict[str, int]) -> None:
    k = chunk_keys(range(32), FP)[0]
    forged = forge(codec.encode(meta(k), payload(1), mac_key=KX), **change)
    codec.decode(forged, expect_key=k)  # every unkeyed check passes
    with pytest.raises(codec.ChunkForged):
        codec.decode(forged, expect_key=k, mac_key=KX)


def test_the_mac_key_is_derived_not_the_secret() -> None:
    assert X.encode() != KX and len(KX) == 32
    assert codec.chunk_mac_key(X.encode()) == KX


# ---------------------------------------------------------------- nodes


@contextmanager
def node(
    tmp: Path, s3: S3Server, bucket: str, secret: str | None
) -> Iterator[tuple[NodeAgent, AgentClient, Path]]:
    """An agent (DRAM, write-through NVMe and S3, the shared bucket) in this process on
    its own loop thread, and a client of it. Yields (agent, client, NVMe directory)."""
    tag = uuid.uuid4().hex[:8]
    nvme = tmp / f"nvme-{tag}"
    cfg: dict[str, Any] = {
        "node_id": f"mac-{tag}",
        "dram": {"capacity": "8MiB", "shm_name": f"tcpa_{tag}", "keep_on_stop": False},
        "nvme": {"enabled": True, "path": str(nvme), "capacity": "64MiB",
                 "write_mode": "write_through"},
        "s3": {"enabled": True, "url": f"s3://{bucket}/kv", "endpoint_url": s3.endpoint_url,
               "region": "us-east-1", "write_mode": "write_through"},
        "agent": {"socket": str(tmp / f"{tag}.sock"), "peer_secret": secret},
    }  # fmt: skip
    emb = EmbeddedAgent(load_config(cfg))
    assert emb.agent is not None
    c = AgentClient(cfg["agent"]["socket"])
    try:
        yield emb.agent, c, nvme
    finally:
        c.close()
        emb.stop()


def forged_count(c: AgentClient, tier: str) -> float:
    return float(
        c.admin("stats")["metrics"].get(f"tiered_cache_forged_chunks_total{{tier={tier}}}", 0)
    )


def s3_object(agent: NodeAgent, key: str) -> str:
    tier = agent.store.by_name["s3"].tier
    return tier.object_key(key)  # type: ignore[attr-defined]


def test_a_chunk_written_with_secret_x_is_refused_by_a_node_with_secret_y(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    """Node A (secret X) saves through its client, which signs with the key A's agent
    hands it; the copy lands in the shared bucket. Node B (secret Y) finds it there and
    refuses it (a miss, counted, the object left for the nodes it is valid for); node C
    (secret X) loads it."""
    keys = chunk_keys(range(32 * 2), FP)
    with node(tmp_path, s3_server, s3_bucket, X) as (a, ca, _):
        ca.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)], wait=True)
        obj = s3_server.client().get_object(Bucket=s3_bucket, Key=s3_object(a, keys[0]))
        blob = obj["Body"].read()
        assert codec.parse_header(blob)[0].key == keys[0]
        codec.decode(blob, mac_key=KX)  # signed by the writer, with X's chunk key
    with node(tmp_path, s3_server, s3_bucket, Y) as (_, cb, _):
        assert cb.lookup(keys) == ["s3", "s3"]
        assert cb.get_many(keys, FP.digest) == [None, None]
        assert forged_count(cb, "s3") == 2
    with node(tmp_path, s3_server, s3_bucket, X) as (_, cc, _):
        got = cc.get_many(keys, FP.digest)
        assert [bytes(g[1]) if g else None for g in got] == [payload(0), payload(1)]
        assert forged_count(cc, "s3") == 0


def test_a_tampered_chunk_on_s3_or_nvme_is_refused_and_counted(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    """Someone with write access to the bucket, or to the NVMe directory, rewrites a chunk
    (payload or header) with valid checksums: the MAC refuses it. A forged NVMe copy is
    removed and the read falls to S3's good copy; forged S3 copies are misses."""
    keys = chunk_keys(range(32 * 3), FP)
    raw = s3_server.client()
    with node(tmp_path, s3_server, s3_bucket, X) as (a, c, nvme):
        c.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)], wait=True)
        # S3: payload and header forged in place.
        for k, change in ((keys[0], {"payload_byte": 3}), (keys[1], {"tokens": 1})):
            o = s3_object(a, k)
            good = raw.get_object(Bucket=s3_bucket, Key=o)["Body"].read()
            raw.put_object(Bucket=s3_bucket, Key=o, Body=forge(good, **change))
        # NVMe: the file of keys[2], forged.
        (path,) = [p for p in nvme.rglob(f"*{keys[2]}*") if p.is_file()]
        path.write_bytes(forge(path.read_bytes(), payload_byte=5))
        # Out of DRAM and NVMe (keys 0, 1) and DRAM (key 2): each read goes to the forgery.
        for k in keys[:2]:
            c.admin("evict", key=k, tiers=["dram", "nvme"])
        c.admin("evict", key=keys[2], tiers=["dram"])
        got = c.get_many(keys, FP.digest)
        assert got[0] is None and got[1] is None
        assert got[2] is not None and bytes(got[2][1]) == payload(2)  # S3's good copy
        assert forged_count(c, "s3") == 2
        assert forged_count(c, "nvme") == 1
        assert not path.exists()  # the forged NVMe copy is gone


def test_without_a_secret_chunks_stay_in_the_old_format(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    (k,) = chunk_keys(range(32), FP)
    with node(tmp_path, s3_server, s3_bucket, None) as (a, c, _):
        c.put_many([(meta(k), payload(0))], wait=True)
        blob = s3_server.client().get_object(Bucket=s3_bucket, Key=s3_object(a, k))["Body"].read()
        assert blob[4] == codec.VERSION
        got = c.get_many([k], FP.digest)
        assert got[0] is not None and bytes(got[0][1]) == payload(0)


def test_the_mac_key_goes_only_to_local_clients_that_may_write(tmp_path: Path) -> None:
    """A local uid that may not write chunks (``agent.allowed_uids``) gets no key to sign
    them with; the agent's own uid gets the key derived from its secret."""
    import shutil
    import tempfile

    from test_admin_auth import NOBODY, _agent, as_uid, raw_frame

    shared = Path(tempfile.mkdtemp(prefix="tc-mac-", dir="/tmp"))
    shared.chmod(0o711)  # another uid must reach the socket (pytest's dirs are 0700)
    sock, proc = _agent(tmp_path, shared, peer_secret=X)
    try:
        (hello,) = as_uid(NOBODY, sock, [raw_frame("hello")])
        assert hello["ok"] and hello["chunk_mac_key"] is None
        c = AgentClient(sock, attach_pool=False)
        try:
            assert c.mac_key == KX
        finally:
            c.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(shared, ignore_errors=True)
