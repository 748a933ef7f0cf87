"""Our tiers behind LMCache, without vLLM: the in-process storage plugin driven through
LMCache's own ``StorageManager`` with CPU memory objects, and the MP-mode L2 adapter
driven through ``L2AdapterInterface`` (what ``lmcache server``'s controllers call).

Each test owns a real node agent (embedded in the test process, NVMe in ``tmp_path``),
so it can restart the agent, damage chunk files and pin keys. Real LMCache, real Redis.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import (
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.platform import consume_fd
from lmcache.v1.storage_backend.storage_manager import StorageManager

from connectors.lmcache_mp import TieredCacheL2Adapter, object_key_to_key
from connectors.lmcache_pins import prefix_object_keys, prefix_pin
from connectors.lmcache_plugin import TieredCacheBackend, engine_key_to_key
from tiered_cache import client as tc_client
from tiered_cache.client import AgentClient

pytestmark = pytest.mark.lmcache

MODEL = "tiny-llama"
LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 32, 256
SHAPE = torch.Size([2, LAYERS, CHUNK, HEADS * HEAD_DIM])  # KV_2LTD, 256 KiB in float32


# ----------------------------------------------------------------------------- store


class Store:
    """A node agent embedded in the test process (``open_store``), restartable."""

    def __init__(self, root: Path, redis_url: str | None = None, **tiers: Any) -> None:
        self.root = root
        self.cfg: dict[str, Any] = {
            "node_id": f"lmc-{root.name[-20:]}".replace("/", "-"),
            # keep_on_stop false: a restart loses DRAM (and no pool outlives the test).
            "dram": {
                "capacity": "8MiB",
                "slot_bytes": "512KiB",
                "keep_on_stop": False,
                **tiers.get("dram", {}),
            },
            "nvme": {
                "enabled": True,
                "path": str(root / "nvme"),
                "capacity": "64MiB",
                "write_mode": "write_through",
                **tiers.get("nvme", {}),
            },
            "agent": {"socket": str(root / "agent.sock"), "pin_sync_interval_s": 0.2},
        }
        if redis_url:
            self.cfg["redis_url"] = redis_url
        self.params = {"tiered_cache": self.cfg, "embedded": "never"}
        self.adapters: list[TieredCacheL2Adapter] = []
        self.client: AgentClient = self.start()

    def adapter(self, **extra: Any) -> TieredCacheL2Adapter:
        """An MP adapter on this store (what ``lmcache server`` would create)."""
        a = TieredCacheL2Adapter({**self.params, **extra})
        self.adapters.append(a)
        return a

    def start(self) -> AgentClient:
        return tc_client.open_store({"tiered_cache": self.cfg})  # starts the embedded agent

    def restart(self) -> None:
        self.client.close()
        tc_client.shutdown_embedded()
        self.client = self.start()

    def file(self, key: str, timeout: float = 10.0) -> Path:
        deadline = time.monotonic() + timeout
        while True:
            found = list((self.root / "nvme").rglob(f"{key}.kvc"))
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"chunk {key} never reached NVMe"
            time.sleep(0.02)

    def corrupt(self, key: str) -> None:
        """Flip payload bytes of the NVMe copy and drop the DRAM copy: the next read is
        of the damaged file."""
        f = self.file(key)
        data = bytearray(f.read_bytes())
        for off in range(300, len(data), 4096):  # past the 256-byte header
            data[off] ^= 0xFF
        f.write_bytes(bytes(data))
        self.client.admin("evict", key=key, tiers=["dram"])

    def tier_keys(self, tier: str) -> set[str]:
        entries = self.client.admin("ls", prefix="", limit=100000)["entries"]
        return {e["key"] for e in entries if e["tier"] == tier}

    def close(self) -> None:
        # Clients first: an agent stopped under live connections leaves their handlers
        # pending on a closed loop.
        for a in self.adapters:
            a.close()
        self.client.close()
        tc_client.shutdown_embedded()


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    made: list[Store] = []

    def make(redis_url: str | None = None, **tiers: Any) -> Store:
        st = Store(tmp_path, redis_url, **tiers)
        made.append(st)
        return st

    yield make
    for st in made:
        st.close()


@pytest.fixture
def store(make_store: Callable[..., Store]) -> Store:
    return make_store()


# ----------------------------------------------------------------------------- MP adapter


def mp_obj(fill: float | None = None, shape: torch.Size = SHAPE, seed: int = 0) -> TensorMemoryObj:
    """A CPU memory object like the MP server's L1 hands to L2 adapters."""
    if fill is None:
        t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    else:
        t = torch.full(shape, fill)
    raw = t.contiguous().view(-1).view(torch.uint8)
    md = MemoryObjMetadata(
        shape=shape,
        dtype=torch.float32,
        address=raw.data_ptr(),
        phy_size=raw.numel(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(raw, md, parent_allocator=None)


def okey(i: int, model: str = MODEL) -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(32, "big"), model_name=model, kv_rank=0)


def _wait(fd: int, timeout_s: float = 30.0) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    assert p.poll(int(timeout_s * 1000)), "adapter never signalled its event fd"
    consume_fd(fd)


def mp_store(a: TieredCacheL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> L2StoreResult:
    tid = a.submit_store_task(keys, objs)
    deadline = time.monotonic() + 30
    while True:
        _wait(a.get_store_event_fd())
        done = a.pop_completed_store_tasks()
        if tid in done:
            return done[tid]
        assert time.monotonic() < deadline


def _query(submit: Callable[[], int], fd: int, query: Callable[[int], Any]) -> list[int]:
    tid = submit()
    deadline = time.monotonic() + 30
    while True:
        _wait(fd)
        bm = query(tid)
        if bm is not None:
            return list(bm.get_indices_list())
        assert time.monotonic() < deadline


def mp_lookup(a: TieredCacheL2Adapter, keys: list[ObjectKey]) -> list[int]:
    found = _query(
        lambda: a.submit_lookup_and_lock_task(keys, {}),
        a.get_lookup_and_lock_event_fd(),
        a.query_lookup_and_lock_result,
    )
    a.submit_unlock(keys)
    return found


def mp_load(a: TieredCacheL2Adapter, keys: list[ObjectKey], bufs: list[Any]) -> list[int]:
    return _query(
        lambda: a.submit_load_task(keys, bufs), a.get_load_event_fd(), a.query_load_result
    )


def test_mp_adapter_store_lookup_load_roundtrip(
    make_store: Callable[..., Store], redis_server: Any
) -> None:
    st = make_store(redis_url=redis_server.url)
    a = st.adapter()
    keys = [okey(i) for i in range(4)]
    objs = [mp_obj(seed=i) for i in range(4)]
    res = mp_store(a, keys, objs)
    assert res.is_successful() and res.bytes_transferred() == 4 * objs[0].get_size()

    # Found per row; a key after a gap is not (LMCache can only use a prefix).
    assert mp_lookup(a, [*keys, okey(99)]) == [0, 1, 2, 3]
    assert mp_lookup(a, [okey(99), okey(98)]) == []
    other = [okey(0, model="other-model"), *keys[:2]]  # a second row, absent
    assert mp_lookup(a, other) == [1, 2]

    bufs = [mp_obj(fill=0.0) for _ in keys]
    assert mp_load(a, keys, bufs) == [0, 1, 2, 3]
    for o, b in zip(objs, bufs, strict=True):
        assert torch.equal(o.tensor, b.tensor)

    # Stored as our chunks under derived keys, published in the Redis directory.
    ours = [object_key_to_key(k) for k in keys]
    assert set(ours) <= st.tier_keys("nvme") or set(ours) <= st.tier_keys("dram")
    st.client.admin("flush", token=None)
    assert all(st.cfg["node_id"] in nodes for nodes in st.client.locate(ours))
    assert a.report_status()["errors"] == 0


def test_mp_adapter_layout_mismatch_is_a_miss(store: Store) -> None:
    a = store.adapter()
    assert mp_store(a, [okey(1)], [mp_obj(seed=1)]).is_successful()
    half = torch.Size([2, LAYERS, CHUNK // 2, HEADS * HEAD_DIM])
    assert mp_load(a, [okey(1)], [mp_obj(fill=0.0, shape=half)]) == []
    assert mp_load(a, [okey(1)], [mp_obj(fill=0.0)]) == [0]


def test_mp_adapter_survives_restarts(store: Store) -> None:
    """The lmcache server restarts (new adapter) and so does our agent (DRAM lost): the
    objects come back from NVMe, byte for byte."""
    keys = [okey(i) for i in range(3)]
    objs = [mp_obj(seed=10 + i) for i in range(3)]
    a = store.adapter(durable=True)
    assert mp_store(a, keys, objs).is_successful()
    a.close()
    store.restart()
    assert store.tier_keys("dram") == set()

    b = store.adapter()
    assert mp_lookup(b, keys) == [0, 1, 2]
    bufs = [mp_obj(fill=0.0) for _ in keys]
    assert mp_load(b, keys, bufs) == [0, 1, 2]
    for o, buf in zip(objs, bufs, strict=True):
        assert torch.equal(o.tensor, buf.tensor)


def test_mp_adapter_corrupted_object_is_a_miss(store: Store) -> None:
    a = store.adapter(durable=True)
    keys = [okey(i) for i in range(3)]
    assert mp_store(a, keys, [mp_obj(seed=20 + i) for i in range(3)]).is_successful()
    store.corrupt(object_key_to_key(keys[1]))

    bufs = [mp_obj(fill=0.0) for _ in keys]
    assert mp_load(a, keys, bufs) == [0, 2]  # the damaged one is a miss, never data
    # Our store dropped the damaged chunk: lookups stop before it from now on.
    assert mp_lookup(a, keys) == [0]


def test_mp_adapter_honours_pins(make_store: Callable[..., Store]) -> None:
    """A token prefix pinned with ``prefix_pin`` maps to the keys LMCache MP stores for
    it, and our NVMe tier keeps those chunks while it evicts everything else."""
    st = make_store(dram={"capacity": "2MiB"}, nvme={"capacity": "2MiB"})
    a = st.adapter(durable=True)
    tokens = list(range(6, 6 + 3 * CHUNK + 17))
    pin = prefix_pin(tokens, MODEL, tiers=["nvme"])
    pinned = prefix_object_keys(tokens, MODEL)
    assert len(pinned) == 3 and pin.keys == [object_key_to_key(k) for k in pinned]
    st.client.admin("pin_add", pin=pin.model_dump(), chunk_bytes=0)

    objs = [mp_obj(seed=30 + i) for i in range(3)]
    assert mp_store(a, pinned, objs).is_successful()
    others = [okey(1000 + i) for i in range(12)]  # 3 MiB through a 2 MiB tier
    for k in others:
        assert mp_store(a, [k], [mp_obj(seed=k.chunk_hash[-1])]).is_successful()

    nvme = st.tier_keys("nvme")
    assert set(pin.keys) <= nvme
    assert len(nvme & {object_key_to_key(k) for k in others}) < len(others)
    st.client.admin("clear", tier="dram")
    bufs = [mp_obj(fill=0.0) for _ in pinned]
    assert mp_load(a, pinned, bufs) == [0, 1, 2]
    assert all(torch.equal(o.tensor, b.tensor) for o, b in zip(objs, bufs, strict=True))


def test_pin_cli(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m connectors.lmcache_pins pin``: the operator's way to pin a prefix."""
    import json

    from connectors.lmcache_pins import main

    tokens = list(range(6, 6 + 2 * CHUNK))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(tokens))
    sock = store.cfg["agent"]["socket"]
    assert main(["keys", "--model", MODEL, "--tokens", f"@{ids}"]) == 0
    keys = capsys.readouterr().out.split()
    assert keys == [object_key_to_key(k) for k in prefix_object_keys(tokens, MODEL)]
    args = ["pin", "--socket", sock, "--model", MODEL, "--tokens", f"@{ids}", "--ttl", "1h"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chunks"] == 2 and out["tiers"] == ["nvme"]
    (pin,) = store.client.admin("pin_ls")["pins"]
    assert pin["id"] == out["id"] and pin["keys"] == keys and pin["tokens"] == tokens
    assert pin["expires_at"] is not None


# ----------------------------------------------------------------------------- in-process


def lmc_config(st: Store, tmp_path: Path) -> LMCacheEngineConfig:
    y = tmp_path / "lmcache.yaml"
    y.write_text(
        "chunk_size: 256\n"
        "local_cpu: true\n"
        "max_local_cpu_size: 0.05\n"
        'storage_plugins: ["tiered"]\n'
        "extra_config:\n"
        "  storage_plugin.tiered.module_path: connectors.lmcache_plugin\n"
        "  storage_plugin.tiered.class_name: TieredCacheBackend\n"
        f"  storage_plugin.tiered.agent_socket: {st.cfg['agent']['socket']}\n"
        "  storage_plugin.tiered.embedded: never\n"
        "  storage_plugin.tiered.durable: true\n"
    )
    return LMCacheEngineConfig.from_file(str(y))


def lmc_metadata() -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float32,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
        chunk_size=CHUNK,
        role="worker",
    )


def ekey(i: int) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, 0, 0x5EED0000 + i, torch.float32)


class Manager:
    """LMCache's StorageManager with our plugin loaded, closed on exit."""

    def __init__(self, st: Store, tmp_path: Path) -> None:
        self.sm = StorageManager(lmc_config(st, tmp_path), lmc_metadata(), EventManager())
        backend = self.sm.storage_backends.get("tiered")
        assert isinstance(backend, TieredCacheBackend), list(self.sm.storage_backends)
        self.plugin: TieredCacheBackend = backend

    def put(self, keys: list[CacheEngineKey], seed: int) -> list[bytes]:
        objs, data = [], []
        for i, _ in enumerate(keys):
            obj = self.sm.allocate(SHAPE, torch.float32, fmt=MemoryFormat.KV_2LTD)
            assert obj is not None and obj.tensor is not None
            g = torch.Generator().manual_seed(seed + i)
            obj.tensor.copy_(torch.randn(SHAPE, generator=g))
            data.append(bytes(obj.byte_array))
            objs.append(obj)
        self.sm.batched_put(keys, objs)  # asynchronous, to every backend
        deadline = time.monotonic() + 30
        while any(self.plugin.exists_in_put_tasks(k) for k in keys):
            assert time.monotonic() < deadline, "puts never finished"
            time.sleep(0.02)
        return data

    def get(self, key: CacheEngineKey) -> bytes | None:
        obj = self.sm.get(key, location="tiered")
        if obj is None:
            return None
        try:
            return bytes(obj.byte_array)
        finally:
            obj.ref_count_down()

    def close(self) -> None:
        self.sm.close()


def test_plugin_through_storage_manager(store: Store, tmp_path: Path) -> None:
    keys = [ekey(i) for i in range(3)]
    m = Manager(store, tmp_path)
    try:
        data = m.put(keys, seed=1)
        assert m.sm.contains(keys[0], search_range=["tiered"]) == "tiered"
        assert m.plugin.batched_contains([*keys, ekey(99)]) == 3
        assert m.sm.contains(ekey(99), search_range=["tiered"]) is None
        for k, d in zip(keys, data, strict=True):
            assert m.get(k) == d  # byte-identical, from our store
        got = m.plugin.batched_get_blocking([*keys, ekey(99)])
        assert [o is not None for o in got] == [True, True, True, False]
        for o, d in zip(got[:3], data, strict=True):
            assert o is not None and bytes(o.byte_array) == d
            o.ref_count_down()
        assert {engine_key_to_key(k) for k in keys} <= store.tier_keys("nvme")
    finally:
        m.close()

    # A new engine (its CPU cache empty) on a restarted agent (its DRAM empty): NVMe.
    store.restart()
    m = Manager(store, tmp_path)
    try:
        assert m.sm.batched_contains(keys)[0] == 3
        assert [m.get(k) for k in keys] == data
    finally:
        m.close()


def test_plugin_corrupted_chunk_is_a_miss(store: Store, tmp_path: Path) -> None:
    keys = [ekey(10 + i) for i in range(2)]
    m = Manager(store, tmp_path)
    try:
        data = m.put(keys, seed=7)
        store.corrupt(engine_key_to_key(keys[0]))
        assert m.get(keys[0]) is None  # damaged: a miss, never data
        assert m.get(keys[1]) == data[1]
        assert m.plugin.batched_contains(keys) == 0  # the damaged chunk was dropped
    finally:
        m.close()


def test_plugin_async_paths_and_pins(store: Store, tmp_path: Path) -> None:
    keys = [ekey(20 + i) for i in range(3)]
    m = Manager(store, tmp_path)
    try:
        data = m.put(keys, seed=11)
        p = m.plugin
        assert asyncio.run(p.batched_async_contains("l1", [*keys, ekey(98)], pin=True)) == 3
        assert all(p.unpin(k) for k in keys) and not p.unpin(keys[0])
        objs = asyncio.run(p.batched_get_non_blocking("l1", [keys[0], ekey(98), keys[1]]))
        assert len(objs) == 1 and bytes(objs[0].byte_array) == data[0]  # the loaded prefix
        objs[0].ref_count_down()
        fut = p.get_non_blocking(keys[2])
        obj = fut.result(30)
        assert obj is not None and bytes(obj.byte_array) == data[2]
        obj.ref_count_down()

        # Our pins win over LMCache's remove; unpinned chunks go.
        from tiered_cache.directory import Pin

        pinned = engine_key_to_key(keys[0])
        pin = Pin(keys=[pinned], tiers=["nvme"], fingerprint="00")
        store.client.admin("pin_add", pin=pin.model_dump(), chunk_bytes=0)
        assert p.remove(keys[0]) is False and p.contains(keys[0])
        assert p.remove(keys[1]) is True and not p.contains(keys[1])
        assert p.remove(ekey(97)) is False
    finally:
        m.close()
