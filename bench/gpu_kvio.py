"""Layer-wise saves and loads through the connector's copy path against a raw pinned copy.

What a prefill pays to save a prompt's KV into DRAM slots, and a decode to load it back,
through the code the vLLM worker runs (``connectors.kv_copy.KVCopier`` over
``connectors.vllm_kvio.PagedKV``: per-layer gathers of scattered blocks into reserved slots
of a real shared-memory DRAM tier, page-locked on CUDA; loads scattered back into other
blocks), against the same bytes moved by one ``copy_`` between a page-locked host buffer
and a contiguous device tensor (CPU: between two host tensors): the link's own speed.

Shapes: Llama-3-8B (32 layers, 8 KV heads of 128, bf16) and Llama-3-70B at TP 8 (80
layers, 1 KV head per rank), vLLM's default block of 16 tokens in its default layout
(LBNHC), 256-token chunks. No vLLM needed: runs wherever torch runs, on CUDA when a GPU
is visible. Goal on a GPU: save and load at >= 0.8 of raw.

    python bench/gpu_kvio.py [--tokens 4096] [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connectors.kv_copy import KVCopier
from connectors.kv_device import KVDevice, device_for
from connectors.vllm_kvio import PagedKV, chunk_spans, payload_tensor
from tiered_cache.tiers.dram import DRAMTier


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    heads: int
    head_size: int
    block: int = 16
    chunk: int = 256
    dtype: torch.dtype = torch.bfloat16

    def block_bytes(self) -> int:  # one block of one layer
        return self.heads * self.block * 2 * self.head_size * 2


SHAPES = (
    Shape("llama3-8b", 32, 8, 128),
    Shape("llama3-70b-tp8", 80, 1, 128),
)


def kv_caches(s: Shape, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One backing buffer, one [B, H, N, 2*hs] view per layer, as vLLM 0.32 allocates them
    (``allocate_kv_cache``): LBNHC (FlashAttention's default) on CUDA, LBHNC (the only
    layout the CPU backend takes) on CPU."""
    raw = torch.empty(s.layers * num_blocks * s.block * s.heads * 2 * s.head_size,
                      dtype=s.dtype, device=device)  # fmt: skip
    raw.normal_()
    if device.type == "cpu":
        full = raw.view(s.layers, num_blocks, s.heads, s.block, 2 * s.head_size)
        return [full[i] for i in range(s.layers)]
    full = raw.view(s.layers, num_blocks, s.block, s.heads, 2 * s.head_size)
    return [full[i].permute(0, 2, 1, 3) for i in range(s.layers)]  # [B, H, N, C] views


def sync(dev: KVDevice) -> None:
    if dev.kind == "cuda":
        torch.cuda.synchronize(dev.device)


def median_s(fn: Any, runs: int, dev: KVDevice) -> float:
    fn()  # warm-up (allocations, pinned staging, kernels)
    sync(dev)
    out = []
    for _ in range(runs):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def bench_shape(s: Shape, tokens: int, runs: int, device: torch.device, *,
                copy_thread: bool) -> dict[str, Any]:
    nblk = tokens // s.block
    num_blocks = 2 * nblk + 8
    layers = kv_caches(s, num_blocks, device)
    kv = PagedKV(layers, [f"l{i}" for i in range(s.layers)], block_size=s.block)
    dev = device_for(layers[0])
    cp = KVCopier(kv, dev, copy_thread=copy_thread)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    src_ids, dst_ids = perm[:nblk], perm[nblk : 2 * nblk]
    spans = chunk_spans(tokens, s.chunk, s.block)
    total = kv.payload_nbytes(nblk)
    dram = DRAMTier(total + (64 << 20), 1 << 20, shm_name=f"tc-bench-{uuid.uuid4().hex[:8]}")
    pinned = dev.pin_host(dram._buf)
    dests: list[torch.Tensor] = []
    try:
        slots = [dram.reserve(kv.payload_nbytes(sp.num_blocks)) for sp in spans]
        dests[:] = [
            payload_tensor(dram.slot_view(sl)[: kv.payload_nbytes(sp.num_blocks)], kv.dtype,
                           kv.payload_shape(sp.num_blocks))
            for sl, sp in zip(slots, spans, strict=True)
        ]
        ids = [src_ids[sp.first_block : sp.end_block] for sp in spans]
        dids = [dst_ids[sp.first_block : sp.end_block] for sp in spans]

        def save() -> None:  # the worker's layer-wise save: one call per layer, then finish
            sc = cp.begin_save(ids, dests)
            for li in range(kv.num_layers):
                cp.save_layer(sc, li)
            cp.finish_save(sc)

        def load() -> None:  # the worker's load: straight from the (pinned) slots
            cp.load_begin()
            for d, ch in zip(dests, dids, strict=True):
                cp.load_chunk(ch, d, src_pinned=pinned)
            cp.load_end()

        t_save = median_s(save, runs, dev)
        t_load = median_s(load, runs, dev)
        for li in (0, kv.num_layers - 1):  # what was loaded is what was saved
            assert torch.equal(layers[li][dst_ids], layers[li][src_ids]), "round trip differs"

        host = torch.empty(total, dtype=torch.uint8, pin_memory=dev.kind == "cuda")
        devbuf = torch.empty(total, dtype=torch.uint8, device=device)
        t_d2h = median_s(lambda: host.copy_(devbuf, non_blocking=True), runs, dev)
        t_h2d = median_s(lambda: devbuf.copy_(host, non_blocking=True), runs, dev)
    finally:
        dests.clear()  # views into the pool: released before it closes
        dev.unpin_host(dram._buf)
        cp.close()
        asyncio.run(dram.close())
    gb = total / 1e9
    return {
        "shape": s.name, "tokens": tokens, "bytes": total, "chunks": len(spans),
        "pool_pinned": pinned,
        "save_gbps": gb / t_save, "load_gbps": gb / t_load,
        "raw_d2h_gbps": gb / t_d2h, "raw_h2d_gbps": gb / t_h2d,
        "save_vs_raw": t_d2h / t_save, "load_vs_raw": t_h2d / t_load,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=0,
                    help="prompt tokens per save/load (default: 8192 on CUDA, 1024 on CPU)")
    ap.add_argument("--runs", type=int, default=5, help="timed repetitions (median)")
    ap.add_argument("--device", default="", help="cuda or cpu (default: cuda if visible)")
    ap.add_argument("--copy-thread", action="store_true",
                    help="layer copies on the helper thread (save_copy_thread: true)")
    ap.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    ap.add_argument("--json", action="store_true", help="a JSON object as the last line")
    a = ap.parse_args(argv)
    if a.tokens < 0 or a.runs < 1:
        ap.error("--tokens must be >= 0 and --runs >= 1")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokens = a.tokens or (8192 if device.type == "cuda" else 1024)
    if tokens % 16:
        ap.error(f"--tokens must be a multiple of the 16-token block, got {tokens}")
    want = set(a.shapes.split(","))
    unknown = want - {s.name for s in SHAPES}
    if unknown:
        ap.error(f"unknown shape(s) {sorted(unknown)}; known: {[s.name for s in SHAPES]}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_kvio: {name}, {tokens} tokens, {a.runs} runs, copy_thread={a.copy_thread}",
          flush=True)  # fmt: skip
    rows = []
    for s in SHAPES:
        if s.name not in want:
            continue
        print(f"  {s.name} ...", end="", flush=True)
        r = bench_shape(s, tokens, a.runs, device, copy_thread=a.copy_thread)
        rows.append(r)
        print(f" {r['bytes'] / 2**20:.0f} MiB: save {r['save_gbps']:.2f} GB/s "
              f"({r['save_vs_raw']:.2f}x raw D2H {r['raw_d2h_gbps']:.2f}), load "
              f"{r['load_gbps']:.2f} GB/s ({r['load_vs_raw']:.2f}x raw H2D "
              f"{r['raw_h2d_gbps']:.2f}), pool pinned: {r['pool_pinned']}", flush=True)  # fmt: skip
    out = {
        "device": name,
        "save_vs_raw": min(r["save_vs_raw"] for r in rows),
        "load_vs_raw": min(r["load_vs_raw"] for r in rows),
        "shapes": rows,
    }
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
