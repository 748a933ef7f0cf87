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

    def in_copy_stream(self) -> bool:
        return bool(getattr(self.on_stream, "depth", 0))

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        self.on_stream.depth = getattr(self.on_stream, "depth", 0) + 1
        try:
            yield
        finally:
            self.on_stream.depth -= 1

    def record(self) -> Any:
        with self._lock:
            self._events += 1
            ev = self._events
        self.log("record", ev)
        return ev

    def copy_wait_event(self, event: Any) -> None:
        self.log("wait_event", event)

    def copy_wait_compute(self) -> None:
        self.log("wait_compute")

    def sync_copies(self) -> None:
        self.log("sync_copies")

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
