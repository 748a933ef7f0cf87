"""Issue 15, item 8: the admin token and local clients' credentials.

- A placeholder or short ``agent.auth_token`` is refused when the config loads, with an
  error naming the key and never quoting the value; the shipped multi-node configs read
  the token from ``${TC_ADMIN_TOKEN}``.
- The agent checks the token itself on every admin op: right accepted, wrong and missing
  refused, whichever client asks (the CLI in Redis mode included: it goes through the
  agent, whose check it cannot skip).
- A local client whose uid (SO_PEERCRED) is neither the agent's, root's nor listed in
  ``agent.allowed_uids`` may read but not write chunks or run admin ops. These tests run
  as root: the client is a forked child that drops to uid 65534 before it connects.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml
from click.testing import CliRunner, Result
from helpers_agent import FP, meta, payload, socket_of, start_agent, write_cfg

from tiered_cache import codec
from tiered_cache.agent.local import peer_uid
from tiered_cache.cli import main
from tiered_cache.client import AgentClient
from tiered_cache.config import ConfigError, load_config
from tiered_cache.ipc import _recv_exact, pack
from tiered_cache.keys import chunk_keys

TOKEN = "0123456789abcdef-admin"
NOBODY = 65534
CONFIGS = Path(__file__).parents[1] / "configs"
_LEN = struct.Struct("!I")

# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "token",
    ["change-me", "changeme", "CHANGE_ME", "secret", "password", "Password!", "", "  ",
     "fifteen-chars-x"],
)  # fmt: skip
def test_placeholder_or_short_token_is_refused_at_load(tmp_path: Path, token: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"agent": {"auth_token": token}}))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "agent.auth_token:" in msg
    assert any(w in msg for w in ("placeholder", "at least 16 characters", "empty")), msg
    if token.strip():  # the value is never quoted
        assert f"'{token}'" not in msg and f'"{token}"' not in msg
    if token == "fifteen-chars-x":
        assert token not in msg


def test_real_token_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TC_ADMIN_TOKEN", TOKEN)
    p = tmp_path / "c.yaml"
    p.write_text("agent: {auth_token: '${TC_ADMIN_TOKEN}'}\n")
    assert load_config(p).agent.auth_token == TOKEN


@pytest.mark.parametrize("name", ["multi-node.yaml", "lmcache-multi-node.yaml"])
def test_shipped_configs_take_the_token_from_the_environment(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    monkeypatch.setenv("TC_PEER_SECRET", "0123456789abcdef")
    monkeypatch.delenv("TC_ADMIN_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="TC_ADMIN_TOKEN is not set"):
        load_config(CONFIGS / name)
    monkeypatch.setenv("TC_ADMIN_TOKEN", "change-me")  # exported, but the placeholder
    with pytest.raises(ConfigError, match="placeholder"):
        load_config(CONFIGS / name)
    monkeypatch.setenv("TC_ADMIN_TOKEN", TOKEN)
    assert load_config(CONFIGS / name).agent.auth_token == TOKEN


def test_allowed_uids_are_checked(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("agent: {allowed_uids: [-1]}\n")
    with pytest.raises(ConfigError, match=r"agent\.allowed_uids\.0"):
        load_config(p)


# --------------------------------------------------------------------------- agent


def raw_frame(op: str, **kw: Any) -> bytes:
    return pack({"op": op, **kw})


def as_uid(uid: int, path: str, frames: list[bytes]) -> list[dict[str, Any]]:
    """Send ``frames`` to the socket at ``path`` from a forked child running as ``uid``
    (it drops root before connecting, so the kernel records ``uid`` as the peer), and
    return the replies. The child uses only socket calls: safe after fork."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(path)
            out = b""
            for f in frames:
                s.sendall(f)
                head = _recv_exact(s, 4)
                out += head + _recv_exact(s, _LEN.unpack(head)[0])
            s.close()
            view = memoryview(out)
            while view:
                view = view[os.write(w, view) :]
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged client failed"
    replies = []
    while data:
        (n,) = _LEN.unpack(data[:4])
        replies.append(msgpack.unpackb(data[4 : 4 + n], raw=False))
        data = data[4 + n :]
    return replies


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another uid can reach (pytest's own are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="tc-admin-auth-", dir="/tmp"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _agent(tmp: Path, shared: Path, **agent: Any) -> tuple[str, Any]:
    sock = str(shared / "agent.sock")
    cfg = write_cfg(
        tmp,
        dram={"capacity": "2MiB", "slot_bytes": "128KiB"},
        agent={"socket": sock, "auth_token": TOKEN, "usage_log_interval_s": 60, **agent},
    )
    proc = start_agent(cfg)
    os.chmod(sock, 0o666)  # the agent makes it 0600; opened here to test the uid check
    return socket_of(cfg), proc


def key(i: int) -> str:
    return chunk_keys(list(range(i, i + FP.chunk_size)), FP)[0]


def test_peer_uid_of_a_real_socket() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peer_uid(a) == os.geteuid()
    with socket.socket() as tcp:
        assert peer_uid(tcp) is None  # not a unix socket: the kernel names no uid


def test_admin_token_right_wrong_missing(tmp_path: Path, shared_dir: Path) -> None:
    sock, proc = _agent(tmp_path, shared_dir)
    c = AgentClient(sock, attach_pool=False)
    try:
        k = key(10)
        wrong = TOKEN[:-1] + ("x" if TOKEN[-1] != "x" else "y")  # same length, last differs
        for token in (None, wrong, TOKEN[:-1], TOKEN + "x", "", "é" * 20):
            with pytest.raises(Exception, match="needs the admin token"):
                c.admin("evict", key=k, token=token)
        c.admin("evict", key=k, token=TOKEN)  # accepted
        assert c.admin("stats")["node_id"]  # reads need no token
    finally:
        c.close()
        proc.kill()
        proc.wait()


def _writes(k: str) -> list[tuple[str, bytes]]:
    data = codec.encode(meta(k, 1024), payload(1, 1024))
    return [
        ("reserve", raw_frame("reserve", sizes=[4096])),
        ("put", raw_frame("put", key=k, data=data)),
        ("commit", raw_frame("commit", items=[[k, 0, len(data), None, 0]])),
        ("register_model", raw_frame("register_model", model={"model_id": "m"})),
        # An alias points a key at a chunk: a write (a wrong one would load other KV).
        ("alias", raw_frame("alias", targets=[k], aliases=[["ab" * 16]])),
        ("evict", raw_frame("evict", key=k, token=TOKEN)),
        ("flush", raw_frame("flush", token=TOKEN)),
    ]


def test_other_uid_may_read_but_not_write(tmp_path: Path, shared_dir: Path) -> None:
    sock, proc = _agent(tmp_path, shared_dir)
    try:
        k = key(20)
        writes = _writes(k)
        reads = [raw_frame("hello"), raw_frame("lookup", keys=[k]), raw_frame("stats")]
        got = as_uid(NOBODY, sock, [f for _, f in writes] + reads)
        for (op, _), r in zip(writes, got, strict=False):
            assert not r["ok"] and r["kind"] == "auth", (op, r)
            assert f"{op} refused: local uid {NOBODY}" in r["error"], r
        assert all(r["ok"] for r in got[len(writes) :]), got[len(writes) :]
        # Told not to send aliases (its client sends none, rather than be refused).
        assert got[len(writes)]["aliases"] is False
        c = AgentClient(sock, attach_pool=False)  # our own uid: the same writes pass
        try:
            assert c.takes_aliases
            assert c.admin("stats")["pool"]["reserved_runs"] == 0  # nobody's took nothing
            c.put_many([(meta(k, 1024), payload(1, 1024))], wait=True)
            assert c.lookup([k]) == ["dram"]
        finally:
            c.close()
    finally:
        proc.kill()
        proc.wait()


def test_allowed_uid_may_write_with_the_token(tmp_path: Path, shared_dir: Path) -> None:
    sock, proc = _agent(tmp_path, shared_dir, allowed_uids=[NOBODY])
    try:
        k = key(30)
        data = codec.encode(meta(k, 1024), payload(2, 1024))
        got = as_uid(
            NOBODY,
            sock,
            [raw_frame("put", key=k, data=data, wait=True), raw_frame("lookup", keys=[k]),
             raw_frame("evict", key=k), raw_frame("evict", key=k, token=TOKEN),
             raw_frame("lookup", keys=[k])],
        )  # fmt: skip
        assert got[0]["ok"] and got[1]["sources"] == ["dram"], got[:2]
        assert not got[2]["ok"] and "needs the admin token" in got[2]["error"], got[2]
        assert got[3]["ok"] and got[4]["sources"] == [], got[3:]
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- CLI


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def test_cli_in_redis_mode_is_checked_by_the_agent(
    tmp_path: Path, shared_dir: Path, redis_server: Any
) -> None:
    """The CLI's own config need not hold the token (or may hold another): with an agent
    running, the agent decides, so a client-side check cannot be skipped by editing the
    file. With no agent, the write goes to Redis, whose credentials guard it."""
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    sock = str(shared_dir / "agent.sock")
    cfg = write_cfg(
        agent_dir,
        redis_url=redis_server.url,
        dram={"capacity": "2MiB", "slot_bytes": "128KiB"},
        agent={"socket": sock, "auth_token": TOKEN},
    )
    proc = start_agent(cfg)
    try:
        doc = yaml.safe_load(cfg.read_text())
        del doc["agent"]["auth_token"]  # the operator's copy, without the token
        mine = tmp_path / "cli.yaml"
        mine.write_text(yaml.safe_dump(doc))
        toks = ",".join(str(t) for t in range(40, 40 + doc.get("chunk_size", 256)))
        add = ("pin", "add", "-c", str(mine), "--tokens", toks, "--json")
        r = cli(*add, env={"TIERED_CACHE_TOKEN": ""})
        assert r.exit_code != 0 and "needs the admin token" in r.stderr, r.output
        r = cli(*add, "--token", TOKEN[:-1] + "?")
        assert r.exit_code != 0 and "needs the admin token" in r.stderr, r.output
        assert json.loads(cli("pin", "ls", "-c", str(mine), "--json").stdout) == []
        pid = json.loads(cli(*add, "--token", TOKEN).stdout)["id"]
        r = cli("pin", "rm", "-c", str(mine), pid, env={"TIERED_CACHE_TOKEN": ""})
        assert r.exit_code != 0 and "needs the admin token" in r.stderr, r.output
        assert cli("pin", "rm", "-c", str(mine), pid, "--token", TOKEN).exit_code == 0
    finally:
        proc.kill()
        proc.wait()
