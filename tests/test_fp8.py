"""The lossy ``fp8`` at-rest codec (tiered_cache.fp8 through tiered_cache.at_rest): each
(layer, head) scaled by a power of two and cast to e4m3 exactly as torch casts, the
rebuilt chunk verified and signed like any other, other dtypes stored as they are."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from tiered_cache import at_rest, codec, fp8
from tiered_cache.at_rest import AtRest, KeyRing

FP = hashlib.md5(b"model").digest()
SHAPE = (3, 4, 5, 16, 32)  # [layers, blocks, heads, tokens, C]: a connector chunk
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def kv(dtype: str, seed: int = 0) -> torch.Tensor:
    """Unit-normal values, each (layer, head) at its own magnitude (2**-12 .. 2**6)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g)
    mags = torch.randint(-12, 7, (SHAPE[0], 1, SHAPE[2], 1, 1), generator=g).float()
    return (x * torch.exp2(mags)).to(DTYPES[dtype])


def reference(x: torch.Tensor) -> torch.Tensor:
    """torch's own e4m3 cast, with the power-of-two scale fp8 picks per (layer, head)."""
    f = x.float()
    amax = f.abs().amax(dim=(1, 3, 4), keepdim=True)
    k = torch.ceil(torch.log2(amax / 448))
    q = (f / torch.exp2(k)).to(torch.float8_e4m3fn)
    return (q.float() * torch.exp2(k)).to(x.dtype)


def chunk(x: torch.Tensor, dtype: str) -> bytes:
    meta = codec.ChunkMeta(key="ef" * 16, fingerprint=FP, num_tokens=64, dtype=dtype,
                           shape=tuple(x.shape), tenant="acme")  # fmt: skip
    return codec.encode(meta, x.contiguous().view(torch.uint16).numpy().tobytes())


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_head_is_scaled_and_cast_as_torch_casts(dtype: str) -> None:
    x = kv(dtype)
    bits = x.view(torch.uint16).numpy()
    stored = fp8.encode(bits, dtype)
    assert len(stored) == fp8.encoded_size(SHAPE) == 3 * 5 + x.numel()
    got = torch.from_numpy(fp8.decode(stored, SHAPE, dtype).view(np.int16)).view(DTYPES[dtype])
    want = reference(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # every head keeps e4m3's relative precision, whatever its magnitude
    err = (got.float() - x.float()).abs().amax(dim=(1, 3, 4))
    assert (err <= x.float().abs().amax(dim=(1, 3, 4)) / 16 + 1e-30).all()
    assert fp8.encode(bits, dtype) == stored  # the same bytes every time


def test_one_scale_for_the_whole_chunk_would_lose_the_small_heads() -> None:
    """Why the scale is per (layer, head): the check above fails under a single scale."""
    x = kv("bfloat16").float()
    k = torch.ceil(torch.log2(x.abs().amax() / 448))
    single = (x / torch.exp2(k)).to(torch.float8_e4m3fn).float() * torch.exp2(k)
    err = (single - x).abs().amax(dim=(1, 3, 4))
    assert not (err <= x.abs().amax(dim=(1, 3, 4)) / 16).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_envelope_rebuilds_a_chunk_that_verifies(dtype: str) -> None:
    x = kv(dtype, seed=1)
    blob = chunk(x, dtype)
    mac = codec.chunk_mac_key(b"cluster secret")
    ring = KeyRing.parse("1 " + bytes(range(32)).hex(), "test")
    for ar in (AtRest(codec="fp8"), AtRest(codec="fp8", keys=ring, mac_key=mac)):
        stored = ar.wrap(blob)
        assert len(stored) < 0.52 * len(blob)
        rebuilt = ar.unwrap(stored)
        meta, payload = codec.decode(rebuilt, expect_key="ef" * 16, expect_fingerprint=FP,
                                     mac_key=ar.mac_key)  # fmt: skip
        assert meta.tenant == "acme" and meta.shape == SHAPE
        got = torch.frombuffer(bytearray(payload), dtype=torch.int16).view(SHAPE)
        assert torch.equal(got, reference(x).view(torch.int16))
    with pytest.raises(codec.ChunkForged):  # signed with the writer's key, no other
        codec.decode(rebuilt, mac_key=codec.chunk_mac_key(b"another secret"))


def test_a_forged_fp8_envelope_fails_the_readers_mac() -> None:
    """An unsealed fp8 envelope written by someone without the chunk key: its rebuilt
    header carries no valid MAC, so a reader with the key refuses it."""
    blob = chunk(kv("bfloat16"), "bfloat16")
    planted = AtRest(codec="fp8").wrap(blob)  # no mac_key
    with pytest.raises(codec.ChunkForged):
        codec.decode(AtRest().unwrap(planted), mac_key=codec.chunk_mac_key(b"secret"))


def test_other_dtypes_are_stored_as_they_are() -> None:
    meta = codec.ChunkMeta(key="ab" * 16, fingerprint=FP, num_tokens=4, dtype="uint8",
                           shape=(4, 1000))  # fmt: skip
    blob = codec.encode(meta, bytes(range(250)) * 16)
    stored = AtRest(codec="fp8").wrap(blob)
    codec_id = at_rest._HEAD.unpack(stored[: at_rest._HEAD.size])[2]
    assert at_rest.CODECS[codec_id] == "none"
    assert bytes(AtRest().unwrap(stored)) == blob


def test_a_damaged_fp8_body_is_a_chunk_error() -> None:
    ar = AtRest(codec="fp8")
    stored = bytearray(ar.wrap(chunk(kv("float16"), "float16")))
    stored[-3] ^= 0x40
    with pytest.raises(codec.ChunkCorrupt):
        ar.unwrap(bytes(stored))
    with pytest.raises(ValueError, match="fp8"):
        fp8.decode(b"\0" * 10, SHAPE, "float16")


def test_a_forged_inner_header_is_refused_before_any_decoding() -> None:
    """An unsealed fp8 envelope is only as good as its checksums, which anyone can
    recompute: a shape of one value a group (a decode loop a value) is refused outright."""
    from test_at_rest import _reheader

    ar = AtRest(codec="fp8")
    stored = ar.wrap(chunk(kv("bfloat16"), "bfloat16"))
    h = at_rest.HEADER_SIZE
    inner, body = stored[h : h + codec.HEADER_SIZE], stored[h + codec.HEADER_SIZE :]
    meta = codec.parse_header(inner)[0]
    n = int(np.prod(SHAPE))
    forged_meta = codec.ChunkMeta(**{**meta.__dict__, "shape": (n, 1, 1, 1, 1)})
    fake = codec.pack_header(forged_meta, b"\0" * (2 * n))
    forged = _reheader(stored[:h] + fake + body)
    with pytest.raises(codec.ChunkCorrupt, match="fp8"):
        ar.unwrap(forged)


def test_a_header_text_field_that_is_not_utf8_is_damage() -> None:
    blob = bytearray(chunk(kv("float16"), "float16"))
    at = blob.index(b"float16")
    blob[at] = 0xFF  # then fix the header checksum, as a forger would
    import struct

    import xxhash

    blob[codec.HEADER_SIZE - 4 : codec.HEADER_SIZE] = struct.pack(
        "<I", xxhash.xxh32_intdigest(bytes(blob[: codec.HEADER_SIZE - 4]))
    )
    with pytest.raises(codec.ChunkCorrupt, match="UTF-8"):
        codec.parse_header(bytes(blob))
