"""The agent's local protocol: typed requests, checked on arrival."""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import typing
from pathlib import Path

import pytest
import yaml

from tiered_cache import protocol as p
from tiered_cache.agent import spawn_agent
from tiered_cache.ipc import IPCError, call_sync

SAMPLE: dict[type, typing.Any] = {
    list[str]: ["00" * 16],
    list[int]: [3],
    list[list[typing.Any]]: [["k", 1, 2]],
    list[list[str]]: [["00" * 16]],
    int: 7,
    float: 1.5,
    bool: True,
    str: "x",
    bytes: b"\x01",
    dict[str, typing.Any]: {"a": 1},
    list[list[int | bytes]]: [[1, b"\x02"]],
    list[int | bytes | None]: [None],
    list[bytes]: [b"\x00" * 4],
    list[list[typing.Any] | None]: [["s"], None],
}


def example(cls: type[p.Request]) -> p.Request:
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        kw[f.name] = SAMPLE.get(hint, SAMPLE.get(args[0]) if args else None)
    return cls(**kw)


@pytest.mark.parametrize("cls", sorted(p.REQUESTS.values(), key=lambda c: c.op))
def test_every_request_round_trips(cls: type[p.Request]) -> None:
    req = example(cls)
    msg = p.encode(req)
    assert msg["op"] == cls.op and msg["v"] == p.VERSION
    assert p.decode(msg) == req
    assert bool(msg.get("noreply")) is cls.noreply


@pytest.mark.parametrize(
    ("msg", "says"),
    [
        ({"op": "nope"}, "unknown op 'nope'"),
        ({"keys": []}, "unknown op None"),
        ({"op": "lookup"}, "lookup: missing field 'keys'"),
        ({"op": "lookup", "keys": "abc"}, "lookup: field 'keys' must be list[str], got str"),
        ({"op": "lookup", "keys": [1]}, "field 'keys' must be list[str]"),
        ({"op": "reserve", "sizes": [True]}, "field 'sizes' must be list[int]"),
        ({"op": "lookup", "keys": [], "bogus": 1}, "lookup: unknown field(s) bogus"),
        ({"op": "hello", "v": 1}, "hello: protocol version 1, this agent speaks 2"),
        ({"op": "evict", "key": "k", "tiers": "dram"}, "field 'tiers' must be"),
    ],
)
def test_bad_requests_name_what_is_wrong(msg: dict[str, typing.Any], says: str) -> None:
    with pytest.raises(p.ProtocolError, match=re.escape(says)):
        p.decode(msg)


def test_a_newer_client_talks_to_an_older_agent_until_it_uses_a_newer_field() -> None:
    """Fields added since (prefetch's wait_s, stats' tenant) stay out of the frame at their
    default, so an agent that does not know them still accepts it."""
    keys = ["a" * 32]
    assert "wait_s" not in p.encode(p.Prefetch(keys))
    assert p.encode(p.Prefetch(keys, None, 1.5))["wait_s"] == 1.5
    assert "tenant" not in p.encode(p.Stats())
    old = {f.name for f in dataclasses.fields(p.Prefetch)} - {"wait_s"}  # an older agent's
    assert set(p.encode(p.Prefetch(keys))) - {"op", "v"} <= old


def test_request_builds_the_typed_message_by_name() -> None:
    assert p.request("evict", key="k", token="t") == p.Evict("k", None, "t")
    with pytest.raises(p.ProtocolError):
        p.request("evict", kee="k")


def test_the_agent_answers_a_bad_frame_with_the_reason_and_keeps_serving(
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "a.yaml"
    sock_path = str(tmp_path / "a.sock")
    cfg.write_text(yaml.safe_dump({"node_id": "proto", "dram": {"capacity": "4MiB"},
                                   "agent": {"socket": sock_path}}))  # fmt: skip
    proc = spawn_agent(cfg, timeout=30, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sock_path)
            with pytest.raises(IPCError, match="lookup: missing field 'keys'"):
                call_sync(s, {"op": "lookup", "v": p.VERSION})
            with pytest.raises(IPCError, match="unknown op 'drop_all'"):
                call_sync(s, {"op": "drop_all"})
            assert call_sync(s, p.encode(p.Lookup([]))) == {"sources": [], "ok": True}
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(
    ("reply", "want"),
    [({"ok": True, "len": 5}, b"chunk"), ({"ok": True, "len": -1}, None),
     ({"ok": True, "data": b"chunk"}, b"chunk"), ({"ok": True, "data": None}, None)],
    ids=["raw", "raw-miss", "old-server", "old-server-miss"],
)  # fmt: skip
async def test_a_peer_reply_is_read_off_the_socket_in_either_form(
    reply: dict[str, typing.Any], want: bytes | None
) -> None:
    import asyncio

    from tiered_cache.agent.peers import _read_chunk
    from tiered_cache.ipc import pack

    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        b.sendall(pack(reply) + (b"chunk" if reply.get("len") == 5 else b""))
        got = await _read_chunk(asyncio.get_running_loop(), a)
        assert (None if got is None else bytes(got)) == want
    finally:
        a.close()
        b.close()


async def test_a_peer_announcing_a_huge_chunk_is_refused_before_any_allocation() -> None:
    import asyncio

    from tiered_cache.agent.peers import _read_chunk
    from tiered_cache.ipc import MAX_FRAME, pack

    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        b.sendall(pack({"ok": True, "len": MAX_FRAME + 1}))
        with pytest.raises(IPCError, match="announced a chunk"):
            await _read_chunk(asyncio.get_running_loop(), a)
    finally:
        a.close()
        b.close()
