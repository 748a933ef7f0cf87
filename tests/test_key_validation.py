"""Chunk keys (and pin ids, namespaces) with a trailing newline are refused at every entry
point: ``re.match`` with ``$`` accepts ``"<32 hex>\\n"``, which would become a file name,
an S3 object key and a Redis key of its own (issue 15, remaining findings)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from tiered_cache import codec
from tiered_cache.directory import LocalDirectory, Pin
from tiered_cache.directory.redis_backend import RedisDirectory
from tiered_cache.keys import is_valid_key
from tiered_cache.tiers.dram import DRAMTier
from tiered_cache.tiers.nvme import NVMeTier
from tiered_cache.tiers.s3 import S3Tier

GOOD = "ab" * 16
BAD = [GOOD + "\n", GOOD + "\r\n", "\n" + GOOD, GOOD[:-1] + "\n", GOOD.upper(), ""]


def chunk() -> bytes:
    meta = codec.ChunkMeta(key=GOOD, fingerprint=b"\1" * 16, num_tokens=1)
    return codec.encode(meta, b"x" * 64)


def test_is_valid_key() -> None:
    assert is_valid_key(GOOD)
    for k in BAD:
        assert not is_valid_key(k), repr(k)


def test_pin_keys_ids_and_fingerprints() -> None:
    Pin(keys=[GOOD], fingerprint="00ff", id="p-1")
    with pytest.raises(ValidationError, match="invalid chunk key"):
        Pin(keys=[GOOD + "\n"], fingerprint="00ff")
    with pytest.raises(ValidationError, match="pin id"):
        Pin(keys=[GOOD], fingerprint="00ff", id="p-1\n")
    with pytest.raises(ValidationError, match="hex"):
        Pin(keys=[GOOD], fingerprint="00ff\n")


async def test_directory_refuses_them() -> None:
    d = LocalDirectory()
    await d.publish("n1", "dram", [GOOD], ttl_s=5)
    with pytest.raises(ValueError, match="invalid chunk key"):
        await d.publish("n1", "dram", [GOOD + "\n"], ttl_s=5)
    with pytest.raises(ValueError, match="invalid chunk key"):
        await d.locate([GOOD + "\n"])
    with pytest.raises(ValueError, match="namespace"):
        RedisDirectory(object(), display_url="redis://x", namespace="tc\n")


async def test_nvme_refuses_them(tmp_path: Path) -> None:
    t = NVMeTier(tmp_path / "nvme", 1 << 20)
    try:
        with pytest.raises(ValueError, match="invalid chunk key"):
            await t.put(GOOD + "\n", chunk())
        with pytest.raises(ValueError, match="invalid chunk key"):
            await t.get(GOOD + "\n")
        assert not [p for p in (tmp_path / "nvme").rglob("*") if "\n" in p.name]
    finally:
        await t.close()


async def test_s3_object_keys_refuse_them() -> None:
    t = S3Tier("tc-bucket", endpoint_url="http://127.0.0.1:9", region="us-east-1")
    try:
        assert t._key_of(t.object_key(GOOD)) == GOOD
        with pytest.raises(ValueError, match="invalid chunk key"):
            t.object_key(GOOD + "\n")
        # A listed object named "<key>\n.kvc" is not taken for a chunk.
        assert t._key_of(t.object_key(GOOD).replace(".kvc", "\n.kvc")) is None
    finally:
        await t.close()


def test_dram_commit_refuses_them() -> None:
    t = DRAMTier(4 * 8192, 8192, shm_name=f"tc_keys_{uuid.uuid4().hex[:8]}")
    try:
        s = t.reserve(100)
        with pytest.raises(ValueError, match="invalid chunk key"):
            t.commit(GOOD + "\n", s, 100)
        t.abort(s)
        assert t.usage().num_chunks == 0
    finally:
        asyncio.run(t.close())


def test_cli_evict_refuses_them() -> None:
    from tiered_cache.cli import main

    r = CliRunner().invoke(main, ["evict", GOOD + "\n"])
    assert r.exit_code != 0
    assert "not a chunk key" in r.output
