"""Keeping the directory current: heartbeats, pins (and the pin file), counters, the
usage log line."""

from __future__ import annotations

import logging
import os

from tiered_cache.agent.state import AgentState
from tiered_cache.directory import DirectoryUnavailable, Pin
from tiered_cache.pinfile import PinFileError, plan_pin_import, read_pin_file

log = logging.getLogger("tiered_cache.agent")


class DirectorySync(AgentState):
    # ---------------------------------------------------------------- pin file

    def _read_pin_file(self) -> list[Pin] | None:
        path = self.cfg.agent.pin_file
        if path is None:
            return None
        try:
            return read_pin_file(path, self.cfg)
        except PinFileError as e:
            raise PinFileError(f"agent.pin_file: {e}") from None

    async def _import_pins(self, pins: list[Pin]) -> bool:
        """Add the pin file's new pins and update changed ones, as `pin import FILE` does
        (pins are keyed by id, so a restart or another agent importing the same file
        changes nothing; pins not in the file are left alone). False when the directory is
        unreachable: the import is retried every ``pin_sync_interval_s``."""
        async with self._pin_import_lock:
            try:
                plan = plan_pin_import(pins, await self.directory.list_pins())
                for _, p in plan.changes:
                    await self.directory.add_pin(p)
            except DirectoryUnavailable as e:
                if not self._pin_import_retry:
                    log.error(
                        "agent.pin_file %s: cannot import its pins yet (%s); retrying every %gs",
                        self.cfg.agent.pin_file,
                        e,
                        self.cfg.agent.pin_sync_interval_s,
                    )
                self._file_pins, self._pin_import_retry = pins, True
                return False
            self._pin_import_retry = False
        await self._sync_pins()
        log.info("agent.pin_file %s: %s", self.cfg.agent.pin_file, plan.summary())
        return True

    async def _retry_pin_import(self) -> None:
        if self._pin_import_retry and self._file_pins is not None:
            await self._import_pins(self._file_pins)

    async def reload_pin_file(self) -> bool:
        """Read ``agent.pin_file`` again and import it (on SIGHUP). A file that cannot be
        used now is one error line; the agent keeps its pins and runs on."""
        try:
            pins = self._read_pin_file()
        except PinFileError as e:
            log.error("%s; pins unchanged", e)
            return False
        if pins is None:
            return False
        self._file_pins = pins
        return await self._import_pins(pins)

    # ---------------------------------------------------------------- background

    async def _heartbeat(self) -> None:
        info = {
            "tiers": self.store.usage(),
            "peer": list(self.peer_address) if self.peer_address else None,
            "pid": os.getpid(),
        }
        await self.directory.heartbeat(self.cfg.node_id, info, self.cfg.heartbeat_ttl_s)
        if self._models:
            await self.directory.register_models(self.cfg.node_id, list(self._models.values()))

    async def _sync_pins(self) -> None:
        v = await self.directory.pins_version()
        if v == self._pins_version:
            return
        pins = await self.directory.list_pins()
        self.store.apply_pins(pins)
        self._pins_version = v

    async def _log_usage(self) -> None:
        parts = []
        for name, u in self.store.usage().items():
            cap = u["capacity_bytes"]
            used = u["used_bytes"] or 0
            pct = f"{100 * used / cap:.0f}%" if cap else "unbounded"
            parts.append(f"{name} {used / 2**20:.1f}MiB/{pct} {u['chunks']} chunks")
        log.info("usage: %s", "; ".join(parts))

    async def _push_counters(self) -> None:
        deltas: dict[str, int] = {}
        for fam in ("hits", "misses"):
            metric = getattr(self.metrics, fam)
            for sample in metric.collect()[0].samples:
                if not sample.name.endswith("_total"):
                    continue
                name = f"{sample.labels['tier']}:{fam}"
                d = int(sample.value - self._counted.get(name, 0.0))
                if d:
                    deltas[name] = d
                    self._counted[name] = sample.value
        if deltas:
            await self.directory.incr_counters(self.cfg.node_id, deltas)
