"""The node agent as a real process: shared-memory clients, crashes, SIGTERM, CLI."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers_agent import FP, cli, meta, payload, start_agent, write_cfg

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
    proc = start_agent(cfg)
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
        # Same client object: it reconnects, and the written-back chunk is still served.
        assert c.lookup(keys) == ["nvme"]
        # The new agent (no Redis: an empty directory) has the client's fingerprint again.
        assert [m["model_id"] for m in c.admin("models")["models"]] == ["agent-test"]
        c.put_many([(meta(keys[1]), payload(1))])
        got = c.get_many(keys, FP.digest)
        assert [bytes(g[1]) for g in got if g] == [payload(0), payload(1)]
        c.close()
    finally:
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
