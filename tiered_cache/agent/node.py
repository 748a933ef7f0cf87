"""``NodeAgent``: a node's tiers, directory and servers, and their lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections import Counter as CounterT
from collections.abc import Callable
from typing import Any

from policies import make_admission, make_eviction
from tiered_cache.agent.admin import AdminOps
from tiered_cache.agent.local import Handler, LocalServer
from tiered_cache.agent.peers import PeerLink, chunk_mac_key
from tiered_cache.agent.sync import DirectorySync
from tiered_cache.at_rest import ENV_KEY_FILE, ENV_KEYS, AtRest, KeyRing
from tiered_cache.config import AtRestPolicy, CacheConfig, ConfigError
from tiered_cache.directory import Directory, LocalDirectory, ModelRegistration, RedisDirectory
from tiered_cache.hierarchy import TieredStore, TierSlot
from tiered_cache.kv_events import KVEvents
from tiered_cache.metrics import Metrics
from tiered_cache.netaddr import advertise_host
from tiered_cache.private_dir import default_runtime_dir, ensure_private_dir, is_inside
from tiered_cache.protocol import Request
from tiered_cache.tiers.base import Tier
from tiered_cache.tiers.enveloped import EnvelopedTier

log = logging.getLogger("tiered_cache.agent")


def _policy_kwargs(p: Any) -> dict[str, Any]:
    return {"k": p.admission_k} if p.admission.lower() == "frequency" else {}


def _at_rest(c: AtRestPolicy, where: str, mac_key: bytes | None) -> AtRest:
    """How a tier stores its chunks at rest; resolved before any tier is built, so a
    missing key ring stops start-up with nothing to tear down."""
    encrypt = c.enabled and c.encrypt
    keys = KeyRing.from_env() if encrypt else None
    if encrypt and keys is None:
        raise ConfigError(f"{where}.encrypt: no key ring; set ${ENV_KEYS} or ${ENV_KEY_FILE}")
    return AtRest(codec=c.codec, keys=keys, mac_key=mac_key)


def build_tiers(cfg: CacheConfig, metrics: Metrics, *, recover_dram: bool = True) -> list[TierSlot]:
    from tiered_cache.tiers.dram import DRAMTier

    mac = chunk_mac_key(cfg.agent)
    nvme_at_rest, s3_at_rest = _at_rest(cfg.nvme, "nvme", mac), _at_rest(cfg.s3, "s3", mac)
    slots: list[TierSlot] = []
    tiers: list[tuple[Any, Tier]] = []
    if cfg.dram.enabled:
        tiers.append(
            (
                cfg.dram,
                DRAMTier(
                    cfg.dram.capacity,
                    cfg.dram.slot_bytes,
                    shm_name=cfg.dram_shm_name,
                    recover=recover_dram,
                    keep_on_close=cfg.dram.keep_on_stop,
                ),
            )
        )
    if cfg.nvme.enabled:
        from tiered_cache.tiers.nvme import NVMeTier

        nvme = NVMeTier(
            cfg.nvme.path,
            cfg.nvme.capacity,
            max_concurrency=cfg.nvme.max_concurrency,
            o_direct=cfg.nvme.o_direct,
            metrics=metrics,
        )
        tiers.append(
            (cfg.nvme, EnvelopedTier(nvme, nvme_at_rest, metrics) if nvme_at_rest.active else nvme)
        )
    if cfg.s3.enabled:
        from tiered_cache.tiers.s3 import S3Tier

        s3 = S3Tier.from_url(
            cfg.s3.url,
            endpoint_url=cfg.s3.endpoint_url,
            region=cfg.s3.region,
            capacity_bytes=cfg.s3.capacity,
            max_concurrency=cfg.s3.max_concurrency,
            connect_timeout=cfg.s3.connect_timeout_s,
            read_timeout=cfg.s3.read_timeout_s,
            max_attempts=cfg.s3.max_attempts,
            index_max_entries=cfg.s3.index_max_entries,
            metrics=metrics,
        )
        tiers.append((cfg.s3, EnvelopedTier(s3, s3_at_rest, metrics) if s3_at_rest.active else s3))
    for tc, tier in tiers:
        slots.append(
            TierSlot(
                tier=tier,
                eviction=make_eviction(tc.eviction),
                admission=make_admission(tc.admission, **_policy_kwargs(tc)),
                write_mode=getattr(tc, "write_mode", "write_back"),
                pin_budget_fraction=tc.pin_budget_fraction,
            )
        )
    return slots


def build_directory(cfg: CacheConfig, metrics: Metrics) -> Directory:
    if cfg.redis_url:
        return RedisDirectory.from_url(cfg.redis_url, metrics=metrics)
    return LocalDirectory()


class NodeAgent(LocalServer, AdminOps, PeerLink, DirectorySync):
    """One node's cache: its tiers, directory and servers (see the package docstring)."""

    def __init__(self, cfg: CacheConfig, *, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        # The default socket and NVMe directory live in a private directory: checked to
        # be ours before anything is created in it (private_dir.py).
        rundir = default_runtime_dir()
        if cfg.agent.socket is None or (cfg.nvme.enabled and is_inside(cfg.nvme.path, rundir)):
            ensure_private_dir(rundir)
        # Read before any tier or socket exists: a pin file that cannot be used stops the
        # start-up with one error naming it.
        self._file_pins = self._read_pin_file()
        # Likewise an address peers could not reach (a wildcard, or loopback with a shared
        # directory).
        self._advertise = advertise_host(cfg) if cfg.agent.peer_port is not None else ""
        self._pin_import_lock = asyncio.Lock()
        self._pin_import_retry = False  # the directory was unreachable: retry the import
        self._reload_task: asyncio.Task[bool] | None = None
        self.metrics = metrics or Metrics()
        self.directory = build_directory(cfg, self.metrics)
        self.store = TieredStore(
            build_tiers(cfg, self.metrics),
            node_id=cfg.node_id,
            directory=self.directory,
            metrics=self.metrics,
            location_ttl_s=cfg.location_ttl_s,
            verify_dram_reads=cfg.dram.verify_reads,
            peer_fetch=self._peer_fetch,
            mac_key=chunk_mac_key(cfg.agent),
            max_background_bytes=cfg.agent.max_background_bytes,
            tenant_quotas=cfg.tenants,
        )
        # vLLM-format KV events of the tiers (kv_events.enabled), fed by the store.
        self.kv_events: KVEvents | None = None
        if cfg.kv_events.enabled:
            self.kv_events = KVEvents(
                cfg.kv_events, cfg.node_id, self.store, cfg.kv_events_state_path, self.metrics
            )
            self.store.residency = self.kv_events
        self._servers: list[asyncio.base_events.Server] = []
        self._local_tasks: set[asyncio.Task[None]] = set()  # one per connected client or peer
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._pins_version = -1
        self.peer_address: tuple[str, int] | None = None
        self.metrics_address: tuple[str, int] | None = None  # (host, port) /metrics is on
        self._metrics_httpd: Any = None
        # Per peer: idle connections, and a bound on fetches in flight (one per connection).
        self._peer_idle: dict[str, list[socket.socket]] = {}
        self._peer_sems: dict[str, asyncio.Semaphore] = {}
        self._peer_addrs: dict[str, tuple[str, int]] = {}  # from the directory's heartbeats
        self._counted: dict[str, float] = {}
        # Fingerprints of connected vLLM connectors (refreshed in the directory with every
        # heartbeat while a client that registered them stays connected).
        self._models: dict[str, ModelRegistration] = {}
        self._model_refs: CounterT[str] = CounterT()
        # One handler per protocol message (local.py: the data path; admin.py: operators).
        self._handlers: dict[type[Request], Handler] = {
            **self._data_handlers(),
            **self._admin_handlers(),
        }

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await self.store.open()
        if self.kv_events is not None:  # binds its sockets, publishes the snapshot
            await self.kv_events.start()
        if self._file_pins is not None:  # before the socket exists: clients see the pins
            await self._import_pins(self._file_pins)
        # Bound now (a bad path fails before the node is advertised), accepting only once
        # the node is in the directory with its pins and chunks published.
        path = self.cfg.socket_path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        srv = await asyncio.start_unix_server(self._serve_local, path=path, start_serving=False)
        os.chmod(path, 0o600)  # before it listens: only this user's processes connect
        self._servers.append(srv)
        if self.cfg.agent.peer_port is not None:
            psrv = await self._start_peer_server()  # peers.py: handshake, caps, timeouts
            self._servers.append(psrv)
            # Publish where other nodes reach us, never the bind address (0.0.0.0 would
            # send every peer to itself).
            self.peer_address = (self._advertise, int(psrv.sockets[0].getsockname()[1]))
        if self.cfg.agent.metrics_port is not None:
            from prometheus_client import start_http_server

            # Loopback unless agent.metrics_host says otherwise: the series name chunk
            # counts, tiers and peers, which is no one else's business by default.
            httpd, _ = start_http_server(
                self.cfg.agent.metrics_port,
                addr=self.cfg.agent.metrics_host,
                registry=self.metrics.registry,
            )
            self._metrics_httpd = httpd
            host, port = httpd.server_address[:2]
            self.metrics_address = (str(host), int(port))
        await self._heartbeat()
        await self._sync_pins()
        await self.store.republish()
        await srv.start_serving()
        for fn, every in (
            (self._heartbeat, max(1.0, self.cfg.heartbeat_ttl_s / 3)),
            (self._sync_pins, self.cfg.agent.pin_sync_interval_s),
            (self._retry_pin_import, self.cfg.agent.pin_sync_interval_s),
            (self._log_usage, self.cfg.agent.usage_log_interval_s),
            (self.store.republish, self.cfg.location_ttl_s / 2),
            (self._push_counters, 5.0),
        ):
            self._tasks.append(asyncio.ensure_future(self._every(fn, every)))
        log.info(
            "agent %s up: socket %s, peer %s, tiers %s",
            self.cfg.node_id,
            path,
            self.peer_address,
            [s.name for s in self.store.slots],
        )

    async def _every(self, fn: Callable[[], Any], interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:
                log.exception("periodic task %s failed", getattr(fn, "__name__", fn))

    async def stop(self) -> None:
        for srv in self._servers:
            srv.close()
        if self._metrics_httpd is not None:  # its thread would keep the port after a stop
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
            self._metrics_httpd = None
        # Connected clients' handlers too: left pending, they would run on a closed loop.
        pending = [*self._tasks, *self._local_tasks]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.write_back_dirty()
        await self.store.flush()
        await self._push_counters()
        for conns in self._peer_idle.values():
            for sock in conns:
                sock.close()
        await self.store.close()
        if self.kv_events is not None:  # after the last write-backs' events
            await self.kv_events.close()
        await self.directory.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.cfg.socket_path)
        self._stopped.set()

    async def write_back_dirty(self) -> int:
        """Copy DRAM chunks that only live in DRAM down to the next write-back tier."""
        if len(self.store.slots) < 2:
            return 0
        top, below = self.store.slots[0], self.store.slots[1]
        keys = [k for k, _ in top.tier.entries()]
        if not keys:
            return 0
        present = await below.tier.contains_many(keys)
        n = 0
        for k, there in zip(keys, present, strict=True):
            if there:
                continue
            raw = await top.tier.get(k)
            if raw is not None and await self.store._write_tier(below, k, raw, demotion=True):
                n += 1
        if n:
            log.info("wrote back %d DRAM chunks to %s", n, below.name)
        return n

    async def run_forever(self) -> None:
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop()))
        if self.cfg.agent.pin_file is not None:  # without one, SIGHUP keeps its default
            with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
                loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        await self._stopped.wait()

    def _on_sighup(self) -> None:
        if self._reload_task is None or self._reload_task.done():
            self._reload_task = asyncio.ensure_future(self.reload_pin_file())
