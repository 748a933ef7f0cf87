"""The simulator's stand-ins for payload I/O: ``SimTier`` (a size-only tier) and the
header-only stub chunks it stores, plus the constants and error type shared by the package."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any

import xxhash

from tiered_cache import codec
from tiered_cache.tiers.base import Tier, TierUsage

BLOCK_TOKENS = 512
# One 512-token block of Llama-3.1-8B KV in bf16: 2 (K, V) x 32 layers x 8 KV heads
# x 128 dims x 2 bytes = 128 KiB per token, 64 MiB per block.
DEFAULT_BLOCK_BYTES = 512 * 128 * 1024
_FINGERPRINT = b"tiered-cache-sim"  # 16 bytes
_HCRC = struct.Struct("<I")

Record = dict[str, Any]


class SimError(ValueError):
    """Bad simulator input (tier spec, policy name, trace). One line, for the CLI."""


# ----------------------------------------------------------------------------- stubs


class SimTier(Tier):
    """A size-only tier: every chunk costs ``block_bytes`` of ``capacity_bytes``.

    It keeps the (tiny) encoded stub it was given so reads, verification, promotion and
    write-back demotion run through the store's normal code path. ``bytes_written``
    counts ``block_bytes`` per stored chunk (SSD wear for an NVMe tier).
    """

    def __init__(self, name: str, capacity_bytes: int, block_bytes: int) -> None:
        if block_bytes < 1:
            raise SimError("block bytes must be >= 1")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self._data: dict[str, bytes | bytearray | memoryview] = {}
        self.writes = 0
        self.bytes_written = 0

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.block_bytes

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        d = self._data
        return [k in d for k in keys]

    async def get(self, key: str) -> bytes | bytearray | None:
        raw = self._data.get(key)
        if raw is None or isinstance(raw, bytes | bytearray):
            return raw
        return bytes(raw)

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._data[key] = data
        self.writes += 1
        self.bytes_written += self.block_bytes

    async def delete(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    def usage(self) -> TierUsage:
        n = len(self._data)
        return TierUsage(n * self.block_bytes, self.capacity_bytes, n)

    def entries(self) -> Iterator[tuple[str, int]]:
        return ((k, self.block_bytes) for k in list(self._data))

    def size_of(self, key: str) -> int | None:
        return self.block_bytes if key in self._data else None

    def fits(self, nbytes: int) -> bool:
        return self.block_bytes <= self.capacity_bytes

    def has_room(self, nbytes: int) -> bool:
        return (len(self._data) + 1) * self.block_bytes <= self.capacity_bytes


def block_key(hash_id: int) -> str:
    """The 32-hex chunk key of a trace block id (ids are 0 <= id < 2**128)."""
    return f"{hash_id:032x}"


def stub_chunk(key: str, block_tokens: int = BLOCK_TOKENS) -> bytes:
    """A valid encoded chunk for ``key`` with an empty payload (header only)."""
    meta = codec.ChunkMeta(key=key, fingerprint=_FINGERPRINT, num_tokens=block_tokens)
    return codec.pack_header(meta, b"")


class StubEncoder:
    """``stub_chunk`` in well under a microsecond: the header of an empty-payload chunk
    differs between keys only in the key field and the header checksum, so both are
    patched into a template built once by ``codec.pack_header`` (the result is
    byte-identical; the tests check it)."""

    _KEY_AT = 28  # magic 4 | version 2 | header_len 2 | flags 4 | fingerprint 16

    def __init__(self, block_tokens: int = BLOCK_TOKENS) -> None:
        probe = "ab" * 16
        tpl = stub_chunk(probe, block_tokens)
        at = self._KEY_AT
        if tpl[at : at + 16] != bytes.fromhex(probe) or len(tpl) != codec.HEADER_SIZE:
            raise RuntimeError("codec header layout changed: update StubEncoder")
        self._pre = tpl[:at]
        self._post = tpl[at + 16 : codec.HEADER_SIZE - 4]

    def __call__(self, key: str) -> bytes:
        body = self._pre + bytes.fromhex(key) + self._post
        return body + _HCRC.pack(xxhash.xxh32_intdigest(body))
