"""The node agent: owns a node's DRAM pool, NVMe directory and S3 client.

- Local vLLM processes talk to it over a unix socket (``ipc`` frames) and move chunk bytes
  through the shared-memory DRAM pool; the agent only hands out slot numbers and leases.
- Peers pull chunks from its DRAM and NVMe over TCP (``peer_port``).
- Background loops keep the directory current (heartbeat, location refresh, pin sync,
  per-tier counters) and log one usage line a minute.
- SIGTERM: stop accepting, write back dirty DRAM chunks, flush lower-tier writes, exit 0.
- ``agent.pin_file``: imported at start-up (a file that cannot be used is a start-up error)
  and again on SIGHUP, as ``tiered-cache pin import FILE`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter as CounterT
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies import EntryInfo, make_admission, make_eviction
from tiered_cache import codec
from tiered_cache.config import CacheConfig, load_config
from tiered_cache.directory import (
    Directory,
    DirectoryUnavailable,
    LocalDirectory,
    ModelRegistration,
    Pin,
    RedisDirectory,
)
from tiered_cache.hierarchy import Hit, PinRefused, TieredStore, TierSlot
from tiered_cache.ipc import IPCError, pack, read_msg
from tiered_cache.metrics import Metrics
from tiered_cache.netaddr import advertise_host
from tiered_cache.pinfile import PinFileError, plan_pin_import, read_pin_file
from tiered_cache.tiers.base import Tier
from tiered_cache.tiers.dram import DRAMTier

log = logging.getLogger("tiered_cache.agent")

PEER_CONNECTIONS = 4  # parallel chunk fetches per peer (the agent's get loads 8 at once)
# Stream buffer for peer frames: with asyncio's 64 KiB default a multi-MiB chunk is read
# through dozens of pause/resume cycles of the transport.
PEER_STREAM_LIMIT = 8 * 2**20


def _policy_kwargs(p: Any) -> dict[str, Any]:
    return {"k": p.admission_k} if p.admission.lower() == "frequency" else {}


def build_tiers(cfg: CacheConfig, metrics: Metrics, *, recover_dram: bool = True) -> list[TierSlot]:
    from tiered_cache.tiers.dram import DRAMTier

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
                ),
            )
        )
    if cfg.nvme.enabled:
        from tiered_cache.tiers.nvme import NVMeTier

        tiers.append(
            (
                cfg.nvme,
                NVMeTier(
                    cfg.nvme.path,
                    cfg.nvme.capacity,
                    max_concurrency=cfg.nvme.max_concurrency,
                    o_direct=cfg.nvme.o_direct,
                    metrics=metrics,
                ),
            )
        )
    if cfg.s3.enabled:
        from tiered_cache.tiers.s3 import S3Tier

        tiers.append(
            (
                cfg.s3,
                S3Tier.from_url(
                    cfg.s3.url,
                    endpoint_url=cfg.s3.endpoint_url,
                    region=cfg.s3.region,
                    capacity_bytes=cfg.s3.capacity,
                    max_concurrency=cfg.s3.max_concurrency,
                    connect_timeout=cfg.s3.connect_timeout_s,
                    read_timeout=cfg.s3.read_timeout_s,
                    max_attempts=cfg.s3.max_attempts,
                    metrics=metrics,
                ),
            )
        )
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


@dataclass
class _Conn:
    leases: CounterT[int] = field(default_factory=CounterT)
    reserved: set[int] = field(default_factory=set)
    models: set[str] = field(default_factory=set)  # fingerprints this client registered


class NodeAgent:
    def __init__(self, cfg: CacheConfig, *, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
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
            verify_dram=cfg.dram.verify_reads,
            peer_fetch=self._peer_fetch,
        )
        self._servers: list[asyncio.base_events.Server] = []
        self._local_tasks: set[asyncio.Task[None]] = set()  # one per connected client or peer
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._pins_version = -1
        self.peer_address: tuple[str, int] | None = None
        # Per peer: idle connections, and a bound on fetches in flight (one per connection).
        self._peer_idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._peer_sems: dict[str, asyncio.Semaphore] = {}
        self._peer_addrs: dict[str, tuple[str, int]] = {}  # from the directory's heartbeats
        self._counted: dict[str, float] = {}
        # Fingerprints of connected vLLM connectors (refreshed in the directory with every
        # heartbeat while a client that registered them stays connected).
        self._models: dict[str, ModelRegistration] = {}
        self._model_refs: CounterT[str] = CounterT()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await self.store.open()
        if self._file_pins is not None:  # before the socket exists: clients see the pins
            await self._import_pins(self._file_pins)
        path = self.cfg.socket_path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        srv = await asyncio.start_unix_server(self._serve_local, path=path)
        os.chmod(path, 0o660)
        self._servers.append(srv)
        if self.cfg.agent.peer_port is not None:
            psrv = await asyncio.start_server(
                self._serve_peer,
                self.cfg.agent.peer_host,
                self.cfg.agent.peer_port,
                limit=PEER_STREAM_LIMIT,
            )
            self._servers.append(psrv)
            # Publish where other nodes reach us, never the bind address (0.0.0.0 would
            # send every peer to itself).
            self.peer_address = (self._advertise, int(psrv.sockets[0].getsockname()[1]))
        if self.cfg.agent.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(self.cfg.agent.metrics_port, registry=self.metrics.registry)
        await self._heartbeat()
        await self._sync_pins()
        await self.store.republish()
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
        # Connected clients' handlers too: left pending, they would run on a closed loop.
        pending = [*self._tasks, *self._local_tasks]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.write_back_dirty()
        await self.store.flush()
        await self._push_counters()
        for conns in self._peer_idle.values():
            for _, w in conns:
                w.close()
        await self.store.close()
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

    # ---------------------------------------------------------------- peers

    async def _peer_address(self, node_id: str, refresh: bool) -> tuple[str, int] | None:
        """The peer's TCP address, asking the directory only when not known or ``refresh``
        (after a failure: the peer may have restarted on another port)."""
        if refresh or node_id not in self._peer_addrs:
            info = (await self.directory.nodes()).get(node_id)
            if not info or not info.get("peer"):
                self._peer_addrs.pop(node_id, None)
                return None
            host, port = info["peer"]
            self._peer_addrs[node_id] = (str(host), int(port))
        return self._peer_addrs[node_id]

    async def _peer_fetch(self, key: str, node_id: str) -> tuple[bytes, float] | None:
        """One chunk from a peer's DRAM/NVMe: (encoded bytes, wire seconds), or None.

        Up to ``PEER_CONNECTIONS`` fetches per peer run at once, each on its own pooled
        connection, so the chunks of one request arrive in parallel."""
        sem = self._peer_sems.setdefault(node_id, asyncio.Semaphore(PEER_CONNECTIONS))
        idle = self._peer_idle.setdefault(node_id, [])
        async with sem:
            for attempt in (0, 1):
                addr = await self._peer_address(node_id, refresh=attempt > 0)
                if addr is None:
                    return None
                conn = idle.pop() if idle else None
                try:
                    if conn is None:
                        conn = await asyncio.wait_for(
                            asyncio.open_connection(*addr, limit=PEER_STREAM_LIMIT), 2.0
                        )
                    r, w = conn
                    t0 = time.perf_counter()
                    w.write(pack({"op": "fetch", "key": key}))
                    await w.drain()
                    msg = await asyncio.wait_for(read_msg(r), 30.0)
                    if msg is None:
                        raise ConnectionError("peer closed")
                    dt = time.perf_counter() - t0
                    idle.append(conn)
                    data = msg.get("data")
                    return (data, dt) if isinstance(data, bytes) else None
                except (OSError, EOFError, asyncio.TimeoutError, IPCError, ValueError):
                    # EOFError: the peer died mid-reply; ValueError: a garbled frame.
                    if conn is not None:
                        conn[1].close()
                    for _, w in idle:  # same peer, likely just as dead
                        w.close()
                    idle.clear()
                    if attempt:
                        raise
                except BaseException:  # cancelled mid-reply: the stream is unusable
                    if conn is not None:
                        conn[1].close()
                    raise
        return None

    async def _serve_peer(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:  # cancelled by stop(), like local clients' handlers
            self._local_tasks.add(me)
        try:
            while True:
                msg = await read_msg(r)
                if msg is None:
                    break
                data: bytes | bytearray | None = None
                key = msg.get("key")
                if msg.get("op") == "fetch" and isinstance(key, str):
                    for slot in self.store.slots:
                        if slot.name == "s3":
                            continue  # peers read S3 themselves
                        if (await slot.tier.contains_many([key]))[0]:
                            data = await slot.tier.get(key)
                            if data is not None:
                                self.metrics.peer_transfers.labels("out").inc()
                                break
                w.write(pack({"ok": True, "data": data}))
                await w.drain()
        except asyncio.CancelledError:
            pass  # the agent is stopping (see _serve_local)
        except Exception:
            log.exception("peer connection failed")
        finally:
            w.close()
            if me is not None:
                self._local_tasks.discard(me)

    # ---------------------------------------------------------------- local clients

    async def _serve_local(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conn = _Conn()
        me = asyncio.current_task()
        if me is not None:
            self._local_tasks.add(me)
        try:
            while True:
                msg = await read_msg(r)
                if msg is None:
                    break
                try:
                    reply = await self._dispatch(conn, msg)
                    reply["ok"] = True
                except PinRefused as e:
                    reply = {"ok": False, "error": str(e), "kind": "pin_refused"}
                except PermissionError as e:
                    reply = {"ok": False, "error": str(e), "kind": "auth"}
                except Exception as e:
                    log.exception("request %s failed", msg.get("op"))
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                if msg.get("noreply"):  # fire-and-forget (release): the client reads nothing
                    continue
                w.write(pack(reply))
                await w.drain()
        except asyncio.CancelledError:
            # The agent is stopping. End quietly: Python 3.11's stream server logs an ERROR
            # for every handler task that ends cancelled.
            pass
        finally:
            # A client that died mid-transfer must not leak slots or leases.
            for slot, n in conn.leases.items():
                for _ in range(n):
                    self.store.release(slot)
            for slot in conn.reserved:
                self.store.abort_dram(slot)
            for h in conn.models:
                self._model_refs[h] -= 1
                if self._model_refs[h] <= 0:
                    del self._model_refs[h]
                    self._models.pop(h, None)  # no longer refreshed; ages out of the directory
            w.close()
            if me is not None:
                self._local_tasks.discard(me)

    def _check_admin(self, msg: dict[str, Any]) -> None:
        token = self.cfg.agent.auth_token
        if token and msg.get("token") != token:
            raise PermissionError("admin operation needs the agent's auth token")

    async def _dispatch(self, conn: _Conn, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        store = self.store
        if op == "hello":
            dram = store.slots[0].tier
            return {
                "node_id": self.cfg.node_id,
                "shm_name": getattr(dram, "shm_name", None),
                "index_shm": dram.shared_index.name if isinstance(dram, DRAMTier) else None,
                "slot_bytes": getattr(dram, "slot_bytes", 0),
                "num_slots": getattr(dram, "num_slots", 0),
                "pool_bytes": getattr(dram, "pool_bytes", 0),
                "tiers": [s.name for s in store.slots],
            }
        if op == "lookup":
            if msg.get("priced"):  # with each chunk's expected load seconds
                srcs, costs = await store.lookup_priced(msg["keys"], int(msg.get("nbytes") or 0))
                return {"sources": srcs, "costs": costs}
            return {"sources": await store.lookup(msg["keys"])}
        if op == "present":  # each key on its own: [source, expected seconds] or None
            found = await store.present(msg["keys"], int(msg.get("nbytes") or 0))
            return {"found": [None if f is None else list(f) for f in found]}
        if op == "prefetch":  # copy remote / lower-tier chunks into DRAM, in the background
            return {"started": await store.prefetch(msg["keys"], msg.get("fp"))}
        if op == "locate":  # nodes holding each key in DRAM/NVMe (for cache-aware routing)
            locs = await self.directory.locate(msg["keys"])
            return {"nodes": [sorted({x.node_id for x in ls if x.tier != "s3"}) for ls in locs]}
        if op == "get":
            fp = msg.get("fp")
            out: list[Any] = []
            sem = asyncio.Semaphore(8)  # chunks of one request load in parallel, bounded

            async def one(key: str) -> tuple[tuple[int, int] | Hit | None, str]:
                served: list[str] = []  # the source that actually served it, for the client
                async with sem:
                    got = await store.lease(key, expect_fingerprint=fp, served=served)
                return got, (served[0] if served else "")

            for got, src in await asyncio.gather(*(one(k) for k in msg["keys"])):
                if got is None:
                    out.append(None)
                elif isinstance(got, Hit):
                    out.append({"data": got.encoded(), "src": got.source})
                else:
                    conn.leases[got[0]] += 1
                    out.append({"slot": got[0], "len": got[1], "src": src})
            return {"items": out}
        if op == "touch":  # one-way: chunks a client read through the shared index
            store.note_dram_hits(msg["hits"])
            return {}
        if op == "release":
            for slot in msg["slots"]:
                if conn.leases[slot] > 0:
                    conn.leases[slot] -= 1
                    store.release(slot)
            return {}
        if op == "reserve":
            slots = []
            for n in msg["sizes"]:
                s = await store.reserve_dram(n)
                if s is not None:
                    conn.reserved.add(s)
                slots.append(s)
            return {"slots": slots}
        if op == "commit":
            for key, slot, length, parent, pos in msg["items"]:
                if slot not in conn.reserved:
                    raise ValueError(f"slot {slot} was not reserved by this client")
                conn.reserved.discard(slot)
                await store.commit_dram(
                    key, slot, length, info=EntryInfo(parent, pos), wait=bool(msg.get("wait"))
                )
            # Hand the client free runs for its next put, so a put costs one round trip
            # (commit) instead of two: runs as long as this commit's largest chunk, only
            # ones free without evicting, never the last quarter of the pool, and at most
            # a 16th of it per client: in a small pool the stashes of busy clients would
            # otherwise leave nothing to evict for a pin.
            dram = store.slots[0].tier
            stash: list[list[int]] = []
            if isinstance(dram, DRAMTier) and msg["items"]:
                size = max(int(it[2]) for it in msg["items"])
                pages = -(-size // dram.slot_bytes)
                give = min(int(msg.get("refill") or 0), 8, dram.num_slots // (16 * pages))
                for _ in range(give):
                    if dram.free_slots - pages < dram.num_slots // 4 or not dram.has_room(size):
                        break
                    sl = dram.reserve(size)
                    conn.reserved.add(sl)
                    stash.append([sl, pages * dram.slot_bytes])
            return {"slots": stash}
        if op == "abort":
            for slot in msg["slots"]:
                if slot in conn.reserved:
                    conn.reserved.discard(slot)
                    store.abort_dram(slot)
            return {}
        if op == "put":  # inline bytes: for chunks larger than a slot or no DRAM tier
            await store.put(msg["key"], msg["data"], wait=bool(msg.get("wait")))
            return {}
        if op == "stats":
            return {
                "node_id": self.cfg.node_id,
                "usage": store.usage(),
                "metrics": _metric_summary(self.metrics),
            }
        if op == "pin_add":
            self._check_admin(msg)
            pin = Pin.model_validate(msg["pin"])
            store.check_pin(pin, int(msg.get("chunk_bytes") or 0))
            await self.directory.add_pin(pin)
            await self._sync_pins()
            return {"id": pin.id}
        if op == "pin_rm":
            self._check_admin(msg)
            ok = await self.directory.remove_pin(msg["id"])
            await self._sync_pins()
            return {"removed": ok}
        if op == "pin_ls":
            pins = await self.directory.list_pins()
            res = await self._residency(pins)
            return {"pins": [p.model_dump() for p in pins], "residency": res}
        if op == "evict":
            self._check_admin(msg)
            await store.delete(msg["key"], tiers=msg.get("tiers"))
            return {}
        if op == "flush":
            self._check_admin(msg)
            await store.flush()
            return {"written_back": await self.write_back_dirty()}
        # -- admin ops for the CLI and dashboard (ls, nodes, counters, warm, clear)
        if op == "ls":  # chunk keys with a prefix, across this node's tiers
            return self._ls(str(msg.get("prefix") or ""), int(msg.get("limit") or 1000))
        if op == "nodes":
            return {"nodes": await self.directory.nodes()}
        if op == "counters":
            return {"counters": await self.directory.counters()}
        if op == "register_model":  # a vLLM connector's fingerprint, for `pin add --model`
            reg = ModelRegistration.model_validate(msg["model"])
            h = reg.hex
            if h not in conn.models:
                conn.models.add(h)
                self._model_refs[h] += 1
            self._models[h] = reg
            await self.directory.register_models(self.cfg.node_id, [reg])
            return {"fingerprint": h}
        if op == "models":
            return {"models": [r.model_dump() for r in await self.directory.models()]}
        if op == "warm":
            self._check_admin(msg)
            wpin = await self.directory.get_pin(str(msg["id"]))
            if wpin is None:
                raise ValueError(f"no pin with id {msg['id']}")
            return await self._warm(wpin)
        if op == "clear":  # drop every chunk of one tier (pinned ones only when asked)
            self._check_admin(msg)
            return await self._clear(str(msg["tier"]), bool(msg.get("include_pinned")))
        raise ValueError(f"unknown op {op!r}")

    def _ls(self, prefix: str, limit: int) -> dict[str, Any]:
        found: list[dict[str, Any]] = []
        for slot in self.store.slots:
            pinned = self.store.pinned_keys(slot.name)
            for k, size in slot.tier.entries():
                if k.startswith(prefix):
                    found.append(
                        {"key": k, "tier": slot.name, "bytes": size, "pinned": k in pinned}
                    )
        found.sort(key=lambda e: e["key"])
        return {"entries": found[: max(0, limit)], "total": len(found)}

    async def _warm_source(self, key: str) -> bytes | bytearray | memoryview | None:
        """The nearest verified copy of ``key`` (a tier of this node, then a peer), read
        without counting a hit: warming is not traffic."""
        for slot in self.store.slots:
            if not (await slot.tier.contains_many([key]))[0]:
                continue
            raw = await slot.tier.get(key)
            if raw is None:
                continue
            try:
                codec.decode(raw, expect_key=key)
            except codec.ChunkError:
                self.metrics.verification_failures.labels(slot.name).inc()
                continue
            return bytes(raw)
        hit = await self.store._get_from_peer(key, None)
        return None if hit is None else hit.encoded()

    async def _warm(self, pin: Pin) -> dict[str, Any]:
        """Copy each chunk of ``pin`` into every pinned tier of this node that lacks it."""
        slots = [self.store.by_name[t] for t in pin.tiers if t in self.store.by_name]
        copied = 0
        missing: list[str] = []
        for key in pin.keys:
            lacking = [s for s in slots if not (await s.tier.contains_many([key]))[0]]
            if not lacking:
                continue
            raw = await self._warm_source(key)
            if raw is None:
                missing.append(key)
                continue
            for s in lacking:
                if await self.store._write_tier(s, key, raw, force=True):
                    copied += 1
        res = (await self._residency([pin]))[pin.id]
        return {"copied": copied, "missing": missing, "residency": res}

    async def _clear(self, tier: str, include_pinned: bool) -> dict[str, Any]:
        slot = self.store.by_name.get(tier)
        if slot is None:
            raise ValueError(
                f"this node has no {tier} tier (has {', '.join(s.name for s in self.store.slots)})"
            )
        pinned: set[str] = set() if include_pinned else self.store.pinned_keys(tier)
        held = [k for k, _ in slot.tier.entries()]
        keys = [k for k in held if k not in pinned]
        for k in keys:
            await self.store.delete(k, tiers=[tier])
        return {"removed": len(keys), "kept_pinned": len(held) - len(keys)}

    async def _residency(self, pins: list[Pin]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for p in pins:
            per: dict[str, str] = {}
            for t in p.tiers:
                slot = self.store.by_name.get(t)
                if slot is None:
                    per[t] = "n/a"
                    continue
                have = (
                    await slot.tier.contains_many(p.keys)
                    if t != "s3"
                    else [slot.tier.size_of(k) is not None for k in p.keys]
                )
                n = sum(have)
                per[t] = "resident" if n == len(p.keys) else ("missing" if n == 0 else "pending")
            out[p.id] = per
        return out


def _metric_summary(m: Metrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in m.registry.collect():
        for s in metric.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            lbl = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{lbl}}}" if lbl else s.name] = s.value
    return out


class EmbeddedAgent:
    """Runs a NodeAgent on its own event loop thread inside the current process."""

    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.agent: NodeAgent | None = None
        self.thread = threading.Thread(target=self._run, name="tiered-cache-agent", daemon=True)
        self.thread.start()
        if not self._ready.wait(60):
            raise TimeoutError("embedded agent did not start")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def boot() -> None:
            self.agent = NodeAgent(self.cfg)
            await self.agent.start()

        try:
            self.loop.run_until_complete(boot())
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        if self.agent is None or not self.loop.is_running():
            return
        fut = asyncio.run_coroutine_threadsafe(self.agent.stop(), self.loop)
        try:
            fut.result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def spawn_agent(
    cfg_path: str | os.PathLike[str],
    *args: str,
    timeout: float = 60.0,
    prefix: Sequence[str] = (),
    **popen: Any,
) -> subprocess.Popen[Any]:
    """``tiered-cache agent -c CFG ARGS`` as a child process (how a node runs it), returned
    once its socket accepts. ``prefix`` runs it under another command (``ip netns exec
    NS``: a node with its own address). ``popen`` goes to ``subprocess.Popen`` (stdout,
    env, ...). If the agent does not come up it is killed, and the error carries its
    output when piped."""
    socket_path = load_config(cfg_path).socket_path
    Path(socket_path).unlink(missing_ok=True)  # a killed agent leaves it behind
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "tiered_cache.cli", "agent", "-c", str(cfg_path), *args],
        **popen,
    )
    try:
        wait_for_socket(socket_path, timeout, alive=lambda: proc.poll() is None)
    except TimeoutError as e:
        proc.kill()
        out = proc.communicate()[0] if proc.stdout is not None else None
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        raise TimeoutError(f"{e}:\n{out}" if out else str(e)) from None
    return proc


def wait_for_socket(
    path: str, timeout: float = 30.0, alive: Callable[[], bool] | None = None
) -> None:
    """Until a unix socket at ``path`` accepts; TimeoutError after ``timeout`` s, or as soon
    as ``alive()`` says the process that should open it has gone."""
    import socket as _s

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise TimeoutError(f"agent exited before its socket {path} appeared")
        try:
            with _s.socket(_s.AF_UNIX) as s:
                s.connect(path)
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"agent socket {path} did not appear in {timeout}s")
