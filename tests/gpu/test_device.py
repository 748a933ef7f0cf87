"""The device interface itself, on whatever device the tests run on (CUDA on the GPU
machine: real streams, events and page-locking)."""

from __future__ import annotations

import torch

from connectors.kv_device import device_for
from tiered_cache.cuda_host import registered_bytes


def test_a_forward_timing_is_device_time_and_resolves_without_blocking(
    device: torch.device,
) -> None:
    dev = device_for(torch.empty(0, device=device))
    n = 2048 if device.type == "cuda" else 128
    a = torch.randn(n, n, device=device)
    t0 = dev.start_timer()
    for _ in range(20):  # queued work: a host clock would see only its launch
        a = a @ a
        a = a / a.norm()
    timing = dev.stop_timer(t0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    sec = timing.seconds()
    assert sec is not None and sec > 0


def test_pinning_the_pool_is_undone_before_it_goes_away(device: torch.device) -> None:
    dev = device_for(torch.empty(0, device=device))
    buf = bytearray(4 << 20)
    mv = memoryview(buf)
    before = registered_bytes()
    ok = dev.pin_host(mv)
    assert ok == (device.type == "cuda")
    if ok:
        assert registered_bytes() == before + len(buf)
        t = torch.frombuffer(mv, dtype=torch.uint8)
        assert t.is_pinned()  # what the worker checks to copy from a slot in place
        assert dev.pin_host(mv)  # twice: one registration
        assert registered_bytes() == before + len(buf)
    dev.unpin_host(mv)
    dev.unpin_host(mv)  # twice: harmless
    assert registered_bytes() == before


def test_a_load_copies_only_after_queued_compute(device: torch.device) -> None:
    """A block being loaded may still be written by kernels queued for its last owner: the
    load's copy must land after them (on CUDA this fails without copy_wait_compute)."""
    from connectors.kv_copy import KVCopier
    from connectors.vllm_kvio import PagedKV

    layers = [torch.zeros(8, 2, 16, 64, device=device) for _ in range(2)]
    kv = PagedKV(layers, ["a", "b"], block_size=16)
    cp = KVCopier(kv, device_for(layers[0]))
    n = 4096 if device.type == "cuda" else 128
    big = torch.randn(n, n, device=device)
    for _ in range(10):  # a long queue of compute, then a write to block 3 at its end
        big = big @ big
        big = big / big.norm()
    layers[0][3].fill_(7.0)
    src = torch.ones(2, 1, 2, 16, 64)
    cp.load_begin()
    cp.load_chunk([3], src)
    cp.load_end()
    assert torch.equal(layers[0][3].cpu(), src[0][0])


def test_a_head_slice_of_another_tp_sizes_chunk_loads_into_its_heads(
    device: torch.device,
) -> None:
    """A TP 2 rank's share of a TP 1 chunk: a strided head slice of a (page-locked, on
    CUDA) payload goes through staging into heads [0, 1) of the blocks, both layers at
    once where they share one buffer; the other head keeps what it held."""
    from connectors.kv_copy import KVCopier
    from connectors.vllm_kvio import PagedKV

    backing = torch.zeros(8, 2, 2, 16, 64, device=device)  # [B, L, H, N, C]
    layers = [backing[:, i] for i in range(2)]
    kv = PagedKV(layers, ["a", "b"], block_size=16)
    cp = KVCopier(kv, device_for(layers[0]))
    backing[:, :, 1] = 5.0
    whole = torch.randn(2, 2, 4, 16, 64, pin_memory=device.type == "cuda")  # 4 heads
    src = whole[:, :, 2:3]  # the heads rank 2 of 4 holds, from a 1-shard chunk
    cp.load_begin()
    cp.load_chunk([3, 6], src, heads=(0, 1))
    cp.load_end()
    got = backing.cpu()
    for li in range(2):
        assert torch.equal(got[[3, 6], li, 0:1], src[li])
    assert torch.all(got[:, :, 1] == 5.0)
    assert not got[[0, 1, 2, 4, 5, 7], :, 0].any()
