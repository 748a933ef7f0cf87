"""LMCache multiprocess (MP) mode: an L2 adapter that keeps LMCache's L2 objects in the
tiered cache (our DRAM pool, NVMe and S3 tiers, Redis directory, pins, policies).

Start ``lmcache server`` with it (``connectors`` must be importable, e.g. PYTHONPATH=repo)::

    lmcache server --l1-size-gb 1 --eviction-policy LRU --supported-transfer-mode auto \\
      --l2-adapter '{"type": "plugin", "module_path": "connectors.lmcache_mp",
                     "class_name": "TieredCacheL2Adapter",
                     "config_class_name": "TieredCacheL2AdapterConfig",
                     "adapter_params": {"config_file": "/etc/tiered-cache.yaml"}}'

``adapter_params`` are the store keys of ``tiered_cache.client.open_store``
(``config_file``, ``tiered_cache``, ``store_dir``, ``agent_socket``, ``embedded``, ...) plus
``durable`` (default false: a store completes once our DRAM pool holds the chunk; true: once
the write-through tiers hold it too) and ``chunk_size`` (the server's ``--chunk-size``, for
our hit-token counters). vLLM keeps using ``LMCacheMPConnector`` unchanged.

Mapping:

* key: ``sha256`` of the length-prefixed fields of LMCache's ``ObjectKey`` (model, kv
  rank, object group, cache salt, chunk hash), truncated to our 32 hex characters;
* data: the object's bytes as one of our chunks (header with checksum). The fingerprint
  hashes the model name and the object's memory layout (shapes, dtypes, format), so a
  chunk is only ever copied into a buffer of the same model and layout; a chunk that fails
  verification is a load miss, never data;
* pins: our tiers never evict pinned chunks; ``connectors.lmcache_pins.prefix_pin`` (or
  ``python -m connectors.lmcache_pins pin``) turns a token prefix into a pin on the keys
  LMCache MP stores for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import struct
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.platform import create_event_notifier

from tiered_cache import client as tc_client
from tiered_cache.codec import MAX_DIMS, ChunkMeta
from tiered_cache.config import ConfigError
from tiered_cache.keys import KEY_BYTES
from tiered_cache.logthrottle import LogThrottle

if TYPE_CHECKING:
    from lmcache.v1.memory_management import MemoryObj

    from tiered_cache.client import AgentClient

# LMCache's handler and LMCACHE_LOG_LEVEL, so our lines land in the server's log.
log = init_logger("tiered_cache.lmcache_mp")

_DOMAIN = b"tiered-cache/lmcache-mp/v1"
STORE_KEYS = (
    "config_file",
    "tiered_cache",
    "store_dir",
    "agent_socket",
    "embedded",
    "verify_dram_reads",
    "dram_capacity",
    "slot_bytes",
)


# ----------------------------------------------------------------------------- mapping


def _digest(domain: bytes, parts: Sequence[bytes]) -> bytes:
    """sha256 over length-prefixed parts: no two field tuples serialize alike."""
    h = hashlib.sha256(domain)
    for p in parts:
        h.update(struct.pack("<I", len(p)))
        h.update(p)
    return h.digest()


def object_key_to_key(key: ObjectKey) -> str:
    """Our chunk key (32 hex) for an LMCache MP ``ObjectKey``: deterministic, so every
    server and node maps the same object to the same chunk."""
    return _digest(
        _DOMAIN + b"|key",
        (
            key.model_name.encode(),
            str(key.kv_rank).encode(),
            str(key.object_group_id).encode(),
            key.cache_salt.encode(),
            bytes(key.chunk_hash),
        ),
    )[:KEY_BYTES].hex()


@dataclass(frozen=True)
class ObjLayout:
    """What a buffer must match to receive a stored object's bytes."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    fmt: int
    nbytes: int

    def canonical(self) -> bytes:
        return json.dumps([self.shapes, self.dtypes, self.fmt, self.nbytes]).encode()


def _dtype_str(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(obj: MemoryObj) -> ObjLayout:
    meta = obj.metadata
    shapes = meta.shapes if meta.shapes else [meta.shape]
    dtypes = meta.dtypes if meta.dtypes else [meta.dtype]
    return ObjLayout(
        shapes=tuple(tuple(int(d) for d in s) for s in shapes),
        dtypes=tuple(_dtype_str(d) for d in dtypes),
        fmt=int(meta.fmt.value),
        nbytes=int(obj.get_size()),
    )


def model_fingerprint(model_name: str) -> bytes:
    """Model-only identity (what pins record; chunks carry ``fingerprint``)."""
    return _digest(_DOMAIN + b"|model", (model_name.encode(),))[:KEY_BYTES]


def fingerprint(model_name: str, layout: ObjLayout) -> bytes:
    """16-byte chunk fingerprint: model name and memory layout."""
    return _digest(_DOMAIN + b"|fp", (model_name.encode(), layout.canonical()))[:KEY_BYTES]


# MemoryFormat value -> (ndim, token dimension), for the header's token count.
_TOKEN_DIM = {
    MemoryFormat.KV_2LTD.value: (4, 2),
    MemoryFormat.KV_T2D.value: (3, 0),
    MemoryFormat.KV_2TD.value: (3, 1),
    MemoryFormat.KV_MLA_FMT.value: (4, 2),
}


def chunk_meta(key: str, fp: bytes, layout: ObjLayout, num_tokens: int | None = None) -> ChunkMeta:
    """Header fields for an object. The payload is opaque bytes; the fingerprint binds the
    exact layout, and single-tensor objects also record their real dtype and shape.
    ``num_tokens`` (else read off the layout when its format says where) only feeds our
    hit-token counters."""
    shape = layout.shapes[0]
    single = len(layout.shapes) == 1 and 0 < len(shape) <= MAX_DIMS
    ndim_tok = _TOKEN_DIM.get(layout.fmt)
    ntok = num_tokens
    if ntok is None:
        ntok = shape[ndim_tok[1]] if single and ndim_tok and len(shape) == ndim_tok[0] else 0
    return ChunkMeta(
        key=key,
        fingerprint=fp,
        num_tokens=int(ntok),
        dtype=layout.dtypes[0] if single else "uint8",
        shape=shape if single else (layout.nbytes,),
        kv_layout=f"lmc{layout.fmt}",
    )


def copy_into(dst: Any, payload: memoryview) -> bool:
    """Copy ``payload`` into a writable buffer of exactly its size; False on a mismatch."""
    out = np.frombuffer(dst, dtype=np.uint8)
    src = np.frombuffer(payload, dtype=np.uint8)
    if out.nbytes != src.nbytes:
        return False
    np.copyto(out, src)  # releases the GIL: the checksum thread overlaps it
    return True


def split_store_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The ``open_store`` part of an adapter/plugin configuration."""
    return {k: params[k] for k in STORE_KEYS if k in params}


class Failures:
    """Failed operations of a connector, counted by (operation, error) and logged once per
    kind a minute with its traceback: a store that fails every load writes one line a
    minute, not one per load, and ``report_status`` shows the counts."""

    def __init__(self, logger: logging.Logger, name: str = "tiered-cache L2") -> None:
        self.name = name  # what the lines call the connector
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self._log = LogThrottle(logger)

    def record(self, what: str, e: BaseException) -> None:
        """Count and (rate-limited) log ``e``, the exception being handled."""
        kind = f"{what}:{type(e).__name__}"
        with self._lock:
            self.counts[kind] += 1
            n = self.counts[kind]
        self._log.log(
            kind, logging.ERROR, "%s %s failed (%d so far): %s: %s",
            self.name, what, n, type(e).__name__, str(e)[:300], exc_info=True,
        )  # fmt: skip

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def by_kind(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class _StoreHandle:
    """Clients of one node agent; starts an embedded agent when none runs (and the
    config allows it) and stops it again on close if this handle started it."""

    def __init__(self, store: Mapping[str, Any], client: str) -> None:
        # open_store starts an embedded agent silently; tell ours from one already running.
        before = set(tc_client._embedded)
        self.client = client  # our kind, for the agent's per-client load counters
        self.clients: list[AgentClient] = []
        try:
            self.first = self.open(store)
        finally:
            self.owns_agent = bool(set(tc_client._embedded) - before)
            if not self.clients and self.owns_agent:  # refused: stop the agent we started
                tc_client.shutdown_embedded()

    def open(self, store: Mapping[str, Any]) -> AgentClient:
        """A client of the agent. The first one checks at start-up that the agent answers
        and can serve loads on its tiers: a config it cannot serve is refused here, on one
        line naming the setting, never found out by a failure on every request."""
        try:
            c = tc_client.open_store(store, client=self.client)
        except OSError as e:
            if str(store.get("embedded", "auto")) != "never":
                raise
            where = store.get("agent_socket") or "agent.socket"
            raise ConfigError(
                f"agent_socket {where}: no node agent answers there and embedded is never "
                f"({type(e).__name__}: {e}); start `tiered-cache agent` or set embedded: auto"
            ) from None
        if not self.clients:
            try:
                c.check_serves()
            except ConfigError:
                c.close()
                raise
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.close()
        if self.owns_agent:
            tc_client.shutdown_embedded()


# ----------------------------------------------------------------------------- adapter


class TieredCacheL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params``: ``open_store`` keys plus ``durable`` and ``chunk_size``."""

    OWN_KEYS = ("durable", "chunk_size")

    def __init__(
        self, store: Mapping[str, Any] | None = None, durable: bool = False, chunk_size: int = 256
    ) -> None:
        self.store = dict(store or {})
        self.durable = durable
        self.chunk_size = chunk_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TieredCacheL2AdapterConfig:
        unknown = set(d) - set(STORE_KEYS) - set(cls.OWN_KEYS)
        if unknown:
            raise ValueError(
                f"unknown tiered-cache adapter params {sorted(unknown)}; "
                f"valid: {', '.join((*STORE_KEYS, *cls.OWN_KEYS))}"
            )
        durable = d.get("durable", False)
        if not isinstance(durable, bool):
            raise ValueError("durable must be a boolean")
        chunk_size = d.get("chunk_size", 256)
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise ValueError("chunk_size must be a positive integer")
        return cls(split_store_params(d), durable=durable, chunk_size=chunk_size)

    @classmethod
    def help(cls) -> str:
        return (
            "tiered-cache L2 adapter params:\n"
            "- config_file (str): tiered-cache YAML (node agent socket, tiers, redis_url)\n"
            "- tiered_cache (dict): the same config inline\n"
            "- store_dir (str): shorthand, DRAM plus a write-through NVMe directory\n"
            "- agent_socket (str): override the agent's unix socket\n"
            "- embedded (auto|never): start an in-process agent when none runs\n"
            "- durable (bool): complete stores only once write-through tiers hold them\n"
            "- chunk_size (int): the server's --chunk-size (token counts in our metrics)"
        )


class TieredCacheL2Adapter(L2AdapterInterface):
    """``L2AdapterInterface`` over a tiered-cache node agent.

    Three worker threads, each with its own agent connection, run stores, lookups and
    loads, so a large store never delays a lookup. Lookup does not lock: our tiers never
    evict a chunk that is being read, and one evicted between lookup and load is a load
    miss, which LMCache already handles. Capacity is ours (tier policies), so the adapter
    declares none and LMCache's L2 eviction leaves it alone.
    """

    def __init__(
        self,
        config: TieredCacheL2AdapterConfig | Mapping[str, Any] | None = None,
        l1_memory_desc: Any = None,  # the plugin factory passes it; we copy through our pool
    ) -> None:
        super().__init__()
        if not isinstance(config, TieredCacheL2AdapterConfig):
            config = TieredCacheL2AdapterConfig.from_dict(dict(config or {}))
        self.config = config
        self._durable = config.durable
        self._handle = _StoreHandle(config.store, "lmcache_mp")
        self._store_client = self._handle.first
        self._lookup_client = self._handle.open(config.store)
        self._load_client = self._handle.open(config.store)
        self._pools = {
            name: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tc-l2-{name}")
            for name in ("store", "lookup", "load")
        }
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._done_store: dict[L2TaskId, L2StoreResult] = {}
        self._done_lookup: dict[L2TaskId, Bitmap] = {}
        self._done_load: dict[L2TaskId, Bitmap] = {}
        self._failures = Failures(log)
        self._closed = False
        self._seen_layouts: set[ObjLayout] = set()
        log.info(
            "tiered-cache L2 adapter on agent %s (node %s, tiers %s)",
            self._store_client.socket_path,
            self._store_client.node_id,
            self._store_client.tiers,
        )

    # -- event fds

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- plumbing

    def _submit(self, pool: str, fn: Callable[[L2TaskId], None]) -> L2TaskId:
        with self._lock:
            task_id = next(self._ids)
        self._pools[pool].submit(fn, task_id)
        return task_id

    def _failed(self, what: str, e: BaseException) -> None:
        self._failures.record(what, e)

    # -- store

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("store", lambda tid: self._store(tid, keys, objects))

    def _store(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        ok, sizes = True, []
        try:
            items: list[tuple[ChunkMeta, Any]] = []
            for key, obj in zip(keys, objects, strict=True):
                lay = layout_of(obj)
                if lay not in self._seen_layouts:  # once per layout: what we store, and how
                    self._seen_layouts.add(lay)
                    log.info("storing LMCache objects of layout %s for %s", lay, key.model_name)
                fp = fingerprint(key.model_name, lay)
                meta = chunk_meta(object_key_to_key(key), fp, lay, self.config.chunk_size)
                items.append((meta, obj.byte_array))
                sizes.append(lay.nbytes)
            self._store_client.put_many(items, wait=self._durable)
        except Exception as e:
            ok = False
            self._failed("store", e)
        if ok and keys:
            self._notify_keys_stored(list(keys), sizes)
        with self._lock:
            self._done_store[task_id] = L2StoreResult(ok, sum(sizes) if ok else 0)
        self._store_efd.notify()

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done_store = self._done_store, {}
        return done

    # -- lookup

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        return self._submit("lookup", lambda tid: self._lookup(tid, keys))

    def _lookup(self, task_id: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        # One prefix lookup per row (same model, rank, group, salt; chunk-ordered): a
        # chunk after a missing one cannot be used, and one round trip serves the row.
        rows: dict[tuple[str, int, int, str], list[int]] = {}
        for i, k in enumerate(keys):
            rows.setdefault((k.model_name, k.kv_rank, k.object_group_id, k.cache_salt), []).append(
                i
            )
        try:
            for idx in rows.values():
                found = self._lookup_client.lookup([object_key_to_key(keys[i]) for i in idx])
                for i in idx[: len(found)]:
                    bitmap.set(i)
        except Exception as e:
            self._failed("lookup", e)
        with self._lock:
            self._done_lookup[task_id] = bitmap
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_lookup.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        pass  # nothing is locked (see the class docstring)

    # -- load

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("load", lambda tid: self._load(tid, keys, objects))

    def _load(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            by_fp: dict[bytes, list[int]] = {}
            for i, (k, obj) in enumerate(zip(keys, objects, strict=True)):
                by_fp.setdefault(fingerprint(k.model_name, layout_of(obj)), []).append(i)
            for fp, idx in by_fp.items():
                for i in self._load_group(keys, objects, idx, fp):
                    bitmap.set(i)
        except Exception as e:
            self._failed("load", e)
        loaded = [keys[i] for i in bitmap.get_indices_list()]
        if loaded:
            self._notify_keys_accessed(loaded)
        with self._lock:
            self._done_load[task_id] = bitmap
        self._load_efd.notify()

    def _load_group(
        self, keys: list[ObjectKey], objects: list[MemoryObj], idx: list[int], fp: bytes
    ) -> list[int]:
        """Load ``keys[i] for i in idx`` (one fingerprint) straight from the agent's shared
        memory into their buffers; returns the indices that arrived intact."""
        short: set[int] = set()

        def sink(j: int, meta: ChunkMeta, payload: memoryview) -> None:
            if not copy_into(objects[idx[j]].byte_array, payload):
                short.add(idx[j])

        got = self._load_client.load_many([object_key_to_key(keys[i]) for i in idx], fp, sink)
        return [i for i, ok in zip(idx, got, strict=True) if ok and i not in short]

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_load.pop(task_id, None)

    # -- status, cleanup

    def report_status(self) -> dict[str, Any]:
        return {
            "is_healthy": not self._closed,
            "type": "TieredCacheL2Adapter",
            "agent_socket": self._store_client.socket_path,
            "node_id": self._store_client.node_id,
            "tiers": list(self._store_client.tiers),
            "durable": self._durable,
            "errors": self._failures.total,
            "errors_by_kind": self._failures.by_kind(),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._handle.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
        log.info("tiered-cache L2 adapter closed")
