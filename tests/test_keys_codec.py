from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_cache import codec
from tiered_cache.keys import ModelFingerprint, chunk_keys, is_valid_key, partial_keys

FP = ModelFingerprint("tiny-llama", dtype="float32", block_size=16, chunk_size=32)


def test_keys_are_chained_deterministic_and_safe() -> None:
    toks = list(range(100))
    k1 = chunk_keys(toks, FP)
    assert len(k1) == 3
    assert k1 == chunk_keys(np.arange(100, dtype=np.int64), FP)
    assert all(is_valid_key(k) for k in k1)
    # Chained: changing the first token changes every key.
    k2 = chunk_keys([1, *toks[1:]], FP)
    assert all(a != b for a, b in zip(k1, k2, strict=True))
    # Changing a token in chunk 2 keeps chunks 0-1.
    k3 = chunk_keys([*toks[:70], 999, *toks[71:]], FP)
    assert k3[:2] == k1[:2] and k3[2] != k1[2]


def test_known_answer_is_stable_across_processes() -> None:
    # Pinned so a change to the hashing scheme is a deliberate, visible format change.
    assert chunk_keys(list(range(32)), FP)[0] == "de58f70b36db1f9f28fd7d0ad8453ed5"


def test_salt_and_fingerprint_isolate() -> None:
    toks = list(range(64))
    base = chunk_keys(toks, FP)
    assert chunk_keys(toks, FP, cache_salt="tenant-a") != base
    other = ModelFingerprint("tiny-llama", dtype="bfloat16", block_size=16, chunk_size=32)
    assert chunk_keys(toks, other) != base
    rank1 = ModelFingerprint("tiny-llama", block_size=16, chunk_size=32, tp_rank=1, tp_world_size=2)
    assert chunk_keys(toks, rank1) != base


def test_partial_tail() -> None:
    toks = list(range(70))
    assert len(chunk_keys(toks, FP)) == 2
    keys = chunk_keys(toks, FP, include_partial=True)
    assert len(keys) == 3
    # The tail's key chains from the last full chunk and covers the 6 tokens after it.
    assert partial_keys(toks, FP, None, keys[1], 64, [6]) == [keys[2]]


@given(st.lists(st.integers(1, 32), min_size=1, max_size=20), st.booleans())
def test_partial_keys_of_many_lengths_equal_each_computed_alone(
    lengths: list[int], second_chunk: bool
) -> None:
    """One running hash serves every length (the probe of every tail length): each key is
    the one a save of exactly those tokens computes, whatever the order of ``lengths``."""
    cs = FP.chunk_size  # 32
    toks = list(range(7, 7 + 2 * cs))
    base = cs if second_chunk else 0
    parent = chunk_keys(toks, FP)[0] if second_chunk else None
    got = partial_keys(toks, FP, None, parent, base, lengths)
    for n, key in zip(lengths, got, strict=True):
        assert key == partial_keys(toks, FP, None, parent, base, [n])[0]
        # ... and the key of a prompt that ends right there (its tail chunk).
        assert key == chunk_keys(toks[: base + n], FP, include_partial=True)[-1]


def test_fingerprint_validation() -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        ModelFingerprint("m", block_size=16, chunk_size=40)
    with pytest.raises(ValueError, match="tp_rank"):
        ModelFingerprint("m", tp_rank=2, tp_world_size=2)


def _meta(key: str, n: int = 32) -> codec.ChunkMeta:
    return codec.ChunkMeta(
        key=key,
        fingerprint=FP.digest,
        num_tokens=n,
        dtype="float32",
        shape=(2, 4, 8),
        kv_layout="LBHNC",
        block_size=16,
    )


def test_header_carries_the_prefix_chain() -> None:
    k0, k1 = chunk_keys(list(range(64)), FP)
    m = codec.ChunkMeta(key=k1, fingerprint=FP.digest, num_tokens=32, parent=k0, position=1)
    got, _ = codec.decode(codec.encode(m, b"x" * 8), expect_key=k1)
    assert (got.parent, got.position) == (k0, 1)
    first, _ = codec.decode(codec.encode(_meta(k0), b"x" * 8))
    assert (first.parent, first.position) == ("", 0)  # what a version-1 header reads as
    with pytest.raises(ValueError, match="parent"):
        codec.encode(codec.ChunkMeta(key=k1, fingerprint=FP.digest, num_tokens=1, parent="ab"), b"")


def test_codec_roundtrip_zero_copy() -> None:
    key = chunk_keys(list(range(32)), FP)[0]
    payload = np.arange(64, dtype=np.float32).tobytes()
    blob = bytearray(codec.encode(_meta(key), payload))
    meta, view = codec.decode(blob, expect_key=key, expect_fingerprint=FP.digest)
    assert meta == _meta(key)
    assert bytes(view) == payload
    blob[codec.HEADER_SIZE] ^= 0xFF  # the view aliases the buffer
    assert bytes(view) != payload


@given(pos=st.integers(min_value=0, max_value=codec.HEADER_SIZE + 255), bit=st.integers(0, 7))
def test_any_flipped_bit_is_detected(pos: int, bit: int) -> None:
    key = "ab" * 16
    blob = bytearray(codec.encode(_meta(key), bytes(range(256))))
    blob[pos] ^= 1 << bit
    with pytest.raises(codec.ChunkError):
        codec.decode(blob, expect_key=key, expect_fingerprint=FP.digest)


@given(cut=st.integers(min_value=0, max_value=codec.HEADER_SIZE + 99))
def test_truncation_is_detected(cut: int) -> None:
    blob = codec.encode(_meta("cd" * 16), bytes(100))
    with pytest.raises(codec.ChunkCorrupt):
        codec.decode(blob[:cut])


def test_mismatch_is_reported() -> None:
    blob = codec.encode(_meta("ab" * 16), bytes(10))
    with pytest.raises(codec.ChunkMismatch):
        codec.decode(blob, expect_key="cd" * 16)
    with pytest.raises(codec.ChunkMismatch):
        codec.decode(blob, expect_fingerprint=b"\0" * 16)
