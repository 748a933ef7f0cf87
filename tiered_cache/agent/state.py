"""What every part of the node agent reads and writes: the node's config, tiers,
directory and metrics, and the bookkeeping its parts share. ``NodeAgent`` (``node``) sets
them; the parts (``local``, ``admin``, ``peers``, ``sync``) are mixed into it and see them
through this declaration."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter as CounterT
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from tiered_cache.config import CacheConfig
    from tiered_cache.directory import Directory, ModelRegistration, Pin
    from tiered_cache.hierarchy import TieredStore
    from tiered_cache.kv_events import KVEvents
    from tiered_cache.metrics import Metrics
    from tiered_cache.protocol import Request


class AgentState:
    cfg: CacheConfig
    store: TieredStore
    directory: Directory
    metrics: Metrics
    peer_address: tuple[str, int] | None
    kv_events: KVEvents | None  # vLLM-format KV events (kv_events.enabled), else None
    # one handler per protocol message (local.py, admin.py)
    _handlers: dict[type[Request], Callable[[Any, Any], Awaitable[dict[str, Any]]]]
    _local_tasks: set[asyncio.Task[None]]  # one per connected client or peer
    # Fingerprints of connected vLLM connectors, and how many clients registered each.
    _models: dict[str, ModelRegistration]
    _model_refs: CounterT[str]
    # pin file (sync.py)
    _file_pins: list[Pin] | None
    _pin_import_lock: asyncio.Lock
    _pin_import_retry: bool
    _pins_version: int
    _counted: dict[str, float]
    # peers (peers.py): idle connections, a bound on fetches in flight, addresses
    _peer_idle: dict[str, list[socket.socket]]
    _peer_sems: dict[str, asyncio.Semaphore]
    _peer_addrs: dict[str, tuple[str, int]]

    # Implemented by one part, called by another.
    async def _sync_pins(self) -> None:
        raise NotImplementedError

    async def write_back_dirty(self) -> int:
        raise NotImplementedError

    def _check_access(self, conn: Any, req: Request) -> None:
        raise NotImplementedError
