"""``LocalDirectory``: in-process dicts, for a single node with no Redis configured."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tiered_cache.api import SHARED_TIERS
from tiered_cache.directory import records
from tiered_cache.directory.base import (
    Directory,
    check_keys,
    check_node,
    check_tier,
    node_view,
    sorted_locs,
)
from tiered_cache.directory.records import Location, ModelRegistration, Pin, newest_first

log = logging.getLogger(__name__)


class LocalDirectory(Directory):
    """Single-process directory. Location and node expiry use the monotonic clock; pins
    keep epoch timestamps because they are user-facing and shared with ``Pin``."""

    _SWEEP_EVERY_S = 30.0

    def __init__(self) -> None:
        self._locs: dict[str, dict[tuple[str, str], float]] = {}
        self._nodes: dict[str, tuple[dict[str, Any], float, float]] = {}  # info, seen, exp_mono
        self._pins: dict[str, Pin] = {}
        self._pinver = 0
        self._counters: dict[str, dict[str, int]] = {}
        self._models: dict[str, ModelRegistration] = {}
        self._last_sweep = time.monotonic()

    async def publish(self, node_id: str, tier: str, keys: Sequence[str], ttl_s: float) -> None:
        check_node(node_id)
        check_tier(tier)
        check_keys(keys)
        now = time.monotonic()
        exp = now + ttl_s
        for k in keys:
            self._locs.setdefault(k, {})[(node_id, tier)] = exp
        if now - self._last_sweep > self._SWEEP_EVERY_S:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Drop expired entries of keys nobody looked up (bounded memory)."""
        self._last_sweep = now
        for k in list(self._locs):
            entries = self._locs[k]
            for member in [m for m, exp in entries.items() if exp <= now]:
                del entries[member]
            if not entries:
                del self._locs[k]

    async def unpublish(self, node_id: str, tier: str, keys: Sequence[str]) -> None:
        for k in keys:
            entries = self._locs.get(k)
            if entries is not None:
                entries.pop((node_id, tier), None)
                if not entries:
                    del self._locs[k]

    def _alive(self, now: float) -> set[str]:
        return {n for n, (_, _, exp) in self._nodes.items() if exp > now}

    async def locate(self, keys: Sequence[str]) -> list[list[Location]]:
        check_keys(keys)
        now = time.monotonic()
        alive = self._alive(now)
        out: list[list[Location]] = []
        for k in keys:
            entries = self._locs.get(k, {})
            locs = [
                Location(n, t)
                for (n, t), exp in entries.items()
                if exp > now and (n in alive or t in SHARED_TIERS)
            ]
            out.append(sorted_locs(locs))
        return out

    async def heartbeat(self, node_id: str, info: Mapping[str, Any], ttl_s: float) -> None:
        check_node(node_id)
        self._nodes[node_id] = (dict(info), time.time(), time.monotonic() + ttl_s)

    async def nodes(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        wall = time.time()
        return {
            n: node_view(info, seen, wall + (exp - now))
            for n, (info, seen, exp) in self._nodes.items()
            if exp > now
        }

    def _expire_pins(self) -> None:
        now = time.time()
        dead = [pid for pid, p in self._pins.items() if p.expired(now)]
        for pid in dead:
            del self._pins[pid]
        if dead:
            self._pinver += 1

    async def add_pin(self, pin: Pin) -> None:
        self._pins[pin.id] = pin.model_copy(deep=True)
        self._pinver += 1

    async def remove_pin(self, pin_id: str) -> bool:
        if self._pins.pop(pin_id, None) is None:
            return False
        self._pinver += 1
        return True

    async def get_pin(self, pin_id: str) -> Pin | None:
        self._expire_pins()
        p = self._pins.get(pin_id)
        return p.model_copy(deep=True) if p else None

    async def list_pins(self) -> list[Pin]:
        self._expire_pins()
        pins = sorted(self._pins.values(), key=lambda p: (p.created_at, p.id))
        return [p.model_copy(deep=True) for p in pins]

    async def pins_version(self) -> int:
        self._expire_pins()
        return self._pinver

    async def incr_counters(self, node_id: str, deltas: Mapping[str, int]) -> None:
        check_node(node_id)
        c = self._counters.setdefault(node_id, {})
        for name, v in deltas.items():
            if int(v):
                c[name] = c.get(name, 0) + int(v)

    async def counters(self) -> dict[str, dict[str, int]]:
        return {n: dict(c) for n, c in self._counters.items()}

    async def register_models(self, node_id: str, regs: Sequence[ModelRegistration]) -> None:
        check_node(node_id)
        now = time.time()
        for r in regs:
            self._models[r.hex] = r.model_copy(update={"node_id": node_id, "last_seen": now})

    async def models(self) -> list[ModelRegistration]:
        cutoff = time.time() - records.MODEL_KEEP_S
        for h in [h for h, r in self._models.items() if r.last_seen < cutoff]:
            del self._models[h]
        return newest_first([r.model_copy() for r in self._models.values()])
