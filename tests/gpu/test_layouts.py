"""Every CUDA backend's KV layout, saved through the connector's copy path into real tiers
and loaded back into other blocks: every token of every layer exact, no other block
touched. Runs on CUDA where there is one (the copies then really are D2H/H2D on a side
stream), on CPU tensors elsewhere.

The saves run as the worker runs them (``KVCopier``: layer by layer into reserved DRAM
slots, inline or on the helper thread, some layers left to the end-of-step catch-up); the
loads read the DRAM tier's page-locked slots directly, or NVMe's bytes through staging.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.kv_copy import KVCopier
from connectors.kv_device import device_for
from connectors.vllm_kvio import (
    GroupedPagedKV,
    PagedKV,
    chunk_spans,
    dtype_name,
    payload_tensor,
)
from gpu.layouts import (
    BACKENDS,
    BY_NAME,
    GRID_DTYPES,
    LAYOUTS,
    KVShape,
    build_kv_caches,
    cases,
    spec_for,
)
from tiered_cache import codec

FP = b"\x01" * 16
CASES = cases()  # every dtype: drawn by the property test
GRID = cases(dtypes=GRID_DTYPES)  # run exhaustively
NUM_BLOCKS = 12


def canonical(views: list[torch.Tensor], block_size: int) -> torch.Tensor:
    """[L, B, H, block_size, C] bytes in token order, whatever the layout or kernel split
    (independent of PagedKV: the oracle)."""
    out = []
    for v in views:
        kb, h, n, c = v.shape
        r = block_size // n
        canon = v.unflatten(0, (kb // r, r)).permute(0, 2, 1, 3, 4).reshape(kb // r, h, block_size, c)
        out.append(canon.contiguous().view(torch.uint8))
    return torch.stack(out)


@dataclass
class Cache:
    spec: KVShape
    raw: torch.Tensor
    views: list[torch.Tensor]
    kv: PagedKV
    copier: KVCopier


def make_cache(case: tuple[str, str, str, int], device: torch.device, *,
               num_blocks: int = NUM_BLOCKS,
               copy_thread: bool = False, fill: int | None = None,
               device_path: bool = False) -> Cache:
    """``device_path``: on CPU tensors, run the code a GPU runs (one gather per layer for all
    chunks, all layers' scatter in one kernel, copies to and from host buffers)."""
    name, layout, dt, bs = case
    b = BY_NAME[name]
    spec = spec_for(b, dt, bs, num_blocks=num_blocks)
    raw, views = build_kv_caches(spec, layout, b.kernel_block_size(bs), device)
    if fill is None:
        raw.random_(-128, 128)
    else:
        raw.fill_(fill)
    kv = PagedKV(views, [f"layer.{i}" for i in range(len(views))], block_size=bs)
    assert kv.num_blocks == num_blocks and kv.block_shape == (spec.num_heads, bs, spec.content)
    if device_path:
        kv.on_host = False
    return Cache(spec, raw, views, kv, KVCopier(kv, device_for(views[0]), copy_thread=copy_thread))


def save(src: Cache, dram: Any, blocks: list[int], prompt_len: int, chunk: int,
         skip_layers: set[int]) -> list[tuple[str, int, int]]:
    """Save the prompt's chunks layer by layer into reserved DRAM slots, as the worker does.
    Returns (key, first block index, blocks) per chunk."""
    kv, bs = src.kv, src.spec.block_size
    spans = chunk_spans(prompt_len, chunk, bs)
    slots, dests, ids = [], [], []
    for s in spans:
        n = kv.payload_nbytes(s.num_blocks)
        slot = dram.reserve(codec.HEADER_SIZE + n)
        view = dram.slot_view(slot)
        slots.append((slot, n))
        dests.append(payload_tensor(view[codec.HEADER_SIZE : codec.HEADER_SIZE + n], kv.dtype,
                                    kv.payload_shape(s.num_blocks)))  # fmt: skip
        ids.append(blocks[s.first_block : s.end_block])
    sc = src.copier.begin_save(ids, dests)
    for li in range(kv.num_layers):
        if li not in skip_layers:  # a layer the model never reported: caught up at the end
            src.copier.save_layer(sc, li)
    src.copier.finish_save(sc)
    out = []
    for s, (slot, n) in zip(spans, slots, strict=True):
        view = dram.slot_view(slot)
        payload = view[codec.HEADER_SIZE : codec.HEADER_SIZE + n]
        key = uuid.uuid4().hex
        meta = codec.ChunkMeta(key=key, fingerprint=FP, num_tokens=s.num_tokens,
                               dtype=dtype_name(kv.dtype), shape=kv.payload_shape(s.num_blocks),
                               block_size=bs, position=s.index)  # fmt: skip
        view[: codec.HEADER_SIZE] = codec.pack_header(meta, payload)
        dram.commit(key, slot, codec.HEADER_SIZE + n)
        out.append((key, s.first_block, s.num_blocks))
    return out


def load(dst: Cache, tier: str, dram: Any, nvme: Any, chunks: list[tuple[str, int, int]],
         blocks: list[int]) -> None:
    """Load each chunk into ``blocks`` from DRAM (page-locked, read in place) or from NVMe
    (bytes through the copier's staging), verifying each as the client does."""
    kv, cp = dst.kv, dst.copier
    cp.reserve_staging(sum(kv.payload_nbytes(n) for _, _, n in chunks))
    cp.load_begin()
    for key, first, n in chunks:
        if tier == "dram":
            got = dram.acquire(key)
            assert got is not None
            slot, length = got
            try:
                _, payload = codec.decode(dram.slot_view(slot)[:length], expect_fingerprint=FP)
                src = payload_tensor(payload, kv.dtype, kv.payload_shape(n))
                cp.load_chunk(blocks[first : first + n], src,
                              src_pinned=cp.dev.needs_pinned and src.is_pinned())  # fmt: skip
            finally:
                dram.release(slot)
        else:
            data = asyncio.run(dram.get(key))  # written through to NVMe, then read back
            assert data is not None
            asyncio.run(nvme.put(key, data))
            raw = asyncio.run(nvme.get(key))
            assert raw is not None
            _, payload = codec.decode(raw, expect_fingerprint=FP)
            cp.load_chunk(blocks[first : first + n],
                          payload_tensor(payload, kv.dtype, kv.payload_shape(n)))  # fmt: skip
    cp.load_end()


def check(src: Cache, dst: Cache, src_blocks: list[int], dst_blocks: list[int],
          prompt_len: int, before: torch.Tensor) -> None:
    bs = src.spec.block_size
    a, b = canonical(src.views, bs).cpu(), canonical(dst.views, bs).cpu()
    nb = -(-prompt_len // bs)
    t = torch.arange(prompt_len)
    sb = torch.tensor(src_blocks[:nb])[t // bs]
    db = torch.tensor(dst_blocks[:nb])[t // bs]
    # a[l, block, h, token, c]: every prompt token of every layer and head, exact
    got = b[:, db, :, t % bs]
    want = a[:, sb, :, t % bs]
    assert torch.equal(got, want), "a loaded token differs from the saved one"
    untouched = sorted(set(range(dst.kv.num_blocks)) - set(dst_blocks[:nb]))
    assert torch.equal(b[:, untouched], before[:, untouched]), "a block outside was written"


def round_trip(case: tuple[str, str, str, int], dst_case: tuple[str, str, str, int],
               device: torch.device, dram: Any, nvme: Any, *, prompt_len: int, chunk_blocks: int,
               perm_seed: int, tier: str, copy_thread: bool, skip_layers: set[int],
               device_path: bool, staged: bool | None = None) -> None:
    """``staged``: force the device path's save to stage layers on the device (True) or to
    copy each layer of each chunk out as it is gathered (False); None: the size rule."""
    import connectors.kv_copy as kv_copy

    keep = kv_copy.PER_LAYER_COPY_MIN_BYTES
    if staged is not None:
        kv_copy.PER_LAYER_COPY_MIN_BYTES = 1 << 40 if staged else 0
    try:
        _round_trip(case, dst_case, device, dram, nvme, prompt_len=prompt_len,
                    chunk_blocks=chunk_blocks, perm_seed=perm_seed, tier=tier,
                    copy_thread=copy_thread, skip_layers=skip_layers,
                    device_path=device_path)  # fmt: skip
    finally:
        kv_copy.PER_LAYER_COPY_MIN_BYTES = keep


def _round_trip(case: tuple[str, str, str, int], dst_case: tuple[str, str, str, int],
                device: torch.device, dram: Any, nvme: Any, *, prompt_len: int,
                chunk_blocks: int, perm_seed: int, tier: str, copy_thread: bool,
                skip_layers: set[int], device_path: bool) -> None:
    bs = case[3]
    src = make_cache(case, device, copy_thread=copy_thread, device_path=device_path)
    dst = make_cache(dst_case, device, fill=0x5A, device_path=device_path)
    before = canonical(dst.views, bs).cpu()
    g = torch.Generator().manual_seed(perm_seed)
    src_blocks = torch.randperm(src.kv.num_blocks, generator=g).tolist()
    dst_blocks = torch.randperm(dst.kv.num_blocks, generator=g).tolist()
    chunks = save(src, dram, src_blocks, prompt_len, chunk_blocks * bs, skip_layers)
    try:
        load(dst, tier, dram, nvme, chunks, dst_blocks)
        if device.type == "cuda":
            torch.cuda.synchronize()
        check(src, dst, src_blocks, dst_blocks, prompt_len, before)
    finally:
        for key, _, _ in chunks:
            asyncio.run(dram.delete(key))
            asyncio.run(nvme.delete(key))


@pytest.mark.parametrize("case", GRID, ids=["-".join(map(str, c)) for c in GRID])
def test_every_backend_layout_round_trips(case: tuple[str, str, str, int], device: torch.device,
                                          dram: Any, nvme: Any) -> None:
    bs = case[3]
    round_trip(case, case, device, dram, nvme, prompt_len=7 * bs + bs // 2 + 1,
               chunk_blocks=2, perm_seed=1, tier="dram", copy_thread=False, skip_layers={1},
               device_path=True, staged=GRID.index(case) % 2 == 0)


def _compatible(case: tuple[str, str, str, int]) -> list[tuple[str, str, str, int]]:
    """Cases whose blocks hold the same bytes per token (same shape class, dtype, block
    size): a chunk written under one layout or kernel split must load under another."""
    mla = BY_NAME[case[0]].mla
    return [c for c in CASES if BY_NAME[c[0]].mla == mla and c[2:] == case[2:]]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_round_trip_property(data: st.DataObject, device: torch.device, dram: Any,
                             nvme: Any) -> None:
    case = data.draw(st.sampled_from(CASES), "case")
    dst_case = data.draw(st.sampled_from(_compatible(case)), "dst_case")
    bs = case[3]
    prompt_len = data.draw(st.integers(2, NUM_BLOCKS * bs), "prompt_len")
    round_trip(
        case, dst_case, device, dram, nvme,
        prompt_len=prompt_len,
        chunk_blocks=data.draw(st.sampled_from([1, 2, 4]), "chunk_blocks"),
        perm_seed=data.draw(st.integers(0, 2**16), "perm_seed"),
        tier=data.draw(st.sampled_from(["dram", "nvme"]), "tier"),
        copy_thread=data.draw(st.booleans(), "copy_thread"),
        skip_layers=data.draw(st.sets(st.integers(0, 2), max_size=3), "skip_layers"),
        device_path=data.draw(st.booleans(), "device_path"),
        staged=data.draw(st.booleans(), "staged"),
    )


def test_cases_cover_every_backend_layout_and_split() -> None:
    assert {c[0] for c in CASES} == {b.name for b in BACKENDS}
    assert {c[1] for c in GRID} == set(LAYOUTS)
    assert {c[0] for c in GRID} == {b.name for b in BACKENDS}
    split = [c for c in GRID if BY_NAME[c[0]].kernel_block_size(c[3]) != c[3]]
    assert {c[0] for c in split} >= {"FLASHINFER", "FLASHMLA", "CUTLASS_MLA", "FLASHINFER_MLA"}


def test_a_view_that_does_not_divide_the_block_size_is_refused() -> None:
    t = torch.zeros(8, 2, 24, 4)
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        PagedKV([t], block_size=64)


# One case per backend and layout, at its smallest block size (kernel splits included).
GROUPED = sorted({(c[0], c[1]): c for c in reversed(GRID)}.values())


def _grouped(c: Cache) -> Cache:
    """``c``'s layers as two KV cache groups (even layers a sliding window's, odd ones
    full attention), as vLLM's hybrid allocator hands them over."""
    bs = c.spec.block_size
    kv = GroupedPagedKV(c.views, [f"layer.{i}" for i in range(len(c.views))],
                        [i % 2 for i in range(len(c.views))], 2, block_size=bs)  # fmt: skip
    kv.on_host = c.kv.on_host
    return Cache(c.spec, c.raw, c.views, kv, KVCopier(kv, device_for(c.views[0])))


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("case", GROUPED, ids=["-".join(map(str, c)) for c in GROUPED])
def test_several_kv_cache_groups_round_trip(case: tuple[str, str, str, int], device_path: bool,
                                            device: torch.device) -> None:
    """Each group's layers are saved from, and loaded into, that group's own blocks; the
    sliding-window group's null blocks (before its window) are skipped, so block 0 and
    every block outside a group's own stay as they were."""
    bs = case[3]
    src = _grouped(make_cache(case, device, device_path=device_path))
    dst = _grouped(make_cache(case, device, fill=0x5A, device_path=device_path))
    before = canonical(dst.views, bs).cpu()
    g = torch.Generator().manual_seed(3)

    def perm() -> list[int]:  # 6 real blocks (never the null block 0)
        return (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()[:6]

    s_ids, d_ids = [perm(), perm()], [perm(), perm()]
    d_ids[0][:4] = [0] * 4  # the window starts in block 4
    kv = src.kv
    dests = [torch.empty(kv.payload_shape(3), dtype=kv.dtype) for _ in range(2)]
    sc = src.copier.begin_save([[ids[0:3] for ids in s_ids], [ids[3:6] for ids in s_ids]],
                               dests)  # fmt: skip
    for li in range(kv.num_layers):
        src.copier.save_layer(sc, li)
    src.copier.finish_save(sc)
    dst.copier.load_begin()
    for k in range(2):
        dst.copier.load_chunk([ids[3 * k : 3 * k + 3] for ids in d_ids], dests[k])
    dst.copier.load_end()
    if device.type == "cuda":
        torch.cuda.synchronize()
    a, b = canonical(src.views, bs).cpu(), canonical(dst.views, bs).cpu()
    for li in range(kv.num_layers):
        ids, sids = d_ids[li % 2], s_ids[li % 2]
        for j, blk in enumerate(ids):
            if blk:
                assert torch.equal(b[li, blk], a[li, sids[j]]), (li, j)
        untouched = sorted(set(range(NUM_BLOCKS)) - set(ids) | {0})
        assert torch.equal(b[li, untouched], before[li, untouched]), li
