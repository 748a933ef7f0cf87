"""Chunk wire/disk format: a fixed 256-byte versioned header, then the raw KV payload.

Header (little endian)::

    magic "TKVC" | version u16 | header_len u16 | flags u32
    fingerprint 16s | key 16s | num_tokens u32 | block_size u32
    dtype 16s | kv_layout 8s | ndim u8 | pad 7 | shape 8*u64
    payload_len u64 | payload_xxh3 u64 | parent 16s | position u32
    ... zero pad ... | header_xxh32 u32 (last 4 bytes)

``parent`` (the previous chunk's key in the prompt, zeros for none) and ``position`` (the
chunk's index in the prompt) are what prefix-aware eviction needs; an agent that finds
chunks left by a previous run reads them here. They sit in what version 1 left as zero
padding, so older chunks read as "no parent, position 0".

The payload checksum is xxh3-64 (tens of GB/s); the header has its own checksum so a
flipped bit in the shape or length is caught before the payload is trusted. Decoding
returns a ``memoryview`` into the caller's buffer: no copy, no per-element work.

Version 2 adds a keyed MAC (``mac`` 16s, right after ``position``): HMAC-SHA256 with the
cluster's chunk key (``chunk_mac_key``), truncated to 128 bits, over a label, the header
fields before it and the payload (HMAC-SHA256 runs at twice BLAKE2b's speed on CPUs with
SHA extensions: bench/mac_cost.py). Checksums catch damage; only the MAC stops a writer without the
key (a peer, the bucket, a shared disk) from planting KV that passes every check. A
reader given a key refuses a version 1 chunk (no MAC) and a wrong MAC (``ChunkForged``);
a reader without one checks none. Chunks written without a key stay version 1.

``tenant`` (32s, right after the MAC's place, in either version) names the tenant whose
request wrote the chunk (``tenancy``: the agent accounts bytes per tenant per tier by it).
It was zero padding before, so older chunks read as no tenant and older readers ignore it.
It is outside the MAC: a wrong tag misplaces bytes in the accounts, never KV in a reply.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field

import xxhash

MAGIC = b"TKVC"
VERSION = 1  # without a MAC
VERSION_MAC = 2  # with one
MAC_SIZE = 16
_MAC_LABEL = b"tiered-cache chunk MAC v2\0"  # domain separation: these MACs and no others
HEADER_SIZE = 256
MAX_DIMS = 8

_FIXED = struct.Struct("<4sHHI16s16sII16s8sB7x8QQQ")
_PREFIX = struct.Struct("<16sI")  # parent key, position
_NO_PARENT = b"\0" * 16
_MAC_AT = _FIXED.size + _PREFIX.size
TENANT_SIZE = 32
TENANT_AT = _MAC_AT + MAC_SIZE
assert TENANT_AT + TENANT_SIZE + 4 <= HEADER_SIZE
_HCRC = struct.Struct("<I")


class ChunkError(Exception):
    """A stored chunk cannot be used. Callers treat it as a miss."""


class ChunkCorrupt(ChunkError):
    """Truncated, bad magic, bad checksum: the bytes are damaged."""


class ChunkMismatch(ChunkError):
    """Intact, but for another key, model fingerprint or KV layout."""


class ChunkForged(ChunkError):
    """The reader has a chunk key and the chunk's MAC is missing or wrong: written by
    someone without the key (or with another one), or altered since."""


class ChunkWrongKey(ChunkMismatch):
    """Intact, but its header names another key: wrong wherever it is stored under this
    one, so readers delete it (a fingerprint mismatch may be right for another reader)."""


@dataclass(frozen=True)
class ChunkMeta:
    key: str  # 32 hex chars
    fingerprint: bytes  # 16 bytes
    num_tokens: int
    dtype: str = "uint8"
    shape: tuple[int, ...] = field(default_factory=tuple)
    kv_layout: str = ""
    block_size: int = 0
    parent: str = ""  # previous chunk's key in the prompt ("" for the first chunk)
    position: int = 0  # chunk index in the prompt
    tenant: str = ""  # the writer's tenant (``tenancy``), "" for none


def _fit(s: str, n: int, what: str) -> bytes:
    b = s.encode()
    if len(b) > n:
        raise ValueError(f"{what} {s!r} longer than {n} bytes")
    return b


def checksum(payload: bytes | bytearray | memoryview) -> int:
    """Payload checksum (xxh3-64). Releases the GIL, so it can overlap a copy."""
    return int(xxhash.xxh3_64_intdigest(payload))


def chunk_mac_key(secret: bytes) -> bytes:
    """The chunk MAC key of a cluster secret (``agent.peer_secret``): HMAC-SHA256 of a
    fixed label, so the key that signs chunks is not the one the peer handshake proves."""
    return hmac.digest(secret, b"tiered-cache chunk MAC key v1", "sha256")


def _mac(key: bytes, head: bytes | memoryview, payload: bytes | bytearray | memoryview) -> bytes:
    """The MAC of a chunk whose header fields before the MAC are ``head``. OpenSSL's HMAC
    releases the GIL on large inputs, so MACs of several chunks run in parallel."""
    h = hmac.new(key, _MAC_LABEL, hashlib.sha256)
    h.update(head)
    h.update(payload)
    return h.digest()[:MAC_SIZE]


def pack_header(
    meta: ChunkMeta,
    payload: bytes | bytearray | memoryview,
    *,
    payload_checksum: int | None = None,
    mac_key: bytes | None = None,
) -> bytes:
    """Header for ``payload``; pass ``payload_checksum`` when already computed. With
    ``mac_key`` the header is version 2 and carries the chunk's MAC."""
    if len(meta.shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dims, got {len(meta.shape)}")
    if len(meta.fingerprint) != 16:
        raise ValueError("fingerprint must be 16 bytes")
    if meta.parent and len(meta.parent) != 32:
        raise ValueError(f"parent must be a 32-hex-digit key, got {meta.parent!r}")
    shape = list(meta.shape) + [0] * (MAX_DIMS - len(meta.shape))
    payload_len = memoryview(payload).nbytes
    fixed = _FIXED.pack(
        MAGIC,
        VERSION if mac_key is None else VERSION_MAC,
        HEADER_SIZE,
        0,
        meta.fingerprint,
        bytes.fromhex(meta.key),
        meta.num_tokens,
        meta.block_size,
        _fit(meta.dtype, 16, "dtype"),
        _fit(meta.kv_layout, 8, "kv_layout"),
        len(meta.shape),
        *shape,
        payload_len,
        checksum(payload) if payload_checksum is None else payload_checksum,
    ) + _PREFIX.pack(bytes.fromhex(meta.parent) if meta.parent else _NO_PARENT, meta.position)
    if mac_key is not None:
        fixed += _mac(mac_key, fixed, memoryview(payload).cast("B"))
    if meta.tenant:
        tenant = _fit(meta.tenant, TENANT_SIZE, "tenant")
        fixed = fixed.ljust(TENANT_AT, b"\0") + tenant.ljust(TENANT_SIZE, b"\0")
    body = fixed + b"\0" * (HEADER_SIZE - 4 - len(fixed))
    return body + _HCRC.pack(xxhash.xxh32_intdigest(body))


def encode(
    meta: ChunkMeta, payload: bytes | bytearray | memoryview, *, mac_key: bytes | None = None
) -> bytes:
    """Header plus payload as one buffer (one copy of the payload)."""
    return pack_header(meta, payload, mac_key=mac_key) + bytes(memoryview(payload).cast("B"))


def encoded_size(payload_len: int) -> int:
    return HEADER_SIZE + payload_len


def parse_header(buf: bytes | bytearray | memoryview) -> tuple[ChunkMeta, int, int]:
    """Validate and parse the header. Returns (meta, payload_len, payload_checksum)."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < HEADER_SIZE:
        raise ChunkCorrupt(f"truncated header: {mv.nbytes} < {HEADER_SIZE} bytes")
    body = mv[: HEADER_SIZE - 4]
    (hcrc,) = _HCRC.unpack(mv[HEADER_SIZE - 4 : HEADER_SIZE])
    if bytes(mv[:4]) != MAGIC:
        raise ChunkCorrupt("bad magic")
    if xxhash.xxh32_intdigest(body) != hcrc:
        raise ChunkCorrupt("header checksum mismatch")
    f = _FIXED.unpack(body[: _FIXED.size])
    _, version, hlen, _flags, fp, key, ntok, bsz, dtype, layout, ndim = f[:11]
    shape = f[11 : 11 + MAX_DIMS]
    payload_len, checksum = f[11 + MAX_DIMS], f[12 + MAX_DIMS]
    parent, position = _PREFIX.unpack_from(body, _FIXED.size)
    if version not in (VERSION, VERSION_MAC) or hlen != HEADER_SIZE:
        raise ChunkCorrupt(f"unsupported chunk version {version} (header {hlen})")
    if ndim > MAX_DIMS:
        raise ChunkCorrupt(f"bad ndim {ndim}")
    try:
        tenant = bytes(body[TENANT_AT : TENANT_AT + TENANT_SIZE]).rstrip(b"\0").decode()
        dtype_s, layout_s = dtype.rstrip(b"\0").decode(), layout.rstrip(b"\0").decode()
    except UnicodeDecodeError:
        raise ChunkCorrupt("a text field (dtype, layout, tenant) is not UTF-8") from None
    meta = ChunkMeta(
        key=key.hex(),
        fingerprint=fp,
        num_tokens=ntok,
        dtype=dtype_s,
        shape=tuple(shape[:ndim]),
        kv_layout=layout_s,
        block_size=bsz,
        parent="" if parent == _NO_PARENT else parent.hex(),
        position=position,
        tenant=tenant,
    )
    return meta, payload_len, checksum


def decode(
    buf: bytes | bytearray | memoryview,
    *,
    expect_key: str | None = None,
    expect_fingerprint: bytes | None = None,
    verify_payload: bool = True,
    mac_key: bytes | None = None,
) -> tuple[ChunkMeta, memoryview]:
    """Verify a whole chunk and return (meta, payload view). Raises ``ChunkError``. With
    ``mac_key``, a chunk without a MAC or with a wrong one raises ``ChunkForged``; the MAC
    covers the payload, so its checksum is not computed again."""
    mv = memoryview(buf).cast("B")
    meta, payload_len, checksum = parse_header(mv)
    if mv.nbytes != HEADER_SIZE + payload_len:
        raise ChunkCorrupt(
            f"size mismatch: have {mv.nbytes} bytes, header says {HEADER_SIZE + payload_len}"
        )
    payload = mv[HEADER_SIZE:]
    if mac_key is not None:
        if mv[4] != VERSION_MAC:  # the version's low byte (little endian)
            raise ChunkForged("no MAC: written without the cluster's chunk key")
        got = bytes(mv[_MAC_AT : _MAC_AT + MAC_SIZE])
        if not hmac.compare_digest(got, _mac(mac_key, mv[:_MAC_AT], payload)):
            raise ChunkForged("MAC mismatch: another key wrote it, or it was altered since")
        verify_payload = False
    if verify_payload and xxhash.xxh3_64_intdigest(payload) != checksum:
        raise ChunkCorrupt("payload checksum mismatch")
    if expect_key is not None and meta.key != expect_key:
        raise ChunkWrongKey(f"chunk is for key {meta.key}, expected {expect_key}")
    if expect_fingerprint is not None and meta.fingerprint != expect_fingerprint:
        raise ChunkMismatch(
            f"chunk fingerprint {meta.fingerprint.hex()} != expected {expect_fingerprint.hex()}"
        )
    return meta, payload
