"""A ranged GET whose answer is not the range asked for (Content-Range or length) is a
failed read, never data (issue 15, remaining findings). moto answers honestly, so a proxy
between boto3 and moto rewrites its answers."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Iterator
from email.message import Message
from typing import Any

import pytest
from conftest import S3Server
from fault_proxy import FaultProxy, Headers

from tiered_cache.tiers.base import TierError
from tiered_cache.tiers.s3 import MIN_PART_SIZE, S3Tier, _BadRange, _checked_range

KEY = "ab" * 16


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_server.endpoint_url)
    yield p
    p.close()


@pytest.fixture
async def tiers(
    s3_server: S3Server, s3_bucket: str, proxy: FaultProxy
) -> AsyncIterator[tuple[S3Tier, S3Tier]]:
    """(straight to moto, through the lying proxy), on one bucket; 5 MiB parts."""
    kw: dict[str, Any] = {"region": "us-east-1", "part_size": MIN_PART_SIZE, "max_attempts": 2}
    honest = S3Tier(s3_bucket, endpoint_url=s3_server.endpoint_url, **kw)
    lying = S3Tier(s3_bucket, endpoint_url=proxy.url, **kw)
    yield honest, lying
    await honest.close()
    await lying.close()


def header(headers: Headers, name: str) -> str | None:
    return next((v for k, v in headers if k.lower() == name.lower()), None)


def replace(headers: Headers, name: str, value: str) -> Headers:
    return [(k, value if k.lower() == name.lower() else v) for k, v in headers]


def no_checksums(headers: Headers) -> Headers:
    """Without the object's checksum headers: a liar does not send ones that give it away
    (botocore would check them against the body)."""
    return [(k, v) for k, v in headers if not k.lower().startswith("x-amz-checksum")]


def range_start(req: Message) -> int | None:
    m = re.fullmatch(r"bytes=(\d+)-\d*", req.get("Range") or "")
    return int(m.group(1)) if m else None


async def test_a_truncated_answer_is_not_data(
    tiers: tuple[S3Tier, S3Tier], proxy: FaultProxy
) -> None:
    """A small chunk: the answer says (and holds) half of it."""
    honest, lying = tiers
    data = os.urandom(1000)
    await honest.put(KEY, data)

    def half(method: str, req: Message, status: int, hs: Headers, body: bytes) -> Any:
        if method == "GET" and header(hs, "Content-Range"):
            hs = no_checksums(replace(hs, "Content-Range", "bytes 0-499/1000"))
            return status, hs, body[:500]
        return status, hs, body

    proxy.on_response = half
    with pytest.raises(TierError, match="asked for bytes 0-"):
        await lying.get(KEY)
    # Nothing was lost: read honestly, the object is whole.
    proxy.on_response = None
    assert await lying.get(KEY) == data


async def test_a_part_from_elsewhere_in_the_object_is_not_data(
    tiers: tuple[S3Tier, S3Tier], proxy: FaultProxy
) -> None:
    """A multipart read (12 MiB in 5 MiB parts): the answer to the second part's GET is
    the first part's bytes, labelled as such, with the right total size."""
    honest, lying = tiers
    data = os.urandom(12 * 2**20)
    await honest.put(KEY, data)
    first = data[:MIN_PART_SIZE]

    def wrong_part(method: str, req: Message, status: int, hs: Headers, body: bytes) -> Any:
        start = range_start(req)
        if method == "GET" and start == MIN_PART_SIZE:
            cr = f"bytes 0-{MIN_PART_SIZE - 1}/{len(data)}"
            return status, no_checksums(replace(hs, "Content-Range", cr)), first
        return status, hs, body

    proxy.on_response = wrong_part
    with pytest.raises(TierError, match="asked for bytes 5242880-"):
        await lying.get(KEY)
    proxy.on_response = None
    assert await lying.get(KEY) == data


async def test_a_range_ignored_past_the_first_part_is_not_data(
    tiers: tuple[S3Tier, S3Tier], proxy: FaultProxy
) -> None:
    """A server that ignores Range answers a later part's GET with the whole object (no
    Content-Range, and the object's length): not that part."""
    honest, lying = tiers
    data = os.urandom(11 * 2**20)
    await honest.put(KEY, data)

    def no_range(method: str, req: Message, status: int, hs: Headers, body: bytes) -> Any:
        start = range_start(req)
        if method == "GET" and start:
            hs = [(k, v) for k, v in no_checksums(hs) if k.lower() != "content-range"]
            return 200, hs, data
        return status, hs, body

    proxy.on_response = no_range
    with pytest.raises(TierError, match="no Content-Range"):
        await lying.get(KEY)


def test_a_claimed_size_over_the_limit_is_refused_before_allocating() -> None:
    resp = {"ContentRange": f"bytes 0-{MIN_PART_SIZE - 1}/{2**50}", "ContentLength": 10}
    with pytest.raises(_BadRange, match="claims"):
        _checked_range(resp, 0, MIN_PART_SIZE, S3Tier.max_object_bytes)
    ok = {"ContentRange": "bytes 0-9/10", "ContentLength": 10}
    assert _checked_range(ok, 0, MIN_PART_SIZE, S3Tier.max_object_bytes) == 10
    for bad in ("bytes 0-9/*", "bytes */10", "bytes 0-9/10\n", "items 0-9/10"):
        with pytest.raises(_BadRange):
            _checked_range({"ContentRange": bad, "ContentLength": 10}, 0, 100, 2**30)
