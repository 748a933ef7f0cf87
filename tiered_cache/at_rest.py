"""At-rest envelopes: what a tier stores in place of a chunk's encoded bytes
(``codec.encode``) when it compresses them, seals them, or both (issue 28).

Layout (little endian), a 128-byte header then the stored bytes::

    magic "TKVR" | version u8 | codec u8 | flags u16 | key_id u32
    raw_len u64 | stored_len u64 | nonce 12s | tenant 32s
    key 16s | parent 16s | position u32 | stored_xxh3 u64
    ... zero pad ... | header_xxh32 u32 (last 4 bytes)

- ``key``, ``parent``, ``position`` and ``tenant`` are the chunk header's, in clear: what
  a tier's restart scan (NVMe) reads to rebuild its index, prefix chains and tenant
  accounts without a key. They are hashes, an index and a tenant's name, never tokens or
  KV; the directory in Redis holds the same. Version 1 (96 bytes, without them) is
  refused as unknown.

- ``codec`` names how the chunk was compressed, so a reader configured with another
  codec (or none) still reads the copy right: the envelope, not the reader's config, says.
  ``zstd`` runs the chunk through Zstandard; ``zstd-planes`` first splits its 16-bit values
  into a plane of high bytes and one of low bytes, which groups a bf16/fp16 cache's
  exponents (repetitive) apart from its mantissas (noise). ``fp8`` is lossy: a bf16 or
  fp16 payload as e4m3 with a scale per (layer, KV head) (``tiered_cache.fp8``); the
  envelope keeps a chunk header for the payload readers will rebuild, its checksum and
  MAC (the writer's ``mac_key``) computed over that, so the hierarchy verifies the rebuilt
  chunk as any other and nobody without the key can plant one. A payload of another
  dtype is stored as it is (codec ``none``).
- ``key_id`` 0 is plaintext. Otherwise the compressed bytes are sealed with AES-256-GCM
  under a per-tenant data key, HKDF-SHA256 of the key ring's master key ``key_id`` and
  the tenant's name. The header up to the stored bytes' checksum is the AEAD's associated
  data: moving a copy to another tenant's name or chunk key, or relabelling its key id or
  codec, fails the tag.
- ``stored_xxh3`` checks the stored bytes before anything decompresses or decrypts them:
  damage is a cheap ``ChunkCorrupt``, and the decompressor only ever sees bytes that were
  written whole, and is capped at ``raw_len`` (itself capped) so a forged length cannot
  make it allocate without bound.

Unwrapping gives back exactly the bytes that were wrapped, whose own header, checksum
and MAC (``codec.decode``) the hierarchy then verifies as for any tier: an envelope adds
checks, it replaces none. Every failure is a ``codec.ChunkError``, which callers already
treat as a miss.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import xxhash
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tiered_cache import codec, fp8

MAGIC = b"TKVR"
VERSION = 2
HEADER_SIZE = 128
#: The largest chunk an envelope may announce: a forged ``raw_len`` is refused before
#: anything is allocated for it (a chunk of a 70B model's 256 tokens is 80 MiB at TP 1).
MAX_RAW = 256 << 20
NONCE_SIZE = 12
TAG_SIZE = 16
TENANT_SIZE = codec.TENANT_SIZE

CodecName = Literal["none", "zstd", "zstd-planes", "fp8"]
CODECS: tuple[CodecName, ...] = get_args(CodecName)
LOSSLESS: tuple[CodecName, ...] = ("none", "zstd", "zstd-planes")
_CODEC_ID: dict[str, int] = {name: i for i, name in enumerate(CODECS)}

_HEAD = struct.Struct("<4sBBHIQQ")  # magic .. stored_len: the AAD begins
_TAIL = struct.Struct(f"<{NONCE_SIZE}s{TENANT_SIZE}s16s16sI")  # nonce .. position: AAD too
_SUM = struct.Struct("<Q")  # stored_xxh3
_HCRC = struct.Struct("<I")
assert _HEAD.size + _TAIL.size + _SUM.size + _HCRC.size <= HEADER_SIZE
_NO_PARENT = b"\0" * 16
_HKDF_INFO = b"tiered-cache at-rest data key v1\0"
#: The environment variables a key ring is read from (never from the YAML).
ENV_KEYS = "TIERED_CACHE_AT_REST_KEYS"
ENV_KEY_FILE = "TIERED_CACHE_AT_REST_KEY_FILE"


class KeyUnavailable(codec.ChunkMismatch):
    """Sealed under a key this reader does not hold, or has retired: a miss, never an
    error to the request. The copy may be right for a reader that holds the key."""


class EnvelopeUnknown(codec.ChunkMismatch):
    """An envelope of a version or codec this reader does not know (written by a newer or
    older release): a miss, never damage, so a rolling upgrade deletes nothing."""


class PlainRefused(codec.ChunkMismatch):
    """A plaintext copy where this reader seals everything: written before encryption was
    turned on, or planted by someone without the key."""


class KeyRingError(ValueError):
    """A key ring that cannot be used: one line naming the variable or file and the line."""


@dataclass(frozen=True)
class KeyRing:
    """Master keys by id. New writes use ``active`` (the highest id not retired); copies
    under any key held and not retired stay readable, so a rotation is: add a key with a
    higher id (new writes move to it), let old copies age out, then mark the old one
    ``retired`` (its copies become misses) and finally drop its line."""

    keys: Mapping[int, bytes]
    retired: frozenset[int] = frozenset()
    _derived: dict[tuple[int, bytes], AESGCM] = field(default_factory=dict, compare=False,
                                                      repr=False)  # fmt: skip

    def __post_init__(self) -> None:
        for kid, secret in self.keys.items():
            if not 0 < kid < 2**32:
                raise KeyRingError(f"key id {kid} outside 1..{2**32 - 1}")
            if len(secret) < 32:
                raise KeyRingError(f"key {kid}: {len(secret)} bytes; at least 32 are needed")
        if self.active is None:
            raise KeyRingError("no key to write with: every key is retired")

    def __repr__(self) -> str:  # never the secrets
        return f"KeyRing(ids={sorted(self.keys)}, retired={sorted(self.retired)})"

    @property
    def active(self) -> int | None:
        live = [k for k in self.keys if k not in self.retired]
        return max(live) if live else None

    def aead(self, key_id: int, tenant: bytes) -> AESGCM:
        """The tenant's data key under master ``key_id``, as an AES-256-GCM context."""
        got = self._derived.get((key_id, tenant))
        if got is not None:
            return got
        if key_id in self.retired or key_id not in self.keys:
            why = "retired" if key_id in self.retired else "not held"
            raise KeyUnavailable(f"sealed under key {key_id}, which this reader has {why}")
        hk = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_HKDF_INFO + tenant)
        got = AESGCM(hk.derive(self.keys[key_id]))
        self._derived[(key_id, tenant)] = got
        return got

    @classmethod
    def parse(cls, text: str, where: str) -> KeyRing:
        """``<id> <hex secret> [retired]`` per line (or separated by ``;``); ``#`` starts a
        comment."""
        keys: dict[int, bytes] = {}
        retired: set[int] = set()
        for n, raw in enumerate(text.replace(";", "\n").splitlines(), 1):
            line = raw.split("#", 1)[0].split()
            if not line:
                continue
            if len(line) not in (2, 3) or (len(line) == 3 and line[2] != "retired"):
                raise KeyRingError(f"{where}, line {n}: expected '<id> <hex key> [retired]'")
            try:
                kid, secret = int(line[0]), bytes.fromhex(line[1])
            except ValueError:
                raise KeyRingError(f"{where}, line {n}: the id is a number, the key hex digits"
                                   ) from None  # fmt: skip
            if kid in keys:
                raise KeyRingError(f"{where}, line {n}: key {kid} given twice")
            keys[kid] = secret
            if len(line) == 3:
                retired.add(kid)
        if not keys:
            raise KeyRingError(f"{where}: no keys")
        try:
            return cls(keys, frozenset(retired))
        except KeyRingError as e:
            raise KeyRingError(f"{where}: {e}") from None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KeyRing | None:
        """The ring in ``$TIERED_CACHE_AT_REST_KEYS``, or in the file
        ``$TIERED_CACHE_AT_REST_KEY_FILE`` names; None when neither is set."""
        env = os.environ if env is None else env
        if env.get(ENV_KEYS):
            return cls.parse(env[ENV_KEYS], f"${ENV_KEYS}")
        path = env.get(ENV_KEY_FILE)
        if not path:
            return None
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise KeyRingError(f"${ENV_KEY_FILE}: cannot read {path}: {e.strerror}") from None
        return cls.parse(text, path)


_LEN = struct.Struct("<Q")


def _compress(name: CodecName, mv: memoryview, level: int) -> bytes:
    if name == "none":
        return bytes(mv)
    if name == "zstd":
        return zstandard.ZstdCompressor(level=level).compress(mv)
    # Byte planes, each its own frame: the exponents' plane entropy-coded on its own, the
    # mantissas' (incompressible) stored raw by zstd instead of sharing its Huffman table.
    # Casts, not strided copies: 16x faster in numpy. Long minimum matches: the exponents
    # have few long repeats, and short ones cost more time than they save bytes.
    n2 = mv.nbytes & ~1
    v = np.frombuffer(mv[:n2], dtype="<u2")
    p = zstandard.ZstdCompressionParameters(compression_level=level, min_match=7)
    c = zstandard.ZstdCompressor(compression_params=p)
    first = c.compress(v.astype(np.uint8).data)
    rest = c.compress((v >> 8).astype(np.uint8).tobytes() + bytes(mv[n2:]))
    return _LEN.pack(len(first)) + first + rest


def _frame(buf: bytes | memoryview, size: int) -> bytes:
    """One zstd frame of exactly ``size`` bytes: the frame's own size is checked first,
    since zstd ignores ``max_output_size`` when a frame states one."""
    if zstandard.frame_content_size(buf) != size:
        raise codec.ChunkCorrupt("zstd frame size differs from the envelope's")
    return zstandard.ZstdDecompressor().decompress(buf, max_output_size=size)


def _fp8_encode(mv: memoryview, mac_key: bytes | None) -> bytes | None:
    """A rebuilt chunk's header, then the fp8 payload; None for a payload fp8 cannot take."""
    meta, n, _ = codec.parse_header(mv)
    if not fp8.supported(meta.dtype, meta.shape) or n != 2 * math.prod(meta.shape):
        return None
    values = np.frombuffer(mv[codec.HEADER_SIZE :], dtype="<u2").reshape(meta.shape)
    body = fp8.encode(values, meta.dtype)
    rebuilt = fp8.decode(body, meta.shape, meta.dtype)
    return codec.pack_header(meta, rebuilt.data, mac_key=mac_key) + body


def _fp8_decode(plain: bytes | memoryview, raw_len: int) -> bytes:
    """The rebuilt chunk. Its header is checked for what decoding will cost before any
    work: an unsealed envelope's inner header is only as good as its checksum."""
    mv = memoryview(plain)
    meta, n, _ = codec.parse_header(mv)
    if codec.HEADER_SIZE + n != raw_len or not fp8.supported(meta.dtype, meta.shape):
        raise codec.ChunkCorrupt(f"fp8: a {meta.dtype} payload of shape {meta.shape}, "
                                 f"{n} B, in an envelope of {raw_len} B")  # fmt: skip
    if n != 2 * math.prod(meta.shape):
        raise codec.ChunkCorrupt(f"fp8: {n} B for shape {meta.shape}")
    try:
        values = fp8.decode(mv[codec.HEADER_SIZE :], meta.shape, meta.dtype)
    except ValueError as e:
        raise codec.ChunkCorrupt(str(e)) from None
    return bytes(mv[: codec.HEADER_SIZE]) + values.tobytes()


def _decompress(name: CodecName, plain: bytes | memoryview, raw_len: int) -> bytes | memoryview:
    if name == "none":
        return plain
    if name == "zstd":
        return _frame(plain, raw_len)
    if name == "fp8":
        return _fp8_decode(plain, raw_len)
    mv = memoryview(plain)
    if mv.nbytes < _LEN.size:
        raise codec.ChunkCorrupt("byte planes: no length")
    (n,) = _LEN.unpack(mv[: _LEN.size])
    if n > mv.nbytes - _LEN.size:
        raise codec.ChunkCorrupt("byte planes: a length past the end")
    half = raw_len // 2
    lo = np.frombuffer(_frame(mv[_LEN.size : _LEN.size + n], half), dtype=np.uint8)
    rest = _frame(mv[_LEN.size + n :], raw_len - half)
    hi = np.frombuffer(rest, dtype=np.uint8, count=half)
    out = (hi.astype("<u2") << 8) | lo
    return out.tobytes() + rest[half:]


def _fields_of(blob: memoryview) -> bytes:
    """The chunk header's tenant, key, parent and position as the envelope stores them."""
    meta = codec.parse_header(blob)[0]
    parent = bytes.fromhex(meta.parent) if meta.parent else _NO_PARENT
    tenant = meta.tenant.encode().ljust(TENANT_SIZE, b"\0")
    return tenant + bytes.fromhex(meta.key) + parent + struct.pack("<I", meta.position)


@dataclass(frozen=True)
class EnvelopeInfo:
    """What an envelope's header says in clear: enough for a restart scan."""

    key: str
    parent: str  # "" for a prompt's first chunk
    position: int
    tenant: str
    size: int  # header plus stored bytes: the file or object's whole length


def _check_header(header: memoryview) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The envelope header's fields (before and after ``stored_len``), checked."""
    if header.nbytes < 5:
        raise codec.ChunkCorrupt("envelope shorter than its header")
    if bytes(header[:4]) != MAGIC:
        raise codec.ChunkCorrupt("not an envelope: bad magic")
    if header[4] != VERSION:  # before the checksum: other versions' headers differ
        raise EnvelopeUnknown(f"envelope version {header[4]}: unknown here")
    if header.nbytes < HEADER_SIZE:
        raise codec.ChunkCorrupt("envelope shorter than its header")
    header = header[:HEADER_SIZE]
    (crc,) = _HCRC.unpack(header[-_HCRC.size :])
    if xxhash.xxh32_intdigest(header[: -_HCRC.size]) != crc:
        raise codec.ChunkCorrupt("envelope header checksum mismatch")
    head = _HEAD.unpack(header[: _HEAD.size])
    if head[2] >= len(CODECS):
        raise EnvelopeUnknown(f"envelope codec {head[2]}: unknown here")
    if head[5] > MAX_RAW:
        raise codec.ChunkCorrupt(f"envelope announces {head[5]} B, over {MAX_RAW}")
    return head, _TAIL.unpack(header[_HEAD.size : _HEAD.size + _TAIL.size])


def describe(header: bytes | bytearray | memoryview) -> EnvelopeInfo:
    """Check an envelope's header (its first ``HEADER_SIZE`` bytes) and say what it holds;
    ``ChunkError`` when it is not a well-formed one. Needs no key."""
    head, tail = _check_header(memoryview(header).cast("B"))
    _nonce, tenant, key, parent, position = tail
    try:
        name = tenant.rstrip(b"\0").decode()
    except UnicodeDecodeError:
        raise codec.ChunkCorrupt("tenant is not UTF-8") from None
    return EnvelopeInfo(key.hex(), "" if parent == _NO_PARENT else parent.hex(),
                        int(position), name, HEADER_SIZE + int(head[6]))  # fmt: skip


def is_envelope(buf: bytes | bytearray | memoryview) -> bool:
    return bytes(memoryview(buf)[:4]) == MAGIC


@dataclass(frozen=True)
class AtRest:
    """How one tier stores chunks: ``codec`` for its writes, ``keys`` to seal them (and to
    open sealed copies). A reader opens any codec; with keys it refuses plaintext."""

    codec: CodecName = "none"
    #: Zstandard's level: 1-3 keep up with NVMe on one core; higher buys little on KV.
    level: int = 1
    keys: KeyRing | None = None
    #: The cluster's chunk key (``codec.chunk_mac_key``): ``fp8`` signs the chunk readers
    #: will rebuild with it, as the writer signed the original.
    mac_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r} ({', '.join(CODECS)})")
        if not 1 <= self.level <= 19:
            raise ValueError(f"zstd level {self.level} outside 1..19")

    @property
    def active(self) -> bool:
        """False when the tier stores chunks as they are (no envelope at all)."""
        return self.codec != "none" or self.keys is not None

    def wrap(self, blob: bytes | bytearray | memoryview) -> bytes:
        mv = memoryview(blob).cast("B")
        if not self.active:
            return bytes(mv)
        fields = _fields_of(mv)
        name, lossy = self.codec, _fp8_encode(mv, self.mac_key) if self.codec == "fp8" else None
        if name == "fp8" and lossy is None:
            name = "none"  # not a 16-bit float payload: kept as it is
        body = lossy if lossy is not None else _compress(name, mv, self.level)
        kid = (self.keys.active or 0) if self.keys is not None else 0
        stored_len = len(body) + (TAG_SIZE if kid else 0)
        head = _HEAD.pack(MAGIC, VERSION, _CODEC_ID[name], 0, kid, mv.nbytes, stored_len)
        nonce = os.urandom(NONCE_SIZE) if kid else b"\0" * NONCE_SIZE
        aad = head + nonce + fields
        if kid and self.keys is not None:
            body = self.keys.aead(kid, fields[:TENANT_SIZE]).encrypt(nonce, body, aad)
        fixed = aad + _SUM.pack(xxhash.xxh3_64_intdigest(body))
        header = fixed + b"\0" * (HEADER_SIZE - len(fixed) - _HCRC.size)
        header += _HCRC.pack(xxhash.xxh32_intdigest(header))
        return header + body

    def unwrap(self, stored: bytes | bytearray | memoryview) -> bytes | memoryview:
        """The chunk's encoded bytes. A plaintext chunk (no envelope) comes back as it is,
        unless this reader seals (``PlainRefused``)."""
        mv = memoryview(stored).cast("B")
        if not is_envelope(mv):
            if bytes(mv[:4]) != codec.MAGIC:
                raise codec.ChunkCorrupt("neither an envelope nor a chunk: bad magic")
            if self.keys is not None:
                raise PlainRefused("a plaintext copy in a tier that seals every chunk")
            return mv
        head, tail = _check_header(mv)
        _, _, cid, _flags, kid, raw_len, stored_len = head
        nonce, tenant = tail[0], tail[1]
        aad_len = _HEAD.size + _TAIL.size
        (sx,) = _SUM.unpack(mv[aad_len : aad_len + _SUM.size])
        body = mv[HEADER_SIZE:]
        if body.nbytes != stored_len:
            raise codec.ChunkCorrupt(f"envelope holds {body.nbytes} B, announces {stored_len}")
        if xxhash.xxh3_64_intdigest(body) != sx:
            raise codec.ChunkCorrupt("stored bytes checksum mismatch")
        plain: bytes | memoryview = body
        if kid:
            if self.keys is None:
                raise KeyUnavailable(f"sealed under key {kid}; this reader holds no keys")
            aad = bytes(mv[:aad_len])
            try:
                plain = self.keys.aead(kid, tenant).decrypt(nonce, body, aad)
            except InvalidTag:
                raise codec.ChunkForged("envelope fails its AES-GCM tag") from None
        elif self.keys is not None:
            raise PlainRefused("an unsealed envelope in a tier that seals every chunk")
        try:
            out = _decompress(CODECS[cid], plain, raw_len)
        except zstandard.ZstdError as e:
            raise codec.ChunkCorrupt(f"zstd: {e}") from None
        if memoryview(out).nbytes != raw_len:
            raise codec.ChunkCorrupt(f"unwrapped {memoryview(out).nbytes} B, expected {raw_len}")
        # Unsealed, the clear fields are only as good as the header checksum: they must
        # be the chunk's own, or a restart scan would book it to another tenant or chain.
        clear = tail[1] + tail[2] + tail[3] + struct.pack("<I", tail[4])
        if not kid and _fields_of(memoryview(out)) != clear:
            raise codec.ChunkCorrupt("envelope's clear fields differ from its chunk's")
        return out
