"""A CPU stand-in for ``CudaDevice`` that records the order of device calls, so the
ordering a GPU needs (events before copies, loads after queued compute, no whole-device
syncs) is checked on a CPU."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from connectors.kv_device import KVDevice, Timing


class RecordingDevice(KVDevice):
    kind = "recording"

    def __init__(self, *, needs_pinned: bool = False) -> None:
        super().__init__()
        self.needs_pinned = needs_pinned
        self.calls: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._events = 0
        self.on_stream = threading.local()
        self.timings: list[Timing] = []

    def log(self, *call: Any) -> None:
        with self._lock:
            self.calls.append(call)

    def in_copy_stream(self) -> str | None:
        """The lane the calling thread is copying on, None on the compute stream."""
        return getattr(self.on_stream, "lane", None)

    @contextlib.contextmanager
    def on_copy_stream(self, lane: str = "save") -> Iterator[None]:
        outer = self.in_copy_stream()
        self.on_stream.lane = lane
        try:
            yield
        finally:
            self.on_stream.lane = outer

    def record(self) -> Any:
        with self._lock:
            self._events += 1
            ev = self._events
        self.log("record", ev)
        return ev

    def copy_wait_event(self, event: Any, lane: str = "save") -> None:
        self.log("wait_event", event, lane)

    def copy_wait_compute(self, lane: str = "load") -> None:
        # Called inside a lane it would wait for the lane itself (a no-op on CUDA).
        self.log("wait_compute", lane, self.in_copy_stream())

    def sync_copies(self, lane: str = "save") -> None:
        self.log("sync_copies", lane)

    def sync_current(self) -> None:
        self.log("sync_current")

    def start_timer(self) -> Any:
        self.log("start_timer")
        return len(self.timings)

    def stop_timer(self, start: Any) -> Timing:
        """A timing the 'device' has not finished: the test resolves it (``_s``)."""
        self.log("stop_timer")
        t = Timing(None)
        self.timings.append(t)
        return t

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]
