"""At-rest envelopes (tiered_cache.at_rest): lossless codecs round-trip bit-exactly, a sealed copy
opens only under its tenant's key, and every damaged, forged, foreign or retired copy is a
``ChunkError`` (a miss), never bytes."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from tiered_cache import at_rest, codec
from tiered_cache.at_rest import AtRest, KeyRing, KeyRingError, KeyUnavailable, PlainRefused

FP = hashlib.md5(b"model").digest()
K1, K2 = bytes(range(32)), bytes(range(32, 64))


def bf16_chunk(tenant: str = "acme", n: int = 64 * 1024, seed: int = 0) -> bytes:
    """An encoded chunk whose payload is bf16 values of unit-normal activations (the top
    16 bits of float32s), as a KV cache holds."""
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    payload = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    meta = codec.ChunkMeta(key="ab" * 16, fingerprint=FP, num_tokens=16, dtype="bfloat16",
                           shape=(n,), parent="cd" * 16, position=3, tenant=tenant)  # fmt: skip
    return codec.encode(meta, payload)


def ring(text: str = "1 " + K1.hex()) -> KeyRing:
    return KeyRing.parse(text, "test")


@pytest.mark.parametrize("name", at_rest.LOSSLESS)
@pytest.mark.parametrize("sealed", [False, True])
def test_round_trip_is_bit_exact(name: at_rest.CodecName, sealed: bool) -> None:
    blob = bf16_chunk()
    ar = AtRest(codec=name, keys=ring() if sealed else None)
    stored = ar.wrap(blob)
    assert bytes(ar.unwrap(stored)) == blob
    meta, payload = codec.decode(ar.unwrap(stored), expect_key="ab" * 16)
    assert meta.tenant == "acme" and bytes(payload) == blob[codec.HEADER_SIZE :]
    if sealed:  # the payload's bytes appear nowhere in what is stored
        assert blob[codec.HEADER_SIZE : codec.HEADER_SIZE + 64] not in stored


def test_byte_planes_compress_bf16_better_than_plain_zstd() -> None:
    blob = bf16_chunk()
    plain = len(AtRest(codec="zstd").wrap(blob))
    planes = len(AtRest(codec="zstd-planes").wrap(blob))
    assert planes < plain < 0.85 * len(blob) and planes < 0.75 * len(blob)


def test_an_odd_length_chunk_keeps_its_last_byte() -> None:
    meta = codec.ChunkMeta(key="cd" * 16, fingerprint=FP, num_tokens=1, shape=(1001,))
    blob = codec.encode(meta, bytes(range(256)) * 3 + bytes(233))
    assert len(blob) % 2 == 1
    ar = AtRest(codec="zstd-planes")
    assert bytes(ar.unwrap(ar.wrap(blob))) == blob


def test_any_reader_opens_any_codec() -> None:
    blob = bf16_chunk()
    lossy = bytes(AtRest(codec="fp8").unwrap(AtRest(codec="fp8").wrap(blob)))
    assert lossy != blob and len(lossy) == len(blob)
    for writer in at_rest.CODECS:
        stored = AtRest(codec=writer).wrap(blob)
        for reader in at_rest.CODECS:
            assert bytes(AtRest(codec=reader).unwrap(stored)) == (
                lossy if writer == "fp8" else blob
            )


def test_no_codec_no_keys_stores_the_chunk_as_it_is() -> None:
    blob = bf16_chunk()
    ar = AtRest()
    assert not ar.active and ar.wrap(blob) == blob and bytes(ar.unwrap(blob)) == blob


def test_every_flipped_byte_is_a_chunk_error() -> None:
    blob = bf16_chunk(n=2048)
    for ar in (AtRest(codec="zstd-planes"), AtRest(codec="zstd", keys=ring())):
        stored = ar.wrap(blob)
        for i in range(0, len(stored), 7):
            bad = bytearray(stored)
            bad[i] ^= 0x10
            with pytest.raises(codec.ChunkError):
                ar.unwrap(bytes(bad))
        with pytest.raises(codec.ChunkCorrupt):
            ar.unwrap(stored[:-1])


def _reheader(stored: bytes, **fields: int | bytes) -> bytes:
    """``stored`` with header fields replaced and both checksums recomputed: what a writer
    without the key can do."""
    import xxhash

    h, t = at_rest._HEAD, at_rest._TAIL
    head = list(h.unpack(stored[: h.size]))
    tail = list(t.unpack(stored[h.size : h.size + t.size]))
    names_h = ["magic", "version", "codec", "flags", "key_id", "raw_len", "stored_len"]
    names_t = ["nonce", "tenant", "key", "parent", "position"]
    for k, v in fields.items():
        if k in names_h:
            head[names_h.index(k)] = v
        else:
            tail[names_t.index(k)] = v
    body = stored[at_rest.HEADER_SIZE :]
    fixed = h.pack(*head) + t.pack(*tail) + at_rest._SUM.pack(xxhash.xxh3_64_intdigest(body))
    header = fixed + b"\0" * (at_rest.HEADER_SIZE - len(fixed) - 4)
    return header + struct.pack("<I", xxhash.xxh32_intdigest(header)) + body


def test_a_copy_relabelled_to_another_tenant_fails_its_tag() -> None:
    ar = AtRest(codec="zstd", keys=ring())
    stored = ar.wrap(bf16_chunk(tenant="acme"))
    assert ar.unwrap(_reheader(stored))  # the helper alone changes nothing
    moved = _reheader(stored, tenant=b"globex".ljust(32, b"\0"))
    with pytest.raises(codec.ChunkForged):
        ar.unwrap(moved)
    with pytest.raises(codec.ChunkForged):  # nor another codec's name
        ar.unwrap(_reheader(stored, codec=2))
    with pytest.raises(codec.ChunkForged):  # nor another chunk's key, parent or position
        ar.unwrap(_reheader(stored, key=b"\x11" * 16))
    with pytest.raises(codec.ChunkForged):
        ar.unwrap(_reheader(stored, position=7))


def test_describe_reads_the_clear_fields_without_a_key() -> None:
    blob = bf16_chunk(tenant="acme")
    meta = codec.parse_header(blob)[0]
    stored = AtRest(codec="zstd-planes", keys=ring()).wrap(blob)
    info = at_rest.describe(stored[: at_rest.HEADER_SIZE])
    assert (info.key, info.parent, info.position, info.tenant) == (
        meta.key, meta.parent, meta.position, "acme")  # fmt: skip
    assert info.size == len(stored)
    bad = bytearray(stored[: at_rest.HEADER_SIZE])
    bad[40] ^= 1
    with pytest.raises(codec.ChunkCorrupt):
        at_rest.describe(bad)
    with pytest.raises(codec.ChunkMismatch):  # an older envelope version: unknown here
        at_rest.describe(_reheader(stored, version=1)[: at_rest.HEADER_SIZE])


def test_tenants_get_different_keys() -> None:
    r = ring()
    a, b = r.aead(1, b"acme".ljust(32, b"\0")), r.aead(1, b"globex".ljust(32, b"\0"))
    nonce = bytes(12)
    assert a.encrypt(nonce, b"kv", b"") != b.encrypt(nonce, b"kv", b"")


def test_another_ring_or_no_ring_never_reads_a_sealed_copy() -> None:
    stored = AtRest(keys=ring()).wrap(bf16_chunk())
    with pytest.raises(codec.ChunkForged):  # same id, another master key
        AtRest(keys=ring("1 " + K2.hex())).unwrap(stored)
    with pytest.raises(KeyUnavailable):  # a key id this reader lacks
        AtRest(keys=ring("2 " + K2.hex())).unwrap(stored)
    with pytest.raises(KeyUnavailable):
        AtRest().unwrap(stored)


def test_rotation_new_writes_take_the_new_key_old_copies_read_until_retired() -> None:
    old = AtRest(keys=ring(f"1 {K1.hex()}")).wrap(bf16_chunk())
    rotated = AtRest(keys=ring(f"1 {K1.hex()}; 2 {K2.hex()}"))
    new = rotated.wrap(bf16_chunk())
    assert at_rest._HEAD.unpack(new[: at_rest._HEAD.size])[4] == 2
    assert bytes(rotated.unwrap(old)) == bytes(rotated.unwrap(new)) == bf16_chunk()
    retired = AtRest(keys=ring(f"1 {K1.hex()} retired; 2 {K2.hex()}"))
    with pytest.raises(KeyUnavailable, match="retired"):
        retired.unwrap(old)
    assert bytes(retired.unwrap(new)) == bf16_chunk()


def test_a_sealing_reader_refuses_plaintext() -> None:
    blob = bf16_chunk()
    sealing = AtRest(keys=ring())
    with pytest.raises(PlainRefused):
        sealing.unwrap(blob)
    with pytest.raises(PlainRefused):
        sealing.unwrap(AtRest(codec="zstd").wrap(blob))


def test_a_forged_size_is_refused_before_anything_is_inflated() -> None:
    stored = AtRest(codec="zstd").wrap(bf16_chunk())
    with pytest.raises(codec.ChunkCorrupt, match="over"):
        AtRest().unwrap(_reheader(stored, raw_len=at_rest.MAX_RAW + 1))
    with pytest.raises(codec.ChunkCorrupt, match="frame size"):
        AtRest().unwrap(_reheader(stored, raw_len=100))


@pytest.mark.parametrize(
    ("text", "msg"),
    [
        ("", "no keys"),
        ("1", "expected"),
        ("x " + K1.hex(), "hex digits"),
        ("1 zz", "hex digits"),
        ("1 " + K1.hex()[:40], "at least 32"),
        (f"1 {K1.hex()}\n1 {K2.hex()}", "twice"),
        (f"1 {K1.hex()} retired", "every key is retired"),
        (f"1 {K1.hex()} old", "expected"),
        (f"0 {K1.hex()}", "outside"),
    ],
)
def test_a_bad_key_ring_is_one_line_naming_where(text: str, msg: str) -> None:
    with pytest.raises(KeyRingError, match=msg) as e:
        KeyRing.parse(text, "$VAR")
    assert str(e.value).startswith("$VAR") and "\n" not in str(e.value)


def test_the_ring_comes_from_the_environment_or_a_file(tmp_path: pytest.TempPathFactory) -> None:
    assert KeyRing.from_env({}) is None
    r = KeyRing.from_env({at_rest.ENV_KEYS: f"# the first\n3 {K1.hex()}"})
    assert r is not None and r.active == 3 and K1.hex() not in repr(r)
    f = tmp_path / "keys"  # type: ignore[operator]
    f.write_text(f"1 {K1.hex()} retired\n2 {K2.hex()}\n")
    r = KeyRing.from_env({at_rest.ENV_KEY_FILE: str(f)})
    assert r is not None and r.active == 2 and r.retired == {1}
    with pytest.raises(KeyRingError, match="cannot read"):
        KeyRing.from_env({at_rest.ENV_KEY_FILE: str(f) + ".missing"})


def test_an_unsealed_envelopes_clear_fields_must_be_its_chunks() -> None:
    """Without a tag, a relabelled tenant (or chain) would only need a fixed checksum: the
    opened chunk's own header must agree, or a restart scan would book it elsewhere."""
    ar = AtRest(codec="zstd")
    stored = ar.wrap(bf16_chunk(tenant="acme"))
    assert ar.unwrap(_reheader(stored))
    with pytest.raises(codec.ChunkCorrupt, match="clear fields"):
        ar.unwrap(_reheader(stored, tenant=b"globex".ljust(32, b"\0")))
    with pytest.raises(codec.ChunkCorrupt, match="clear fields"):
        ar.unwrap(_reheader(stored, position=9))


def test_an_unknown_envelope_version_is_a_mismatch_not_damage() -> None:
    stored = bytearray(AtRest(codec="zstd").wrap(bf16_chunk()))
    stored[4] = at_rest.VERSION + 1  # a later release's envelope
    with pytest.raises(at_rest.EnvelopeUnknown):
        AtRest().unwrap(bytes(stored))
