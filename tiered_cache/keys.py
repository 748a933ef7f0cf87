"""Chunk identity: model fingerprints and chained prefix hashes.

A chunk key is ``sha256(parent_digest || token_bytes)`` truncated to 128 bits and rendered
as 32 lowercase hex characters, so it is safe as a file name, an S3 key and a Redis key.
The chain is seeded with the model fingerprint and an optional ``cache_salt``, so two
models (or two tenants) never share a key. Tokens are hashed as little-endian int32 bytes
through numpy, so there is no per-token Python work.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np

KEY_HEX_LEN = 32
KEY_BYTES = KEY_HEX_LEN // 2
# fullmatch, not "$": "$" also matches before a trailing newline, which would let
# "<32 hex>\n" into file names, object keys and Redis keys.
_KEY_RE = re.compile(r"[0-9a-f]{32}")

DEFAULT_CHUNK_SIZE = 256
# The fingerprint fields that identify the weights (all optional, "" when unknown).
IDENTITY_FIELDS = ("revision", "quantization", "overrides", "weights", "cache_epoch")


@dataclass(frozen=True)
class ModelFingerprint:
    """What must match for a KV chunk to be valid on a reader.

    Covers model id, KV dtype, KV layout, block size and tensor-parallel placement, and
    what says which weights produced the KV (``IDENTITY_FIELDS``): the model and code
    revisions, the quantization, config overrides, the checkpoint files' identity
    (``connectors.vllm_common.weights_identity``) and the operator's ``cache_epoch``.
    """

    model_id: str
    dtype: str = "float32"
    kv_layout: str = "LBHNC"
    block_size: int = 16
    tp_rank: int = 0
    tp_world_size: int = 1
    chunk_size: int = DEFAULT_CHUNK_SIZE
    revision: str = ""
    quantization: str = ""
    overrides: str = ""  # canonical JSON of the overrides that change the weights' output
    weights: str = ""  # digest of the checkpoint files (names, sizes, mtimes)
    cache_epoch: str = ""

    def __post_init__(self) -> None:
        if self.chunk_size <= 0 or self.block_size <= 0:
            raise ValueError("chunk_size and block_size must be positive")
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size {self.chunk_size} must be a multiple of block_size {self.block_size}"
            )
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for world {self.tp_world_size}")

    def canonical(self) -> bytes:
        base = (
            f"tiered-cache/v1|model={self.model_id}|dtype={self.dtype}|layout={self.kv_layout}"
            f"|block={self.block_size}|chunk={self.chunk_size}"
            f"|tp={self.tp_rank}/{self.tp_world_size}"
        )
        # Only the identity fields that are set, as one JSON object (no separator can be
        # forged inside a value): a fingerprint without them keeps its old digest.
        ident = {f: str(getattr(self, f)) for f in IDENTITY_FIELDS if getattr(self, f)}
        if ident:
            base += "|id=" + json.dumps(ident, sort_keys=True, separators=(",", ":"))
        return base.encode()

    @property
    def digest(self) -> bytes:
        """16-byte fingerprint stored in every chunk header."""
        return hashlib.sha256(self.canonical()).digest()[:KEY_BYTES]

    @property
    def hex(self) -> str:
        return self.digest.hex()


def is_valid_key(key: object) -> TypeGuard[str]:
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def _as_int32_bytes(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    if arr.size and (arr.dtype.kind not in "iu"):
        raise TypeError(f"tokens must be integers, got {arr.dtype}")
    return arr.astype("<i4", copy=False)


def root_digest(fp: ModelFingerprint, cache_salt: str | None = None) -> bytes:
    h = hashlib.sha256(b"root|" + fp.digest)
    if cache_salt:
        h.update(b"|salt|" + cache_salt.encode())
    return h.digest()[:KEY_BYTES]


def chunk_keys(
    tokens: Sequence[int] | np.ndarray,
    fp: ModelFingerprint,
    cache_salt: str | None = None,
    *,
    include_partial: bool = False,
) -> list[str]:
    """Keys of the chunks of ``tokens``: full chunks, plus the partial tail if asked.

    The partial tail's key chains from the same parent, so a longer prompt's full chunk at
    that position has a different key (its token bytes differ).
    """
    arr = _as_int32_bytes(tokens)
    cs = fp.chunk_size
    n_full = arr.size // cs
    ends = [(i + 1) * cs for i in range(n_full)]
    if include_partial and arr.size % cs:
        ends.append(arr.size)
    parent = root_digest(fp, cache_salt)
    keys: list[str] = []
    start = 0
    for end in ends:
        d = hashlib.sha256(parent + arr[start:end].tobytes()).digest()[:KEY_BYTES]
        keys.append(d.hex())
        parent = d
        start = end
    return keys


def partial_keys(
    tokens: Sequence[int] | np.ndarray,
    fp: ModelFingerprint,
    cache_salt: str | None,
    parent_key: str | None,
    start: int,
    lengths: Sequence[int],
) -> list[str]:
    """Keys of partial chunks ``tokens[start : start + n]`` for each ``n`` in ``lengths``,
    chained from ``parent_key`` (the previous chunk's key; None for the first chunk).

    A partial tail chunk saved by an earlier, shorter prompt has such a key: a longer
    prompt that shares those tokens finds it by asking for these keys (connector: the
    block-aligned tails of multi-turn conversations)."""
    arr = _as_int32_bytes(tokens)
    parent = bytes.fromhex(parent_key) if parent_key else root_digest(fp, cache_salt)
    # One running hash, copied at each length: a probe of every token length of a chunk
    # (``probe_lengths``) costs one pass over its tokens, not one per length.
    out: dict[int, str] = {}
    h = hashlib.sha256(parent)
    at = start
    for n in sorted(set(lengths)):
        h.update(arr[at : start + n].tobytes())
        at = start + n
        out[n] = h.copy().digest()[:KEY_BYTES].hex()
    return [out[n] for n in lengths]


def probe_lengths(span_tokens: int) -> list[int]:
    """Candidate lengths, longest first, of an earlier prompt's partial chunk inside a
    chunk span of ``span_tokens``: every length, not only whole blocks. A conversation's
    previous turn ended anywhere in the chunk, and its exact tail is what the next turn
    shares; probing block multiples only lost up to a block per turn (127 tokens with
    vLLM CPU's 128-token blocks)."""
    return list(range(span_tokens, 0, -1))
