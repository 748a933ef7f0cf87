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

    # -- streams and ordering. Loads and saves each have a side stream ("lane"), so a
    # save's wait never includes a batch of loads queued before it, nor the reverse.
    def bind_compute(self) -> None:
        """Take the calling thread's current stream as the compute stream (vLLM's forward
        runs on a stream of its own; helper threads would see another)."""

    @contextlib.contextmanager
    def on_copy_stream(self, lane: str = "save") -> Iterator[None]:
        """Run the enclosed copies on the lane's side stream (CPU: inline)."""
        yield

    def record(self) -> Any:
        """An event marking the current point of the compute stream (CPU: None)."""
        return None

    def copy_wait_event(self, event: Any, lane: str = "save") -> None:
        """Make later copies on the lane wait for ``event`` (a save after its layer)."""

    def copy_wait_compute(self, lane: str = "load") -> None:
        """Make later copies on the lane wait for all compute queued so far (a load)."""

    def sync_copies(self, lane: str = "save") -> None:
        """Block until every copy queued on the lane is done."""

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
        self.streams = {lane: torch.cuda.Stream(device) for lane in ("load", "save")}
        self.compute: torch.cuda.Stream | None = None

    def bind_compute(self) -> None:
        self.compute = torch.cuda.current_stream(self.device)

    def _compute(self) -> torch.cuda.Stream:
        # Never a side stream: inside on_copy_stream the current stream is the lane's.
        if self.compute is not None:
            return self.compute
        cur = torch.cuda.current_stream(self.device)
        if cur in self.streams.values():
            raise RuntimeError("no compute stream bound (bind_compute) inside a copy lane")
        return cur

    @contextlib.contextmanager
    def on_copy_stream(self, lane: str = "save") -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.streams[lane]):
            yield

    def record(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self._compute())
        return ev

    def copy_wait_event(self, event: Any, lane: str = "save") -> None:
        if event is not None:
            self.streams[lane].wait_event(event)

    def copy_wait_compute(self, lane: str = "load") -> None:
        self.streams[lane].wait_stream(self._compute())

    def sync_copies(self, lane: str = "save") -> None:
        self.streams[lane].synchronize()

    def sync_current(self) -> None:
        self._compute().synchronize()

    def start_timer(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self._compute())
        return ev

    def stop_timer(self, start: Any) -> Timing:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self._compute())
        return _CudaTiming(start, end)

    def pin_host(self, buf: memoryview) -> bool:
        from tiered_cache.cuda_host import register_host

        with torch.cuda.device(self.device):  # a helper thread's current device may be 0
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
