"""Chunks between nodes: the peer server (this node's DRAM and NVMe over TCP) and the
puller (pooled connections to other nodes' agents)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from tiered_cache.agent.state import AgentState
from tiered_cache.ipc import (
    MAX_FRAME,
    IPCError,
    pack,
    read_msg,
    sock_read_msg,
    sock_recv_exact,
)

log = logging.getLogger("tiered_cache.agent")

PEER_CONNECTIONS = 4  # parallel chunk fetches per peer (the agent's get loads 8 at once)
# The peer server's stream buffer for requests (small; replies go out as raw bytes).
PEER_STREAM_LIMIT = 8 * 2**20


class PeerLink(AgentState):
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
        off the socket straight into its buffer (a stream reader would copy it thrice)."""
        sem = self._peer_sems.setdefault(node_id, asyncio.Semaphore(PEER_CONNECTIONS))
        idle = self._peer_idle.setdefault(node_id, [])
        loop = asyncio.get_running_loop()
        async with sem:
            for attempt in (0, 1):
                addr = await self._peer_address(node_id, refresh=attempt > 0)
                if addr is None:
                    return None
                sock = idle.pop() if idle else None
                try:
                    if sock is None:
                        sock = await asyncio.wait_for(_connect(loop, addr), 2.0)
                    t0 = time.perf_counter()
                    await loop.sock_sendall(sock, pack({"op": "fetch", "key": key, "raw": True}))
                    data = await asyncio.wait_for(_read_chunk(loop, sock), 30.0)
                    dt = time.perf_counter() - t0
                    idle.append(sock)
                    return None if data is None else (data, dt)
                except (OSError, EOFError, asyncio.TimeoutError, IPCError, ValueError):
                    # EOFError: the peer died mid-reply; ValueError: a garbled frame.
                    if sock is not None:
                        sock.close()
                    for s in idle:  # same peer, likely just as dead
                        s.close()
                    idle.clear()
                    if attempt:
                        raise
                except BaseException:  # cancelled mid-reply: the stream is unusable
                    if sock is not None:
                        sock.close()
                    raise
        return None

    async def _serve_peer(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:  # cancelled by stop(), like local clients' handlers
            self._local_tasks.add(me)
        try:
            while True:
                msg = await read_msg(r)
                if msg is None:
                    break
                data: bytes | bytearray | None = None
                key = msg.get("key")
                if msg.get("op") == "fetch" and isinstance(key, str):
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
                await w.drain()
        except asyncio.CancelledError:
            pass  # the agent is stopping (see _serve_local)
        except Exception:
            log.exception("peer connection failed")
        finally:
            w.close()
            if me is not None:
                self._local_tasks.discard(me)


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
    n = head.get("len")
    if type(n) is int:
        if n > MAX_FRAME:
            raise IPCError(f"peer announced a chunk of {n} bytes")
        return None if n < 0 else await sock_recv_exact(loop, sock, n)
    data = head.get("data")  # a server from before raw replies
    return bytearray(data) if isinstance(data, bytes) else None
