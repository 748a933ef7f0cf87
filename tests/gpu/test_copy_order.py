"""The order of device calls the copy path makes, checked on a CPU with a recording fake of
the device interface: what a GPU needs and a CPU cannot show (streams, events)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from connectors.kv_copy import KVCopier
from connectors.vllm_kvio import PagedKV
from gpu.fakes import RecordingDevice

L, B, H, N, C = 4, 10, 2, 16, 8


def rig(*, copy_thread: bool = False, needs_pinned: bool = False) -> tuple[KVCopier, RecordingDevice]:
    layers = [torch.randn(B, H, N, C) for _ in range(L)]
    kv = PagedKV(layers, [f"l{i}" for i in range(L)], block_size=N)
    dev = RecordingDevice(needs_pinned=needs_pinned)
    orig_gather, orig_scatter = kv.gather_layer, kv.scatter

    def gather_layer(li: int, idx: torch.Tensor, out: torch.Tensor) -> None:
        dev.log("gather", li, dev.in_copy_stream())
        orig_gather(li, idx, out)

    def scatter(block_ids: Any, src: torch.Tensor) -> None:
        dev.log("scatter", tuple(block_ids), dev.in_copy_stream())
        orig_scatter(block_ids, src)

    kv.gather_layer = gather_layer  # type: ignore[method-assign]
    kv.scatter = scatter  # type: ignore[method-assign]
    return KVCopier(kv, dev, copy_thread=copy_thread), dev


@pytest.mark.parametrize("copy_thread", [False, True])
def test_a_layer_is_copied_on_the_copy_stream_after_its_own_event(copy_thread: bool) -> None:
    cp, dev = rig(copy_thread=copy_thread)
    dests = [torch.empty(L, 2, H, N, C), torch.empty(L, 1, H, N, C)]
    sc = cp.begin_save([[3, 5], [7]], dests)
    for li in (0, 1, 3):  # layer 2 never reported: caught up at the end of the step
        cp.save_layer(sc, li)
    cp.finish_save(sc)
    calls = dev.calls
    for li in range(L):
        gathers = [i for i, c in enumerate(calls) if c[0] == "gather" and c[1] == li]
        assert len(gathers) == 2 and all(calls[i][2] for i in gathers)  # on the copy stream
        # the nearest wait before the layer's copies is for an event recorded before it
        wait = max(i for i, c in enumerate(calls[: gathers[0]]) if c[0] == "wait_event")
        ev = calls[wait][1]
        assert calls.index(("record", ev)) < wait
    # the caught-up layer waits for an event recorded after the other layers were queued
    last_record = max(i for i, c in enumerate(calls) if c[0] == "record")
    assert last_record > max(i for i, c in enumerate(calls) if c[0] == "gather" and c[1] == 3)
    assert calls[-1] == ("sync_copies",)  # the copy stream only: never the whole device
    assert "sync_current" not in dev.names()
    for d, ids in zip(dests, ([3, 5], [7]), strict=True):
        for li in range(L):
            assert torch.equal(d[li], cp.kv.layers[li][ids])


@pytest.mark.parametrize("needs_pinned", [False, True])
def test_a_load_waits_for_queued_compute_before_its_first_copy(needs_pinned: bool) -> None:
    cp, dev = rig(needs_pinned=needs_pinned)
    srcs = [torch.randn(L, 2, H, N, C), torch.randn(L, 1, H, N, C)]
    cp.reserve_staging(sum(s.numel() * 4 for s in srcs))
    cp.load_begin()
    cp.load_chunk([1, 2], srcs[0])
    cp.load_chunk([6], srcs[1])
    cp.load_end()
    names = dev.names()
    first_scatter = names.index("scatter")
    assert "wait_compute" in names[:first_scatter]
    assert all(c[2] for c in dev.calls if c[0] == "scatter")  # on the copy stream
    assert names[-1] == "sync_copies"
    assert "sync_current" not in names
    for li in range(L):
        assert torch.equal(cp.kv.layers[li][[1, 2]], srcs[0][li])
        assert torch.equal(cp.kv.layers[li][[6]], srcs[1][li])


def test_a_pinned_source_is_waited_for_before_the_caller_releases_it() -> None:
    """A page-locked slot is DMA'd from in place: the copy must be done before load_chunk
    returns (the client may then hand the slot to a writer)."""
    cp, dev = rig(needs_pinned=True)
    cp.load_begin()
    cp.load_chunk([4], torch.randn(L, 1, H, N, C), src_pinned=True)
    names = dev.names()
    assert names[names.index("scatter") + 1] == "sync_copies"
    cp.load_end()


def test_a_pageable_source_is_staged_so_its_copy_can_run_async() -> None:
    """Without page-locked memory the source is copied to staging first and the batch is
    synced once, not once per chunk."""
    cp, dev = rig(needs_pinned=True)
    src = torch.randn(L, 1, H, N, C)
    cp.reserve_staging(2 * src.numel() * 4)
    cp.load_begin()
    cp.load_chunk([4], src.clone())
    cp.load_chunk([5], src.clone())
    assert dev.names().count("sync_copies") == 0
    cp.load_end()
    assert dev.names().count("sync_copies") == 1
    assert torch.equal(cp.kv.layers[0][4], src[0][0])


def test_staging_that_fills_up_drains_before_it_is_reused() -> None:
    cp, dev = rig(needs_pinned=True)
    src = torch.randn(L, 1, H, N, C)
    cp.reserve_staging(src.numel() * 4)  # room for one chunk
    cp.load_begin()
    cp.load_chunk([4], src)
    cp.load_chunk([5], src * 2)
    # the second chunk reused the buffer: the first one's copy was waited for first
    names = dev.names()
    assert names.count("sync_copies") == 1 and names.index("sync_copies") < len(names) - 1
    cp.load_end()
    assert torch.equal(cp.kv.layers[1][5], (src * 2)[1][0])
