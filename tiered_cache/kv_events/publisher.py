"""vLLM's KV event transport, on the agent's event loop: a ZMQ PUB socket sends each batch
as ``(topic, seq, payload)`` (``seq`` 8 bytes big endian, from 0), and a ROUTER socket
answers replay requests ``(identity, b"", start_seq)`` with the buffered batches from
``start_seq`` on, then ``(identity, b"", b"", -1, b"")``. That is ``ZmqEventPublisher``'s
protocol (vllm/distributed/kv_events.py), so vLLM's subscribers and llm-d's work as they are.

Differences, each because the agent is not an engine:
- Batches are not engine steps: events wait at most ``flush_s`` (or until ``batch_events``
  have queued), then go as one batch per topic, from the loop once the request that
  emitted them has been answered.
- A replay from before the oldest buffered batch (a consumer that joined late or fell far
  behind) is answered with a snapshot: ``AllBlocksCleared`` and a ``BlockStored`` per chunk
  per tier, as of the latest published ``seq`` (every page carries that ``seq``), then the
  end marker. The consumer goes on with the batches after it.
- Memory is bounded with no subscriber: PUB drops at its high-water mark, the replay buffer
  keeps ``buffer_steps`` batches of at most ``batch_events`` events each, and events wait
  for at most one flush. A replay request longer than its 3 small frames closes that peer's
  connection (ZMQ_MAXMSGSIZE); a malformed one is refused with the end marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from tiered_cache.kv_events.wire import KVEvent, KVEventBatch, encode_batch
from tiered_cache.logthrottle import LogThrottle
from tiered_cache.metrics import Metrics

log = logging.getLogger("tiered_cache.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_REQUEST_BYTES = 64  # a replay request's largest frame (its identity; the seq is 8)

Snapshot = Callable[[], list[tuple[str, list[KVEvent]]]]


class EventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        snapshot: Snapshot,
        *,
        metrics: Metrics | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        batch_events: int = 512,
        flush_s: float = 0.005,
        data_parallel_rank: int | None = None,
        bind: bool = True,
    ) -> None:
        self._endpoint = endpoint
        self._bind_pub = bind
        self._replay_endpoint = replay_endpoint
        self._snapshot = snapshot
        self.metrics = metrics or Metrics()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self._hwm = hwm
        self.batch_events = batch_events
        self.flush_s = flush_s
        self._dp_rank = data_parallel_rank
        # PUB is a plain socket: a non-blocking send is done when it returns (an asyncio
        # socket's may queue behind earlier ones). ROUTER waits for requests on the loop.
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._pending: dict[str, list[KVEvent]] = {}
        self._n_pending = 0
        self._timer: asyncio.TimerHandle | None = None
        self._soon = False  # a flush is scheduled with call_soon
        self._snap: tuple[int, list[tuple[bytes, bytes]]] | None = None  # (seq, pages)
        self.next_seq = 0
        self.endpoint = ""  # as bound (a port of 0 resolved)
        self.replay_address: str | None = None
        self._log = LogThrottle(log, 60.0)

    async def start(self) -> None:
        """Bind both sockets and publish the snapshot (a fresh start is a full state)."""
        self._pub = self._sync_ctx.socket(zmq.PUB)
        self._pub.set_hwm(self._hwm)
        if self._bind_pub:
            self.endpoint = _bind(self._pub, self._endpoint)
        else:  # to a consumer that binds (llm-d's indexer at a fixed address)
            self._pub.connect(self._endpoint)
            self.endpoint = self._endpoint
        if self._replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            # A reply is as long as the buffer or a snapshot: past the default high-water
            # mark ROUTER would drop the rest, end marker included, without a word.
            # Mandatory: a send waits for room, or fails for a consumer that left.
            self._replay.setsockopt(zmq.SNDHWM, 0)
            self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.replay_address = _bind(self._replay, self._replay_endpoint)
            self._replay_task = asyncio.ensure_future(self._serve_replay())
        self._pending, self._n_pending = {}, 0  # the snapshot covers them
        for topic, events in self._snapshot():
            self._send(topic, events)
        log.info("KV events on %s (replay %s)", self.endpoint, self.replay_address)

    def emit(self, topic: str, event: KVEvent) -> None:
        """Queue one event: it goes out with the next flush (within ``flush_s``)."""
        self._pending.setdefault(topic, []).append(event)
        self._n_pending += 1
        if self._n_pending >= 8 * self.batch_events:
            self.flush()  # the loop has not run a flush for long: bounded all the same
        elif self._pub is None:
            return
        elif self._n_pending >= self.batch_events:
            # A full batch goes out as soon as the loop is free: after the reply to the
            # request that emitted it, not in that request's time.
            if not self._soon:
                self._soon = True
                asyncio.get_running_loop().call_soon(self.flush)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_s, self.flush)

    def flush(self) -> None:
        """Send every queued event now, one batch per topic."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._soon = False
        pending, self._pending, self._n_pending = self._pending, {}, 0
        if self._pub is None:
            return
        for topic, events in pending.items():
            self._send(topic, events)

    def _send(self, topic: str, events: list[KVEvent]) -> None:
        assert self._pub is not None
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(KVEventBatch(time.time(), events, self._dp_rank))
        t = topic.encode()
        # PUB never blocks: with no subscriber, or one past its high-water mark, ZMQ drops.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((t, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, t, payload))
        self.metrics.kv_event_batches.inc()
        for kind, n in Counter(type(e).__name__ for e in events).items():
            self.metrics.kv_events.labels(kind).inc(n)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = await self._replay.recv_multipart()
                await self._answer(frames)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # one consumer's bad request must not end the service
                self._log.log("replay", logging.WARNING, "KV event replay failed: %r", e)

    async def _answer(self, frames: list[Any]) -> None:
        assert self._replay is not None
        sock = self._replay
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.metrics.kv_event_replays.labels("refused").inc()
            self._log.log(
                "bad_replay", logging.WARNING, "refused a malformed KV event replay request (%d frames)",
                len(frames),
            )
            if len(frames) >= 2 and frames[1] == b"":  # a REQ client waits: end it
                await sock.send_multipart((frames[0], b"", b"", END_SEQ, b""))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        self.flush()  # everything emitted so far is in the buffer
        oldest = self._buffer[0][0] if self._buffer else self.next_seq
        # Older than the buffer (joined late, fell behind), or newer than anything sent (a
        # consumer of this agent's previous run): the whole state instead.
        if start < oldest or start > self.next_seq:
            self.metrics.kv_event_replays.labels("snapshot").inc()
            seq = max(self.next_seq - 1, 0)
            if self._snap is None or self._snap[0] != seq:
                # Built without yielding to the loop: no event can slip in between. Kept
                # until the next batch: consumers asking together cost one build.
                self._snap = (seq, [
                    (topic.encode(), encode_batch(KVEventBatch(time.time(), events, self._dp_rank)))
                    for topic, events in self._snapshot()
                ])  # fmt: skip
            sb = seq.to_bytes(8, "big")
            msgs = [(client, b"", t, sb, payload) for t, payload in self._snap[1]]
        else:
            self.metrics.kv_event_replays.labels("replayed").inc()
            msgs = [
                (client, b"", t, s.to_bytes(8, "big"), payload)
                for s, t, payload in list(self._buffer)
                if s >= start
            ]
        try:
            for m in msgs:
                await sock.send_multipart(m)
            await sock.send_multipart((client, b"", b"", END_SEQ, b""))
        except zmq.ZMQError as e:  # EHOSTUNREACH: the consumer left mid-reply
            log.debug("replay to a consumer that left: %s", e)

    async def close(self) -> None:
        self.flush()
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=100)  # the last batches still reach connected subscribers
        self._pub = self._replay = None
        self._ctx.term()
        self._sync_ctx.term()


def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
    """Bind ``endpoint``; a TCP port of 0 binds a free one. Returns the bound address."""
    sock.bind(endpoint)
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
