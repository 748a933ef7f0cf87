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


def rig(*, copy_thread: bool = False, needs_pinned: bool = False,
        device_path: bool = False) -> tuple[KVCopier, RecordingDevice]:
    """``device_path``: run the branches a GPU runs (one gather per layer for all chunks,
    staged small layers, all layers' scatter at once) on these CPU tensors."""
    raw = torch.randn(L, B, H, N, C)
    layers = [raw[i] for i in range(L)]
    kv = PagedKV(layers, [f"l{i}" for i in range(L)], block_size=N)
    kv.on_host = not device_path
    dev = RecordingDevice(needs_pinned=needs_pinned)
    orig = {n: getattr(kv, n) for n in ("gather_layer", "gather_layer_parts",
                                        "gather_layer_local", "gather", "scatter")}  # fmt: skip

    def logged(name: str) -> Any:
        def f(*a: Any) -> None:
            dev.log(name, a[0] if name != "scatter" else tuple(a[0]), dev.in_copy_stream())
            orig[name](*a)

        return f

    for name in orig:
        setattr(kv, name, logged(name))
    return KVCopier(kv, dev, copy_thread=copy_thread), dev


def _layer_copies(dev: RecordingDevice, li: int) -> list[int]:
    kinds = ("gather_layer", "gather_layer_parts", "gather_layer_local")
    return [i for i, c in enumerate(dev.calls) if c[0] in kinds and c[1] == li]


@pytest.mark.parametrize("copy_thread", [False, True])
@pytest.mark.parametrize("mode", ["host", "device-parts", "device-staged"])
def test_a_layer_is_copied_on_the_save_lane_after_its_own_event(
    copy_thread: bool, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import connectors.kv_copy as kv_copy

    monkeypatch.setattr(kv_copy, "PER_LAYER_COPY_MIN_BYTES", 1 << 40 if mode == "device-staged" else 0)
    cp, dev = rig(copy_thread=copy_thread, device_path=mode != "host")
    dests = [torch.empty(L, 2, H, N, C), torch.empty(L, 1, H, N, C)]
    sc = cp.begin_save([[3, 5], [7]], dests)
    assert (sc.staged is not None) == (mode == "device-staged")
    for li in (0, 1, 3):  # layer 2 never reported: caught up at the end of the step
        cp.save_layer(sc, li)
    cp.finish_save(sc)
    calls = dev.calls
    for li in range(L):
        copies = _layer_copies(dev, li)
        assert copies and all(calls[i][2] == "save" for i in copies)  # on the save lane
        # the nearest wait before the layer's copies is for an event recorded before it
        wait = max(i for i, c in enumerate(calls[: copies[0]]) if c[0] == "wait_event")
        ev = calls[wait][1]
        assert calls.index(("record", ev)) < wait
    # the caught-up layer waits for an event recorded after the other layers were queued
    last_record = max(i for i, c in enumerate(calls) if c[0] == "record")
    assert last_record > max(_layer_copies(dev, 3))
    assert calls[-1] == ("sync_copies", "save")  # the save lane only, never the device
    assert "sync_current" not in dev.names()
    for d, ids in zip(dests, ([3, 5], [7]), strict=True):
        for li in range(L):
            assert torch.equal(d[li], cp.kv.layers[li][ids])


def test_a_staged_save_waits_for_the_compute_stream_not_for_its_own_lane() -> None:
    """The staged path (no slots reserved, layer-wise saves off) gathers every layer at the
    end of the step: it must wait for the forward from the compute stream; asked from
    inside the copy lane, CUDA would wait for the lane itself and read unwritten KV."""
    cp, dev = rig(device_path=True)
    out = torch.empty(L, 2, H, N, C)
    cp.gather([4, 6], out)
    names = dev.names()
    wait = names.index("wait_compute")
    assert dev.calls[wait] == ("wait_compute", "save", None)  # for the save lane, from outside
    assert wait < names.index("gather")
    assert dev.calls[-1] == ("sync_copies", "save")
    assert torch.equal(out[2], cp.kv.layers[2][[4, 6]])


@pytest.mark.parametrize("needs_pinned", [False, True])
@pytest.mark.parametrize("device_path", [False, True])
def test_a_load_waits_for_queued_compute_before_its_first_copy(
    needs_pinned: bool, device_path: bool
) -> None:
    cp, dev = rig(needs_pinned=needs_pinned, device_path=device_path)
    srcs = [torch.randn(L, 2, H, N, C), torch.randn(L, 1, H, N, C)]
    cp.reserve_staging(sum(s.numel() * 4 for s in srcs))
    cp.load_begin()
    cp.load_chunk([1, 2], srcs[0])
    cp.load_chunk([6], srcs[1])
    cp.load_end()
    names = dev.names()
    first_scatter = names.index("scatter")
    assert ("wait_compute", "load", None) in dev.calls[:first_scatter]
    assert all(c[2] == "load" for c in dev.calls if c[0] == "scatter")  # on the load lane
    assert dev.calls[-1] == ("sync_copies", "load")
    assert "sync_current" not in names
    for li in range(L):
        assert torch.equal(cp.kv.layers[li][[1, 2]], srcs[0][li])
        assert torch.equal(cp.kv.layers[li][[6]], srcs[1][li])


def test_an_async_load_waits_for_the_event_recorded_when_it_was_asked_for() -> None:
    """From the loader thread the compute stream is not the current one: the load waits for
    an event the engine's thread recorded in start_load_kv."""
    cp, dev = rig(needs_pinned=True)
    ev = dev.record()
    cp.load_begin(after=ev)
    cp.load_chunk([4], torch.randn(L, 1, H, N, C))
    cp.load_end()
    assert ("wait_event", ev, "load") in dev.calls[: dev.names().index("scatter")]
    assert "wait_compute" not in dev.names()


def test_a_pinned_source_is_waited_for_before_the_caller_releases_it() -> None:
    """A page-locked slot is DMA'd from in place: the copy must be done before load_chunk
    returns (the client may then hand the slot to a writer)."""
    cp, dev = rig(needs_pinned=True)
    cp.load_begin()
    cp.load_chunk([4], torch.randn(L, 1, H, N, C), src_pinned=True)
    names = dev.names()
    assert dev.calls[names.index("scatter") + 1] == ("sync_copies", "load")
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


def test_a_failed_layer_copy_still_waits_for_the_others_before_the_slots_go() -> None:
    cp, dev = rig(copy_thread=True)
    dests = [torch.empty(L, 1, H, N, C)]
    sc = cp.begin_save([[3]], dests)
    boom = cp._copier().submit(lambda: (_ for _ in ()).throw(RuntimeError("copy failed")))
    sc.copies.append(boom)
    for li in range(L):
        cp.save_layer(sc, li)
    with pytest.raises(RuntimeError, match="copy failed"):
        cp.finish_save(sc)
    assert all(f.done() for f in sc.copies)
    assert dev.calls[-1] == ("sync_copies", "save")
