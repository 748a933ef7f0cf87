"""The one copy path between vLLM's paged KV and DRAM slots, for CPU and CUDA alike.

What differs by device (streams, events, syncs, host pinning) is behind ``KVDevice``; the
order of operations is the same for both and is what ``tests/gpu`` checks on a CPU with a
recording fake:

save, layer-wise (``begin_save`` → ``save_layer`` per layer → ``finish_save``):
  record an event after the layer's kernels → the copy stream waits for it → gather the
  layer's blocks of each chunk into its reserved slot (inline, or on a helper thread with
  ``copy_thread``) → at the end of the step, copy layers the model never reported, then
  wait for the copy stream only (never for the whole compute stream).
load (``load_begin`` → ``load_chunk`` per chunk → ``load_end``):
  the copy stream waits for all queued compute once → per chunk, the payload is staged in
  a persistent page-locked buffer (or read straight from a page-locked pool), then copied
  to the device and scattered into its blocks → one wait for the copy stream at the end.

No vLLM import: ``bench/gpu_kvio.py`` and the layout tests drive it directly.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.kv_device import KVDevice
from connectors.vllm_kvio import BlockIds, HostStaging, PagedKV


@dataclass
class _Staging:
    buf: HostStaging
    used: int = 0  # bytes queued for the device from it since the last sync


@dataclass
class SaveCopy:
    """One step's layer-wise save: the destination of each chunk ([L, n, *block] over its
    reserved slot) and its block index, and which layers were copied or submitted."""

    dests: list[torch.Tensor]
    idx: list[torch.Tensor]
    # Every chunk's blocks in one index, and each chunk's rows of it: on a GPU one gather
    # kernel per layer serves all chunks.
    idx_all: torch.Tensor | None = None
    parts: list[tuple[int, int]] = field(default_factory=list)
    # Small per-layer pieces (a few KV heads per rank): each layer is gathered into this
    # device buffer ([L, n_total, *block]) and each chunk leaves the device in one copy at
    # the end of the step, instead of one copy per layer per chunk.
    staged: torch.Tensor | None = None
    layers: set[int] = field(default_factory=set)
    copies: list[Future[None]] = field(default_factory=list)


# A layer of a chunk at least this large leaves the device as soon as it is gathered (the
# copy overlaps the next layers); smaller ones cost more to issue than to move (~10 us of
# launch against 2.4 us for 128 KiB at 54 GB/s) and wait in device staging.
PER_LAYER_COPY_MIN_BYTES = 512 << 10
# The most device memory a step's staged save may take (else: per-layer copies).
MAX_DEVICE_STAGING_BYTES = 512 << 20


class KVCopier:
    def __init__(self, kv: PagedKV, device: KVDevice, *, copy_thread: bool = False) -> None:
        self.kv = kv
        self.dev = device
        # A helper thread overlaps copies with the next layers' compute on CUDA; on a CPU it
        # overlaps nothing (the same cores compute) and starts a second OpenMP team.
        self.copy_thread = copy_thread
        self._pool: ThreadPoolExecutor | None = None
        # Load staging per thread: sync loads (the engine's thread) and async ones (the
        # loader's) may run at once.
        self._local = threading.local()

    def _stage(self) -> _Staging:
        st: _Staging | None = getattr(self._local, "staging", None)
        if st is None:
            pin = self.dev.needs_pinned and self.dev.kind == "cuda"
            st = self._local.staging = _Staging(HostStaging(pin=pin))
        return st

    # ------------------------------------------------------------------------ saves

    def begin_save(self, block_ids: Sequence[BlockIds], dests: list[torch.Tensor]) -> SaveCopy:
        # On the copy stream: the block index's upload (and the staging buffer) is then
        # ordered before the layer copies that use it, whichever thread or stream calls.
        with self.dev.on_copy_stream():
            return self._begin_save(block_ids, dests)

    def _begin_save(self, block_ids: Sequence[BlockIds], dests: list[torch.Tensor]) -> SaveCopy:
        kv = self.kv
        if kv.on_host:  # index_select straight into each slot: no staging copy
            return SaveCopy(dests, [kv.index(b) for b in block_ids])
        flat = kv.concat(block_ids)
        parts, a = [], 0
        for ids in block_ids:
            parts.append((a, a + kv.count(ids)))
            a += kv.count(ids)
        staged = None
        piece = kv.block_bytes * (a // max(1, len(block_ids)))  # a layer of a mean chunk
        if piece < PER_LAYER_COPY_MIN_BYTES and kv.payload_nbytes(a) <= MAX_DEVICE_STAGING_BYTES:
            try:
                staged = torch.empty(kv.payload_shape(a), dtype=kv.dtype, device=kv.device)
            except torch.OutOfMemoryError:  # vLLM took the memory: copy layer by layer
                staged = None
        return SaveCopy(dests, [], kv.index(flat), parts, staged)

    def save_layer(self, sc: SaveCopy, li: int) -> None:
        """Copy layer ``li``'s blocks of every chunk into their slots, after the kernels
        queued so far (the layer's own) have run."""
        if li in sc.layers:
            return
        sc.layers.add(li)
        ev = self.dev.record()
        if self.copy_thread:
            sc.copies.append(self._copier().submit(self._copy_layer, sc, li, ev, True))
        else:
            self._copy_layer(sc, li, ev, False)

    def _copier(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tc-save-copy")
        return self._pool

    def _copy_layer(self, sc: SaveCopy, li: int, ev: Any, threaded: bool) -> None:
        if threaded:
            # The destinations were made inside vLLM's inference mode; writing them from
            # another thread needs that mode there too.
            with torch.inference_mode():
                self._copy_layer_now(sc, li, ev)
        else:
            self._copy_layer_now(sc, li, ev)

    def _copy_layer_now(self, sc: SaveCopy, li: int, ev: Any) -> None:
        with self.dev.on_copy_stream():
            self.dev.copy_wait_event(ev)
            self._gather(sc, li)

    def _gather(self, sc: SaveCopy, li: int) -> None:
        if sc.staged is not None:
            assert sc.idx_all is not None
            self.kv.gather_layer_local(li, sc.idx_all, sc.staged[li])
        elif sc.idx_all is not None:
            parts = [(a, b, d[li]) for (a, b), d in zip(sc.parts, sc.dests, strict=True)]
            self.kv.gather_layer_parts(li, sc.idx_all, parts)
        else:
            for idx, dst in zip(sc.idx, sc.dests, strict=True):
                self.kv.gather_layer(li, idx, dst[li])

    def finish_save(self, sc: SaveCopy) -> None:
        """Join the layer copies, copy any layer the model never reported, and wait for the
        copy stream: the slots hold the step's KV when this returns, and vLLM may reuse the
        blocks. On an error every copy already queued is still waited for, so the caller
        may release the slots."""
        try:
            err: BaseException | None = None
            for f in sc.copies:
                try:
                    f.result()
                except BaseException as e:  # join the others before raising
                    err = err or e
            if err is not None:
                raise err
            missing = [li for li in range(self.kv.num_layers) if li not in sc.layers]
            if missing:
                ev = self.dev.record()  # after the whole forward pass
                with torch.inference_mode(), self.dev.on_copy_stream():
                    self.dev.copy_wait_event(ev)
                    for li in missing:
                        self._gather(sc, li)
            if sc.staged is not None:  # one copy per chunk: [L, a:b] of the staged layers
                with self.dev.on_copy_stream():
                    for (a, b), dst in zip(sc.parts, sc.dests, strict=True):
                        dst.copy_(sc.staged[:, a:b], non_blocking=True)
        finally:
            self.dev.sync_copies()
            sc.staged = None

    def gather(self, block_ids: BlockIds, out: torch.Tensor) -> None:
        """Every layer of ``block_ids`` into ``out`` (host), after all queued compute."""
        self.dev.copy_wait_compute("save")  # from the compute stream, not inside the lane
        with self.dev.on_copy_stream("save"):
            self.kv.gather(block_ids, out)
        self.dev.sync_copies("save")

    # ------------------------------------------------------------------------ loads

    def load_begin(self, after: Any = None) -> None:
        """Start a batch of loads: later copies wait for every kernel queued on the compute
        stream so far, or, from another thread, up to ``after`` (an event recorded on the
        compute stream when the load was asked for): with async scheduling a block being
        loaded may still be written for its last owner."""
        self._stage().used = 0
        if after is not None:
            self.dev.copy_wait_event(after, "load")
        else:
            self.dev.copy_wait_compute("load")

    def reserve_staging(self, nbytes: int) -> None:
        """Size the staging buffer for a batch of ``nbytes`` before ``load_begin``."""
        if self.dev.needs_pinned:
            self._stage().buf.reserve(nbytes)

    def load_chunk(
        self,
        block_ids: BlockIds,
        src: torch.Tensor,
        *,
        src_pinned: bool = False,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Scatter ``src`` ([L, n, *block], host; valid only during this call) into
        ``block_ids`` (into KV heads [lo, hi) only, with ``heads``). A pageable source is
        first copied into the staging buffer, so the device copy runs asynchronously; a
        page-locked one is copied directly and waited for before returning."""
        kv = self.kv
        if not self.dev.needs_pinned:
            with self.dev.on_copy_stream("load"):
                kv.scatter(block_ids, src, heads)
            return
        if src_pinned:
            with self.dev.on_copy_stream("load"):
                kv.scatter(block_ids, src, heads)
            self.dev.sync_copies("load")  # the caller may release the slot once we return
            return
        nbytes = src.numel() * src.element_size()
        st = self._stage()
        if st.used + nbytes > st.buf.capacity:
            # Full (or too small): let queued copies drain before reusing or regrowing it.
            self.dev.sync_copies("load")
            st.used = 0
        buf = st.buf.reserve(nbytes)
        host = buf[st.used : st.used + nbytes].view(src.dtype).view(src.shape)
        host.copy_(src)  # contiguous: one DMA (a head slice of a chunk is strided)
        st.used += nbytes
        with self.dev.on_copy_stream("load"):
            kv.scatter(block_ids, host, heads)

    def load_end(self) -> None:
        """Wait for the batch's copies; the staging buffer is free again."""
        self.dev.sync_copies("load")
        self._stage().used = 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
