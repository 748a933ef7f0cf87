"""LMCache in-process engine (``LMCacheConnectorV1``, CUDA deployments): a storage plugin
that keeps LMCache's chunks in the tiered cache (node agent, DRAM pool, NVMe, S3, Redis
directory, pins).

LMCache config (YAML named by ``LMCACHE_CONFIG_FILE``)::

    storage_plugins: ["tiered"]
    extra_config:
      storage_plugin.tiered.module_path: connectors.lmcache_plugin
      storage_plugin.tiered.class_name: TieredCacheBackend
      storage_plugin.tiered.config_file: /etc/tiered-cache.yaml   # or store_dir, ...

Options (``storage_plugin.<name>.<option>``): the ``open_store`` keys (``config_file``,
``store_dir``, ``agent_socket``, ``embedded``, ...), ``durable`` (a put completes once the
write-through tiers hold it) and ``admin_token`` (for ``remove``, when the agent has one).

Keys are ``sha256`` of LMCache's ``CacheEngineKey.to_string()`` (model, world size,
worker, chunk hash, dtype, tags; the layer for layer-wise keys), truncated to our 32 hex.
The fingerprint covers the engine metadata (model, world size, worker, KV dtype and
shape, chunk size, MLA); each chunk's header records the object's own shape, dtype and
memory format so ``get`` can allocate it. A chunk that fails verification is a miss.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import (
    AllocatorBackendInterface,
    StoragePluginInterface,
)

from connectors.lmcache_mp import (
    STORE_KEYS,
    Failures,
    _digest,
    _StoreHandle,
    chunk_meta,
    copy_into,
    layout_of,
)
from tiered_cache.codec import ChunkMeta
from tiered_cache.keys import KEY_BYTES

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

log = init_logger("tiered_cache.lmcache_plugin")

_DOMAIN = b"tiered-cache/lmcache-v1/v1"
_TRUE = ("1", "true", "yes", "on")


def engine_key_to_key(key: CacheEngineKey) -> str:
    """Our chunk key (32 hex) for an in-process LMCache ``CacheEngineKey``."""
    return _digest(_DOMAIN + b"|key", (key.to_string().encode(),))[:KEY_BYTES].hex()


def metadata_fingerprint(md: LMCacheMetadata | None) -> bytes:
    """16-byte fingerprint of the engine that reads and writes the chunks."""
    if md is None:
        return _digest(_DOMAIN + b"|fp", (b"unknown",))[:KEY_BYTES]
    parts = (
        md.model_name,
        str(md.world_size),
        str(md.worker_id),
        str(md.kv_dtype).removeprefix("torch."),
        ",".join(str(int(d)) for d in md.kv_shape),
        str(md.chunk_size),
        str(bool(md.use_mla)),
    )
    return _digest(_DOMAIN + b"|fp", tuple(p.encode() for p in parts))[:KEY_BYTES]


def plugin_options(config: LMCacheEngineConfig | None, cls: type) -> dict[str, Any]:
    """``storage_plugin.<name>.*`` options of the plugin entry naming ``cls``."""
    extra: Mapping[str, Any] = (config.extra_config if config is not None else None) or {}
    names = list(getattr(config, "storage_plugins", None) or [])
    for name in names:
        pre = f"storage_plugin.{name}."
        if extra.get(pre + "class_name") == cls.__name__ and extra.get(pre + "module_path") in (
            cls.__module__,
            __name__,
        ):
            return {k[len(pre) :]: v for k, v in extra.items() if k.startswith(pre)}
    raise ValueError(f"no storage_plugins entry names {cls.__module__}.{cls.__name__}")


def _layout_from_header(meta: ChunkMeta) -> tuple[torch.Size, torch.dtype, MemoryFormat]:
    if not meta.kv_layout.startswith("lmc"):
        raise ValueError(f"not an LMCache chunk (layout {meta.kv_layout!r})")
    return torch.Size(meta.shape), getattr(torch, meta.dtype), MemoryFormat(int(meta.kv_layout[3:]))


class TieredCacheBackend(StoragePluginInterface):
    """``StoragePluginInterface`` over a tiered-cache node agent.

    Puts run on one writer thread (its own agent connection); reads use another
    connection on the caller's thread. LMCache's lookup pins are counted but protect
    nothing beyond what our tiers already do (a chunk being read is never evicted): one
    evicted between lookup and get is a miss, and LMCache recomputes it. Our own pins
    are honoured: our tiers never evict them and ``remove`` refuses them.
    """

    def __init__(
        self,
        dst_device: str = "cpu",
        config: LMCacheEngineConfig | None = None,
        metadata: LMCacheMetadata | None = None,
        local_cpu_backend: LocalCPUBackend | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        opts = plugin_options(config, type(self))
        store = {k: opts[k] for k in STORE_KEYS if k in opts}
        self._durable = str(opts.get("durable", "false")).lower() in _TRUE
        self._admin_token = opts.get("admin_token")
        self._fp = metadata_fingerprint(metadata)
        self._handle = _StoreHandle(store, "lmcache_plugin")
        self._failures = Failures(log, "tiered-cache storage plugin")
        self._writer = self._handle.first
        self._reader = self._handle.open(store)
        self._read_lock = threading.Lock()  # remove's ls + evict must not interleave
        self._put_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tc-lmc-put")
        self._get_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tc-lmc-get")
        self._lock = threading.Lock()
        self._in_flight: Counter[CacheEngineKey] = Counter()
        self._pins: Counter[CacheEngineKey] = Counter()
        self._closed = False
        log.info(
            "tiered-cache storage plugin on agent %s (node %s, tiers %s), fingerprint %s",
            self._writer.socket_path,
            self._writer.node_id,
            self._writer.tiers,
            self._fp.hex(),
        )

    def __str__(self) -> str:
        return "TieredCacheBackend"

    # -- writes

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return self._in_flight[key] > 0

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future[None]] | None:
        if not keys:
            return None
        keys = list(keys)
        for obj in objs:
            obj.ref_count_up()  # the caller drops its reference when we return
        with self._lock:
            self._in_flight.update(keys)
        fut = self._put_pool.submit(self._put, keys, list(objs), on_complete_callback)
        return [fut]

    def _put(
        self,
        keys: list[CacheEngineKey],
        objs: list[MemoryObj],
        on_complete: Callable[[CacheEngineKey], None] | None,
    ) -> None:
        stored: list[CacheEngineKey] = []
        try:
            items: list[tuple[ChunkMeta, Any]] = []
            for key, obj in zip(keys, objs, strict=True):
                lay = layout_of(obj)
                if len(lay.shapes) != 1:
                    log.warning("skipping %s: multi-tensor objects are not supported", key)
                    continue
                items.append((chunk_meta(engine_key_to_key(key), self._fp, lay), obj.byte_array))
                stored.append(key)
            self._writer.put_many(items, wait=self._durable)
        except Exception as e:
            self._failures.record("store", e)
            stored = []
        finally:
            for obj in objs:
                obj.ref_count_down()
            with self._lock:
                self._in_flight.subtract(keys)
                self._in_flight += Counter()  # drop zero counts
        if on_complete is not None:
            for key in stored:
                try:
                    on_complete(key)
                except Exception:
                    log.exception("put completion callback failed for %s", key)

    # -- lookups

    def _present(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many leading ``keys`` our store can serve."""
        try:
            with self._read_lock:
                return len(self._reader.lookup([engine_key_to_key(k) for k in keys]))
        except Exception as e:  # a miss for LMCache (it recomputes), counted and logged
            self._failures.record("lookup", e)
            return 0

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        if not keys:
            return 0
        n = self._present(keys)
        if pin and n:
            with self._lock:
                self._pins.update(keys[:n])
        return n

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return await asyncio.wrap_future(self._get_pool.submit(self.batched_contains, keys, pin))

    def pin(self, key: CacheEngineKey) -> bool:
        if not self.contains(key):
            return False
        with self._lock:
            self._pins[key] += 1
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        with self._lock:
            if self._pins[key] <= 0:
                self._pins.pop(key, None)
                return False
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]
        return True

    # -- reads

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Verified chunks copied into objects from the local CPU backend; None = miss."""
        out: list[MemoryObj | None] = [None] * len(keys)
        if not keys:
            return out
        alloc = self.get_allocator_backend()
        bad: set[int] = set()

        def sink(i: int, meta: ChunkMeta, payload: memoryview) -> None:
            try:
                shape, dtype, fmt = _layout_from_header(meta)
            except (ValueError, AttributeError) as e:
                log.warning("chunk for %s unusable: %s", keys[i], e)
                bad.add(i)
                return
            # No busy wait for room: a chunk that cannot be placed now is a miss.
            obj = alloc.allocate(shape, dtype, fmt, busy_loop=False)
            if obj is None:
                bad.add(i)  # no room in the local CPU backend: a miss
                return
            out[i] = obj
            if not copy_into(obj.byte_array, payload):
                bad.add(i)

        try:
            with self._read_lock:
                ok = self._reader.load_many([engine_key_to_key(k) for k in keys], self._fp, sink)
        except Exception as e:  # misses for LMCache (it recomputes), counted and logged
            self._failures.record("load", e)
            ok = [False] * len(keys)
        for i, good in enumerate(ok):
            obj = out[i]
            if obj is not None and (not good or i in bad):
                obj.ref_count_down()  # copied, then failed verification: never handed out
                out[i] = None
        return out

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def get_non_blocking(self, key: CacheEngineKey, location: str | None = None) -> Future[Any]:
        return self._get_pool.submit(self.get_blocking, key)

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """The loaded prefix of ``keys`` (a prefix is all LMCache can use)."""
        objs = await asyncio.wrap_future(self._get_pool.submit(self.batched_get_blocking, keys))
        out: list[MemoryObj] = []
        for obj in objs:
            if obj is None:
                break
            out.append(obj)
        for obj in objs[len(out) :]:
            if obj is not None:
                obj.ref_count_down()
        return out

    # -- removal, housekeeping

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Drop the chunk from every tier of this node, unless one of our pins holds it."""
        k = engine_key_to_key(key)
        with self._read_lock:
            entries = self._reader.admin("ls", prefix=k, limit=16)["entries"]
            if not entries or any(e["pinned"] for e in entries):
                return False
            self._reader.admin("evict", key=k, token=self._admin_token)
        return True

    def failures(self) -> dict[str, int]:
        """Failed operations so far, by ``operation:error``."""
        return self._failures.by_kind()

    def touch_cache(self) -> None:
        pass  # recency lives in our tiers' policies, updated on every read

    def get_allocator_backend(self) -> AllocatorBackendInterface:
        if self.local_cpu_backend is None:
            raise RuntimeError("the tiered-cache plugin needs LMCache's LocalCPUBackend")
        return self.local_cpu_backend

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._put_pool.shutdown(wait=True)  # pending puts land before we disconnect
        self._get_pool.shutdown(wait=True)
        self._handle.close()


__all__ = ["TieredCacheBackend", "engine_key_to_key", "metadata_fingerprint"]
