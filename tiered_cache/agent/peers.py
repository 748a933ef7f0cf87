"""Chunks between nodes: the peer server (this node's DRAM and NVMe over TCP) and the
puller (pooled connections to other nodes' agents)."""

from __future__ import annotations

import asyncio
import logging
import time

from tiered_cache.agent.state import AgentState
from tiered_cache.ipc import IPCError, pack, read_msg

log = logging.getLogger("tiered_cache.agent")

PEER_CONNECTIONS = 4  # parallel chunk fetches per peer (the agent's get loads 8 at once)
# Stream buffer for peer frames: with asyncio's 64 KiB default a multi-MiB chunk is read
# through dozens of pause/resume cycles of the transport.
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

    async def _peer_fetch(self, key: str, node_id: str) -> tuple[bytes, float] | None:
        """One chunk from a peer's DRAM/NVMe: (encoded bytes, wire seconds), or None.

        Up to ``PEER_CONNECTIONS`` fetches per peer run at once, each on its own pooled
        connection, so the chunks of one request arrive in parallel."""
        sem = self._peer_sems.setdefault(node_id, asyncio.Semaphore(PEER_CONNECTIONS))
        idle = self._peer_idle.setdefault(node_id, [])
        async with sem:
            for attempt in (0, 1):
                addr = await self._peer_address(node_id, refresh=attempt > 0)
                if addr is None:
                    return None
                conn = idle.pop() if idle else None
                try:
                    if conn is None:
                        conn = await asyncio.wait_for(
                            asyncio.open_connection(*addr, limit=PEER_STREAM_LIMIT), 2.0
                        )
                    r, w = conn
                    t0 = time.perf_counter()
                    w.write(pack({"op": "fetch", "key": key}))
                    await w.drain()
                    msg = await asyncio.wait_for(read_msg(r), 30.0)
                    if msg is None:
                        raise ConnectionError("peer closed")
                    dt = time.perf_counter() - t0
                    idle.append(conn)
                    data = msg.get("data")
                    return (data, dt) if isinstance(data, bytes) else None
                except (OSError, EOFError, asyncio.TimeoutError, IPCError, ValueError):
                    # EOFError: the peer died mid-reply; ValueError: a garbled frame.
                    if conn is not None:
                        conn[1].close()
                    for _, w in idle:  # same peer, likely just as dead
                        w.close()
                    idle.clear()
                    if attempt:
                        raise
                except BaseException:  # cancelled mid-reply: the stream is unusable
                    if conn is not None:
                        conn[1].close()
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
