"""The local server: vLLM connectors (and the CLI, dashboard and router) over the unix
socket. Each frame is decoded into its typed request (``tiered_cache.protocol``) and
handed to the handler the table names; this module holds the data path's handlers
(lookups, leases, slot reservations and commits), ``admin`` the operators'."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import struct
from collections import Counter as CounterT
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from prometheus_client import CollectorRegistry, Counter

from policies import EntryInfo
from tiered_cache import codec
from tiered_cache.agent.state import AgentState
from tiered_cache.directory import ModelRegistration
from tiered_cache.hierarchy import Hit, PinRefused
from tiered_cache.ipc import IPCError, pack, read_msg
from tiered_cache.keys import is_valid_key
from tiered_cache.logthrottle import LogThrottle
from tiered_cache.protocol import (
    CLIENT_KINDS,
    REQUESTS,
    Abort,
    Alias,
    Commit,
    Describe,
    Get,
    Hello,
    Locate,
    Lookup,
    Prefetch,
    Present,
    ProtocolError,
    Put,
    RegisterModel,
    Release,
    Request,
    Reserve,
    Touch,
    decode,
)
from tiered_cache.tiers.base import SlotTier

log = logging.getLogger("tiered_cache.agent")


@dataclass
class _Conn:
    """What one connected client holds; released when its socket closes."""

    leases: CounterT[int] = field(default_factory=CounterT)
    reserved: set[int] = field(default_factory=set)
    models: set[str] = field(default_factory=set)  # fingerprints this client registered
    uid: int | None = None  # the peer's uid (SO_PEERCRED); None where unknown
    trusted: bool = True  # may write chunks and run admin ops (``AdminOps._check_access``)
    client: str = "other"  # its kind, from its hello (``CLIENT_KINDS``): counters' label


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_PREFETCH_WAIT_S = 5.0  # the longest a prefetch request waits for its chunks to land
# The most chunk bytes one get reply carries inline (chunks not leased in DRAM: no DRAM
# tier, or no room in it), past its first chunks: the rest are answered "later" and the
# client asks again, so a long prompt's load on an NVMe- or S3-only node holds a bounded
# staging buffer, not the whole prompt's KV at once.
MAX_INLINE_REPLY_BYTES = 64 << 20
LATER = "later"


def peer_uid(sock: Any) -> int | None:
    """The uid of the process at the other end of a unix socket (a ``socket`` or
    asyncio's wrapper of one), as the kernel saw it at connect time: it cannot be forged.
    None where the platform does not say (no ``SO_PEERCRED``); OSError if asking fails."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if sock is None or opt is None or sock.family != socket.AF_UNIX:
        return None
    _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, opt, _UCRED.size))
    return int(uid)


def _bad_key(op: str, key: Any) -> ProtocolError:
    return ProtocolError(f"{op}: invalid chunk key {key!r} (32 lowercase hex characters)")


def _check_keys(op: str, keys: list[str]) -> None:
    """Every key a chunk key, before the store sees any (its tiers raise on others, and a
    prefetch would raise once per key in the background)."""
    for k in keys:
        if not is_valid_key(k):
            raise _bad_key(op, k)


# What a broken stream raises in ``read_msg``: a frame cut short, not msgpack, not a map.
_BAD_FRAME = (asyncio.IncompleteReadError, IPCError, ValueError, TypeError, msgpack.UnpackException)


Handler = Callable[[_Conn, Any], Awaitable[dict[str, Any]]]


class _LoadCounters:
    """Chunks each kind of client asked this agent for, and those whose load failed (by
    error), on the agent's registry: the dashboard's failure rate per client."""

    def __init__(self, registry: CollectorRegistry) -> None:
        p = "tiered_cache_client_"
        self.loads = _counter(registry, p + "loads", "Chunks clients loaded or asked for", [
            "client"])  # fmt: skip
        self.failures = _counter(
            registry, p + "load_failures", "Chunks whose load failed, by client and error",
            ["client", "kind"],
        )  # fmt: skip


def _counter(registry: CollectorRegistry, name: str, doc: str, labels: list[str]) -> Counter:
    try:
        return Counter(name, doc, labels, registry=registry)
    except ValueError:  # a second agent on one registry (tests): share its series
        found = registry._names_to_collectors[name]
        assert isinstance(found, Counter)
        return found


class LocalServer(AgentState):
    @functools.cached_property
    def _load_counters(self) -> _LoadCounters:
        return _LoadCounters(self.metrics.registry)

    @functools.cached_property
    def _client_log(self) -> LogThrottle:
        """Lines about what clients sent: one per kind a minute (a client repeats at
        will). This agent's own windows: another agent in the process keeps its own."""
        return LogThrottle(log)

    async def _serve_local(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conn = _Conn()
        try:
            conn.uid = peer_uid(w.get_extra_info("socket"))
            # Unknown only where the platform has no SO_PEERCRED: the socket's 0600 mode
            # is the guard there.
            conn.trusted = (
                conn.uid is None
                or conn.uid in (0, os.geteuid())
                or (conn.uid in self.cfg.agent.allowed_uids)
            )
        except OSError:  # could not ask: trust nothing
            conn.trusted = False
        me = asyncio.current_task()
        if me is not None:
            self._local_tasks.add(me)
        try:
            while True:
                try:
                    msg = await read_msg(r)
                except _BAD_FRAME as e:  # the stream is out of step: drop the connection
                    self._client_log.log(
                        "bad_frame", logging.WARNING,
                        "local socket: closed a connection that sent a malformed frame (%s: %s)",
                        type(e).__name__, str(e)[:200],
                    )  # fmt: skip
                    break
                if msg is None:
                    break
                reply = await self._handle(conn, msg)
                if msg.get("noreply"):  # fire-and-forget (release): the client reads nothing
                    continue
                w.write(pack(reply))
                await w.drain()
        except asyncio.CancelledError:
            # The agent is stopping. End quietly: Python 3.11's stream server logs an ERROR
            # for every handler task that ends cancelled.
            pass
        finally:
            # A client that died mid-transfer must not leak slots or leases: each is
            # returned on its own, so one failure cannot keep the rest.
            for slot, n in conn.leases.items():
                for _ in range(n):
                    with contextlib.suppress(Exception):
                        self.store.release(slot)
            for slot in conn.reserved:
                with contextlib.suppress(Exception):
                    self.store.abort_dram(slot)
            conn.leases.clear()
            conn.reserved.clear()
            for h in conn.models:
                self._model_refs[h] -= 1
                if self._model_refs[h] <= 0:
                    del self._model_refs[h]
                    self._models.pop(h, None)  # no longer refreshed; ages out of the directory
            w.close()
            if me is not None:
                self._local_tasks.discard(me)

    async def _handle(self, conn: _Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """The reply to one frame: the handler's result with ``ok``, or the error."""
        try:
            req = decode(msg)
            self._check_access(conn, req)
            reply = await self._handlers[type(req)](conn, req)
            reply["ok"] = True
        except ProtocolError as e:
            op = msg.get("op")
            self._client_log.log(
                ("refused", op if isinstance(op, str) and op in REQUESTS else None),
                logging.WARNING, "refused a request: %s", str(e)[:500],
            )  # fmt: skip
            reply = {"ok": False, "error": str(e), "kind": "protocol"}
        except PinRefused as e:
            reply = {"ok": False, "error": str(e), "kind": "pin_refused"}
        except PermissionError as e:
            reply = {"ok": False, "error": str(e), "kind": "auth"}
        except Exception as e:
            # decode() passed it, so ``op`` is one of ours. The first of each kind a minute
            # keeps its traceback; a client that repeats the request cannot fill the log.
            self._client_log.log(
                ("failed", msg.get("op"), type(e).__name__), logging.ERROR,
                "request %s failed: %s: %s", msg.get("op"), type(e).__name__, str(e)[:500],
                exc_info=True,
            )  # fmt: skip
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return reply

    def _data_handlers(self) -> dict[type[Request], Handler]:
        return {
            Hello: self._hello,
            Lookup: self._lookup,
            Present: self._present,
            Alias: self._alias,
            Describe: self._describe,
            Prefetch: self._prefetch,
            Locate: self._locate,
            Get: self._get,
            Touch: self._touch,
            Release: self._release,
            Reserve: self._reserve,
            Commit: self._commit,
            Abort: self._abort,
            Put: self._put,
            RegisterModel: self._register_model,
        }

    async def _hello(self, conn: _Conn, req: Hello) -> dict[str, Any]:
        if req.client:  # a bounded label: a client names itself, but from a fixed list
            conn.client = req.client if req.client in CLIENT_KINDS else "other"
        dram = self.store.slots[0].tier
        pool = dram if isinstance(dram, SlotTier) else None
        return {
            "node_id": self.cfg.node_id,
            "shm_name": pool.shm_name if pool else None,
            "index_shm": pool.shared_index.name if pool else None,
            "slot_bytes": pool.slot_bytes if pool else 0,
            "num_slots": pool.num_slots if pool else 0,
            "pool_bytes": pool.pool_bytes if pool else 0,
            "tiers": [s.name for s in self.store.slots],
            # Writers on this node sign their chunks with it; a client that may not write
            # gets none. The peer secret it derives from never leaves the agent.
            "chunk_mac_key": self.store.mac_key if conn.trusted else None,
            # Whether this client may register aliases (a write): one that may not, or
            # an agent that predates them, is sent none.
            "aliases": conn.trusted,
            # Whether to describe chunks' vLLM blocks (this agent publishes KV events).
            "kv_events": self.kv_events is not None and conn.trusted,
        }

    async def _lookup(self, conn: _Conn, req: Lookup) -> dict[str, Any]:
        _check_keys("lookup", req.keys)
        if req.priced:  # with each chunk's expected load seconds
            srcs, costs = await self.store.lookup_priced(req.keys, req.nbytes, req.fresh)
            return {"sources": srcs, "costs": costs}
        return {"sources": await self.store.lookup(req.keys, req.fresh)}

    async def _present(self, conn: _Conn, req: Present) -> dict[str, Any]:
        _check_keys("present", req.keys)
        found = await self.store.present(req.keys, req.nbytes)
        return {"found": [None if f is None else list(f) for f in found]}

    async def _alias(self, conn: _Conn, req: Alias) -> dict[str, Any]:
        _check_keys("alias", req.targets)
        if len(req.aliases) != len(req.targets):
            raise ProtocolError("alias: one list of aliases per target")
        for names in req.aliases:
            _check_keys("alias", names)
        self.store.aliases.add(req.targets, req.aliases)
        return {}

    async def _describe(self, conn: _Conn, req: Describe) -> dict[str, Any]:
        _check_keys("describe", req.keys)
        if self.kv_events is not None:
            try:
                self.kv_events.describe(req)
            except ValueError as e:
                raise ProtocolError(str(e)) from None
        return {}

    async def _prefetch(self, conn: _Conn, req: Prefetch) -> dict[str, Any]:
        _check_keys("prefetch", req.keys)
        started = await self.store.prefetch(req.keys, req.fp)
        if req.wait_s > 0:  # bounded: a client's request must not hold its connection long
            landed = await self.store.wait_prefetched(
                req.keys, min(req.wait_s, MAX_PREFETCH_WAIT_S)
            )
            return {"started": started, "landed": landed}
        return {"started": started}

    async def _locate(self, conn: _Conn, req: Locate) -> dict[str, Any]:
        _check_keys("locate", req.keys)
        locs = await self.directory.locate(req.keys)
        return {"nodes": [sorted({x.node_id for x in ls if x.tier != "s3"}) for ls in locs]}

    async def _get(self, conn: _Conn, req: Get) -> dict[str, Any]:
        store = self.store
        _check_keys("get", req.keys)  # before any lease is taken
        out: list[Any] = []
        sem = asyncio.Semaphore(8)  # chunks of one request load in parallel, bounded
        inline = 0  # bytes of chunks this reply carries itself (not leased in DRAM)

        async def one(key: str) -> tuple[tuple[int, int] | Hit | str | None, str]:
            nonlocal inline
            served: list[str] = []  # the source that actually served it, for the client
            async with sem:
                # The reply is the staging buffer of chunks DRAM does not hold (no DRAM
                # tier, or no room): bounded, the rest asked for again by the client.
                if inline >= MAX_INLINE_REPLY_BYTES:
                    return LATER, ""
                got = await store.lease(key, expect_fingerprint=req.fp, served=served)
                if isinstance(got, Hit):
                    inline += memoryview(got.encoded()).nbytes
            return got, (served[0] if served else "")

        # Every load runs to its end even when one fails: the leases the others took are
        # then returned, not lost with the failed request.
        counters = self._load_counters
        results = await asyncio.gather(*(one(k) for k in req.keys), return_exceptions=True)
        done = [r for r in results if not isinstance(r, BaseException)]
        # Chunks answered "later" are counted when the client asks for them again.
        later = sum(1 for got, _ in done if isinstance(got, str))
        counters.loads.labels(conn.client).inc(len(req.keys) - later)
        if len(done) < len(results):
            for got, _ in done:
                if isinstance(got, tuple):
                    store.release(got[0])
            err = next(r for r in results if isinstance(r, BaseException))
            # The whole request fails: each of its chunks is a failed load. Logged by
            # ``_handle``, once per kind a minute.
            counters.failures.labels(conn.client, type(err).__name__).inc(len(req.keys) - later)
            raise err
        for got, src in done:
            if got is None:
                out.append(None)
            elif isinstance(got, str):
                out.append({"later": True})
            elif isinstance(got, Hit):
                out.append({"data": got.encoded(), "src": got.source})
            else:
                conn.leases[got[0]] += 1
                out.append({"slot": got[0], "len": got[1], "src": src})
        return {"items": out}

    async def _touch(self, conn: _Conn, req: Touch) -> dict[str, Any]:
        self._load_counters.loads.labels(conn.client).inc(len(req.hits))
        self.store.note_dram_hits(req.hits)  # hits clients read through the shared index
        return {}

    async def _release(self, conn: _Conn, req: Release) -> dict[str, Any]:
        for slot in req.slots:
            if conn.leases[slot] > 0:
                conn.leases[slot] -= 1
                self.store.release(slot)
        return {}

    async def _reserve(self, conn: _Conn, req: Reserve) -> dict[str, Any]:
        slots = []
        for n in req.sizes:
            s = await self.store.reserve_dram(n)
            if s is not None:
                conn.reserved.add(s)
            slots.append(s)
        return {"slots": slots}

    async def _commit(self, conn: _Conn, req: Commit) -> dict[str, Any]:
        store = self.store
        try:
            items = self._check_commit(conn, req.items)
        except ProtocolError:
            # Refused whole, nothing committed: the runs it names that this client reserved
            # go back to the pool (the client drops them on an error), others stay as
            # they are (another client's reservation is not ours to free).
            for it in req.items:
                sl = it[1] if len(it) > 1 else None
                if isinstance(sl, int) and sl in conn.reserved:
                    conn.reserved.discard(sl)
                    store.abort_dram(sl)
            raise
        for n, (key, slot, length, parent, pos) in enumerate(items):
            conn.reserved.discard(slot)
            try:
                await store.commit_dram(
                    key, slot, length, info=EntryInfo(parent, pos), wait=req.wait
                )
            except BaseException:
                # Not committed (checked above, so unexpected): free it and the rest.
                for _, sl, *_ in items[n + 1 :]:
                    conn.reserved.discard(sl)
                    store.abort_dram(sl)
                with contextlib.suppress(Exception):
                    if store.slots[0].tier.size_of(key) is None:
                        store.abort_dram(slot)
                raise
        # Hand the client free runs for its next put, so a put costs one round trip
        # (commit) instead of two: runs as long as this commit's largest chunk, only ones
        # free without evicting, never the last quarter of the pool, and at most a 16th of
        # it per client: in a small pool the stashes of busy clients would otherwise leave
        # nothing to evict for a pin.
        dram = store.slots[0].tier
        stash: list[list[int]] = []
        if isinstance(dram, SlotTier) and req.items:
            size = max(int(it[2]) for it in req.items)
            pages = -(-size // dram.slot_bytes)
            give = min(req.refill, 8, dram.num_slots // (16 * pages))
            for _ in range(give):
                if dram.free_slots - pages < dram.num_slots // 4 or not dram.has_room(size):
                    break
                sl = dram.reserve(size)
                conn.reserved.add(sl)
                stash.append([sl, pages * dram.slot_bytes])
        return {"slots": stash}

    def _check_commit(
        self, conn: _Conn, items: list[list[Any]]
    ) -> list[tuple[str, int, int, str | None, int]]:
        """Every item of a commit, checked before any is committed: its shape, the key, a
        run this client reserved and names once, a length that fits the run, and a
        header naming that key and length (256 bytes read; the payload's checksum is the
        readers' to verify)."""
        tier = self._pool_tier()
        out: list[tuple[str, int, int, str | None, int]] = []
        seen: set[int] = set()
        for i, it in enumerate(items):
            where = f"commit item {i}"
            if len(it) != 5:
                raise ProtocolError(f"{where}: want [key, slot, length, parent, position]")
            key, slot, length, parent, pos = it
            if not isinstance(key, str) or not is_valid_key(key):
                raise _bad_key(where, key)
            if not _is_int(slot) or not _is_int(length) or not _is_int(pos):
                raise ProtocolError(f"{where}: slot, length and position must be integers")
            if parent is not None and not (isinstance(parent, str) and is_valid_key(parent)):
                raise ProtocolError(f"{where}: parent must be a chunk key or null")
            if slot not in conn.reserved or slot in seen:
                raise ProtocolError(f"{where}: slot {slot} is not reserved by this client")
            seen.add(slot)
            run = tier.slot_view(slot)
            if not codec.HEADER_SIZE <= length <= run.nbytes:
                raise ProtocolError(f"{where}: length {length} does not fit its {run.nbytes} B run")
            try:
                meta, plen, _ = codec.parse_header(run[: codec.HEADER_SIZE])
            except codec.ChunkError as e:
                raise ProtocolError(f"{where}: slot {slot} holds no chunk header ({e})") from None
            if meta.key != key or codec.HEADER_SIZE + plen != length:
                raise ProtocolError(
                    f"{where}: the header in slot {slot} is for {meta.key} and "
                    f"{codec.HEADER_SIZE + plen} B, not {key} and {length} B"
                )
            out.append((key, slot, length, parent, pos))
        return out

    def _pool_tier(self) -> SlotTier:
        tier = self.store.slots[0].tier
        if not isinstance(tier, SlotTier):
            raise ProtocolError("this agent has no DRAM pool to commit into")
        return tier

    async def _abort(self, conn: _Conn, req: Abort) -> dict[str, Any]:
        for slot in req.slots:
            if slot in conn.reserved:
                conn.reserved.discard(slot)
                self.store.abort_dram(slot)
        return {}

    async def _put(self, conn: _Conn, req: Put) -> dict[str, Any]:
        # Inline bytes: for chunks that fit no DRAM run, or no DRAM tier. The header must
        # name this key and this many bytes (a cheap check; readers verify the payload).
        if not is_valid_key(req.key):
            raise _bad_key("put", req.key)
        try:
            meta, plen, _ = codec.parse_header(req.data[: codec.HEADER_SIZE])
        except codec.ChunkError as e:
            raise ProtocolError(f"put: not a chunk ({e})") from None
        if meta.key != req.key or codec.HEADER_SIZE + plen != len(req.data):
            raise ProtocolError(
                f"put: the header is for {meta.key} and {codec.HEADER_SIZE + plen} B, not"
                f" {req.key} and {len(req.data)} B"
            )
        await self.store.put(req.key, req.data, wait=req.wait)
        return {}

    async def _register_model(self, conn: _Conn, req: RegisterModel) -> dict[str, Any]:
        """A vLLM connector's fingerprint, kept in the directory for `pin add --model`."""
        reg = ModelRegistration.model_validate(req.model)
        h = reg.hex
        if h not in conn.models:
            conn.models.add(h)
            self._model_refs[h] += 1
        self._models[h] = reg
        await self.directory.register_models(self.cfg.node_id, [reg])
        return {"fingerprint": h}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
