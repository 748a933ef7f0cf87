"""Lossy fp8 (e4m3) storage of a bf16 or fp16 KV payload, with a power-of-two scale per
(layer, KV head): the at-rest codec ``fp8`` (``tiered_cache.at_rest``).

- **Groups.** A connector chunk's payload is ``[layers, blocks, heads, tokens, C]``
  (``connectors.vllm_kvio``): one scale per (layer, head), over all of the chunk's tokens,
  as KV's range differs far more between heads than between tokens. A 4-D payload (one of
  LMCache's ``[2, layers, tokens, hidden]`` formats) gets one per (K/V, layer), one of 2 or
  3 dimensions one per leading index, and a flat one a single scale.
- **Scales are powers of two**, ``2**k`` with ``k`` the smallest exponent that brings the
  group's largest magnitude within e4m3's 448. Scaling is then exact: encoding is one
  multiply and a 32 Ki-entry lookup of the scaled value (round to nearest, ties to even),
  decoding one 256-entry table per group. e4m3's relative precision is
  the same across its normal range, so a power of two costs at most the top binade.
- **Exact steps only, no torch.** Lookups and power-of-two multiplies on the values' bit
  patterns, so a reader on any machine rebuilds the same bytes, bit for bit: the writer
  signs the header of exactly what readers will rebuild (``at_rest``).

Stored: ``k`` as int8 per group, then one byte per value (sign | exponent 4 | mantissa 3).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

#: Mantissa bits of the 16-bit dtypes fp8 takes.
MANTISSA_BITS = {"bfloat16": 7, "float16": 10}
E4M3_MAX = 448.0
_MAX_BYTE = 0x7E  # 448; 0x7F is NaN in e4m3fn
_K_RANGE = (-100, 100)  # keeps every decoded bf16 value normal; fp16 rounds its own


#: The fewest values a scale may cover: bounds the per-group decode loop (a forged shape
#: of one value a group would make it run once per value).
MIN_GROUP = 1024


def supported(dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether fp8 takes a payload: 16-bit floats, no empty dimension, groups of at least
    ``MIN_GROUP`` values (a connector chunk's (layer, head) holds thousands)."""
    if dtype not in MANTISSA_BITS or not shape or min(shape) < 1:
        return False
    return math.prod(shape) >= MIN_GROUP * groups(shape)


def group_axes(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The axes a scale is kept per: (layer, head) for a connector chunk."""
    if len(shape) == 5:
        return (0, 2)
    if len(shape) == 4:
        return (0, 1)
    return (0,) if len(shape) > 1 else ()


def _e4m3() -> np.ndarray:
    """Values of the positive finite e4m3 bytes 0..0x7E, increasing with the byte."""
    b = np.arange(_MAX_BYTE + 1)
    e, m = b >> 3, (b & 7).astype(np.float64)
    return np.where(e == 0, m * 2.0**-9, (1 + m / 8) * np.exp2(e - 7.0))


@cache
def _magnitudes(mbits: int) -> np.ndarray:
    """float64 value of every 15-bit magnitude code of the dtype (inf and NaN: inf)."""
    codes = np.arange(1 << 15, dtype=np.uint32)
    with np.errstate(invalid="ignore"):
        if mbits == 7:
            v = (codes << 16).view(np.float32).astype(np.float64)
        else:
            v = codes.astype(np.uint16).view(np.float16).astype(np.float64)
    return np.where(np.isnan(v), np.inf, v)


@cache
def _encode_lut(mbits: int) -> np.ndarray:
    """Magnitude code -> e4m3 byte, round to nearest, ties to the even byte, saturating."""
    t, v = _e4m3(), _magnitudes(mbits)
    hi = np.clip(np.searchsorted(t, v), 1, _MAX_BYTE)
    lo = hi - 1
    d_lo, d_hi = v - t[lo], t[hi] - v
    pick = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return np.where(v >= E4M3_MAX, _MAX_BYTE, pick).astype(np.uint8)


@cache
def _decode_table(mbits: int, k: int) -> np.ndarray:
    """e4m3 byte -> the dtype's bit pattern of its value times ``2**k``."""
    t = np.concatenate([_e4m3(), [E4M3_MAX]])  # 0x7F is never written
    with np.errstate(over="ignore"):  # only a forged k overflows: a checksum then fails
        v = np.concatenate([t, -t]) * 2.0**k
    if mbits == 7:
        return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return v.astype(np.float16).view(np.uint16)


def _exponents(amax: np.ndarray, mbits: int) -> np.ndarray:
    v = _magnitudes(mbits)[amax]
    with np.errstate(divide="ignore"):
        k = np.ceil(np.log2(np.where(v > 0, v, E4M3_MAX) / E4M3_MAX))
    k = np.where(np.isfinite(k), k, _K_RANGE[1])
    k = k + (v / np.exp2(k) > E4M3_MAX)  # log2's rounding, never past 448
    return np.clip(k, *_K_RANGE).astype(np.int8)


def encode(values: np.ndarray, dtype: str) -> bytes:
    """``values``: the payload as uint16 bit patterns, in its chunk shape."""
    mbits = MANTISSA_BITS[dtype]
    axes = group_axes(values.shape)
    reduce = tuple(a for a in range(values.ndim) if a not in axes)
    mag = values & np.uint16(0x7FFF)  # the order of magnitudes is their codes' order
    amax = mag.max(axis=reduce, keepdims=True) if reduce else mag
    k = _exponents(amax, mbits)
    # value / 2**k is exact (a power of two), and so is its return to the 16-bit dtype:
    # fewer significant bits than the dtype holds, within e4m3's range.
    scale = np.exp2(-k.astype(np.float32))
    if mbits == 7:
        wide = (values.astype(np.uint32) << 16).view(np.float32) * scale
        scaled = (wide.view(np.uint32) >> 16).astype(np.uint16)
    else:
        scaled = (values.view(np.float16).astype(np.float32) * scale).astype(np.float16)
        scaled = scaled.view(np.uint16)
    scaled &= np.uint16(0x7FFF)
    q = _encode_lut(mbits)[scaled]
    q |= ((values >> np.uint16(8)) & np.uint16(0x80)).astype(np.uint8)
    return k.tobytes() + q.tobytes()


def groups(shape: tuple[int, ...]) -> int:
    return math.prod(shape[a] for a in group_axes(shape))


def encoded_size(shape: tuple[int, ...]) -> int:
    return groups(shape) + math.prod(shape)


def decode(stored: bytes | memoryview, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """The uint16 bit patterns ``encode`` stood for (``ValueError`` on a wrong length)."""
    mbits = MANTISSA_BITS[dtype]
    mv = memoryview(stored)
    ng = groups(shape)
    if mv.nbytes != encoded_size(shape):
        raise ValueError(f"fp8: {mv.nbytes} B for shape {shape}, expected {encoded_size(shape)}")
    axes = group_axes(shape)
    k = np.frombuffer(mv[:ng], dtype=np.int8).reshape([shape[a] for a in axes])
    q = np.frombuffer(mv[ng:], dtype=np.uint8).reshape(shape)
    out = np.empty(shape, dtype=np.uint16)
    # One table per group (256 entries): a take per (layer, head), not per token.
    for idx in np.ndindex(*k.shape):
        sl: list[int | slice] = [slice(None)] * len(shape)
        for a, i in zip(axes, idx, strict=True):
            sl[a] = i
        s = tuple(sl)
        np.take(_decode_table(mbits, int(k[idx])), q[s], out=out[s])
    return out
