"""Every client reads back what it stored, on every mix of our tiers (issue 30).

Mixes: NVMe only, S3 only, NVMe + S3, DRAM only, and all three. Clients: the vLLM
connector's read (``AgentClient.load_report``, as ``vllm_worker._fetch`` calls it), the
LMCache MP L2 adapter (what ``lmcache server`` drives) and the in-process LMCache plugin
(through LMCache's own ``StorageManager``). Each case stores chunks, restarts the agent
(DRAM lost unless it is the only tier: then a warm restart keeps the pool), loads them back
and checks the bytes, the tier that served each (the agent's hit counters) and that no
load failed. Where a mix has S3 below another tier, one chunk is also dropped from that
tier so S3 serves it. Real agent (embedded), real files, real S3 (moto over HTTP), real
LMCache.

Before the fix, every load on a mix without DRAM failed: the agent leased reads through
DRAM slots (``TierError: no DRAM tier``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiered_cache import client as tc_client
from tiered_cache.client import AgentClient

pytestmark = pytest.mark.lmcache

MIXES = ["nvme", "s3", "nvme+s3", "dram", "dram+nvme+s3"]
N = 3  # objects per case


def _cfg(mix: str, root: Path, s3: Any, bucket: str) -> dict[str, Any]:
    tiers = set(mix.split("+"))
    cfg: dict[str, Any] = {
        "node_id": f"mx-{uuid.uuid4().hex[:8]}",
        # Alone, DRAM survives the restart (warm: the pool is kept); with tiers below it,
        # it is dropped so that they serve.
        "dram": {
            "enabled": "dram" in tiers,
            "capacity": "8MiB",
            "slot_bytes": "512KiB",
            "keep_on_stop": tiers == {"dram"},
        },
        "nvme": {
            "enabled": "nvme" in tiers,
            "path": str(root / "nvme"),
            "capacity": "64MiB",
            "write_mode": "write_through",
        },
        "s3": {
            "enabled": "s3" in tiers,
            "url": f"s3://{bucket}/kv",
            "endpoint_url": s3.endpoint_url,
            "region": "us-east-1",
            "write_mode": "write_through",
        },
        "agent": {"socket": str(root / "agent.sock")},
    }
    return cfg


class MixStore:
    """An embedded agent on one tier mix, restartable, with its hit counters."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.params = {"tiered_cache": cfg, "embedded": "never"}
        self.closers: list[Callable[[], None]] = []
        self.client: AgentClient = tc_client.open_store({"tiered_cache": cfg})

    def restart(self) -> None:
        self.client.close()
        tc_client.shutdown_embedded()
        self.client = tc_client.open_store({"tiered_cache": self.cfg})

    def hits(self) -> dict[str, float]:
        metrics = self.client.admin("stats")["metrics"]
        out: dict[str, float] = {}
        for k, v in metrics.items():
            if k.startswith("tiered_cache_hits_total{"):
                out[k.split("tier=")[1].rstrip("}")] = float(v)
        return out

    def drop(self, key: str, tier: str) -> None:
        self.client.admin("evict", key=key, tiers=[tier])

    def close(self) -> None:
        for c in self.closers:
            c()
        self.client.close()
        tc_client.shutdown_embedded()


@pytest.fixture(params=MIXES)
def mix(
    request: pytest.FixtureRequest, tmp_path: Path, s3_server: Any, s3_bucket: str
) -> Iterator[tuple[str, MixStore]]:
    st = MixStore(_cfg(request.param, tmp_path, s3_server, s3_bucket))
    yield request.param, st
    st.close()


def expected(mix: str) -> tuple[list[str], str | None]:
    """Which tier serves each of the ``N`` objects after the restart, and the tier to drop
    object 0 from first (so that S3 serves it), if any."""
    tiers = mix.split("+")
    nearest = "dram" if tiers == ["dram"] else next(t for t in tiers if t != "dram")
    if "s3" in tiers and nearest != "s3":
        return ["s3"] + [nearest] * (N - 1), nearest
    return [nearest] * N, None


def _check_hits(st: MixStore, before: dict[str, float], want: list[str]) -> None:
    """The agent counted one hit per object on the tier ``want`` names. Hits a client
    read straight from the DRAM pool reach the agent in a batch a moment later."""
    exp: dict[str, float] = {}
    for t in want:
        exp[t] = exp.get(t, 0.0) + 1
    deadline = time.monotonic() + 5
    while True:
        after = st.hits()
        got = {t: v - before.get(t, 0.0) for t, v in after.items()}
        got = {t: v for t, v in got.items() if v}
        if got == exp or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got == exp


# ----------------------------------------------------------------------------- vLLM


def test_vllm_connector_reads(mix: tuple[str, MixStore]) -> None:
    """``load_report`` as ``vllm_worker._fetch`` calls it: verified chunks into a sink,
    the source of each, no failures."""
    from helpers_agent import FP, meta, payload

    name, st = mix
    keys = [uuid.uuid4().hex for _ in range(N)]
    data = [payload(i) for i in range(N)]
    st.client.put_many([(meta(k), d) for k, d in zip(keys, data, strict=True)], wait=True)
    st.restart()
    want, drop_from = expected(name)
    if drop_from:
        st.drop(keys[0], drop_from)
    before = st.hits()
    got: dict[int, bytes] = {}
    rep = st.client.load_report(keys, FP.digest, lambda i, m, p: got.__setitem__(i, bytes(p)))
    assert rep.ok == [True] * N and rep.failures == {}
    assert rep.sources == want
    assert [got[i] for i in range(N)] == data
    _check_hits(st, before, want)


# ----------------------------------------------------------------------------- LMCache MP


def test_lmcache_mp_adapter_reads(mix: tuple[str, MixStore]) -> None:
    from test_lmcache_plugin import mp_load, mp_lookup, mp_obj, mp_store, okey

    from connectors.lmcache_mp import TieredCacheL2Adapter, object_key_to_key

    name, st = mix
    keys = [okey(1000 + i) for i in range(N)]
    objs = [mp_obj(seed=i) for i in range(N)]
    a = TieredCacheL2Adapter({**st.params, "durable": True})
    assert mp_store(a, keys, objs).is_successful()
    a.close()
    st.restart()  # and a new server: L1 lost
    want, drop_from = expected(name)
    if drop_from:
        st.drop(object_key_to_key(keys[0]), drop_from)
    a = TieredCacheL2Adapter({**st.params, "durable": True})
    st.closers.append(a.close)
    before = st.hits()
    # A restarted agent learns of S3's copies by asking S3, and a lookup waits at most
    # DIRECTORY_MISS_S3_WAIT_S (50 ms) for that HEAD before it answers a miss (the late
    # answer is dropped): on a busy host (CI: 2 cores) the first lookup may miss. Ask
    # again, each time after the agent answered.
    found: list[int] = []
    for _ in range(20):
        found = mp_lookup(a, keys)
        if found:
            break
    assert found == list(range(N))
    bufs = [mp_obj(fill=0.0) for _ in keys]
    assert mp_load(a, keys, bufs) == list(range(N))
    for o, b in zip(objs, bufs, strict=True):
        assert torch.equal(o.tensor, b.tensor)
    _check_hits(st, before, want)
    assert a.report_status()["errors"] == 0


# ----------------------------------------------------------------------------- plugin


def test_lmcache_plugin_reads(mix: tuple[str, MixStore], tmp_path: Path) -> None:
    from test_lmcache_plugin import Manager, ekey

    from connectors.lmcache_plugin import engine_key_to_key

    name, st = mix
    keys = [ekey(500 + i) for i in range(N)]
    m = Manager(st, tmp_path)  # type: ignore[arg-type]  # reads .cfg only
    try:
        data = m.put(keys, seed=5)
    finally:
        m.close()
    st.restart()  # and a new engine: its CPU cache empty
    want, drop_from = expected(name)
    if drop_from:
        st.drop(engine_key_to_key(keys[0]), drop_from)
    m = Manager(st, tmp_path)  # type: ignore[arg-type]
    try:
        before = st.hits()
        assert m.plugin.batched_contains(keys) == N
        assert [m.get(k) for k in keys] == data
        _check_hits(st, before, want)
    finally:
        m.close()


# ----------------------------------------------------------------------------- staging


def test_inline_reads_are_bounded_per_reply(
    tmp_path: Path, s3_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without DRAM the chunk bytes ride in the agent's replies: one reply carries at
    most ``MAX_INLINE_REPLY_BYTES`` past its first chunks, the client asks again for the
    rest, and every chunk arrives."""
    from helpers_agent import FP, meta, payload
    from helpers_agent import N as NBYTES

    from tiered_cache.agent import local
    from tiered_cache.protocol import Get

    monkeypatch.setattr(local, "MAX_INLINE_REPLY_BYTES", 2 * NBYTES)
    st = MixStore(_cfg("nvme", tmp_path, s3_server, s3_bucket))
    try:
        keys = [uuid.uuid4().hex for _ in range(20)]
        data = [payload(i) for i in range(20)]
        st.client.put_many([(meta(k), d) for k, d in zip(keys, data, strict=True)], wait=True)
        gets: list[int] = []
        call = st.client._call

        def counting(req: Any) -> dict[str, Any]:
            reply = call(req)
            if isinstance(req, Get):
                gets.append(sum(1 for it in reply["items"] if it and "data" in it))
            return reply

        monkeypatch.setattr(st.client, "_call", counting)
        got: dict[int, bytes] = {}
        rep = st.client.load_report(keys, FP.digest, lambda i, m, p: got.__setitem__(i, bytes(p)))
        assert rep.ok == [True] * 20 and [got[i] for i in range(20)] == data
        # Eight load at once, so a reply may pass the bound by up to eight chunks.
        assert len(gets) > 1 and sum(gets) == 20 and max(gets) <= 2 + 8
        # Each chunk counted once in the client's loads, not once per time it was asked.
        metrics = st.client.admin("stats")["metrics"]
        assert metrics["tiered_cache_client_loads_total{client=vllm}"] == 20
    finally:
        st.close()


# ----------------------------------------------------------------------------- failures


class _Records(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


def test_load_failures_counted_per_client_and_logged_once(
    tmp_path: Path,
    s3_server: Any,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store whose every load fails: the adapter counts each failure by kind and logs
    one line (with its traceback) a minute, not one per load; the agent counts the failed
    chunks per client, and the dashboard's figures show a failure rate of 1 for that
    client only."""
    from helpers_agent import FP, meta, payload
    from test_lmcache_plugin import mp_load, mp_obj, mp_store, okey

    from connectors.lmcache_mp import TieredCacheL2Adapter
    from tiered_cache.dashboard.figures import History, cumulative, summarize
    from tiered_cache.dashboard.sources import Reading, parse_flat
    from tiered_cache.ipc import IPCError
    from tiered_cache.tiers.base import TierError

    st = MixStore(_cfg("nvme", tmp_path, s3_server, s3_bucket))
    try:
        a = TieredCacheL2Adapter({**st.params, "durable": True})
        st.closers.append(a.close)
        keys = [okey(2000 + i) for i in range(N)]
        assert mp_store(a, keys, [mp_obj(seed=i) for i in range(N)]).is_successful()
        vkeys = [uuid.uuid4().hex]
        st.client.put_many([(meta(vkeys[0]), payload(0))], wait=True)
        assert st.client.load_report(vkeys, FP.digest, lambda *_: None).ok == [True]

        def reading() -> Reading:
            rd = Reading(t=time.time())
            for k, v in st.client.admin("stats")["metrics"].items():
                name, labels = parse_flat(k)
                rd.samples.append((name, labels, float(v)))
            return rd

        hist = History(window_s=3600)
        hist.add(time.time(), cumulative(reading()))

        async def broken(*args: Any, **kw: Any) -> None:
            raise TierError("disk on fire")

        agent = tc_client._embedded[st.client.socket_path].agent
        monkeypatch.setattr(agent.store, "lease", broken)
        seen: list[logging.LogRecord] = []  # LMCache's logger does not propagate
        handler = _Records(seen)
        logging.getLogger("tiered_cache.lmcache_mp").addHandler(handler)
        st.closers.append(
            lambda: logging.getLogger("tiered_cache.lmcache_mp").removeHandler(handler)
        )
        for _ in range(3):
            assert mp_load(a, keys, [mp_obj(fill=0.0) for _ in keys]) == []
        status = a.report_status()
        assert status["errors"] == 3 and status["errors_by_kind"] == {"load:IPCError": 3}
        lines = [r for r in seen if "tiered-cache L2 load failed" in r.getMessage()]
        assert len(lines) == 1 and lines[0].exc_info is not None
        with pytest.raises(IPCError, match="disk on fire"):
            st.client.load_report(vkeys, FP.digest, lambda *_: None)

        rd = reading()
        samples = {(n, tuple(sorted(lb.items()))): v for n, lb, v in rd.samples}
        fail = "tiered_cache_client_load_failures_total"
        assert samples[(fail, (("client", "lmcache_mp"), ("kind", "TierError")))] == 3 * N
        assert samples[(fail, (("client", "vllm"), ("kind", "TierError")))] == 1
        clients = summarize(rd)["clients"]
        # Since the agent started: the adapter's start-up probe was one load that worked.
        assert clients["lmcache_mp"]["loads"] == 3 * N + 1
        assert clients["lmcache_mp"]["load_failures"] == 3 * N
        point = hist.add(time.time(), cumulative(rd))
        # Over the window: every lmcache_mp load failed; the vLLM client's one load too,
        # after one that worked before the window's start.
        assert point["load_failure_rate"]["lmcache_mp"] == 1.0
        assert point["load_failure_rate"]["vllm"] == 1.0
        assert hist.export()["load_failure_rate"]["lmcache_mp"] == [0.0, 1.0]  # probe: ok
    finally:
        st.close()


# ----------------------------------------------------------------------------- start-up


def test_unservable_store_is_refused_at_start_up(
    tmp_path: Path, s3_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that cannot serve loads (here its read path raises, as every no-DRAM
    store's did before the fix) refuses the adapter and the plugin when they start, on one
    line naming the setting; so does a socket no agent answers with embedded: never."""
    from test_lmcache_plugin import lmc_config, lmc_metadata

    from connectors.lmcache_mp import TieredCacheL2Adapter
    from connectors.lmcache_plugin import TieredCacheBackend
    from tiered_cache.config import ConfigError
    from tiered_cache.tiers.base import TierError

    with pytest.raises(ConfigError) as e:
        TieredCacheL2Adapter({"agent_socket": str(tmp_path / "none.sock"), "embedded": "never"})
    msg = str(e.value)
    assert (
        msg.startswith(f"agent_socket {tmp_path / 'none.sock'}: no node agent") and "\n" not in msg
    )

    st = MixStore(_cfg("nvme", tmp_path, s3_server, s3_bucket))
    try:

        async def broken(*args: Any, **kw: Any) -> None:
            raise TierError("no DRAM tier: shared-memory transfers are unavailable")

        agent = tc_client._embedded[st.client.socket_path].agent
        monkeypatch.setattr(agent.store, "lease", broken)
        with pytest.raises(ConfigError) as e:
            TieredCacheL2Adapter(st.params)
        msg = str(e.value)
        assert msg.startswith("tiers (dram, nvme, s3 .enabled):") and "\n" not in msg
        assert "(tiers nvme) cannot serve loads: TierError: no DRAM tier" in msg
        with pytest.raises(ConfigError, match="cannot serve loads"):
            # (LMCache's StorageManager logs the error and runs without the plugin.)
            TieredCacheBackend(config=lmc_config(st, tmp_path), metadata=lmc_metadata())  # type: ignore[arg-type]
        monkeypatch.undo()
        TieredCacheL2Adapter(st.params).close()  # a store that serves: accepted
    finally:
        st.close()


def test_first_save_after_the_agent_was_replaced(
    tmp_path: Path, s3_server: Any, s3_bucket: str
) -> None:
    """A client that mapped one agent's pool and has not saved yet, when another agent
    takes over the socket: its first save lands in the new agent (it used to write into
    the old pool's mapping while the new agent reserved slots in its own: 'slot 0 holds no
    chunk header'). Found by the LMCache e2e when switching tier mixes."""
    from helpers_agent import FP, meta, payload

    cfg = _cfg("dram", tmp_path, s3_server, s3_bucket)
    cfg["dram"]["keep_on_stop"] = False
    st = MixStore(cfg)
    late = AgentClient(st.client.socket_path)  # maps the pool, no save connection yet
    try:
        st.client.close()
        tc_client.shutdown_embedded()
        st.cfg = {**cfg, "node_id": cfg["node_id"] + "-b"}  # another agent, another pool
        st.client = tc_client.open_store({"tiered_cache": st.cfg})
        key = uuid.uuid4().hex
        late.put_many([(meta(key), payload(7))], wait=True)
        got: dict[int, bytes] = {}
        rep = st.client.load_report([key], FP.digest, lambda i, m, p: got.__setitem__(i, bytes(p)))
        assert rep.ok == [True] and got[0] == payload(7)
    finally:
        late.close()
        st.close()
