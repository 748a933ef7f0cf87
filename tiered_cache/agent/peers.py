"""Chunks between nodes: the peer server (this node's DRAM and NVMe over TCP) and the
puller (pooled connections to other nodes' agents).

The peer port is guarded (docs/operations.md, "Peer port security"): with
``agent.peer_secret`` every connection opens with a mutual HMAC-SHA256 handshake over both
sides' nonces, and the server closes connections that fail it, stay idle, announce an
oversized request, or come beyond ``agent.peer_max_connections``.

Handshake (client = puller, server = peer port), frames as everywhere else (``ipc``):
  client -> ``{"op": "auth", "v": 1, "nonce": Nc}``
  server -> ``{"ok": true, "nonce": Ns, "mac": HMAC(K, "...server" 0 Nc Ns)}``
  client -> ``{"op": "auth_proof", "mac": HMAC(K, "...client" 0 Nc Ns)}``, then requests.
Each side proves the key over the other's fresh nonce; the role label keeps one side's
MAC from serving as the other's. It authenticates the connection, it does not encrypt it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any, TypeGuard

import msgpack

from tiered_cache import codec
from tiered_cache.agent.state import AgentState
from tiered_cache.hierarchy.remote import PROBE_KEY
from tiered_cache.hierarchy.types import PeerSkipped
from tiered_cache.ipc import (
    MAX_FRAME,
    FrameTooLarge,
    IPCError,
    pack,
    read_msg,
    sock_read_msg,
    sock_recv_exact,
)
from tiered_cache.keys import is_valid_key
from tiered_cache.logthrottle import LogThrottle
from tiered_cache.netaddr import _is_loopback

if TYPE_CHECKING:
    from tiered_cache.config import AgentConfig
    from tiered_cache.metrics import Metrics

log = logging.getLogger("tiered_cache.agent")

PEER_CONNECTIONS = 4  # parallel chunk fetches per peer (the agent's get loads 8 at once)
# The peer server's stream buffer: requests are a key each (replies go out as raw bytes),
# and a connection that sends more than this (x2) unread is paused, not buffered.
PEER_STREAM_LIMIT = 64 * 2**10
PEER_MAX_REQUEST = 2**20  # a request frame announcing more is refused unread
HANDSHAKE_MAX_FRAME = 1024
HANDSHAKE_VERSION = 1
NONCE_BYTES = 32
_LABEL = b"tiered-cache peer handshake v1 "
SERVER, CLIENT = b"server", b"client"

# Why the server closed a connection (the ``reason`` label of
# tiered_cache_peer_connections_closed_total), and what its log line says.
_WHY = {
    "auth_failed": "it failed the handshake (no agent.peer_secret, or another one)",
    "handshake_timeout": "no handshake within agent.peer_handshake_timeout_s",
    "over_cap": "agent.peer_max_connections connections were open",
    "frame_too_large": f"it announced a frame over {PEER_MAX_REQUEST} bytes",
    "bad_frame": "it sent a malformed frame",
    "idle_timeout": "no complete request within agent.peer_idle_timeout_s",
}


class PeerAuthError(IPCError):
    """The peer and this node could not authenticate each other: a failed fetch."""


class _Close(Exception):
    """Close this peer connection; ``reason`` is a key of ``_WHY``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def peer_mac(secret: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What ``role`` (SERVER or CLIENT) sends to prove it holds ``secret``."""
    return hmac.digest(secret, _LABEL + role + b"\0" + client_nonce + server_nonce, "sha256")


def _is_nonce(v: object) -> TypeGuard[bytes]:
    return isinstance(v, bytes) and len(v) == NONCE_BYTES


def _secret(cfg: AgentConfig) -> bytes | None:
    s = cfg.peer_secret
    return None if s is None else s.get_secret_value().encode()


def chunk_mac_key(cfg: AgentConfig) -> bytes | None:
    """The key chunks are signed with (``codec.chunk_mac_key`` of ``agent.peer_secret``),
    or None without a secret: then chunks carry no MAC and none is checked."""
    s = _secret(cfg)
    return None if s is None else codec.chunk_mac_key(s)


async def peer_handshake(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, secret: bytes
) -> None:
    """The puller's side of the handshake on a fresh connection; PeerAuthError if the
    server does not prove it holds ``secret`` (nothing is requested from it then)."""
    nc = os.urandom(NONCE_BYTES)
    await loop.sock_sendall(sock, pack({"op": "auth", "v": HANDSHAKE_VERSION, "nonce": nc}))
    reply = await sock_read_msg(loop, sock, HANDSHAKE_MAX_FRAME)
    if not reply.get("ok"):
        raise PeerAuthError(f"peer refused the handshake: {reply.get('error', 'no reason')}")
    ns, mac = reply.get("nonce"), reply.get("mac")
    if not (
        _is_nonce(ns)
        and isinstance(mac, bytes)
        and hmac.compare_digest(mac, peer_mac(secret, SERVER, nc, ns))
    ):
        raise PeerAuthError("peer failed the handshake: its agent.peer_secret differs")
    await loop.sock_sendall(
        sock, pack({"op": "auth_proof", "mac": peer_mac(secret, CLIENT, nc, ns)})
    )


class PeerGate:
    """The peer server's admission: the connection cap, timeouts, and a count (and a
    rate-limited log line) for every connection it closes."""

    def __init__(self, cfg: AgentConfig, metrics: Metrics) -> None:
        self.secret = _secret(cfg)
        self.max_connections = cfg.peer_max_connections
        self.handshake_timeout = cfg.peer_handshake_timeout_s
        self.idle_timeout = cfg.peer_idle_timeout_s
        self._metrics = metrics
        self._open: dict[asyncio.Task[Any], str] = {}  # -> peer address; oldest first
        self._pending: set[asyncio.Task[Any]] = set()  # not yet through the handshake
        self._log = LogThrottle(log)  # one line per refusal reason a minute

    def admit(self, task: asyncio.Task[Any], peer: str) -> bool:
        """Whether ``task``'s connection may proceed. At the cap, the oldest connection
        still in its handshake makes room (so sockets opened without the secret cannot
        lock authenticated peers out); with none, the new one is refused."""
        if len(self._open) >= self.max_connections:
            victim = next((t for t in self._open if t in self._pending), None)
            if victim is None:
                self.closed("over_cap", peer)
                return False
            self.closed("over_cap", self._open.pop(victim))
            self._pending.discard(victim)
            victim.cancel()
        self._open[task] = peer
        if self.secret is not None:
            self._pending.add(task)
        return True

    def authenticated(self, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)

    def release(self, task: asyncio.Task[Any]) -> None:
        self._open.pop(task, None)
        self._pending.discard(task)

    def closed(self, reason: str, peer: str) -> None:
        self._metrics.peer_connections_closed.labels(reason).inc()
        if reason == "idle_timeout":  # pooled connections of quiet peers: routine
            log.debug("peer port: closed %s: %s", peer, _WHY[reason])
            return
        self._log.log(
            reason,
            logging.WARNING,
            "peer port: closed a connection from %s: %s",
            peer,
            _WHY[reason],
        )


async def _frame(
    r: asyncio.StreamReader, max_frame: int, timeout: float, why: str
) -> dict[str, Any] | None:
    """The next frame (None at end of stream) within ``timeout`` (else _Close(why))."""
    try:
        return await asyncio.wait_for(read_msg(r, max_frame), timeout)
    except asyncio.TimeoutError:
        raise _Close(why) from None
    except FrameTooLarge:
        raise _Close("frame_too_large") from None
    except asyncio.IncompleteReadError:  # closed mid-frame
        return None
    except (IPCError, ValueError, TypeError, msgpack.UnpackException):
        raise _Close("bad_frame") from None


class PeerLink(AgentState):
    _peer_gate: PeerGate

    # ---------------------------------------------------------------- peers

    async def _peer_address(self, node_id: str, refresh: bool) -> tuple[str, int] | None:
        """The peer's TCP address, asking the directory only when not known or ``refresh``
        (after a failure: the peer may have restarted on another port)."""
        if refresh or node_id not in self._peer_addrs:
            info = (await self.directory.nodes()).get(node_id)
            if not info or not info.get("peer"):
                self._peer_addrs.pop(node_id, None)
                return None
            host, port = info["peer"]
            self._peer_addrs[node_id] = (str(host), int(port))
        return self._peer_addrs[node_id]

    async def _peer_fetch(self, key: str, node_id: str) -> tuple[bytearray, float] | None:
        """One chunk from a peer's DRAM/NVMe: (encoded bytes, wire seconds), or None.

        Up to ``PEER_CONNECTIONS`` fetches per peer run at once, each on its own pooled
        connection, so the chunks of one request arrive in parallel. The chunk is read
        off the socket straight into its buffer (a stream reader would copy it thrice).
        A new connection first passes the handshake when ``agent.peer_secret`` is set;
        one that fails it raises PeerAuthError (the store counts a miss)."""
        sem = self._peer_sems.setdefault(node_id, asyncio.Semaphore(PEER_CONNECTIONS))
        idle = self._peer_idle.setdefault(node_id, [])
        loop = asyncio.get_running_loop()
        secret = _secret(self.cfg.agent)
        async with sem:
            if key != PROBE_KEY and self.store.peer_down(node_id):
                # It failed while this fetch queued for a connection: don't wait on it too.
                raise PeerSkipped(node_id)
            for attempt in (0, 1):
                addr = await self._peer_address(node_id, refresh=attempt > 0)
                if addr is None:
                    return None
                sock = _pooled(idle)
                try:
                    if sock is None:
                        sock = await asyncio.wait_for(_connect(loop, addr), 2.0)
                        if secret is not None:
                            await asyncio.wait_for(
                                peer_handshake(loop, sock, secret),
                                self.cfg.agent.peer_handshake_timeout_s,
                            )
                    t0 = time.perf_counter()
                    await loop.sock_sendall(sock, pack({"op": "fetch", "key": key, "raw": True}))
                    data = await asyncio.wait_for(
                        _read_chunk(loop, sock), self.cfg.agent.peer_fetch_timeout_s
                    )
                    dt = time.perf_counter() - t0
                    idle.append(sock)
                    return None if data is None else (data, dt)
                except PeerAuthError:  # a retry would meet the same secret
                    if sock is not None:
                        sock.close()
                    raise
                except (OSError, EOFError, asyncio.TimeoutError, IPCError, ValueError) as e:
                    # EOFError: the peer died mid-reply; ValueError: a garbled frame.
                    if sock is not None:
                        sock.close()
                    for s in idle:  # same peer, likely just as dead
                        s.close()
                    idle.clear()
                    # A stale pooled connection or a moved peer deserves a second try; a
                    # peer that let the timeout pass would only hang again.
                    if attempt or isinstance(e, asyncio.TimeoutError):
                        raise
                except BaseException:  # cancelled mid-reply: the stream is unusable
                    if sock is not None:
                        sock.close()
                    raise
        return None

    async def _start_peer_server(self) -> asyncio.base_events.Server:
        """The peer port's server (bound and serving), guarded by a ``PeerGate``."""
        a = self.cfg.agent
        self._peer_gate = PeerGate(a, self.metrics)
        if self._peer_gate.secret is None and self.cfg.redis_url and not _is_loopback(a.peer_host):
            log.warning(
                "peer port %s:%s is unauthenticated: anyone who reaches it can read this"
                " node's chunks. Set agent.peer_secret (the same on every node, e.g."
                " ${TC_PEER_SECRET}) to require a handshake; see docs/operations.md.",
                a.peer_host,
                a.peer_port,
            )
        return await asyncio.start_server(
            self._serve_peer, a.peer_host, a.peer_port, limit=PEER_STREAM_LIMIT
        )

    async def _serve_peer(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        gate = self._peer_gate
        me = asyncio.current_task()
        name = w.get_extra_info("peername")
        peer = f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name)
        if me is None or not gate.admit(me, peer):
            w.close()
            return
        self._local_tasks.add(me)  # cancelled by stop(), like local clients' handlers
        try:
            if gate.secret is not None:
                await self._peer_accept_handshake(r, w, gate)
                gate.authenticated(me)
            while True:
                msg = await _frame(r, PEER_MAX_REQUEST, gate.idle_timeout, "idle_timeout")
                if msg is None:
                    break
                await self._peer_answer(msg, w, gate.secret is not None)
                try:
                    await asyncio.wait_for(w.drain(), gate.idle_timeout)
                except asyncio.TimeoutError:  # it stopped reading replies
                    raise _Close("idle_timeout") from None
        except _Close as c:
            gate.closed(c.reason, peer)
        except asyncio.CancelledError:
            pass  # the agent is stopping (see _serve_local), or the cap made room
        except ConnectionError:
            pass  # the peer went away mid-reply
        except Exception:
            log.exception("peer connection failed")
        finally:
            gate.release(me)
            w.close()
            self._local_tasks.discard(me)

    async def _peer_accept_handshake(
        self, r: asyncio.StreamReader, w: asyncio.StreamWriter, gate: PeerGate
    ) -> None:
        """The server's side of the handshake, within ``peer_handshake_timeout_s`` in all;
        _Close unless the client proves it holds the secret (and then nothing is served)."""
        assert gate.secret is not None
        deadline = time.monotonic() + gate.handshake_timeout

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        hello = await _frame(r, HANDSHAKE_MAX_FRAME, left(), "handshake_timeout")
        ok = hello is not None and hello.get("op") == "auth" and hello.get("v") == HANDSHAKE_VERSION
        nc = hello.get("nonce") if hello is not None and ok else None
        if _is_nonce(nc):
            ns = os.urandom(NONCE_BYTES)
            w.write(pack({"ok": True, "nonce": ns, "mac": peer_mac(gate.secret, SERVER, nc, ns)}))
            proof = await _frame(r, HANDSHAKE_MAX_FRAME, left(), "handshake_timeout")
            mac = proof.get("mac") if proof and proof.get("op") == "auth_proof" else None
            if isinstance(mac, bytes) and hmac.compare_digest(
                mac, peer_mac(gate.secret, CLIENT, nc, ns)
            ):
                return
        if not w.is_closing():  # a clear answer for a puller of ours without the secret
            w.write(pack({"ok": False, "error": "peer authentication failed (agent.peer_secret)"}))
        raise _Close("auth_failed")

    async def _peer_answer(
        self, msg: dict[str, Any], w: asyncio.StreamWriter, authenticated: bool
    ) -> None:
        """Write the reply to one request (a fetch: the chunk from DRAM or NVMe)."""
        data: bytes | bytearray | None = None
        key = msg.get("key")
        if msg.get("op") == "auth" and not authenticated:  # a puller with a secret
            w.write(pack({"ok": False, "error": "this agent has no agent.peer_secret"}))
            return
        # A malformed key is a miss: the tiers would raise on it, and one bad frame must
        # cost neither the connection nor a logged traceback.
        if msg.get("op") == "fetch" and is_valid_key(key):
            for slot in self.store.slots:
                if slot.name == "s3":
                    continue  # peers read S3 themselves
                if (await slot.tier.contains_many([key]))[0]:
                    data = await slot.tier.get(key)
                    if data is not None:
                        self.metrics.peer_transfers.labels("out").inc()
                        break
        if msg.get("raw"):  # the reply frame, then the chunk as it is
            w.write(pack({"ok": True, "len": -1 if data is None else len(data)}))
            if data is not None:
                w.write(data)
        else:  # a puller from before raw replies
            w.write(pack({"ok": True, "data": data}))


def _pooled(idle: list[socket.socket]) -> socket.socket | None:
    """An idle pooled connection the peer has not closed meanwhile (its idle timeout), or
    None: a closed one would cost the fetch a failed attempt."""
    while idle:
        sock = idle.pop()
        try:
            sock.recv(1, socket.MSG_PEEK)  # b"": closed; bytes: out of step
        except BlockingIOError:
            return sock  # nothing to read: open and in step
        except OSError:
            pass
        sock.close()
    return None


async def _connect(loop: asyncio.AbstractEventLoop, addr: tuple[str, int]) -> socket.socket:
    """A non-blocking TCP connection to a peer (host names resolved off the loop)."""
    host, port = addr
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    err: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, sockaddr)
            return sock
        except OSError as e:
            sock.close()
            err = e
        except BaseException:  # timed out or cancelled mid-connect
            sock.close()
            raise
    raise err or OSError(f"no address for {host}:{port}")


async def _read_chunk(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytearray | None:
    """A peer's reply to a raw fetch: the chunk, or None when it does not hold it."""
    head = await sock_read_msg(loop, sock)
    if head.get("ok") is False:  # e.g. it wants the handshake this node cannot do
        raise PeerAuthError(f"peer refused the fetch: {head.get('error', 'no reason')}")
    n = head.get("len")
    if type(n) is int:
        if n > MAX_FRAME:
            raise IPCError(f"peer announced a chunk of {n} bytes")
        return None if n < 0 else await sock_recv_exact(loop, sock, n)
    data = head.get("data")  # a server from before raw replies
    return bytearray(data) if isinstance(data, bytes) else None
