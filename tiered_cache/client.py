"""Connector-side access to the node's cache: an ``AgentClient`` over the agent's unix
socket, with chunk bytes moved through the shared-memory DRAM pool.

``open_store(extra_config)`` connects to the node agent; when none is running (and
``embedded`` allows it) it starts one inside this process, so a single vLLM instance works
with no extra process. Every chunk handed to the caller has been verified against its key
and the model fingerprint; anything else is a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from tiered_cache import codec
from tiered_cache.api import PayloadLike
from tiered_cache.codec import ChunkMeta
from tiered_cache.config import CacheConfig, load_config
from tiered_cache.ipc import ConnectionLost, IPCError, call_sync

log = logging.getLogger(__name__)
T = TypeVar("T")
_KEPT_MAPPINGS: list[Any] = []
_HASH_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tc-hash")

# Called with (index in request, meta, payload view) while the slot is leased: copy out now.
Sink = Callable[[int, ChunkMeta, memoryview], None]


class AgentClient:
    """ChunkStore backed by a node agent. Thread-safe (one request at a time)."""

    def __init__(
        self,
        socket_path: str,
        *,
        verify_payload: bool = True,
        timeout: float = 60.0,
        attach_pool: bool = True,
    ):
        self.socket_path = socket_path
        self.attach_pool = attach_pool  # False for control-only clients (CLI, router)
        self.verify_payload = verify_payload
        self.timeout = timeout
        self._lock = threading.Lock()
        self._shm: Any = None
        self._stale: list[Any] = []
        self._buf: memoryview | None = None
        self._connect()

    def _connect(self) -> None:
        from tiered_cache.tiers.dram import attach_shm, maybe_pin_host_memory, prefault

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        hello = call_sync(sock, {"op": "hello"})
        self.node_id: str = hello["node_id"]
        self.tiers: list[str] = hello["tiers"]
        self.slot_bytes: int = hello["slot_bytes"]
        if self._shm is not None:
            # Views handed out earlier may still point into the old mapping: keep it
            # referenced (closing it would fail while views exist) and never reuse it.
            self._stale.append(self._shm)
        self._shm = (
            attach_shm(hello["shm_name"]) if hello.get("shm_name") and self.attach_pool else None
        )
        self._buf = (
            memoryview(self._shm.buf)
            if self._shm is not None and self._shm.buf is not None
            else None
        )
        if self._buf is not None:
            prefault(self._buf, write=False)
            maybe_pin_host_memory(self._buf)

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return call_sync(self._sock, msg)

    def _retry(self, fn: Callable[[], T]) -> T:
        """Run ``fn``; if the agent restarted under us, reconnect once and run it again
        (the agent dropped our leases and reservations with the old connection)."""
        try:
            return fn()
        except ConnectionLost as e:
            log.warning("agent at %s went away (%s): reconnecting", self.socket_path, e)
            with self._lock:
                with contextlib.suppress(OSError):
                    self._sock.close()
                self._connect()
            return fn()

    def _slot(self, slot: int, length: int) -> memoryview:
        assert self._buf is not None
        off = slot * self.slot_bytes
        return self._buf[off : off + length]

    # -- ChunkStore

    def lookup(self, keys: Sequence[str]) -> list[str]:
        if not keys:
            return []
        return self._retry(
            lambda: list(self._call({"op": "lookup", "keys": list(keys)})["sources"])
        )

    def locate(self, keys: Sequence[str]) -> list[list[str]]:
        """Node ids holding each key in DRAM or NVMe, cluster-wide (from the directory)."""
        if not keys:
            return []
        reply = self._retry(lambda: self._call({"op": "locate", "keys": list(keys)}))
        return [list(n) for n in reply["nodes"]]

    def load_many(self, keys: Sequence[str], fingerprint: bytes | None, sink: Sink) -> list[bool]:
        """Verify each chunk and hand it to ``sink`` straight from shared memory.
        Returns which keys were delivered; the rest are misses."""
        if not keys:
            return []
        return self._retry(lambda: self._load_many(keys, fingerprint, sink))

    def _load_many(self, keys: Sequence[str], fingerprint: bytes | None, sink: Sink) -> list[bool]:
        items = self._call({"op": "get", "keys": list(keys), "fp": fingerprint})["items"]
        ok = [False] * len(keys)
        leased: list[int] = []
        try:
            for i, (key, item) in enumerate(zip(keys, items, strict=True)):
                if item is None:
                    continue
                if "slot" in item:
                    leased.append(item["slot"])
                    raw: PayloadLike = self._slot(item["slot"], item["len"])
                else:
                    raw = item["data"]
                try:
                    meta, payload = codec.decode(
                        raw, expect_key=key, expect_fingerprint=fingerprint, verify_payload=False
                    )
                    want = codec.parse_header(raw)[2]
                except codec.ChunkError as e:
                    log.warning("chunk %s failed verification: %s", key, e)
                    continue
                # Hash on a second core while the sink copies: a mismatch reports the chunk
                # as failed, and the connector then has vLLM recompute what the sink wrote.
                fut = _HASH_POOL.submit(codec.checksum, payload) if self.verify_payload else None
                sink(i, meta, payload)
                if fut is not None and fut.result() != want:
                    log.warning("chunk %s failed verification: payload checksum mismatch", key)
                    continue
                ok[i] = True
        finally:
            if leased:
                self._call({"op": "release", "slots": leased})
        return ok

    def get_many(
        self, keys: Sequence[str], fingerprint: bytes
    ) -> list[tuple[ChunkMeta, memoryview] | None]:
        out: list[tuple[ChunkMeta, memoryview] | None] = [None] * len(keys)

        def keep(i: int, meta: ChunkMeta, payload: memoryview) -> None:
            out[i] = (meta, memoryview(bytearray(payload)))

        self.load_many(keys, fingerprint, keep)
        return out

    def put_many(
        self,
        items: Sequence[tuple[ChunkMeta, PayloadLike]],
        *,
        wait: bool = False,
        parents: Sequence[str | None] | None = None,
    ) -> None:
        if not items:
            return
        self._retry(lambda: self._put_many(items, wait, parents))

    def _put_many(
        self,
        items: Sequence[tuple[ChunkMeta, PayloadLike]],
        wait: bool,
        parents: Sequence[str | None] | None,
    ) -> None:
        payloads = [memoryview(p).cast("B") for _, p in items]
        sizes = [codec.HEADER_SIZE + p.nbytes for p in payloads]
        slots: list[int | None] = (
            self._call({"op": "reserve", "sizes": sizes})["slots"]
            if self._buf is not None
            else [None] * len(items)
        )
        commits: list[list[Any]] = []
        try:
            for i, ((meta, _), payload, slot) in enumerate(
                zip(items, payloads, slots, strict=True)
            ):
                parent = parents[i] if parents else None
                if slot is None:  # no room in DRAM (or too large): inline copy to the agent
                    self._call(
                        {
                            "op": "put",
                            "key": meta.key,
                            "data": codec.encode(meta, payload),
                            "wait": wait,
                        }
                    )
                    continue
                dst = self._slot(slot, sizes[i])
                fut = _HASH_POOL.submit(codec.checksum, payload)  # overlaps the copy
                # numpy's copy releases the GIL, so the checksum thread really overlaps it.
                np.copyto(
                    np.frombuffer(dst[codec.HEADER_SIZE :], dtype=np.uint8),
                    np.frombuffer(payload, dtype=np.uint8),
                )
                dst[: codec.HEADER_SIZE] = codec.pack_header(
                    meta, payload, payload_checksum=fut.result()
                )
                commits.append([meta.key, slot, sizes[i], parent, i])
        except BaseException:
            self._call({"op": "abort", "slots": [s for s in slots if s is not None]})
            raise
        if commits:
            self._call({"op": "commit", "items": commits, "wait": wait})

    def admin(self, op: str, **kw: Any) -> dict[str, Any]:
        return self._retry(lambda: self._call({"op": op, **kw}))

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
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
                    "slot_bytes": extra_config.get("slot_bytes", "8MiB"),
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
    verify_payload: bool = True,
    attach_pool: bool = True,
) -> AgentClient:
    """Client for ``cfg``'s node agent; start one in-process if allowed and none runs."""
    path = cfg.socket_path
    try:
        return AgentClient(path, verify_payload=verify_payload, attach_pool=attach_pool)
    except (FileNotFoundError, ConnectionRefusedError, IPCError, OSError):
        if embedded == "never":
            raise
    from tiered_cache.agent import EmbeddedAgent

    with _embedded_lock:
        if path not in _embedded:
            log.info("no node agent at %s: starting an embedded one", path)
            _embedded[path] = EmbeddedAgent(cfg)
    return AgentClient(path, verify_payload=verify_payload)


def open_store(extra_config: Mapping[str, Any]) -> AgentClient:
    """ChunkStore for a connector. Keys: ``config_file``, ``tiered_cache`` (inline),
    ``embedded`` (auto|never), ``verify_dram_reads`` (default true)."""
    cfg = config_from_extra(extra_config)
    sock = extra_config.get("agent_socket")
    if sock:
        cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"socket": sock})})
    return connect(
        cfg,
        embedded=str(extra_config.get("embedded", "auto")),
        verify_payload=bool(extra_config.get("verify_dram_reads", True)),
    )


def shutdown_embedded() -> None:
    with _embedded_lock:
        for agent in _embedded.values():
            agent.stop()
        _embedded.clear()
