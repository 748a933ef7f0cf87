"""A consumer of KV events: which leading blocks of a prompt some tier holds, learnt from
the agents' event streams instead of asked per request (the router's ``lookup: events``).

Events name blocks by vLLM's hashes, which a router cannot compute (they are seeded per
engine), so the index keys each block by what it can compute: its parent's hash, a hash of
its tokens, and its extra keys (the cache salt, on the first block). A prompt is walked
block by block from the start: ``(None, tokens[0:bs], salt) -> h0``, ``(h0, tokens[bs:2bs])
-> h1``, ... as long as some tier holds the block. That is block granularity: unlike the
agent's lookup, the index does not see a chunk's partial tail to the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from array import array
from collections import Counter
from collections.abc import Sequence
from typing import Any

import xxhash
import zmq
import zmq.asyncio

from tiered_cache.kv_events.wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)

log = logging.getLogger("tiered_cache.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_Key = tuple[str, BlockHash | None, int, Any]  # (model, parent, tokens' hash, extra keys)


def model_of_topic(topic: bytes) -> str:
    """The model a topic names in llm-d's convention, ``kv@<pod>@<model>``; "" otherwise
    (the publisher serves one model, or does not say)."""
    parts = topic.decode(errors="replace").split("@", 2)
    return parts[2] if len(parts) == 3 and parts[0] == "kv" else ""


def _tokens_hash(tokens: Sequence[int]) -> int:
    return int(xxhash.xxh3_64_intdigest(array("I", tokens).tobytes()))


class BlockIndex:
    """Blocks announced by each source (a publisher), and where they are."""

    def __init__(self) -> None:
        self.block_size = 0  # from the events (vLLM's KV block size)
        self._child: dict[_Key, BlockHash] = {}
        self._key_of: dict[BlockHash, _Key] = {}
        # block -> (source, ownership) -> announced copies
        self._where: dict[BlockHash, Counter[tuple[str, str]]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def apply(self, source: str, batch: KVEventBatch, model: str = "") -> None:
        """Take one batch from ``source``; ``model``: the model its topic names ("": any).
        vLLM's hashes do not name the model: the same tokens hash alike in every one."""
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(source, ev, model)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._drop(h, (source, str(ev.ownership)))
            elif isinstance(ev, AllBlocksCleared):
                self.clear(source)

    def _stored(self, source: str, ev: BlockStored, model: str) -> None:
        bs = ev.block_size
        if bs <= 0 or len(ev.token_ids) < bs * len(ev.block_hashes):
            return  # a placeholder (vLLM's for shapes it cannot describe): not joinable
        self.block_size = bs
        parent = ev.parent_block_hash
        where = (source, str(ev.ownership))
        for j, h in enumerate(ev.block_hashes):
            extra = ev.extra_keys[j] if ev.extra_keys else None
            key: _Key = (model, parent, _tokens_hash(ev.token_ids[j * bs : (j + 1) * bs]),
                         tuple(extra) if extra else None)  # fmt: skip
            self._child[key] = h
            self._key_of[h] = key
            self._where.setdefault(h, Counter())[where] += 1
            parent = h

    def _drop(self, h: BlockHash, where: tuple[str, str]) -> None:
        c = self._where.get(h)
        if c is None or not c[where]:
            return
        c[where] -= 1
        if c[where] <= 0:
            del c[where]
        if not c:
            del self._where[h]
            key = self._key_of.pop(h, None)
            if key is not None and self._child.get(key) == h:
                del self._child[key]

    def clear(self, source: str) -> None:
        for h in [h for h, c in self._where.items() if any(s == source for s, _ in c)]:
            for w in [w for w in self._where[h] if w[0] == source]:
                self._where[h][w] = 1
                self._drop(h, w)

    def cached_blocks(self, tokens: Sequence[int], salt: str | None = None, model: str = "") -> int:
        """How many leading full blocks of ``tokens`` some tier holds: of ``model``'s, or of
        publishers that name no model."""
        n = self._walk(tokens, salt, model)
        return max(n, self._walk(tokens, salt, "")) if model else n

    def _walk(self, tokens: Sequence[int], salt: str | None, model: str) -> int:
        bs = self.block_size
        if bs <= 0:
            return 0
        parent: BlockHash | None = None
        n = 0
        for j in range(len(tokens) // bs):
            extra = (salt,) if j == 0 and salt else None
            h = self._child.get(
                (model, parent, _tokens_hash(tokens[j * bs : (j + 1) * bs]), extra)
            )
            if h is None or h not in self._where:
                break
            parent = h
            n += 1
        return n


class EventSubscriber:
    """Follows one publisher (vLLM's protocol) into a ``BlockIndex``: subscribes, catches
    up by a replay from 0 (a snapshot once the buffer has rotated), and replays whenever a
    sequence number is skipped."""

    def __init__(self, index: BlockIndex, endpoint: str, replay_endpoint: str | None) -> None:
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.source = endpoint
        self.last_seq = -1
        self.batches = 0
        self._ctx = zmq.asyncio.Context()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        backoff = 0.5
        while True:  # a failure restarts the subscription (the index stays meanwhile)
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV event subscription to %s failed; again in %.1f s",
                              self.endpoint, backoff)  # fmt: skip
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def _follow(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        # Each (re)connection starts with a replay from 0: after an agent restart its
        # numbering starts over and its start snapshot may have gone out while this
        # socket was away, so what came before says nothing about the new run.
        mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if mon in ready:
                    await mon.recv_multipart()
                    self.last_seq = -1
                    await self._replay(0)
                if sub not in ready:
                    continue
                topic, seq_b, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_b, "big")
                if seq < self.last_seq - 1 and seq <= 1:  # numbering started over
                    self.last_seq = -1
                    await self._replay(0)
                if seq <= self.last_seq:
                    continue  # had it by replay
                if seq > self.last_seq + 1:
                    await self._replay(self.last_seq + 1)
                    if seq <= self.last_seq:
                        continue
                self._apply(seq, payload, topic)
        finally:
            sub.disable_monitor()
            mon.close(linger=0)
            sub.close(linger=0)

    def _apply(self, seq: int, payload: bytes, topic: bytes = b"") -> None:
        try:
            self.index.apply(self.source, decode_batch(payload), model_of_topic(topic))
        except Exception as e:  # a batch we cannot read: skipped, the rest still counts
            log.warning("undecodable KV event batch %d from %s: %r", seq, self.endpoint, e)
        self.last_seq = max(self.last_seq, seq)
        self.batches += 1

    async def _replay(self, start: int, timeout_s: float = 5.0) -> None:
        if self.replay_endpoint is None:
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                self._apply(int.from_bytes(frames[2], "big"), frames[3], frames[1])
        except asyncio.TimeoutError:
            log.warning("KV event replay from %s timed out", self.replay_endpoint)
        finally:
            sock.close(linger=0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._ctx.term()
