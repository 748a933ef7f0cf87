"""Admin CLI against a real agent process: pins (add/ls/rm/export/import/warm), stats,
ls, evict, flush, nodes, tokens, one-line errors, and the agent's ``GET /metrics``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest
import yaml
from click.testing import CliRunner, Result
from conftest import free_port
from helpers_agent import start_agent
from helpers_agent import write_cfg as agent_cfg

from tiered_cache import codec
from tiered_cache.cli import main
from tiered_cache.client import AgentClient
from tiered_cache.keys import ModelFingerprint, chunk_keys
from tiered_cache.metrics import Metrics

TOKEN = "adm-token-not-a-secret"
CHUNK = 32  # tokens per chunk in these configs
N = 16 * 1024  # payload bytes per chunk


@dataclass
class Agent:
    cfg: Path
    sock: str
    node_id: str
    metrics_port: int
    proc: subprocess.Popen[str]

    def client(self) -> AgentClient:
        return AgentClient(self.sock)


def write_cfg(tmp: Path, **over: Any) -> Path:
    """The shared agent config with a token, 32-token chunks and a smaller pool."""
    base: dict[str, Any] = {
        "node_id": f"adm-{uuid.uuid4().hex[:8]}",
        "chunk_size": CHUNK,
        "dram": {"capacity": "1MiB", "slot_bytes": "64KiB"},
        "nvme": {"enabled": True, "path": str(tmp / "nvme"), "capacity": "16MiB"},
        "agent": {"socket": str(tmp / "agent.sock"), "auth_token": TOKEN},
    }
    return agent_cfg(tmp, **{**base, **over})


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    tmp = tmp_path_factory.mktemp("adm")
    cfg = write_cfg(tmp)
    port = free_port()
    proc = start_agent(cfg, "--metrics-port", str(port))
    doc = yaml.safe_load(cfg.read_text())
    yield Agent(cfg, doc["agent"]["socket"], doc["node_id"], port, proc)
    proc.kill()
    proc.wait()


def fp() -> ModelFingerprint:
    """The fingerprint `pin add --tokens` uses with its defaults and this chunk size."""
    return ModelFingerprint("default", chunk_size=CHUNK, block_size=16)


def put_chunks(a: Agent, keys: list[str], seed: int = 0) -> None:
    c = a.client()
    try:
        items = []
        for i, k in enumerate(keys):
            data = np.random.default_rng(seed + i).integers(0, 255, N, dtype=np.uint8).tobytes()
            m = codec.ChunkMeta(
                key=k,
                fingerprint=fp().digest,
                num_tokens=CHUNK,
                dtype="uint8",
                shape=(N,),
                kv_layout="LBHNC",
                block_size=16,
            )
            items.append((m, data))
        c.put_many(items, wait=True)
    finally:
        c.close()


def run(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), input=input, env=env, catch_exceptions=False)


def ok(*args: str, **kw: Any) -> Result:
    r = run(*args, **kw)
    assert r.exit_code == 0, (args, r.output)
    return r


def one_line_error(r: Result, needle: str) -> None:
    assert r.exit_code != 0
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def toks(start: int, n_chunks: int) -> list[int]:
    return list(range(start, start + n_chunks * CHUNK))


def csv(ts: list[int]) -> str:
    return ",".join(map(str, ts))


# --------------------------------------------------------------------------- help


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, cmd in group.commands.items():
        yield (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))


def test_every_command_has_help() -> None:
    cmds = list(_commands(main))
    for want in [
        ("pin", "add"), ("pin", "ls"), ("pin", "rm"), ("pin", "import"), ("pin", "export"),
        ("pin", "warm"), ("stats",), ("ls",), ("evict",), ("flush",), ("nodes",),
        ("dashboard",), ("models",),
    ]:  # fmt: skip
        assert want in cmds
    for c in cmds:
        r = ok(*c, "--help")
        assert r.output.startswith("Usage:") and len(r.output.splitlines()) > 2, c


# --------------------------------------------------------------------------- pins


def test_pin_lifecycle_tokens_and_residency(agent: Agent) -> None:
    cfg = str(agent.cfg)
    t = toks(10_000, 3)
    # Admin writes need the agent's token; reads do not.
    one_line_error(run("pin", "add", "-c", cfg, "--tokens", csv(t)), "auth token")
    r = ok(
        "pin", "add", "-c", cfg, "--tokens", csv(t), "--tiers", "dram,nvme", "--ttl", "24h",
        "--note", "sys prompt", "--owner", "ops", "--token", TOKEN, "--json",
    )  # fmt: skip
    info = json.loads(r.stdout)
    assert info["chunks"] == 3 and info["tokens"] == 3 * CHUNK and info["ttl_s"] == 86400
    rows = json.loads(ok("pin", "ls", "-c", cfg, "--json").stdout)
    row = next(x for x in rows if x["id"] == info["id"])
    assert row["owner"] == "ops" and row["note"] == "sys prompt" and row["chunks"] == 3
    assert 86000 < row["ttl_left_s"] <= 86400 and 0 <= row["age_s"] < 60
    assert row["residency"] == {"dram": "missing", "nvme": "missing"}
    text = ok("pin", "ls", "-c", cfg).stdout
    assert re.search(rf"{info['id']}\s+ops\s+\S+\s+2[34]\.\d+h\s+3\s", text), text
    assert "dram=missing nvme=missing" in text
    # Two of the three chunks arrive: the pin is pending in DRAM.
    put_chunks(agent, chunk_keys(t, fp())[:2])
    row = next(
        x for x in json.loads(ok("pin", "ls", "-c", cfg, "--json").stdout) if x["id"] == info["id"]
    )
    assert row["residency"]["dram"] == "pending"
    # Env var token works too.
    ok("pin", "rm", "-c", cfg, info["id"], env={"TIERED_CACHE_TOKEN": TOKEN})
    one_line_error(run("pin", "rm", "-c", cfg, info["id"], "--token", TOKEN), "no pin with id")


def test_pin_by_connector_fingerprint(agent: Agent) -> None:
    """`--fingerprint` (the hex the vLLM connector logs) gives the connector's keys."""
    cfg = str(agent.cfg)
    real = ModelFingerprint(
        "meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16",
        kv_layout="NHD@cuda/FullAttentionSpec", chunk_size=64, block_size=16,
    )  # fmt: skip
    t = toks(15_000, 5)
    pid = json.loads(
        ok("pin", "add", "-c", cfg, "--tokens", csv(t), "--fingerprint", real.hex,
           "--chunk-size", "64", "--salt", "s", "--token", TOKEN, "--json").stdout
    )["id"]  # fmt: skip
    doc = yaml.safe_load(ok("pin", "export", "-c", cfg).stdout)
    mine = next(p for p in doc["pins"] if p["id"] == pid)
    assert mine["keys"] == chunk_keys(t, real, cache_salt="s") and mine["fingerprint"] == real.hex
    one_line_error(run("pin", "add", "-c", cfg, "--tokens", csv(t), "--fingerprint", "abc"),
                   "--fingerprint takes 32 hex characters")  # fmt: skip
    ok("pin", "rm", "-c", cfg, pid, "--token", TOKEN)


def test_warm_copies_from_a_lower_tier(agent: Agent) -> None:
    cfg = str(agent.cfg)
    t = toks(20_000, 2)
    keys = chunk_keys(t, fp())
    put_chunks(agent, keys, seed=100)
    # Chunks only in NVMe: write back, then evict from DRAM.
    assert "wrote back" in ok("flush", "-c", cfg, "--write-back", "--token", TOKEN).stdout
    listed = json.loads(ok("ls", "-c", cfg, "--prefix", keys[0][:12], "--json").stdout)
    assert {e["tier"] for e in listed["entries"]} == {"dram", "nvme"}
    for k in keys:
        r = ok("evict", "-c", cfg, k, "--tier", "dram", "--token", TOKEN)
        assert r.stdout.strip() == f"evicted {k} from dram"
    one_line_error(run("evict", "-c", cfg, keys[0], "--tier", "dram", "--token", TOKEN), "no chunk")
    pid = json.loads(
        ok("pin", "add", "-c", cfg, "--tokens", csv(t), "--tiers", "dram,nvme",
           "--token", TOKEN, "--json").stdout
    )["id"]  # fmt: skip
    row = next(x for x in json.loads(ok("pin", "ls", "-c", cfg, "--json").stdout) if x["id"] == pid)
    assert row["residency"] == {"dram": "missing", "nvme": "resident"}
    one_line_error(run("pin", "warm", "-c", cfg, pid), "auth token")
    r = ok("pin", "warm", "-c", cfg, pid, "--token", TOKEN, "--json")
    out = json.loads(r.stdout)
    assert out["copied"] == 2 and out["prefilled_via"] is None
    assert out["residency"] == {"dram": "resident", "nvme": "resident"}
    # Warming a resident pin copies nothing.
    assert "copied 0 chunk copies" in ok("pin", "warm", "-c", cfg, pid, "--token", TOKEN).stdout
    ok("pin", "rm", "-c", cfg, pid, "--token", TOKEN)


class FakeVLLM:
    """Stands in for a vLLM server in this unit test only (a real one is too slow here):
    records the requests and, like vLLM's tiered-cache connector would, stores the prompt's
    chunks through the node agent when it gets a completion request."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.requests: list[tuple[str, Any]] = []
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(30)

    def _run(self) -> None:
        from aiohttp import web

        async def models(req: web.Request) -> web.Response:
            self.requests.append(("models", None))
            return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

        async def completions(req: web.Request) -> web.Response:
            body = await req.json()
            self.requests.append(("completions", body))
            keys = chunk_keys(body["prompt"], fp(), cache_salt=body.get("cache_salt"))
            await asyncio.to_thread(put_chunks, self.agent, keys, 7)
            return web.json_response({"choices": [{"text": "x"}]})

        async def boot() -> None:
            app = web.Application()
            app.router.add_get("/v1/models", models)
            app.router.add_post("/v1/completions", completions)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(boot())
        self._ready.set()
        self._loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_warm_prefills_through_vllm_when_no_tier_has_it(agent: Agent) -> None:
    cfg = str(agent.cfg)
    t = [*toks(30_000, 2), 1, 2, 3]  # a partial tail chunk is not pinned
    pid = json.loads(
        ok("pin", "add", "-c", cfg, "--tokens", csv(t), "--tiers", "dram", "--salt", "tenant-a",
           "--token", TOKEN, "--json").stdout
    )["id"]  # fmt: skip
    one_line_error(run("pin", "warm", "-c", cfg, pid, "--token", TOKEN), "pass --server")
    one_line_error(
        run(
            "pin",
            "warm",
            "-c",
            cfg,
            pid,
            "--token",
            TOKEN,
            "--server",
            f"http://127.0.0.1:{free_port()}",
        ),
        "cannot reach vLLM at http://127.0.0.1:",
    )
    fake = FakeVLLM(agent)
    try:
        r = ok("pin", "warm", "-c", cfg, pid, "--token", TOKEN, "--server", fake.url + "/v1",
               "--salt", "tenant-a")  # fmt: skip
        assert f"prefilled through {fake.url}/v1 (fake-model)" in r.stdout
        assert "dram=resident" in r.stdout
        kinds = [k for k, _ in fake.requests]
        assert kinds == ["models", "completions"]
        body = fake.requests[1][1]
        assert body["prompt"] == t and body["max_tokens"] == 1
        assert body["model"] == "fake-model" and body["cache_salt"] == "tenant-a"
    finally:
        fake.stop()
    ok("pin", "rm", "-c", cfg, pid, "--token", TOKEN)


def test_export_import_roundtrip(agent: Agent, tmp_path: Path) -> None:
    cfg = str(agent.cfg)
    ids = [
        json.loads(
            ok("pin", "add", "-c", cfg, "--tokens", csv(toks(40_000 + 1000 * i, 1)), "--note",
               f"p{i}", "--tiers", "dram,nvme", "--token", TOKEN, "--json").stdout
        )["id"]
        for i in range(2)
    ]  # fmt: skip
    out = tmp_path / "pins.yaml"
    ok("pin", "export", "-c", cfg, "-o", str(out))
    doc = yaml.safe_load(out.read_text())
    exported = {p["id"]: p for p in doc["pins"]}
    assert set(ids) <= set(exported) and doc["version"] == 1
    assert exported[ids[0]]["tokens"] == toks(40_000, 1)
    assert exported[ids[0]]["tiers"] == ["dram", "nvme"] and "created_at" not in exported[ids[0]]
    assert (
        ok("pin", "export", "-c", cfg).stdout.split("\n", 2)[2] == out.read_text().split("\n", 2)[2]
    )
    for i in ids:
        ok("pin", "rm", "-c", cfg, i, "--token", TOKEN)
    one_line_error(run("pin", "import", "-c", cfg, str(out)), "auth token")
    r = ok("pin", "import", "-c", cfg, str(out), "--token", TOKEN)
    assert "2 added" in r.stdout.splitlines()[-1]
    assert "2 unchanged" in ok("pin", "import", "-c", cfg, str(out), "--token", TOKEN).stdout
    # Edit in git, re-import: the changed pin is updated; --prune drops the one removed.
    doc["pins"] = [p for p in doc["pins"] if p["id"] == ids[0]]
    doc["pins"][0]["note"] = "edited"
    out.write_text(yaml.safe_dump(doc))
    r = ok("pin", "import", "-c", cfg, str(out), "--prune", "--dry-run", "--token", TOKEN)
    assert "would be updated" in r.stdout and "would be removed" in r.stdout
    r = ok("pin", "import", "-c", cfg, str(out), "--prune", "--token", TOKEN)
    assert "1 updated" in r.stdout and "1 removed" in r.stdout
    rows = json.loads(ok("pin", "ls", "-c", cfg, "--json").stdout)
    assert [(x["id"], x["note"]) for x in rows] == [(ids[0], "edited")]
    bad = tmp_path / "bad.yaml"
    bad.write_text("pins:\n- {id: x, keys: [nothex], fingerprint: ab}\n")
    one_line_error(run("pin", "import", "-c", cfg, str(bad), "--token", TOKEN), "pin #1: keys")
    ok("pin", "rm", "-c", cfg, ids[0], "--token", TOKEN)


# --------------------------------------------------------------------------- cache admin


def traffic(a: Agent, base: int) -> list[str]:
    """Puts that overflow DRAM into NVMe, then gets: hits in both tiers, and misses."""
    keys = chunk_keys(toks(base, 24), fp())
    put_chunks(a, keys, seed=base)
    c = a.client()
    try:
        for i in range(0, len(keys), 4):  # batches well below the DRAM pool's 16 slots
            got = c.get_many(keys[i : i + 4], fp().digest)
            assert all(g is not None for g in got)
        missing = chunk_keys(toks(base + 1, 2), fp())
        assert c.get_many(missing, fp().digest) == [None, None]
    finally:
        c.close()
    return keys


def test_stats_ls_nodes(agent: Agent) -> None:
    cfg = str(agent.cfg)
    keys = traffic(agent, 50_000)
    s = json.loads(ok("stats", "-c", cfg, "--json").stdout)
    assert s["node_id"] == agent.node_id
    assert s["tiers"]["dram"]["hits"] > 0 and s["tiers"]["nvme"]["hits"] > 0
    assert s["tiers"]["nvme"]["hit_tokens"] > 0
    assert s["misses"] >= 2 and 0 < s["hit_rate"] < 1
    assert s["tiers"]["dram"]["capacity_bytes"] == 2**20
    assert s["tiers"]["nvme"]["used_bytes"] > 0 and s["tiers"]["dram"]["evictions"] > 0
    assert set(s["errors"]) >= {"verification_failures", "directory_errors", "recompute_fallbacks"}
    assert [n["node"] for n in s["nodes"]] == [agent.node_id]
    text = ok("stats", "-c", cfg).stdout
    assert re.search(r"^dram\s+\d+\.\d%\s+\d+", text, re.M) and "errors:" in text, text
    r = ok("stats", "-c", cfg, "--json", "--watch", "0.2", "--count", "3")
    assert len(r.stdout.strip().splitlines()) == 3
    r = ok("stats", "-c", cfg, "--watch", "0.2", "--count", "2")
    assert r.stdout.count(f"node {agent.node_id}") == 2
    # ls --prefix across tiers
    ls = json.loads(ok("ls", "-c", cfg, "--prefix", keys[0][:6], "--json").stdout)
    assert ls["total"] >= 1 and all(e["key"].startswith(keys[0][:6]) for e in ls["entries"])
    assert {
        e["tier"]
        for e in json.loads(ok("ls", "-c", cfg, "--limit", "1000", "--json").stdout)["entries"]
    } == {"dram", "nvme"}
    assert keys[0] in ok("ls", "-c", cfg, "--prefix", keys[0]).stdout
    one_line_error(run("ls", "-c", cfg, "--prefix", "xyz"), "--prefix must be hex")
    # nodes
    nodes = json.loads(ok("nodes", "-c", cfg, "--json").stdout)
    assert [n["node"] for n in nodes] == [agent.node_id]
    assert set(nodes[0]["tiers"]) == {"dram", "nvme"} and 0 <= nodes[0]["heartbeat_age_s"] < 30
    assert agent.node_id in ok("nodes", "-c", cfg).stdout


def test_flush_asks_and_keeps_pins(agent: Agent) -> None:
    cfg = str(agent.cfg)
    traffic(agent, 60_000)
    t = toks(70_000, 1)
    put_chunks(agent, chunk_keys(t, fp()))
    pid = json.loads(
        ok("pin", "add", "-c", cfg, "--tokens", csv(t), "--token", TOKEN, "--json").stdout
    )["id"]
    one_line_error(run("flush", "-c", cfg, "--tier", "tape", "--yes"), "unknown tier tape")
    before = json.loads(ok("ls", "-c", cfg, "--limit", "1000", "--json").stdout)["total"]
    r = run("flush", "-c", cfg, "--tier", "dram", "--token", TOKEN, input="n\n")
    assert r.exit_code != 0 and "Drop every unpinned chunk from dram" in r.output
    assert json.loads(ok("ls", "-c", cfg, "--limit", "1000", "--json").stdout)["total"] == before
    one_line_error(run("flush", "-c", cfg, "--tier", "dram", "--yes"), "auth token")
    r = ok("flush", "-c", cfg, "--tier", "dram", "--token", TOKEN, input="y\n")
    assert re.search(r"flushed dram: removed \d+ chunks, kept 1 pinned", r.stdout), r.stdout
    left = json.loads(ok("ls", "-c", cfg, "--limit", "1000", "--json").stdout)["entries"]
    assert [e["key"] for e in left if e["tier"] == "dram"] == chunk_keys(t, fp())
    row = next(x for x in json.loads(ok("pin", "ls", "-c", cfg, "--json").stdout) if x["id"] == pid)
    assert row["residency"] == {"dram": "resident"}
    ok("pin", "rm", "-c", cfg, pid, "--token", TOKEN)


# --------------------------------------------------------------------------- errors


def cli_proc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiered_cache.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TIERED_CACHE_TOKEN": ""},
    )


def test_errors_are_one_line(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                    "num_key_value_heads": 8})
    )  # fmt: skip
    no_agent = tmp_path / "none.yaml"
    no_agent.write_text(yaml.safe_dump({"agent": {"socket": str(tmp_path / "no.sock")}}))
    cases = [
        (["pin", "add", "--tokens", "1,2", "--ttl", "tomorrow"], "not a duration"),
        (["pin", "add", "--tokens", "1,2", "--tiers", "dram,floppy"], "unknown tier floppy"),
        (
            ["pin", "add", "--tokens", csv(toks(0, 20 * 256 // CHUNK)), "--model", str(model),
             "--block-size", "16"],  # by hand: nothing registered here
            "does not fit the dram pin budget",
        ),
        (
            ["pin", "add", "-c", str(no_agent), "--tokens", "1,2", "--model", str(model)],
            "no node agent at",
        ),
        (["models", "-c", str(no_agent)], "no node agent at"),
        (["stats", "-c", str(no_agent)], f"no node agent at {tmp_path / 'no.sock'}"),
        (["nodes", "-c", str(no_agent)], "no node agent at"),
        (["ls", "-c", str(no_agent)], "no node agent at"),
        (["pin", "ls", "-c", str(no_agent)], "no node agent at"),
        (["flush", "-c", str(no_agent)], "give --tier"),
        (["evict", "-c", str(no_agent), "zz"], "not a chunk key"),
        (["stats", "--watch", "0"], "--watch takes a positive number"),
    ]
    for args, needle in cases:
        one_line_error(run(*args), needle)


def test_unreachable_redis_is_named_without_password(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "redis_url": "redis://:hunter2@127.0.0.1:1/0",
                "agent": {"socket": str(tmp_path / "s")},
            }
        )
    )
    for args in (["nodes"], ["stats"], ["pin", "ls"], ["pin", "export"], ["dashboard"]):
        r = run(*args, "-c", str(p))
        one_line_error(r, "cannot reach Redis at redis://127.0.0.1:1/0")
        assert "hunter2" not in r.output
    # And as a real process: exit status and stderr only.
    r2 = cli_proc("nodes", "-c", str(p))
    assert r2.returncode == 1 and "hunter2" not in r2.stderr + r2.stdout
    assert r2.stderr.startswith("error: cannot reach Redis at redis://127.0.0.1:1/0")


def test_pins_and_nodes_through_redis(tmp_path: Path, redis_server: Any) -> None:
    """With redis_url the CLI talks to Redis; an agent on the same directory sees the pin
    and reports fleet residency."""
    cfg = write_cfg(tmp_path, redis_url=redis_server.url, heartbeat_ttl_s=5)
    proc = start_agent(cfg)
    try:
        doc = yaml.safe_load(cfg.read_text())
        a = Agent(cfg, doc["agent"]["socket"], doc["node_id"], 0, proc)
        t = toks(80_000, 2)
        pid = json.loads(
            ok("pin", "add", "-c", str(cfg), "--tokens", csv(t), "--token", TOKEN, "--json").stdout
        )["id"]
        put_chunks(a, chunk_keys(t, fp()))
        rows = json.loads(ok("pin", "ls", "-c", str(cfg), "--json").stdout)
        assert rows[0]["id"] == pid and rows[0]["residency"] == {"dram": "resident"}
        assert rows[0]["fleet"] == {"dram": [a.node_id]}
        nodes = json.loads(ok("nodes", "-c", str(cfg), "--json").stdout)
        assert [n["node"] for n in nodes] == [a.node_id]
        one_line_error(run("pin", "rm", "-c", str(cfg), pid), "needs the admin token")
        ok("pin", "rm", "-c", str(cfg), pid, "--token", TOKEN)
    finally:
        proc.kill()
        proc.wait()


def test_pin_by_model_uses_fingerprints_registered_in_redis(
    tmp_path: Path, redis_server: Any
) -> None:
    """A connector registers through its agent; with redis_url `pin add --model` (a served
    name here) reads the registrations from Redis and pins under every TP rank's keys."""
    cfg = write_cfg(tmp_path, redis_url=redis_server.url, heartbeat_ttl_s=5)
    proc = start_agent(cfg)
    c = AgentClient(yaml.safe_load(cfg.read_text())["agent"]["socket"], attach_pool=False)
    try:
        t = toks(85_000, 3)
        one_line_error(
            run("pin", "add", "-c", str(cfg), "--tokens", csv(t), "--model", "llama-8b",
                "--token", TOKEN),
            "no vLLM instance has registered model 'llama-8b' yet; start it",
        )  # fmt: skip
        fps = [
            ModelFingerprint("/models/llama-8b", dtype="bfloat16", block_size=16,
                             kv_layout="NHD@cuda/FullAttentionSpec", tp_rank=r,
                             tp_world_size=2, chunk_size=CHUNK)
            for r in range(2)
        ]  # fmt: skip
        for f in fps:  # what each TP rank's connector sends
            h = c.register_model({**dataclasses.asdict(f), "aliases": ["llama-8b"]})
            assert h == f.hex
        listed = json.loads(ok("models", "-c", str(cfg), "--json").stdout)
        assert sorted(m["fingerprint"] for m in listed) == sorted(f.hex for f in fps)
        assert {m["node"] for m in listed} == {yaml.safe_load(cfg.read_text())["node_id"]}
        info = json.loads(
            ok("pin", "add", "-c", str(cfg), "--tokens", csv(t), "--model", "llama-8b",
               "--token", TOKEN, "--json").stdout
        )  # fmt: skip
        pin = yaml.safe_load(ok("pin", "export", "-c", str(cfg)).stdout)["pins"][0]
        assert pin["id"] == info["id"]
        assert sorted(pin["keys"]) == sorted(chunk_keys(t, fps[0]) + chunk_keys(t, fps[1]))
        one_line_error(
            run("pin", "add", "-c", str(cfg), "--tokens", csv(t), "--model", "llama-8b",
                "--chunk-size", str(2 * CHUNK), "--token", TOKEN),
            f"registered with chunk size {CHUNK}, not --chunk-size {2 * CHUNK}",
        )  # fmt: skip
    finally:
        c.close()
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- metrics


def test_agent_serves_prometheus_metrics(agent: Agent) -> None:
    traffic(agent, 90_000)
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        body = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(body)}
    hits = {
        s.labels["tier"]: s.value
        for s in fams["tiered_cache_hits"].samples
        if s.name.endswith("_total")
    }
    assert hits["dram"] > 0 and hits["nvme"] > 0
    assert fams["tiered_cache_load_seconds"].type == "histogram"
    assert fams["tiered_cache_used_bytes"].type == "gauge"
    assert any(s.value > 0 for s in fams["tiered_cache_written_bytes"].samples)


def test_metric_names_follow_prometheus_conventions() -> None:
    m = Metrics()
    names = set()
    for fam in m.registry.collect():
        names.add(fam.name)
        assert fam.name.startswith("tiered_cache_"), fam.name
        assert not re.search(r"_(ms|milliseconds|kb|mb|mib|percent)(_|$)", fam.name), fam.name
        if fam.type == "counter":
            assert (
                all(s.name.endswith(("_total", "_created")) for s in fam.samples) or not fam.samples
            )
        if fam.type == "histogram":
            assert fam.name.endswith("_seconds"), fam.name
        if fam.type == "gauge":  # in base units
            assert fam.name.endswith(("_bytes", "_seconds", "_bytes_per_second")), fam.name
    for want in ["lookups", "hits", "misses", "hit_tokens", "read_bytes", "written_bytes",
                 "load_seconds", "store_seconds", "evictions", "admission_rejects",
                 "verification_failures", "pinned_bytes", "used_bytes", "capacity_bytes",
                 "directory_errors", "recompute_fallbacks", "peer_transfers"]:  # fmt: skip
        assert f"tiered_cache_{want}" in names, want
