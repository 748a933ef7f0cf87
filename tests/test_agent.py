"""The node agent as a real process: shared-memory clients, crashes, SIGTERM, CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers_agent import (
    FP,
    cli,
    drop_pool,
    meta,
    payload,
    pool_name,
    socket_of,
    start_agent,
    write_cfg,
)

from tiered_cache.client import AgentClient, open_store, shutdown_embedded
from tiered_cache.keys import chunk_keys


def test_put_get_through_shared_memory(agent: tuple[Path, subprocess.Popen[str]]) -> None:
    cfg, _ = agent
    c = AgentClient(yaml.safe_load(cfg.read_text())["agent"]["socket"])
    keys = chunk_keys(np.arange(32 * 40), FP)
    c.put_many([(meta(k), payload(i)) for i, k in enumerate(keys[:4])])
    assert c.lookup(keys[:6]) == ["dram"] * 4
    got = c.get_many(keys[:5], FP.digest)
    assert [bytes(g[1]) if g else None for g in got] == [payload(i) for i in range(4)] + [None]
    # Fill DRAM (16 slots) so early chunks are written back to NVMe, then read them back.
    c.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)])
    assert set(c.lookup(keys)) == {"dram", "nvme"}
    got = c.get_many(keys, FP.digest)
    assert all(g is not None and bytes(g[1]) == payload(i) for i, g in enumerate(got))
    # A client with the wrong fingerprint gets misses, never data.
    assert c.get_many(keys[:2], b"\x00" * 16) == [None, None]
    c.close()


def test_dead_client_releases_its_slots(agent: tuple[Path, subprocess.Popen[str]]) -> None:
    cfg, _ = agent
    sock = yaml.safe_load(cfg.read_text())["agent"]["socket"]
    c = AgentClient(sock)
    reserved = c.admin("reserve", sizes=[1000] * 16)["slots"]
    assert all(s is not None for s in reserved)
    c.close()  # dies without commit
    c2 = AgentClient(sock)
    # The agent frees a dead client's runs when it sees the disconnect: wait for that
    # state (all 16 reservable again), not for a guessed time.
    deadline = time.monotonic() + 10
    while True:
        got = c2.admin("reserve", sizes=[1000] * 16)["slots"]
        if all(s is not None for s in got):
            break
        c2.admin("abort", slots=[s for s in got if s is not None])
        assert time.monotonic() < deadline, "a dead client's reserved runs were never freed"
        time.sleep(0.01)
    c2.close()


def test_sigterm_writes_back_and_restart_serves(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path)
    proc = start_agent(cfg, "--drop-dram")  # the restart finds the chunks on NVMe only
    sock = yaml.safe_load(cfg.read_text())["agent"]["socket"]
    c = AgentClient(sock)
    keys = chunk_keys(np.arange(32 * 5), FP)
    c.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)])
    c.close()
    idle = AgentClient(sock)  # still connected when the agent stops
    assert idle.lookup(keys[:1]) == ["dram"]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    idle.close()
    assert proc.returncode == 0, out
    assert "wrote back 5 DRAM chunks to nvme" in out
    # A clean stop logs no errors, even with a client still connected.
    assert "ERROR" not in out and "Traceback" not in out, out
    proc = start_agent(cfg)
    try:
        c = AgentClient(sock)
        assert c.lookup(keys) == ["nvme"] * 5
        assert [bytes(g[1]) for g in c.get_many(keys, FP.digest) if g] == [
            payload(i) for i in range(5)
        ]
        c.close()
    finally:
        proc.kill()
        proc.wait()


WRITER = r"""
import sys, numpy as np
from tiered_cache.client import AgentClient
from tiered_cache import codec
from tiered_cache.keys import ModelFingerprint, chunk_keys
FP = ModelFingerprint("agent-test", chunk_size=32, block_size=16)
c = AgentClient(sys.argv[1])
keys = chunk_keys(np.arange(32 * 400), FP)
for i, k in enumerate(keys):
    data = np.random.default_rng(i).integers(0, 255, 64 * 1024, dtype=np.uint8).tobytes()
    m = codec.ChunkMeta(key=k, fingerprint=FP.digest, num_tokens=32, dtype="uint8",
                        shape=(len(data),), kv_layout="LBHNC", block_size=16)
    c.put_many([(m, data)], wait=True)
    print(i, k, flush=True)
"""


def test_kill_9_during_writes_keeps_every_acknowledged_chunk(tmp_path: Path) -> None:
    cfg = write_cfg(
        tmp_path,
        nvme={
            "enabled": True,
            "path": str(tmp_path / "nvme"),
            "capacity": "64MiB",
            "write_mode": "write_through",
        },
    )
    proc = start_agent(cfg)
    sock = yaml.safe_load(cfg.read_text())["agent"]["socket"]
    w = subprocess.Popen([sys.executable, "-c", WRITER, sock], stdout=subprocess.PIPE, text=True)
    acked: list[tuple[int, str]] = []
    assert w.stdout is not None
    for line in w.stdout:
        i, k = line.split()
        acked.append((int(i), k))
        if len(acked) == 60:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    w.kill()
    w.wait()
    proc = start_agent(cfg)
    try:
        c = AgentClient(sock)
        keys = [k for _, k in acked]
        assert len(c.lookup(keys)) == len(keys)
        got = c.get_many(keys, FP.digest)
        for (i, _), g in zip(acked, got, strict=True):
            assert g is not None and bytes(g[1]) == payload(i)
        c.close()
    finally:
        proc.kill()
        proc.wait()
    assert not list((tmp_path / "nvme" / ".tmp").iterdir())


def test_open_store_starts_embedded_agent(tmp_path: Path) -> None:
    extra = {
        "tiered_cache": {
            "node_id": f"emb-{uuid.uuid4().hex[:6]}",
            "dram": {"capacity": "1MiB", "slot_bytes": "128KiB"},
            "agent": {"socket": str(tmp_path / "emb.sock")},
        }
    }
    try:
        s1 = open_store(extra)
        s2 = open_store(extra)  # second client in the process shares the same agent
        k = chunk_keys(np.arange(32), FP)
        s1.put_many([(meta(k[0]), payload(0))])
        assert s2.lookup(k) == ["dram"]
        s1.close()
        s2.close()
    finally:
        shutdown_embedded()
        drop_pool(pool_name(extra["tiered_cache"]))  # kept by the clean stop


def test_cli_pins_through_agent(agent: tuple[Path, subprocess.Popen[str]]) -> None:
    cfg, _ = agent
    toks = ",".join(str(t) for t in range(600))
    r = cli(
        "pin",
        "add",
        "-c",
        str(cfg),
        "--tokens",
        toks,
        "--tiers",
        "dram,nvme",
        "--ttl",
        "1h",
        "--note",
        "system prompt",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["chunks"] == 2  # 600 tokens / chunk_size 256 in this config
    ls = cli("pin", "ls", "-c", str(cfg), "--json")
    rows = json.loads(ls.stdout)
    assert [p["id"] for p in rows] == [info["id"]]
    assert rows[0]["residency"] == {"dram": "missing", "nvme": "missing"}
    assert cli("pin", "rm", "-c", str(cfg), info["id"]).returncode == 0
    assert json.loads(cli("pin", "ls", "-c", str(cfg), "--json").stdout) == []
    again = cli("pin", "rm", "-c", str(cfg), info["id"])
    assert again.returncode != 0 and again.stderr.startswith("error: no pin")


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["pin", "add", "--tokens", "1,2", "--ttl", "soon"], "not a duration"),
        (["pin", "add", "--tokens", "1,2", "--tiers", "tape"], "unknown tier tape"),
        (["pin", "add", "--tokens", "x,y"], "--tokens takes integers"),
        (["agent", "-c", "/nonexistent.yaml"], "config file not found"),
    ],
)
def test_cli_bad_input_is_one_line(args: list[str], msg: str) -> None:
    r = cli(*args)
    assert r.returncode != 0
    assert msg in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_bad_config_names_the_key(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("dram: {capacity: lots, colour: blue}\n")
    r = cli("agent", "-c", str(p))
    assert r.returncode != 0
    assert "dram.capacity" in r.stderr and "dram.colour: unknown key" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_unreachable_redis_hides_password(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text("redis_url: redis://:hunter2@127.0.0.1:1/0\n")
    r = cli("pin", "add", "-c", str(p), "--tokens", ",".join(["1"] * 300))
    assert r.returncode != 0
    assert "127.0.0.1:1" in r.stderr and "hunter2" not in r.stderr
    assert "Traceback" not in r.stderr


def test_client_survives_agent_restart(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path)
    proc = start_agent(cfg)
    sock = yaml.safe_load(cfg.read_text())["agent"]["socket"]
    c = AgentClient(sock)
    keys = chunk_keys(np.arange(32 * 2), FP)
    c.put_many([(meta(keys[0]), payload(0))])
    c.register_model(dataclasses.asdict(FP))
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    proc = start_agent(cfg)
    try:
        # Same client object: it reconnects (to the kept DRAM pool), and the chunk is
        # still served.
        assert c.lookup(keys) == ["dram"]
        # The new agent (no Redis: an empty directory) has the client's fingerprint again.
        assert [m["model_id"] for m in c.admin("models")["models"]] == ["agent-test"]
        c.put_many([(meta(keys[1]), payload(1))])
        got = c.get_many(keys, FP.digest)
        assert [bytes(g[1]) for g in got if g] == [payload(0), payload(1)]
        c.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_remapped_pool_frees_old_mappings_once_nothing_points_into_them(
    tmp_path: Path,
) -> None:
    """Agents restarted onto new pools: the client closes an earlier pool's mapping at a
    reconnect once nothing points into it, so it keeps at most the one before (the call
    that found the agent gone may still hold a view) and any a view handed out still
    uses. Kept for good, every such restart grew a vLLM worker by a pool until it was
    OOM-killed."""
    from multiprocessing import shared_memory

    cfg = write_cfg(tmp_path, dram={"capacity": "2MiB", "slot_bytes": "128KiB",
                                    "keep_on_stop": False})  # fmt: skip
    sock = yaml.safe_load(cfg.read_text())["agent"]["socket"]
    keys = chunk_keys(np.arange(32 * 5), FP)
    proc = start_agent(cfg)
    c = AgentClient(sock)

    def restart_and_put(i: int) -> None:
        nonlocal proc
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        proc = start_agent(cfg)
        c.put_many([(meta(keys[i]), payload(i))])  # reconnects onto the new pool

    def old_pools() -> list[shared_memory.SharedMemory]:
        return [x for x in c._stale if isinstance(x, shared_memory.SharedMemory)]

    try:
        c.put_many([(meta(keys[0]), payload(0))])
        pools = [c._shm]
        assert c._buf is not None
        view = c._buf[:16]  # a view handed out, as a load in flight holds one
        for i in range(1, 4):
            restart_and_put(i)
            pools.append(c._shm)
            assert len(old_pools()) <= 2 and pools[0] in old_pools()  # in use: kept
        assert all(p._mmap is None for p in pools[1:-2])  # closed once unused
        view.release()
        restart_and_put(4)
        assert pools[0]._mmap is None and len(old_pools()) <= 1
        got = c.get_many(keys[4:], FP.digest)
        assert [bytes(g[1]) for g in got if g] == [payload(4)]
    finally:
        c.close()
        proc.kill()
        proc.wait()


def test_every_node_honours_a_pin_within_seconds(tmp_path: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from tiered_cache.directory import Pin, RedisDirectory

    socks, procs = [], []
    for name in ("pa", "pb"):
        d = tmp_path / name
        d.mkdir()
        cfg = write_cfg(
            d,
            redis_url=redis_server.url,
            agent={"socket": str(d / "a.sock"), "pin_sync_interval_s": 0.5},
        )
        procs.append(start_agent(cfg))
        socks.append(str(d / "a.sock"))
    keys = chunk_keys(np.arange(32 * 2), FP)
    clients = [AgentClient(s) for s in socks]
    for c in clients:
        c.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)])

    def pinned_everywhere() -> list[bool]:
        out = []
        for c in clients:
            rows = [r for r in c.admin("ls", prefix=keys[0])["entries"] if r["tier"] == "dram"]
            assert len(rows) == 1  # resident in this node's DRAM
            out.append(bool(rows[0]["pinned"]))
        return out

    def wait_until(want: bool) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            if all(x == want for x in pinned_everywhere()):
                return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"pin state {want} not reached on every node: {pinned_everywhere()}")

    async def edit(add: bool) -> None:
        d = RedisDirectory.from_url(redis_server.url)
        try:
            if add:
                await d.add_pin(
                    Pin(id="abcdef123456", keys=[keys[0]], tiers=["dram"], fingerprint=FP.hex)
                )
            else:
                await d.remove_pin("abcdef123456")
        finally:
            await d.close()

    try:
        assert pinned_everywhere() == [False, False]
        asyncio.run(edit(True))
        assert wait_until(True) < 3.0
        asyncio.run(edit(False))
        assert wait_until(False) < 3.0
    finally:
        for c in clients:
            c.close()
        for p in procs:
            p.kill()
            p.wait()


def test_a_client_stash_leaves_room_in_a_small_pool(
    agent: tuple[Path, subprocess.Popen[str]],
) -> None:
    """The agent hands a committing client free slots for its next put, but at most a 16th
    of the pool (here 16 slots: one), so busy clients cannot reserve a small pool away."""
    cfg, _ = agent
    c = AgentClient(yaml.safe_load(cfg.read_text())["agent"]["socket"])
    try:
        keys = chunk_keys(np.arange(32 * 8), FP)
        c.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)])  # asks for 8
        assert len(c._stash) == 1
        more = chunk_keys(np.arange(32 * 12), FP)[8:]
        for i, k in enumerate(more):
            c.put_many([(meta(k), payload(i))])
            assert len(c._stash) <= 1
        assert c.lookup(keys) == ["dram"] * 8
    finally:
        c.close()


def _dram_only(tmp_path: Path) -> Path:
    """32 slots of 128 KiB, no tier below: a chunk not in the pool is gone."""
    return write_cfg(
        tmp_path, dram={"capacity": "4MiB", "slot_bytes": "128KiB"}, nvme={"enabled": False}
    )


@pytest.mark.parametrize(
    ("sig", "args", "kept"),
    [("SIGTERM", (), True), ("SIGKILL", (), True), ("SIGTERM", ("--drop-dram",), False)],
    ids=["sigterm-keeps", "kill9-keeps", "sigterm-drop-dram"],
)
def test_restart_finds_the_dram_pool(
    tmp_path: Path, sig: str, args: tuple[str, ...], kept: bool
) -> None:
    """A planned restart keeps the DRAM cache as a crash does (issue 15, item 13): all 20
    chunks, byte-exact; ``--drop-dram`` removes the pool on a clean stop."""
    cfg = _dram_only(tmp_path)
    sock = socket_of(cfg)
    pool = Path("/dev/shm", pool_name(yaml.safe_load(cfg.read_text())))
    keys = chunk_keys(np.arange(32 * 20), FP)
    proc = start_agent(cfg, *args)
    # Connected through the stop, holding the slots the agent stashes for its next put:
    # a clean stop must release them, and they must not come back as chunks.
    c = AgentClient(sock)
    c.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)])
    assert c.lookup(keys) == ["dram"] * 20
    assert stat.S_IMODE(pool.stat().st_mode) == 0o600
    proc.send_signal(getattr(signal, sig))
    out, _ = proc.communicate(timeout=30)
    c.close()
    if sig == "SIGTERM":
        assert proc.returncode == 0, out
        assert "ERROR" not in out and "Traceback" not in out, out
        assert ("with 20 chunks for the next start" in out) == kept, out
    assert pool.exists() == kept
    proc = start_agent(cfg)
    try:
        c = AgentClient(sock)
        got = c.get_many(keys, FP.digest)
        if kept:
            assert c.lookup(keys) == ["dram"] * 20
            assert [bytes(g[1]) if g else None for g in got] == [payload(i) for i in range(20)]
        else:
            assert c.lookup(keys) == [] and got == [None] * 20
        c.close()
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------- the private runtime directory (issue 15, 9)


@pytest.fixture
def default_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A config with the default socket and NVMe path, and the runtime directory they
    fall in (``TIERED_CACHE_RUNTIME_DIR``, here and in the agent: /tmp is shared)."""
    rundir = tmp_path / "run"
    monkeypatch.setenv("TIERED_CACHE_RUNTIME_DIR", str(rundir))
    cfg = write_cfg(tmp_path, nvme={"enabled": True, "write_mode": "write_through"}, agent={})
    return cfg, rundir


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_default_runtime_dir_is_per_user(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiered_cache.config import load_config

    monkeypatch.delenv("TIERED_CACHE_RUNTIME_DIR", raising=False)
    cfg = load_config({"node_id": "n1"})
    rundir = f"/tmp/tiered-cache-{os.geteuid()}"
    assert (cfg.socket_path, cfg.nvme.path) == (f"{rundir}/n1.sock", f"{rundir}/nvme")


def test_default_paths_are_in_a_private_runtime_dir(default_paths: tuple[Path, Path]) -> None:
    """Without agent.socket and nvme.path the agent makes its runtime directory 0700 and
    puts its socket (0600) and NVMe files (0600, directories 0700) in it."""
    cfg, rundir = default_paths
    node = yaml.safe_load(cfg.read_text())["node_id"]
    sock = rundir / f"{node}.sock"
    old = os.umask(0o022)  # what the agent inherits: the modes must not depend on it
    try:
        proc = start_agent(cfg)
    finally:
        os.umask(old)
    try:
        assert _mode(rundir) == 0o700 and os.stat(rundir).st_uid == os.geteuid()
        assert _mode(sock) == 0o600
        assert _mode(rundir / "nvme") == 0o700
        k = chunk_keys(np.arange(32), FP)[0]
        c = AgentClient(str(sock))
        try:
            c.put_many([(meta(k), payload(0))], wait=True)
            chunk = rundir / "nvme" / k[:2] / f"{k}.kvc"
            deadline = time.monotonic() + 10  # written through in the background
            while not chunk.exists():
                assert time.monotonic() < deadline, "the chunk never reached NVMe"
                time.sleep(0.02)
            assert _mode(chunk) == 0o600 and _mode(chunk.parent) == 0o700
        finally:
            c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


@pytest.mark.parametrize(
    ("owner", "mode", "msg"),
    [(65534, 0o777, "belongs to uid 65534, not to this user"), (None, 0o755, "open to other")],
    ids=["another-owner", "group-other-access"],
)
def test_a_squatted_runtime_dir_stops_the_agent(
    default_paths: tuple[Path, Path], owner: int | None, mode: int, msg: str
) -> None:
    """A runtime directory someone else made (or one open to others) is refused with one
    line, before anything is created in it."""
    if owner is not None and os.geteuid() != 0:
        pytest.skip("giving a directory away needs root")
    cfg, rundir = default_paths
    rundir.mkdir()
    if owner is not None:
        os.chown(rundir, owner, owner)
    os.chmod(rundir, mode)
    r = cli("agent", "-c", str(cfg))
    assert r.returncode != 0
    assert msg in r.stderr and str(rundir) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert os.listdir(rundir) == []


def test_runtime_dir_must_be_a_real_directory(tmp_path: Path) -> None:
    from tiered_cache.private_dir import UnsafePath, ensure_private_dir

    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePath, match="not a directory"):
        ensure_private_dir(str(tmp_path / "link"))
    ensure_private_dir(str(tmp_path / "fresh"))
    assert _mode(tmp_path / "fresh") == 0o700
