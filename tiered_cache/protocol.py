"""The node agent's local protocol: one typed message per operation.

Frames are length-prefixed msgpack maps (``tiered_cache.ipc``). A request is
``{"op": NAME, "v": VERSION, <its fields>}``; the reply is a map with ``"ok": true`` and
the operation's result, or ``"ok": false`` with ``"error"`` (and ``"kind"``: ``auth``,
``pin_refused``, ``protocol``). Chunk bytes never travel in these frames locally: they go
through the shared-memory DRAM pool, and frames carry slot numbers (the exceptions, for
chunks that fit nowhere in DRAM or an agent with no DRAM tier: ``put``, and ``get`` replies,
bounded per reply, the rest answered ``later``).

``decode`` checks what the agent receives (an unknown operation, a field that is missing,
extra or of the wrong type is a ``ProtocolError`` naming it); clients build requests with
the dataclasses below (``AgentClient``: sync; ``agent_call``: async, for the CLI and the
dashboard). ``VERSION`` changes when a field changes meaning.

Admin operations (``pin_add``, ``pin_rm``, ``evict``, ``flush``, ``warm``, ``clear``) carry
the agent's token when it has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from tiered_cache.ipc import IPCError, pack, read_msg

VERSION = 2


class ProtocolError(ValueError):
    """A request the agent cannot take: unknown operation, missing or bad field."""


@dataclass(frozen=True)
class Request:
    op: ClassVar[str]
    noreply: ClassVar[bool] = False  # one-way: the agent sends nothing back


# -- chunk data path (connectors)


@dataclass(frozen=True)
class Hello(Request):
    """The agent's identity and its DRAM pool's layout (for attaching it). ``client``:
    which kind of client this connection is (``CLIENT_KINDS``), for per-client counters."""

    op = "hello"
    client: str = ""


# Kinds of client the agent counts loads and load failures for (any other: "other").
CLIENT_KINDS = ("vllm", "lmcache_mp", "lmcache_plugin")


@dataclass(frozen=True)
class Lookup(Request):
    """Source of each leading loadable chunk; ``priced``: with expected load seconds."""

    op = "lookup"
    keys: list[str]
    priced: bool = False
    nbytes: int = 0
    fresh: bool = False  # ask the directory and S3 about recent misses too


@dataclass(frozen=True)
class Present(Request):
    """Each key on its own (no prefix rule): [source, expected seconds] or None."""

    op = "present"
    keys: list[str]
    nbytes: int = 0


@dataclass(frozen=True)
class Alias(Request):
    """Name the block-aligned prefixes of whole chunks: ``aliases[i]`` are keys of
    prefixes of ``targets[i]`` (a partial chunk's keys, ``keys.partial_keys``). ``present``
    answers an alias with its target, which a prompt that diverges inside the chunk loads
    the first blocks of. Local to the agent; fire-and-forget."""

    op = "alias"
    noreply = True
    targets: list[str]
    aliases: list[list[str]]


@dataclass(frozen=True)
class Describe(Request):
    """What vLLM calls the blocks of chunks this client saves or loads, for the agent's
    KV events (``tiered_cache.kv_events``): per chunk, the hashes of its full blocks, the
    hash of the block before them, and their tokens (uint32, little endian); ``extra_keys``
    per chunk, one entry per block, as vLLM publishes them. Sent only to an agent whose
    hello says ``kv_events``; fire-and-forget."""

    op = "describe"
    noreply = True
    keys: list[str]
    hashes: list[list[int | bytes]]
    parents: list[int | bytes | None]
    tokens: list[bytes]
    block_size: int
    model: str = ""
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None


@dataclass(frozen=True)
class Prefetch(Request):
    """Copy chunks that live below DRAM or on other nodes into DRAM, in the background;
    with ``wait_s``, reply once they have landed (or their copies failed), at most then."""

    op = "prefetch"
    keys: list[str]
    fp: bytes | None = None
    wait_s: float = 0.0


@dataclass(frozen=True)
class Locate(Request):
    """Nodes holding each key in DRAM or NVMe (cache-aware routing)."""

    op = "locate"
    keys: list[str]


@dataclass(frozen=True)
class Get(Request):
    """Lease each key in DRAM (promoting it first): slot and length, or the bytes."""

    op = "get"
    keys: list[str]
    fp: bytes | None = None


@dataclass(frozen=True)
class Touch(Request):
    """Chunks a client read straight from the pool: ``[key, bytes, tokens]`` each."""

    op = "touch"
    noreply = True
    hits: list[list[Any]]


@dataclass(frozen=True)
class Release(Request):
    """Leases a ``get`` took."""

    op = "release"
    noreply = True
    slots: list[int]


@dataclass(frozen=True)
class Reserve(Request):
    """One DRAM run per size, for the client to fill (None where refused)."""

    op = "reserve"
    sizes: list[int]


@dataclass(frozen=True)
class Commit(Request):
    """Publish filled runs: ``[key, slot, length, parent, position]`` each. ``refill``:
    how many free runs to hand back for the next put."""

    op = "commit"
    items: list[list[Any]]
    wait: bool = False
    refill: int = 0


@dataclass(frozen=True)
class Abort(Request):
    op = "abort"
    slots: list[int]


@dataclass(frozen=True)
class Put(Request):
    """An encoded chunk inline (one that fits no DRAM run)."""

    op = "put"
    key: str
    data: bytes
    wait: bool = False


@dataclass(frozen=True)
class RegisterModel(Request):
    """A vLLM connector's fingerprint (``ModelRegistration`` fields)."""

    op = "register_model"
    model: dict[str, Any]


# -- operators (CLI, dashboard, router)


@dataclass(frozen=True)
class Stats(Request):
    op = "stats"
    tenant: str = ""  # only this tenant's figures (``tenancy``); older clients send none


@dataclass(frozen=True)
class Nodes(Request):
    op = "nodes"


@dataclass(frozen=True)
class Counters(Request):
    op = "counters"


@dataclass(frozen=True)
class Models(Request):
    op = "models"


@dataclass(frozen=True)
class Ls(Request):
    op = "ls"
    prefix: str = ""
    limit: int = 1000
    tenant: str = ""  # only this tenant's chunks


@dataclass(frozen=True)
class PinLs(Request):
    op = "pin_ls"


@dataclass(frozen=True)
class PinAdd(Request):
    op = "pin_add"
    pin: dict[str, Any]
    chunk_bytes: int = 0
    token: str | None = None


@dataclass(frozen=True)
class PinRm(Request):
    op = "pin_rm"
    id: str
    token: str | None = None


@dataclass(frozen=True)
class Evict(Request):
    op = "evict"
    key: str
    tiers: list[str] | None = None
    token: str | None = None


@dataclass(frozen=True)
class Flush(Request):
    op = "flush"
    token: str | None = None


@dataclass(frozen=True)
class Warm(Request):
    op = "warm"
    id: str
    token: str | None = None


@dataclass(frozen=True)
class Clear(Request):
    op = "clear"
    tier: str
    include_pinned: bool = False
    token: str | None = None


ADMIN: frozenset[type[Request]] = frozenset({PinAdd, PinRm, Evict, Flush, Warm, Clear})

REQUESTS: dict[str, type[Request]] = {
    cls.op: cls
    for cls in (
        Hello, Lookup, Present, Alias, Describe, Prefetch, Locate, Get, Touch, Release, Reserve, Commit,
        Abort, Put, RegisterModel, Stats, Nodes, Counters, Models, Ls, PinLs, PinAdd, PinRm,
        Evict, Flush, Warm, Clear,
    )
}  # fmt: skip


def encode(req: Request) -> dict[str, Any]:
    """The frame's map for ``req``. Optional fields at their default are left out (decode
    fills them in), so a client that knows a newer field still talks to an older agent
    as long as it does not use it (a rolling upgrade)."""
    msg = {
        f.name: getattr(req, f.name)
        for f in dataclasses.fields(req)
        if f.default is dataclasses.MISSING
        or f.default_factory is not dataclasses.MISSING
        or getattr(req, f.name) != f.default
    }
    msg["op"], msg["v"] = req.op, VERSION
    if req.noreply:
        msg["noreply"] = True
    return msg


def request(op: str, **fields: Any) -> Request:
    """``request("evict", key=k)``: the typed request for an operation named at run time
    (``AgentClient.admin``, the CLI), checked like ``decode`` checks a frame."""
    return decode({"op": op, **fields})


def decode(msg: dict[str, Any]) -> Request:
    """The typed request in a received frame; ``ProtocolError`` naming what is wrong."""
    op = msg.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None or not isinstance(op, str):
        raise ProtocolError(f"unknown op {op!r}")
    v = msg.get("v", VERSION)
    if v != VERSION:
        raise ProtocolError(f"{op}: protocol version {v!r}, this agent speaks {VERSION}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in msg:
            kwargs[f.name] = _check(op, f.name, msg[f.name], hints[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{op}: missing field {f.name!r}")
    extra = set(msg) - set(hints) - {"op", "v", "noreply"}
    if extra:
        raise ProtocolError(f"{op}: unknown field(s) {', '.join(sorted(extra))}")
    return cls(**kwargs)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _check(op: str, name: str, value: Any, hint: Any) -> Any:
    if not _matches(value, hint):
        raise ProtocolError(f"{op}: field {name!r} must be {_show(hint)}, got {type(value).__name__}")
    return value


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(x, item) for x in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is bytes:
        return isinstance(value, bytes | bytearray)
    return isinstance(value, hint)


def _show(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


async def agent_call(path: str, req: Request, timeout: float = 30.0) -> dict[str, Any]:
    """One request to a node agent over its unix socket (no shared-memory attach): the
    async client, for the CLI and the dashboard."""
    try:
        r, w = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise AgentUnreachable(f"no node agent at {path} ({type(e).__name__})") from None
    try:
        w.write(pack(encode(req)))
        await w.drain()
        reply = await asyncio.wait_for(read_msg(r), timeout)
    finally:
        w.close()
        with contextlib.suppress(Exception):
            await w.wait_closed()
    if reply is None:
        raise IPCError(f"agent at {path} closed the connection")
    if not reply.get("ok"):
        raise IPCError(str(reply.get("error", "unknown error")))
    return reply


class AgentUnreachable(IPCError):
    """Nothing answers on the agent's socket."""


