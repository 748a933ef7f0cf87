"""What differs between moving KV on a CPU and on a CUDA device, behind one small interface.

The copy code (``connectors.kv_copy``) is the same for both: gather a layer's blocks into a
DRAM slot, scatter a chunk's blocks back. Only these differ, and only these live here:

- streams: CUDA copies run on a side stream so they overlap the compute stream; on a CPU
  there is one "stream" and every copy is done when its call returns;
- ordering: a save copy waits for an event recorded after its layer's kernels; a load waits
  for *all* pending work on the compute stream (with async scheduling a block being loaded
  may still be written by kernels queued for its previous owner: vLLM's own offload worker
  does ``wait_stream(current_stream())`` for the same reason);
- completion: syncing one stream or one event, never the whole device;
- timing: a forward pass on CUDA is timed with events (host clocks see kernel launches, not
  compute), resolved later without blocking;
- host memory: page-locking the DRAM pool (``cudaHostRegister``) so copies run at DMA speed.

No vLLM import: the GPU layout tests and ``bench/gpu_kvio.py`` drive it without vLLM.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch


class Timing:
    """A timed span. ``seconds()`` is None until the device has finished it."""

    def __init__(self, seconds: float | None = None) -> None:
        self._s = seconds

    def seconds(self) -> float | None:
        return self._s


class KVDevice:
    """The CPU implementation: copies are synchronous, so ordering and completion are no-ops.

    Subclasses override the hooks; the copy code calls them in the same places for every
    device, so a recording fake (``tests/gpu/fakes.py``) can check their order on a CPU.
    """

    kind = "cpu"
    #: Whether host buffers handed to a copy must be page-locked for async copies.
    needs_pinned = False

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    # -- streams and ordering
    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        """Run the enclosed copies on the side stream (CPU: inline)."""
        yield

    def record(self) -> Any:
        """An event marking the current point of the compute stream (CPU: None)."""
        return None

    def copy_wait_event(self, event: Any) -> None:
        """Make later copies on the side stream wait for ``event`` (a save after its layer)."""

    def copy_wait_compute(self) -> None:
        """Make later copies on the side stream wait for all queued compute (a load)."""

    def sync_copies(self) -> None:
        """Block until every copy queued on the side stream is done."""

    def sync_current(self) -> None:
        """Block until the current (compute) stream's queued work is done."""

    # -- timing
    def start_timer(self) -> Any:
        return time.perf_counter()

    def stop_timer(self, start: Any) -> Timing:
        return Timing(time.perf_counter() - start)

    # -- host memory
    def pin_host(self, buf: memoryview) -> bool:
        """Page-lock ``buf`` for DMA; False where it is not needed or not possible."""
        return False

    def unpin_host(self, buf: memoryview) -> None:
        """Undo ``pin_host`` (before the mapping goes away)."""


class _CudaTiming(Timing):
    def __init__(self, start: Any, end: Any) -> None:
        super().__init__(None)
        self._start, self._end = start, end

    def seconds(self) -> float | None:
        if self._s is None and self._end.query():
            self._s = self._start.elapsed_time(self._end) / 1000.0
        return self._s


class CudaDevice(KVDevice):
    """CUDA: one side stream for loads and saves, events for ordering and timing."""

    kind = "cuda"
    needs_pinned = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def copy_wait_event(self, event: Any) -> None:
        if event is not None:
            self.stream.wait_event(event)

    def copy_wait_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def sync_copies(self) -> None:
        self.stream.synchronize()

    def sync_current(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def start_timer(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def stop_timer(self, start: Any) -> Timing:
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        return _CudaTiming(start, end)

    def pin_host(self, buf: memoryview) -> bool:
        from tiered_cache.cuda_host import register_host

        return register_host(buf)

    def unpin_host(self, buf: memoryview) -> None:
        from tiered_cache.cuda_host import unregister_host

        unregister_host(buf)


def device_for(t: torch.Tensor) -> KVDevice:
    """The device interface for KV tensors living where ``t`` lives."""
    if t.device.type == "cuda":
        return CudaDevice(t.device)
    if t.device.type == "cpu":
        return KVDevice(t.device)
    raise ValueError(
        f"TieredCacheConnector: KV cache on {t.device.type!r} is not supported (cpu or cuda)"
    )
