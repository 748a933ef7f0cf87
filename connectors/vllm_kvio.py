"""Chunk math and paged-KV block copies for the vLLM connector. No vLLM imports.

vLLM hands a connector one tensor per attention layer whose first dimension is the block
id (``[num_blocks, H, block_size, C]`` in 0.32/0.33, strided per the KV cache layout; MLA
uses ``H == 1``; see ``PagedKV`` for kernel-split views). A block is copied as an opaque
unit: on the CPU backend each (block, head) holds all K then all V, on CUDA each token holds
K|V, and neither matters here because K and V are never split.

A chunk's payload is the chunk's blocks of every layer, as one buffer shaped
``[num_layers, n_blocks, *block_shape]``: one ``index_select`` per layer writes it, one
``index_copy_`` per layer reads it back. There is no per-token Python work.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.uint8: "uint8",
    torch.int8: "int8",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _name
_DTYPES_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}") from None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- chunk math


@dataclass(frozen=True)
class ChunkSpan:
    """Chunk ``index`` covers tokens [start, end) and blocks [first_block, end_block)."""

    index: int
    start: int
    end: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def first_block(self) -> int:
        return self.start // self.block_size

    @property
    def end_block(self) -> int:
        return cdiv(self.end, self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.end_block - self.first_block


def chunk_spans(
    num_tokens: int, chunk_size: int, block_size: int, *, include_partial: bool = True
) -> list[ChunkSpan]:
    """Spans in ``keys.chunk_keys`` order (full chunks, then the partial tail if asked)."""
    if chunk_size % block_size:
        raise ValueError(f"chunk_size {chunk_size} is not a multiple of block_size {block_size}")
    n_full = num_tokens // chunk_size
    spans = [ChunkSpan(i, i * chunk_size, (i + 1) * chunk_size, block_size) for i in range(n_full)]
    if include_partial and num_tokens % chunk_size:
        spans.append(ChunkSpan(n_full, n_full * chunk_size, num_tokens, block_size))
    return spans


def loadable_spans(num_prompt_tokens: int, chunk_size: int, block_size: int) -> list[ChunkSpan]:
    """Chunks worth loading for a prompt: those holding a token before the last one.

    vLLM must compute the last prompt token itself (to sample from it), so a tail chunk
    that holds only that token is useless.
    """
    limit = num_prompt_tokens - 1
    return [
        s
        for s in chunk_spans(num_prompt_tokens, chunk_size, block_size, include_partial=True)
        if s.start < limit
    ]


@dataclass(frozen=True)
class BlockRange:
    """Blocks [lo, hi) (indices into the request's block table) of chunk ``span``."""

    span: ChunkSpan
    lo: int
    hi: int


def load_block_ranges(
    spans: Sequence[ChunkSpan], start_token: int, end_token: int
) -> list[BlockRange]:
    """Which blocks of which chunks to write for loading tokens [start_token, end_token).

    Blocks are written whole: ``start_token`` is block aligned in vLLM (its local hit),
    and an unaligned one rewrites its block's computed head with the same KV. The last
    block may be partial: it holds the true KV of the same prompt, and vLLM recomputes
    the tokens past ``end_token`` over it.
    """
    bs = spans[0].block_size if spans else 1
    lo_b, hi_b = start_token // bs, cdiv(end_token, bs)
    out: list[BlockRange] = []
    for s in spans:
        lo, hi = max(lo_b, s.first_block), min(hi_b, s.end_block)
        if lo < hi:
            out.append(BlockRange(s, lo, hi))
    return out


# ------------------------------------------------------------------------ paged KV access


class HostStaging:
    """A growable flat host byte buffer (pinned when the KV lives on an accelerator)."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._buf = torch.empty(0, dtype=torch.uint8)

    def reserve(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            size = max(nbytes, int(self._buf.numel() * 1.5))
            self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        return self._buf

    @property
    def capacity(self) -> int:
        return int(self._buf.numel())


def payload_tensor(
    payload: memoryview | bytes | bytearray, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """Zero-copy tensor over a chunk payload (a copy source, or a reserved DRAM slot to
    write a save into)."""
    mv = memoryview(payload).cast("B")
    with warnings.catch_warnings():
        # torch warns on read-only buffers; the tensor is only ever a copy source.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mv, dtype=torch.uint8)
    return flat.view(dtype).view(*shape)


# A chunk's blocks: vLLM's block ids, or (several KV cache groups) one list of them per group.
BlockIds = Sequence[int] | Sequence[Sequence[int]]
NULL_BLOCK = 0  # vLLM's null block (``BlockPool.null_block``): a sliding window's freed slots


class PagedKV:
    """The layers' paged KV tensors, in a fixed layer order, indexed by vLLM's block ids.

    vLLM 0.32 hands connectors ``[B, H, N, C]`` views whose strides follow the resolved
    ``KVCacheLayout`` (``LBNHC``, ``LBHNC``, block-outermost ``BL..`` ones) and, where the
    attention backend takes smaller blocks than ``--block-size`` (FlashInfer 16-64, FlashMLA
    64, CUTLASS MLA 128), whose first dimension counts *kernel* blocks: ``num_blocks *
    ratio`` of ``N = block_size / ratio`` tokens (``v1/kv_cache_interface.py``,
    ``create_kv_cache_views``). Given vLLM's ``block_size``, such views (``N < block_size``)
    are grouped back into scheduler blocks (as vLLM's ``group_kernel_blocks`` does), and a block's
    payload is always the canonical ``[H, block_size, C]``: a chunk written under one kernel
    split loads under another.
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        names: Sequence[str] | None = None,
        block_size: int | None = None,
    ):
        if not layers:
            raise ValueError("no KV cache layers")
        first = layers[0]
        for t in layers:
            if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
                raise ValueError(
                    "all KV layers must share one block shape and dtype, got "
                    f"{tuple(t.shape)}/{t.dtype} vs {tuple(first.shape)}/{first.dtype}"
                )
            if t.device != first.device:
                raise ValueError("all KV layers must be on one device")
        rows = int(first.shape[0])
        self.ratio = 1  # kernel blocks per scheduler block
        if block_size is not None and first.dim() == 4 and first.shape[2] != block_size:
            n = int(first.shape[2])
            if block_size % n or rows % (block_size // n):
                raise ValueError(
                    f"KV views {tuple(first.shape)} hold {n}-token blocks, which do not "
                    f"divide --block-size {block_size}: unsupported KV cache layout"
                )
            self.ratio = block_size // n
        nb = rows // self.ratio
        self.layers = list(layers)
        # [B, ratio, H, N/ratio, C] views: one scheduler block per row (pure views).
        self._grouped = (
            [t.unflatten(0, (nb, self.ratio)) for t in layers] if self.ratio > 1 else self.layers
        )
        self.names = list(names) if names is not None else [str(i) for i in range(len(layers))]
        self._by_name = {n: i for i, n in enumerate(self.names)}
        self.num_layers = len(layers)
        self.num_blocks = nb
        shape = tuple(int(x) for x in first.shape[1:])
        if self.ratio > 1:
            h, n, c = shape
            shape = (h, n * self.ratio, c)
        self.block_shape = shape
        self.dtype = first.dtype
        self.device = first.device
        self.on_host = first.device.type == "cpu"
        self.block_bytes = math.prod(shape) * first.element_size()
        # All layers as one [L, B, ...] view when vLLM laid them out at one stride in one
        # buffer (it does: allocate_kv_cache): a load then writes every layer of a chunk with
        # one kernel instead of one per layer.
        self._stack = _stacked(self.layers)
        if self._stack is not None and self.ratio > 1:
            self._stack = self._stack.unflatten(1, (nb, self.ratio))

    @property
    def kernel_block_tokens(self) -> int | None:
        """Tokens per kernel block when views are split (None when they are not)."""
        return self.block_shape[1] // self.ratio if self.ratio > 1 else None

    def payload_shape(self, n_blocks: int, heads: int | None = None) -> tuple[int, ...]:
        """``[L, n_blocks, H, N, C]``; with ``heads``, a payload of that many KV heads (a
        chunk another TP size wrote)."""
        if heads is None:
            return (self.num_layers, n_blocks, *self.block_shape)
        return (self.num_layers, n_blocks, heads, *self.block_shape[1:])

    def payload_nbytes(self, n_blocks: int) -> int:
        return self.num_layers * n_blocks * self.block_bytes

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        if self.device.type == "cpu":
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise IndexError(f"block id out of range [0, {self.num_blocks}): {list(block_ids)}")

    def layer_index(self, name: str) -> int | None:
        return self._by_name.get(name)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        """A canonical ``[n, H, r*N, C]`` tensor as ``[n, r, H, N, C]`` (a permuted view)."""
        n, h = t.shape[0], t.shape[1]
        _, tok, c = self.block_shape
        return t.view(n, h, self.ratio, tok // self.ratio, c).permute(0, 2, 1, 3, 4)

    def gather_layer_parts(
        self, li: int, idx: torch.Tensor, parts: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Layer ``li``'s blocks ``idx`` into several host tensors: rows [a, b) of ``idx``
        into ``out`` ([b - a, *block]) for each ``(a, b, out)``. On an accelerator one gather
        kernel serves them all, then one copy per part leaves the device."""
        if self.on_host:
            for a, b, out in parts:
                self.gather_layer(li, idx[a:b], out)
            return
        g = self._grouped[li].index_select(0, idx)
        if self.ratio > 1:
            g = g.permute(0, 2, 1, 3, 4).reshape(g.shape[0], *self.block_shape)
        for a, b, out in parts:
            out.copy_(g[a:b], non_blocking=True)

    def gather_layer_local(self, li: int, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Layer ``li``'s blocks ``idx`` into ``out`` ([n, *block_shape]) on the KV's own
        device, in canonical order: one kernel, nothing leaves the device."""
        if self.ratio == 1:
            torch.index_select(self.layers[li], 0, idx, out=out)
        else:
            self._split(out).copy_(self._grouped[li].index_select(0, idx))

    def gather_layer(self, li: int, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the blocks ``idx`` (from ``index``) of layer ``li`` into ``out`` ([n, *block],
        host). On an accelerator it is queued on the current stream."""
        if self.ratio == 1:
            layer = self.layers[li]
            if self.on_host:
                torch.index_select(layer, 0, idx, out=out)
            else:
                out.copy_(layer.index_select(0, idx), non_blocking=True)
            return
        g = self._grouped[li].index_select(0, idx)  # [n, r, H, N, C], on the KV's device
        canon = g.permute(0, 2, 1, 3, 4)  # token r*N + t of a block is kernel block r's t
        if self.on_host:
            out.view(canon.shape).copy_(canon)
        else:  # reorder on the device (cheap), then one contiguous D2H copy
            out.copy_(canon.contiguous().view(out.shape), non_blocking=True)

    def count(self, block_ids: BlockIds) -> int:
        """Blocks in ``block_ids`` (a chunk's)."""
        return len(block_ids)

    def concat(self, parts: Sequence[BlockIds]) -> BlockIds:
        """Several chunks' blocks as one, in order."""
        return [b for ids in parts for b in cast(Sequence[int], ids)]

    def index(self, block_ids: BlockIds) -> torch.Tensor:
        ids = cast(Sequence[int], block_ids)
        self._check_ids(ids)
        return self._index(ids)

    def gather(self, block_ids: BlockIds, out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out`` ([L, n, *block_shape], host).

        On an accelerator the copies are queued on the current stream.
        """
        idx = self.index(block_ids)
        if self.on_host:
            for li in range(self.num_layers):
                self.gather_layer(li, idx, out[li])
            return
        # Gather every layer on the device, then one large D2H copy.
        if self._stack is not None:
            g = self._stack.index_select(1, idx)  # [L, n, (r,) H, N, C]
            if self.ratio > 1:
                g = g.permute(0, 1, 3, 2, 4, 5)
            out.copy_(g.reshape(out.shape), non_blocking=True)
            return
        dev = torch.empty(out.shape, dtype=out.dtype, device=self.device)
        for li in range(self.num_layers):
            if self.ratio == 1:
                torch.index_select(self.layers[li], 0, idx, out=dev[li])
            else:  # canonical order: [n, r, H, N, C] -> [n, H, r*N, C]
                self._split(dev[li]).copy_(self._grouped[li].index_select(0, idx))
        out.copy_(dev, non_blocking=True)

    def scatter(
        self, block_ids: BlockIds, src: torch.Tensor, heads: tuple[int, int] | None = None
    ) -> None:
        """Write ``src`` ([L, n, *block_shape], host) into blocks ``block_ids`` of every layer.
        With ``heads`` (lo, hi), ``src`` holds KV heads [lo, hi) of each block only (part of
        a chunk written at another TP size) and the other heads are left as they are.

        On an accelerator the copies are queued on the current stream; ``src`` must stay
        valid (and unchanged) until they are done."""
        block_ids = cast(Sequence[int], block_ids)
        self._check_ids(block_ids)
        heads = self._check_payload(self.count(block_ids), src, heads)
        if heads is not None:
            self._scatter_heads(block_ids, src, heads)
            return
        idx = self._index(block_ids)
        if self.on_host and self._stack is not None and self.ratio == 1:
            # CPU: index_copy_ runs at ~0.5 GB/s there; a slice copy per run of consecutive
            # blocks, every layer at once, runs at memcpy speed.
            j = 0
            for a, n in _runs(block_ids):
                self._stack[:, a : a + n].copy_(src[:, j : j + n])
                j += n
            return
        # One H2D copy of the whole chunk (a pinned ``src`` makes it async), then per layer
        # one device-side index_copy_.
        dsrc = src if self.on_host else src.to(self.device, non_blocking=True)
        if self._stack is not None and not self.on_host:
            if self.ratio > 1:  # [L, n, H, r*N, C] -> [L, n, r, H, N, C]
                h, tok, c = self.block_shape
                n = len(block_ids)
                dsrc = dsrc.view(self.num_layers, n, h, self.ratio, tok // self.ratio, c)
                dsrc = dsrc.permute(0, 1, 3, 2, 4, 5)
            self._stack.index_copy_(1, idx, dsrc)
            return
        for li in range(self.num_layers):
            s = dsrc[li]
            if self.ratio > 1:
                s = self._split(s)
            self._grouped[li].index_copy_(0, idx, s)

    def _check_payload(
        self, n: int, src: torch.Tensor, heads: tuple[int, int] | None
    ) -> tuple[int, int] | None:
        """``heads`` as ``scatter`` uses it (None for all heads), once ``src`` is checked to
        be a payload of ``n`` blocks of them."""
        n_heads = self.block_shape[0]
        if heads is not None and tuple(heads) == (0, n_heads):
            heads = None
        want = self.payload_shape(n, None if heads is None else heads[1] - heads[0])
        if heads is not None and not 0 <= heads[0] < heads[1] <= n_heads:
            raise ValueError(f"head range {heads} outside [0, {n_heads})")
        if tuple(src.shape) != want:
            raise ValueError(f"payload shape {tuple(src.shape)} != {want}")
        return heads

    def _scatter_heads(
        self, block_ids: Sequence[int], src: torch.Tensor, heads: tuple[int, int]
    ) -> None:
        """``scatter`` into KV heads [lo, hi) of each block: a strided destination (per
        (layer, block), ``hi - lo`` heads of ``N x C`` each), one copy per layer."""
        lo, n = heads[0], heads[1] - heads[0]
        hdim = 2 if self.ratio > 1 else 1  # [B, (r,) H, N, C]
        if self.on_host and self._stack is not None and self.ratio == 1:
            j = 0
            dst = self._stack.narrow(2, lo, n)
            for a, k in _runs(block_ids):
                dst[:, a : a + k].copy_(src[:, j : j + k])
                j += k
            return
        idx = self._index(block_ids)
        dsrc = src if self.on_host else src.to(self.device, non_blocking=True)
        if self._stack is not None and not self.on_host and self.ratio == 1:
            self._stack.narrow(2, lo, n).index_copy_(1, idx, dsrc)  # every layer at once
            return
        for li in range(self.num_layers):
            s = dsrc[li]
            if self.ratio > 1:
                s = self._split(s)
            self._grouped[li].narrow(hdim, lo, n).index_copy_(0, idx, s)


class GroupedPagedKV(PagedKV):
    """Layers in several KV cache groups (vLLM's hybrid allocator: full attention and
    sliding window layers), each group with its own block ids: a chunk's blocks are one
    list per group, the payload is every layer in model order (as when vLLM makes them
    one group), and ``NULL_BLOCK`` stands where a sliding window has freed a block: a load
    skips it (the window needs only its own blocks), a save never names one. Each layer
    is copied on its own: a block id means another block in each group, so no view spans
    all layers."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        names: Sequence[str] | None,
        groups: Sequence[int],
        num_groups: int,
        block_size: int | None = None,
    ):
        super().__init__(layers, names, block_size)
        if len(groups) != self.num_layers or any(not 0 <= g < num_groups for g in groups):
            raise ValueError(f"layer groups {list(groups)} do not fit {num_groups} groups")
        self.groups = list(groups)
        self.num_groups = num_groups
        self._stack = None

    def _ids(self, block_ids: BlockIds) -> list[list[int]]:
        ids = [list(g) if isinstance(g, Sequence) else [] for g in block_ids]
        if len(ids) != self.num_groups or len({len(g) for g in ids}) != 1 or not ids[0]:
            raise ValueError(
                f"block ids must be {self.num_groups} equally long lists (one per KV cache "
                f"group), got {ids}"
            )
        return ids

    def count(self, block_ids: BlockIds) -> int:
        return len(self._ids(block_ids)[0])

    def concat(self, parts: Sequence[BlockIds]) -> BlockIds:
        out: list[list[int]] = [[] for _ in range(self.num_groups)]
        for p in parts:
            for g, ids in enumerate(self._ids(p)):
                out[g].extend(ids)
        return out

    def index(self, block_ids: BlockIds) -> torch.Tensor:
        """``[groups, n]``: what the ``gather_layer*`` methods take (a save's blocks)."""
        ids = self._ids(block_ids)
        flat = [b for g in ids for b in g]
        if NULL_BLOCK in flat:  # the scheduler saves only blocks every group holds
            raise ValueError(f"a save names a freed (null) block: {ids}")
        self._check_ids(flat)
        return self._index(flat).view(self.num_groups, -1)

    def _row(self, li: int, idx: torch.Tensor) -> torch.Tensor:
        return idx[self.groups[li]] if idx.dim() == 2 else idx

    def gather_layer(self, li: int, idx: torch.Tensor, out: torch.Tensor) -> None:
        super().gather_layer(li, self._row(li, idx), out)

    def gather_layer_local(self, li: int, idx: torch.Tensor, out: torch.Tensor) -> None:
        super().gather_layer_local(li, self._row(li, idx), out)

    def gather_layer_parts(
        self, li: int, idx: torch.Tensor, parts: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None:
        super().gather_layer_parts(li, self._row(li, idx), parts)

    def gather(self, block_ids: BlockIds, out: torch.Tensor) -> None:
        idx = self.index(block_ids)
        if self.on_host:
            for li in range(self.num_layers):
                self.gather_layer(li, idx, out[li])
            return
        dev = torch.empty(out.shape, dtype=out.dtype, device=self.device)
        for li in range(self.num_layers):
            self.gather_layer_local(li, idx, dev[li])
        out.copy_(dev, non_blocking=True)

    def scatter(
        self, block_ids: BlockIds, src: torch.Tensor, heads: tuple[int, int] | None = None
    ) -> None:
        ids = self._ids(block_ids)
        self._check_ids([b for g in ids for b in g])
        heads = self._check_payload(len(ids[0]), src, heads)
        lo, hi = heads if heads is not None else (0, self.block_shape[0])
        hdim = 2 if self.ratio > 1 else 1  # [B, (r,) H, N, C]
        keep = [[j for j, b in enumerate(g) if b != NULL_BLOCK] for g in ids]
        dsrc = src if self.on_host else src.to(self.device, non_blocking=True)
        fast = self.on_host and self.ratio == 1
        idx: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for li in range(self.num_layers):
            g = self.groups[li]
            if not keep[g]:
                continue  # all of this chunk is before the group's window
            dst = self._grouped[li]
            if heads is not None:
                dst = dst.narrow(hdim, lo, hi - lo)
            s = dsrc[li]
            if fast:  # CPU: a slice copy per run (index_copy_ is slow there)
                for j, b, k in _pair_runs(keep[g], ids[g]):
                    dst[b : b + k].copy_(s[j : j + k])
                continue
            if g not in idx:
                rows = [ids[g][j] for j in keep[g]]
                sel = None if len(rows) == len(ids[g]) else self._index(keep[g])
                idx[g] = (self._index(rows), sel)
            at, sel = idx[g]
            if sel is not None:
                s = s.index_select(0, sel)
            if self.ratio > 1:
                s = self._split(s)
            dst.index_copy_(0, at, s)


def _pair_runs(keep: Sequence[int], ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position, block id, length) runs over positions ``keep`` of ``ids`` where both
    the position and the block id go up by one."""
    out: list[tuple[int, int, int]] = []
    for j in keep:
        b = ids[j]
        if out and out[-1][0] + out[-1][2] == j and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((j, b, 1))
    return out


def _stacked(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[L, *shape]`` over layers that are equally strided views of one storage, each the
    same distance past the last (else None)."""
    first = layers[0]
    if len(layers) < 2:
        return first.unsqueeze(0)
    base = first.untyped_storage().data_ptr()
    step = layers[1].storage_offset() - first.storage_offset()
    if step <= 0:
        return None
    for i, t in enumerate(layers):
        if (
            t.untyped_storage().data_ptr() != base
            or t.stride() != first.stride()
            or t.storage_offset() - first.storage_offset() != i * step
        ):
            return None
    return torch.as_strided(
        first, (len(layers), *first.shape), (step, *first.stride()), first.storage_offset()
    )


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """``ids`` as (first, length) runs of consecutive values, in order."""
    out: list[tuple[int, int]] = []
    for b in ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out
