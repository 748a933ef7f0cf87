"""Chunks across TP sizes: which KV heads of which writer shard a reader rank takes.

With full attention and ``R`` dividing the model's ``H`` KV heads, vLLM gives rank ``r``
heads ``[r*H/R, (r+1)*H/R)``, and a chunk written by shard ``w`` of ``W`` holds exactly
those of its writer (payload ``[L, n, H/W, N, C]``, keyed by ``w/W``). A reader at
another TP size takes from each writer shard the heads it shares with its own: a head
slice of one chunk when it runs more ranks (R > W), the join of several chunks when it
runs fewer (R < W). A same-TP reader reads its own shard's chunk as before.

Which other sizes wrote is the operator's setting (``peer_tp_sizes``): the decode never
learns the prefill's TP size otherwise, and guessing would cost a lookup per size.
No vLLM or torch import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiered_cache.keys import ModelFingerprint


@dataclass(frozen=True)
class HeadPart:
    """Heads ``src`` of writer shard ``shard``'s payload go to heads ``dst`` of this rank."""

    shard: int
    src: tuple[int, int]
    dst: tuple[int, int]


def head_parts(total_heads: int, shards: int, shard: int, writer_shards: int) -> list[HeadPart]:
    """What rank ``shard`` of ``shards`` reads of a chunk ``writer_shards`` shards wrote."""
    if total_heads % shards or total_heads % writer_shards:
        raise ValueError(
            f"{total_heads} KV heads do not split evenly over {shards} and {writer_shards} "
            "shards"
        )
    mine, theirs = total_heads // shards, total_heads // writer_shards
    lo, hi = shard * mine, (shard + 1) * mine
    out: list[HeadPart] = []
    for w in range(lo // theirs, -(-hi // theirs)):
        a, b = max(lo, w * theirs), min(hi, (w + 1) * theirs)
        out.append(HeadPart(w, (a - w * theirs, b - w * theirs), (a - lo, b - lo)))
    return out


def shard_fingerprint(fp: ModelFingerprint, shard: int, shards: int) -> ModelFingerprint:
    """The fingerprint shard ``shard`` of a ``shards``-shard pool keys its chunks by."""
    if fp.tp_rank == shard and fp.tp_world_size == shards:
        return fp
    return dataclasses.replace(fp, tp_rank=shard, tp_world_size=shards)


def parse_sizes(value: Any) -> list[int]:
    """``peer_tp_sizes`` as given: ``2``, ``"1,2"`` or ``[1, 2]``."""
    if value is None or value == "" or value == []:
        return []
    items = value.split(",") if isinstance(value, str) else (
        list(value) if isinstance(value, (list, tuple)) else [value]
    )
    out: list[int] = []
    for it in items:
        try:
            n = int(str(it).strip())
        except ValueError:
            n = 0
        if n <= 0:
            raise ValueError(
                f"peer_tp_sizes must list positive TP sizes (e.g. [1, 2] or \"1,2\"), "
                f"got {value!r}"
            )
        if n not in out:
            out.append(n)
    return out


def peer_shards(
    sizes: list[int],
    *,
    tp_size: int,
    shards: int,
    rank_heads: int,
    total_heads: int | None,
    shards_at: Callable[[int], int],
) -> list[int]:
    """The writer shard counts, other than this pool's, to read chunks from: one per
    size in ``sizes`` whose KV is cut differently (``shards_at(size)``: MLA's is one
    shard at every size, so its pools already share keys). Refused with one line where
    the heads cannot be split or joined: replicated KV heads (fewer than TP) or a size
    that does not divide them."""
    out: list[int] = []
    total = total_heads if total_heads else rank_heads * shards
    for size in sizes:
        n = shards_at(size)
        if n == shards or n in out:
            continue
        if shards != tp_size or total != rank_heads * shards:
            raise ValueError(
                f"peer_tp_sizes={sizes}: this model's {total} KV heads are replicated "
                f"across {tp_size} ranks, so chunks cannot be split across TP sizes; "
                f"remove peer_tp_sizes or run both pools at TP {tp_size}"
            )
        if total % n:
            raise ValueError(
                f"peer_tp_sizes={sizes}: TP {size} does not divide this model's {total} KV "
                f"heads; list only sizes that do"
            )
        out.append(n)
    return out
