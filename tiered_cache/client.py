"""Connector-side access to the node's cache: an ``AgentClient`` over the agent's unix
socket, with chunk bytes moved through the shared-memory DRAM pool.

``open_store(extra_config)`` connects to the node agent; when none is running (and
``embedded`` allows it) it starts one inside this process, so a single vLLM instance works
with no extra process. Every chunk handed to the caller has been verified against its key
and the model fingerprint; anything else is a miss.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from tiered_cache import codec
from tiered_cache.api import LoadReport, PayloadLike, Sink, SlotReservation
from tiered_cache.codec import ChunkMeta
from tiered_cache.config import CacheConfig, ConfigError, load_config
from tiered_cache.ipc import ConnectionLost, IPCError, call_sync, send_only
from tiered_cache.protocol import (
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
    Put,
    RegisterModel,
    Release,
    Request,
    Reserve,
    Touch,
    encode,
    request,
)
from tiered_cache.tiers.shm_index import SlotIndexReader

log = logging.getLogger(__name__)
T = TypeVar("T")
_KEPT_MAPPINGS: list[Any] = []


def _close_if_unused(mapping: Any) -> bool:
    """Close an earlier pool mapping unless something still uses it: a view into it, or a
    page-lock (its memoryview in ``_pinned``) both hold an export, and closing a mapping
    with exports raises ``BufferError`` instead. Index readers are left alone: another
    thread may be reading through one between its own checks."""
    if isinstance(mapping, SlotIndexReader):
        return False
    try:
        mapping.close()
    except BufferError:
        return False
    return True
_STASH_MAX = 8  # slots a client may hold reserved between puts
_TOUCH_BATCH = 64  # direct DRAM hits reported to the agent per message, at most
_TOUCH_AGE_S = 0.25  # ... or this long after the first unreported one
_TOUCH_SEND_S = 1.0  # a touch the agent does not take in this long breaks the connection
_HASH_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tc-hash")
_PROBE_KEY = "0" * 32  # no chunk's key in practice (keys are hashes): the start-up probe


def _commit_item(meta: ChunkMeta, slot: int, size: int) -> list[Any]:
    """One ``Commit`` item: the prefix information rides in the chunk's own header."""
    return [meta.key, slot, size, meta.parent or None, meta.position]


class AgentClient:
    """``SlotStore`` backed by a node agent. Thread-safe.

    The protocol is request/reply on one socket, so a connection carries one exchange at
    a time (its lock). Saves (reserve, commit, abort, put) have a connection of their own:
    a get the agent serves slowly (a hung peer, a slow S3) must not hold up the forward
    pass's layer-wise save behind it. Reservations live on the save connection, leases on
    the main one; the agent drops each connection's with it."""

    def __init__(
        self,
        socket_path: str,
        *,
        verify_dram_reads: bool = True,
        timeout: float = 60.0,
        attach_pool: bool = True,
        client: str = "",
    ):
        self.socket_path = socket_path
        self.client = client  # the kind of client, for the agent's per-client counters
        self.attach_pool = attach_pool  # False for control-only clients (CLI, router)
        self.verify_dram_reads = verify_dram_reads
        self.timeout = timeout
        self._lock = threading.Lock()  # the main connection: one exchange at a time
        self._save_lock = threading.Lock()  # the save connection's
        self._save_sock: socket.socket | None = None  # connected at the first save
        self._save_broken = False
        self._conn_gen = 0  # reservations die with the save connection
        self._stash: list[tuple[int, int]] = []  # (slot, bytes) reserved for our next put
        # Guards the pool mapping, the index and the touches: never held across a call.
        self._state_lock = threading.Lock()
        self._shm: Any = None
        self._stale: list[Any] = []
        # Set by a GPU worker (pin_pool): page-locks each mapping of the pool it copies from.
        self._pin_host: Callable[[memoryview], bool] | None = None
        self._unpin_host: Callable[[memoryview], None] | None = None
        # Mappings pinned, the current one and earlier ones (kept mapped while views may
        # still use them): all unpinned before they are closed.
        self._pinned: list[memoryview] = []
        self._buf: memoryview | None = None
        self._index: SlotIndexReader | None = None
        self._touches: list[list[Any]] = []  # direct DRAM hits not yet reported
        self._touch_timer: threading.Timer | None = None
        self._models: list[dict[str, Any]] = []  # registrations to repeat after a reconnect
        self._connect()

    def _connect(self) -> None:
        from tiered_cache.tiers.dram import attach_shm, prefault

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._broken = False
        hello = self._hello(sock)
        self._pool_name: str | None = hello.get("shm_name") if self.attach_pool else None
        self.node_id: str = hello["node_id"]
        self.tiers: list[str] = hello["tiers"]
        # The cluster's chunk MAC key when the agent has one: chunks written here carry a
        # MAC that other nodes check (codec.py).
        self.mac_key: bytes | None = hello.get("chunk_mac_key")
        self.takes_aliases = bool(hello.get("aliases"))
        self.takes_descriptions = bool(hello.get("kv_events"))
        self.slot_bytes: int = hello["slot_bytes"]
        # A chunk takes a run of slots: anything up to the pool's size fits.
        self.pool_bytes: int = int(hello.get("pool_bytes") or 0)
        shm = attach_shm(hello["shm_name"]) if hello.get("shm_name") and self.attach_pool else None
        buf = memoryview(shm.buf) if shm is not None and shm.buf is not None else None
        if buf is not None:
            prefault(buf, write=False)
            if self._pin_host is not None and self._pin_host(buf):  # a GPU worker's, remapped
                self._pinned.append(buf)
        index = None
        if buf is not None and hello.get("index_shm"):
            try:
                index = SlotIndexReader(attach_shm(hello["index_shm"]), hello.get("num_slots"))
            except (OSError, ValueError) as e:  # every load then asks the agent
                log.warning("shared DRAM index unavailable (%s): loads go through the agent", e)
        with self._state_lock:
            # Views handed out earlier may still point into the old mapping, and another
            # thread may still read through the old index (see _load_direct): keep both
            # referenced and never reuse them (a new agent has marked the index dead).
            self._stale.extend(x for x in (self._shm, self._index) if x is not None)
            self._shm, self._buf, self._index = shm, buf, index
            # An earlier pool's mapping nothing points into any more (no view, no pin) is
            # closed: kept, each restart of an agent onto a new pool would grow this
            # process by a whole pool, for the life of the process.
            self._stale = [x for x in self._stale if not _close_if_unused(x)]
        for m in self._models:  # a restarted agent forgot what this client registered
            call_sync(sock, encode(RegisterModel(m)))

    def _same_pool(self, hello: Mapping[str, Any]) -> bool:
        """Whether ``hello`` comes from the agent whose pool this client has mapped."""
        if hello.get("shm_name") != self._pool_name:
            return False
        return self._index is None or self._index.live

    def _hello(self, sock: socket.socket) -> dict[str, Any]:
        """Hello naming this client's kind; a plain one to an agent that predates it."""
        try:
            return call_sync(sock, encode(Hello(self.client)))
        except ConnectionLost:
            raise
        except IPCError as e:
            if not self.client or "unknown field" not in str(e):
                raise
            return call_sync(sock, encode(Hello()))

    def _call(self, req: Request) -> dict[str, Any]:
        msg = encode(req)
        with self._lock:
            if self._broken:  # the last exchange failed: never read its late reply
                self._reconnect_locked()
            if self._touches:  # ahead of the request, so the agent's answer reflects them
                self._flush_touches()
            try:
                return call_sync(self._sock, msg)
            except ConnectionLost:
                self._break_locked()
                raise

    def _save_call(self, req: Request) -> dict[str, Any]:
        """``_call`` on the save connection. After it broke, both connections are made
        anew (the agent may have restarted: the pool must be mapped again before a save
        writes into it)."""
        msg = encode(req)
        self._save_ready()
        with self._save_lock:
            if self._save_sock is None:
                self._connect_save()
            if self._save_broken:  # broke again since: this call fails like its exchange
                raise ConnectionLost("agent connection broken")
            assert self._save_sock is not None
            try:
                return call_sync(self._save_sock, msg)
            except ConnectionLost:
                self._save_broken = True
                with contextlib.suppress(OSError):
                    self._save_sock.close()
                raise

    def _save_ready(self) -> None:
        """Reconnect if the save connection broke, before anything uses its stash."""
        if self._save_broken:
            with self._lock:
                if self._save_broken:
                    self._reconnect_locked()

    def _connect_save(self) -> None:
        """Open the save connection (call with ``_save_lock`` held)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
            hello = self._hello(sock)
        except (OSError, IPCError):
            sock.close()
            raise
        if self._buf is not None and not self._same_pool(hello):
            # The agent behind the socket restarted (or was replaced) since our pool was
            # mapped: its slots are in another pool than the one we would write into.
            # Checked on this new connection, not the main one, so a save never queues
            # behind a load stuck on the main connection.
            sock.close()
            self._save_broken = True  # _save_ready: both connections anew, the pool remapped
            raise ConnectionLost("the node agent changed since this client mapped its pool")
        self._save_sock = sock
        self._save_broken = False
        self._conn_gen += 1
        self._stash = []

    def _send(self, req: Request) -> None:
        """One-way message (the agent does not answer)."""
        msg = encode(req)
        with self._lock:
            if self._broken:
                return  # the agent dropped this connection's state with it
            try:
                send_only(self._sock, msg)
            except ConnectionLost:
                self._break_locked()

    def _break_locked(self) -> None:
        self._broken = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def _reconnect_locked(self) -> None:
        """A new main connection (call with ``_lock`` held); the save connection too when
        it broke (lock order: ``_lock``, then ``_save_lock``)."""
        with contextlib.suppress(OSError):
            self._sock.close()
        self._connect()  # raises OSError while the agent is down
        self._broken = False
        with self._save_lock:
            if self._save_broken and self._save_sock is not None:
                self._save_sock.close()
                self._connect_save()

    def _retry(self, fn: Callable[[], T]) -> T:
        """Run ``fn``; if the agent restarted under us, reconnect once and run it again
        (the agent dropped our leases and reservations with the old connection). An
        agent that did not answer in time is not asked again: it may be hung."""
        try:
            return fn()
        except ConnectionLost as e:
            if e.timed_out:
                raise
            log.info("agent at %s went away (%s): reconnecting", self.socket_path, e)
            return fn()

    def _slot(self, slot: int, length: int) -> memoryview:
        assert self._buf is not None
        off = slot * self.slot_bytes
        return self._buf[off : off + length]

    # -- ChunkStore

    def lookup(self, keys: Sequence[str]) -> list[str]:
        if not keys:
            return []
        return self._retry(lambda: list(self._call(Lookup(list(keys)))["sources"]))

    def ping(self) -> None:
        """One round trip (reconnecting first if the last exchange failed)."""
        self._retry(lambda: self._call(Hello()))

    def lookup_priced(
        self, keys: Sequence[str], nbytes: int = 0, fresh: bool = False
    ) -> tuple[list[str], list[float]]:
        """``lookup`` plus the agent's expected seconds to load each found chunk from its
        source (priced at ``nbytes`` when its size is not known locally). ``fresh``: not
        answered from the agent's recent misses (a chunk another node is writing now)."""
        if not keys:
            return [], []
        req = Lookup(list(keys), priced=True, nbytes=int(nbytes), fresh=bool(fresh))
        r = self._retry(lambda: self._call(req))
        return list(r["sources"]), [float(c) for c in r["costs"]]

    def present(self, keys: Sequence[str], nbytes: int = 0) -> list[tuple[str, float, str] | None]:
        """Each key on its own (no prefix rule): (source, expected load seconds, key to
        load) or None. The key to load is the key itself, or the whole chunk an alias
        names a prefix of (an agent that knows no aliases answers pairs)."""
        if not keys:
            return []
        r = self._retry(lambda: self._call(Present(list(keys), int(nbytes))))  # fmt: skip
        return [
            None if f is None else (str(f[0]), float(f[1]), str(f[2]) if len(f) > 2 else k)
            for k, f in zip(keys, r["found"], strict=True)
        ]

    def alias(self, targets: Sequence[str], aliases: Sequence[Sequence[str]]) -> None:
        """Register ``aliases[i]`` as keys of prefixes of chunk ``targets[i]`` (no reply)."""
        if targets and self.takes_aliases:
            self._send(Alias(list(targets), [list(a) for a in aliases]))

    def describe(self, req: Describe) -> None:
        """Tell the agent what vLLM calls the blocks of some chunks (no reply); only to an
        agent that publishes KV events."""
        if req.keys and self.takes_descriptions:
            self._send(req)

    def prefetch(
        self, keys: Sequence[str], fingerprint: bytes | None = None, wait_s: float = 0.0
    ) -> int:
        """Have the agent copy ``keys`` into its DRAM in the background (from NVMe, a peer
        or S3); poll ``in_dram``. With ``wait_s``, the reply comes once they have landed
        (or their copies failed), at most ``wait_s`` later. Returns how many copies it
        started."""
        if not keys:
            return 0
        req = Prefetch(list(keys), fingerprint, float(wait_s))
        return int(self._retry(lambda: self._call(req))["started"])

    def in_dram(self, keys: Sequence[str]) -> list[bool] | None:
        """Which keys the shared DRAM index holds now, with no round trip to the agent;
        None without an index (then ask ``lookup``)."""
        with self._state_lock:
            ix = self._index
        if ix is None:
            return None
        return [ix.find(k) is not None for k in keys]

    def locate(self, keys: Sequence[str]) -> list[list[str]]:
        """Node ids holding each key in DRAM or NVMe, cluster-wide (from the directory)."""
        if not keys:
            return []
        reply = self._retry(lambda: self._call(Locate(list(keys))))
        return [list(n) for n in reply["nodes"]]

    def register_model(self, model: Mapping[str, Any]) -> str:
        """Register a connector's fingerprint (``ModelRegistration`` fields) with the agent,
        which keeps it in the directory while this client stays connected. Returns its hex."""
        doc = dict(model)
        h = str(self._retry(lambda: self._call(RegisterModel(doc)))["fingerprint"])
        self._models.append(doc)
        return h

    def check_serves(self) -> None:
        """Start-up check that this agent can serve loads on its tiers: one load of a key
        nothing stores must come back a miss (it counts as one). A ``ConfigError`` on one
        line otherwise, so a store that cannot read is refused when its client starts,
        not found out by a failure on every load."""
        try:
            self.load_report([_PROBE_KEY], None, lambda *_: None)
        except IPCError as e:
            raise ConfigError(
                f"tiers (dram, nvme, s3 .enabled): the node agent at {self.socket_path} "
                f"(tiers {', '.join(self.tiers) or 'none'}) cannot serve loads: "
                + " ".join(str(e).split())[:300]
            ) from None

    def load_many(self, keys: Sequence[str], fingerprint: bytes | None, sink: Sink) -> list[bool]:
        """Verify each chunk and hand it to ``sink`` straight from shared memory.
        Returns which keys were delivered; the rest are misses."""
        return self.load_report(keys, fingerprint, sink).ok

    def load_report(self, keys: Sequence[str], fingerprint: bytes | None, sink: Sink) -> LoadReport:
        """``load_many`` that also says which source served each chunk and why a returned
        chunk was refused."""
        if not keys:
            return LoadReport([], [])
        return self._retry(lambda: self._load_many(keys, fingerprint, sink))

    def _load_many(self, keys: Sequence[str], fingerprint: bytes | None, sink: Sink) -> LoadReport:
        rep = LoadReport([False] * len(keys), [""] * len(keys))
        # DRAM hits straight from the pool through the shared index: no round trip. The
        # agent serves the rest (lower tiers, peers, and any read that raced a writer).
        todo = self._load_direct(keys, fingerprint, sink, rep)
        while todo:  # an agent serving inline bytes answers a bounded reply at a time
            todo = self._load_via_agent(keys, todo, fingerprint, sink, rep)
        return rep

    def _load_via_agent(
        self,
        keys: Sequence[str],
        todo: list[int],
        fingerprint: bytes | None,
        sink: Sink,
        rep: LoadReport,
    ) -> list[int]:
        """One get of ``keys[i] for i in todo``; returns the positions the agent answered
        "later" (its reply was full: ask again)."""
        want = [keys[i] for i in todo]
        items = self._call(Get(list(want), fingerprint))["items"]
        leased: list[int] = []
        later: list[int] = []
        try:
            for i, key, item in zip(todo, want, items, strict=True):
                if item is None:
                    continue
                if item.get("later"):
                    later.append(i)
                    continue
                rep.sources[i] = str(item.get("src") or "")
                if "slot" in item:
                    leased.append(item["slot"])
                    raw: PayloadLike = self._slot(item["slot"], item["len"])
                else:
                    raw = item["data"]
                self._deliver(i, key, raw, fingerprint, sink, rep)
        finally:
            if leased:  # one-way: a get costs one round trip
                self._send(Release(leased))
        if later and len(later) == len(todo):  # the agent served none: never spin on it
            raise IPCError("the agent answered no chunk of a get")
        return later

    def _load_direct(
        self, keys: Sequence[str], fingerprint: bytes | None, sink: Sink, rep: LoadReport
    ) -> list[int]:
        """Serve what the shared index finds; return the positions left for the agent."""
        with self._state_lock:  # one consistent (index, pool) pair, should a reconnect swap them
            ix, buf, slot_bytes = self._index, self._buf, self.slot_bytes
        if ix is None or buf is None:
            return list(range(len(keys)))
        rest: list[int] = []
        hits: list[list[Any]] = []
        for i, key in enumerate(keys):
            found = ix.find(key)
            if found is None or found[0] * slot_bytes + found[2] > buf.nbytes:
                rest.append(i)
                continue
            slot, gen, length = found
            off = slot * slot_bytes
            status, tokens = self._deliver(
                i,
                key,
                buf[off : off + length],
                fingerprint,
                sink,
                rep,
                still_valid=functools.partial(ix.unchanged, slot, gen),
            )
            if status in ("raced", "wrong_key"):
                # The slot changed under the copy, or holds another key's chunk (the
                # agent deletes that one and looks further): ask the agent.
                rest.append(i)
            elif status == "ok":
                rep.sources[i] = "dram"
                hits.append([key, length, tokens])
        if hits:
            # Recency for eviction and the hit metrics go to the agent one-way and in
            # batches: a message per load would wake the agent (a core) on every hit.
            with self._state_lock:
                self._touches.extend(hits)
                full = len(self._touches) >= _TOUCH_BATCH
            # Not behind a call another thread has in flight: the timer sends them then.
            if full and self._lock.acquire(blocking=False):
                try:
                    self._flush_touches()
                finally:
                    self._lock.release()
            with self._state_lock:
                if self._touches and self._touch_timer is None:  # an idle client reports soon
                    self._touch_timer = threading.Timer(_TOUCH_AGE_S, self._flush_later)
                    self._touch_timer.daemon = True
                    self._touch_timer.start()
        return rest

    def _flush_later(self) -> None:
        with self._state_lock:
            self._touch_timer = None
        with self._lock:
            self._flush_touches()

    def _flush_touches(self) -> None:
        """Send the pending touches (call with ``_lock`` held). A lost connection loses
        them: they are hints."""
        with self._state_lock:
            hits, self._touches = self._touches, []
        if not hits or self._broken:
            return
        sock = self._sock
        sock.settimeout(_TOUCH_SEND_S)  # a stalled agent must not stall direct reads long
        try:
            send_only(sock, encode(Touch(hits)))
        except (ConnectionLost, OSError):
            # Part of a frame may have gone out: the stream is unusable. The next call
            # reconnects instead of reading out of step.
            self._break_locked()
            return
        with contextlib.suppress(OSError):
            sock.settimeout(self.timeout)

    def _deliver(
        self,
        i: int,
        key: str,
        raw: PayloadLike,
        fingerprint: bytes | None,
        sink: Sink,
        rep: LoadReport,
        still_valid: Callable[[], bool] | None = None,
    ) -> tuple[str, int]:
        """Verify one chunk and hand it to ``sink``: ("ok" | "failed" | "raced" |
        "wrong_key", tokens). "raced" means ``still_valid`` turned false: the bytes may be
        torn, not damaged; "wrong_key" (reads through the index only): the header names
        another key."""
        try:
            meta, payload = codec.decode(
                raw, expect_key=key, expect_fingerprint=fingerprint, verify_payload=False
            )
            want = codec.parse_header(raw)[2]
        except codec.ChunkError as e:
            if still_valid is not None and not still_valid():
                return "raced", 0
            if still_valid is not None and isinstance(e, codec.ChunkWrongKey):
                return "wrong_key", 0  # read through the index: the agent drops it
            log.warning("chunk %s failed verification: %s", key, e)
            rep.failures[i] = "mismatch" if isinstance(e, codec.ChunkMismatch) else "verification"
            return "failed", 0
        # Hash on a second core while the sink copies: a mismatch reports the chunk as
        # failed, and the connector then has vLLM recompute what the sink wrote.
        fut = _HASH_POOL.submit(codec.checksum, payload) if self.verify_dram_reads else None
        sink(i, meta, payload)
        bad = fut is not None and fut.result() != want
        if still_valid is not None and not still_valid():
            return "raced", 0
        if bad:
            log.warning("chunk %s failed verification: payload checksum mismatch", key)
            rep.failures[i] = "verification"
            return "failed", 0
        rep.ok[i] = True
        return "ok", meta.num_tokens

    def get_many(
        self, keys: Sequence[str], fingerprint: bytes
    ) -> list[tuple[ChunkMeta, memoryview] | None]:
        out: list[tuple[ChunkMeta, memoryview] | None] = [None] * len(keys)

        def keep(i: int, meta: ChunkMeta, payload: memoryview) -> None:
            out[i] = (meta, memoryview(bytearray(payload)))

        ok = self.load_many(keys, fingerprint, keep)
        # The sink also saw copies that were then refused (damaged, or raced and missed).
        return [o if k else None for o, k in zip(out, ok, strict=True)]

    def put_many(
        self,
        items: Sequence[tuple[ChunkMeta, PayloadLike]],
        *,
        wait: bool = False,
    ) -> None:
        if not items:
            return
        self._retry(lambda: self._put_many(items, wait))

    def _put_many(self, items: Sequence[tuple[ChunkMeta, PayloadLike]], wait: bool) -> None:
        self._save_ready()
        payloads = [memoryview(p).cast("B") for _, p in items]
        sizes = [codec.HEADER_SIZE + p.nbytes for p in payloads]
        slots: list[int | None] = [None] * len(items)
        if self._buf is not None:
            # Runs the agent handed us with the last commit first, then reserve the rest.
            fits = [i for i, n in enumerate(sizes) if n <= self.pool_bytes]
            rest: list[int] = []
            for i in fits:
                at = next((j for j, (_, cap) in enumerate(self._stash) if cap >= sizes[i]), None)
                if at is None:
                    rest.append(i)
                else:
                    slots[i] = self._stash.pop(at)[0]
            if rest:
                got = self._save_call(Reserve([sizes[i] for i in rest]))["slots"]
                for i, sl in zip(rest, got, strict=True):
                    slots[i] = sl
        commits: list[list[Any]] = []
        try:
            for i, ((meta, _), payload, slot) in enumerate(
                zip(items, payloads, slots, strict=True)
            ):
                if slot is None:  # no room in DRAM (or too large): inline copy to the agent
                    blob = codec.encode(meta, payload, mac_key=self.mac_key)
                    self._save_call(Put(meta.key, blob, wait))
                    continue
                dst = self._slot(slot, sizes[i])
                # Checksum (and MAC) overlap the copy: numpy's copy releases the GIL.
                fut = _HASH_POOL.submit(codec.pack_header, meta, payload, mac_key=self.mac_key)
                np.copyto(
                    np.frombuffer(dst[codec.HEADER_SIZE :], dtype=np.uint8),
                    np.frombuffer(payload, dtype=np.uint8),
                )
                dst[: codec.HEADER_SIZE] = fut.result()
                commits.append(_commit_item(meta, slot, sizes[i]))
        except BaseException:
            self._save_call(Abort([s for s in slots if s is not None]))
            raise
        if commits:
            refill = max(0, min(len(commits), _STASH_MAX) - len(self._stash))
            r = self._save_call(Commit(commits, wait, refill))
            self._stash.extend((int(sl), int(cap)) for sl, cap in r.get("slots", ()))

    # -- zero-copy puts: the caller writes payloads straight into reserved DRAM slots

    def reserve_payloads(self, payload_sizes: Sequence[int]) -> SlotReservation | None:
        """Reserve one DRAM slot per payload; None when any does not fit (the caller then
        uses ``put_many``). Fill ``views[i]`` and call ``commit_payloads``, or
        ``abort_reservation``."""
        if self._buf is None or not payload_sizes:
            return None
        sizes = [codec.HEADER_SIZE + n for n in payload_sizes]
        slots = self._retry(lambda: self._save_call(Reserve(sizes))["slots"])
        res = SlotReservation(list(slots), [], sizes, self._conn_gen)
        if any(s is None for s in slots):
            self.abort_reservation(res)
            return None
        res.views = [
            self._slot(sl, n)[codec.HEADER_SIZE :] for sl, n in zip(slots, sizes, strict=True)
        ]
        return res

    def commit_payloads(
        self,
        res: SlotReservation,
        metas: Sequence[ChunkMeta],
        *,
        wait: bool = False,
    ) -> None:
        """Checksum (and MAC) each filled payload on the hash pool, write its header and
        commit."""
        if res.gen != self._conn_gen:
            raise ConnectionLost("the agent restarted: the reserved slots are gone")
        views = res.views
        heads = list(
            _HASH_POOL.map(functools.partial(codec.pack_header, mac_key=self.mac_key), metas, views)
        )
        commits: list[list[Any]] = []
        for i, (meta, slot) in enumerate(zip(metas, res.slots, strict=True)):
            assert slot is not None
            self._slot(slot, codec.HEADER_SIZE)[:] = heads[i]
            commits.append(_commit_item(meta, slot, res.sizes[i]))
        self._save_call(Commit(commits, wait))

    def abort_reservation(self, res: SlotReservation) -> None:
        if res.gen != self._conn_gen:
            return  # the agent dropped them with the old connection
        held = [s for s in res.slots if s is not None]
        if held:
            with contextlib.suppress(ConnectionLost, OSError):
                self._save_call(Abort(held))

    def admin(self, op: str, **kw: Any) -> dict[str, Any]:
        return self._retry(lambda: self._call(request(op, **kw)))

    def pin_pool(
        self, pin: Callable[[memoryview], bool], unpin: Callable[[memoryview], None]
    ) -> bool:
        """Page-lock the DRAM pool with ``pin`` now and after every remap; ``unpin`` runs
        before a mapping is closed. Only a process that DMA-copies to a GPU calls this."""
        self._pin_host, self._unpin_host = pin, unpin
        if self._buf is None or not pin(self._buf):
            return False
        self._pinned.append(self._buf)
        return True

    def close(self) -> None:
        try:
            with self._state_lock:
                if self._touch_timer is not None:
                    self._touch_timer.cancel()
                    self._touch_timer = None
            with self._lock:
                self._flush_touches()
            self._sock.close()
            with self._save_lock:
                if self._save_sock is not None:
                    self._save_sock.close()
        finally:
            # Indexes of earlier connections too: a reader left to the garbage collector
            # would close its segment while its own view still holds it.
            for ix in [self._index, *self._stale]:
                if isinstance(ix, SlotIndexReader):
                    ix.close()
            self._index = None
            if self._unpin_host is not None:
                for mv in self._pinned:
                    self._unpin_host(mv)
            self._pinned.clear()
            try:
                if self._buf is not None:
                    self._buf.release()
                if self._shm is not None:
                    self._shm.close()
            except BufferError:
                # A caller still holds a view: keep the mapping referenced for the life of
                # the process (unmapping under a live view would crash; GC would complain).
                _KEPT_MAPPINGS.append(self._shm)
            self._buf = None
            self._shm = None


_embedded: dict[str, Any] = {}
_embedded_lock = threading.Lock()


def config_from_extra(extra_config: Mapping[str, Any]) -> CacheConfig:
    """Our config from a connector's extra config: ``config_file`` (YAML) or inline
    ``tiered_cache`` mapping; neither gives the embedded defaults."""
    if extra_config.get("config_file"):
        return load_config(str(extra_config["config_file"]))
    if extra_config.get("store_dir"):
        # Shorthand for tests and demos: DRAM plus a write-through NVMe directory, with
        # the agent socket and pool named after the directory so processes share them.
        d = os.path.abspath(str(extra_config["store_dir"]))
        tag = hashlib.sha256(d.encode()).hexdigest()[:10]
        return load_config(
            {
                "node_id": f"local-{tag}",
                "dram": {
                    "capacity": extra_config.get("dram_capacity", "256MiB"),
                    "slot_bytes": extra_config.get("slot_bytes", "auto"),
                },
                "nvme": {
                    "enabled": True,
                    "path": d,
                    "capacity": "4GiB",
                    "write_mode": "write_through",
                },
                "agent": {"socket": os.path.join(d, "agent.sock")},
            }
        )
    inline = extra_config.get("tiered_cache")
    return load_config(dict(inline) if inline else None)


def connect(
    cfg: CacheConfig,
    *,
    embedded: str = "auto",
    verify_dram_reads: bool = True,
    attach_pool: bool = True,
    timeout: float = 60.0,
    client: str = "",
) -> AgentClient:
    """Client for ``cfg``'s node agent; start one in-process if allowed and none runs.
    ``client``: its kind (``protocol.CLIENT_KINDS``), for the agent's per-client counters."""
    path = cfg.socket_path
    try:
        return AgentClient(
            path,
            verify_dram_reads=verify_dram_reads,
            attach_pool=attach_pool,
            timeout=timeout,
            client=client,
        )
    except (FileNotFoundError, ConnectionRefusedError, IPCError, OSError):
        if embedded == "never":
            raise
    from tiered_cache.agent import EmbeddedAgent

    # Several processes (the TP ranks of one vLLM) may find no agent at once; a second
    # embedded agent would unlink the first's socket and pool. One starts it under a file
    # lock beside the socket; the others wait, then connect to it.
    with _embedded_lock, _start_lock(path):
        if path not in _embedded:
            try:
                return AgentClient(path, verify_dram_reads=verify_dram_reads,
                                   attach_pool=attach_pool, timeout=timeout,
                                   client=client)  # fmt: skip
            except (FileNotFoundError, ConnectionRefusedError, IPCError, OSError):
                pass
            log.info("no node agent at %s: starting an embedded one", path)
            _embedded[path] = EmbeddedAgent(cfg)
    return AgentClient(path, verify_dram_reads=verify_dram_reads, timeout=timeout, client=client)


@contextlib.contextmanager
def _start_lock(socket_path: str) -> Iterator[None]:
    """An exclusive lock shared by every process that may start an agent on ``socket_path``."""
    import fcntl

    d = os.path.dirname(os.path.abspath(socket_path))
    if not os.path.isdir(d):  # the agent would refuse a runtime dir open to others
        os.makedirs(d, mode=0o700, exist_ok=True)
    fd = os.open(socket_path + ".start-lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def open_store(extra_config: Mapping[str, Any], *, client: str = "vllm") -> AgentClient:
    """ChunkStore for a connector. Keys: ``config_file``, ``tiered_cache`` (inline),
    ``embedded`` (auto|never), ``verify_dram_reads`` (default true), ``agent_timeout_s``
    (how long a call may wait for the agent's answer; 60). ``client``: the connector's
    kind (``protocol.CLIENT_KINDS``; the vLLM connector by default)."""
    cfg = config_from_extra(extra_config)
    sock = extra_config.get("agent_socket")
    if sock:
        cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"socket": sock})})
    return connect(
        cfg,
        embedded=str(extra_config.get("embedded", "auto")),
        verify_dram_reads=bool(extra_config.get("verify_dram_reads", True)),
        timeout=float(extra_config.get("agent_timeout_s", 60.0)),
        client=client,
    )


def shutdown_embedded() -> None:
    with _embedded_lock:
        for agent in _embedded.values():
            agent.stop()
        _embedded.clear()
