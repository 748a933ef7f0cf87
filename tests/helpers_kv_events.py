"""A KV event consumer built on vLLM's own classes (``vllm.distributed.kv_events``): what
an external router sees of an agent's tiers. It subscribes, catches up by replay, follows
the stream, and asks for a replay whenever a sequence number is skipped."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END = (-1).to_bytes(8, "big", signed=True)


class Consumer:
    def __init__(self, endpoint: str, replay: str, topic: str = "") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        # ownership (node:tier) -> block hash -> how many announced copies
        self.view: dict[str, Counter[int | bytes]] = {}
        self.last_seq = -1
        self.batches = 0
        self.replays = 0
        self.stored_events: list[BlockStored] = []

    def apply(self, seq: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        self.batches += 1
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.view.clear()
            elif isinstance(ev, BlockStored):
                self.stored_events.append(ev)
                c = self.view.setdefault(str(ev.ownership), Counter())
                c.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                c = self.view.setdefault(str(ev.ownership), Counter())
                c.subtract(ev.block_hashes)
                for h in [h for h, n in c.items() if n <= 0]:
                    assert c[h] == 0, f"removed {h} more often than stored"
                    del c[h]
        self.last_seq = max(self.last_seq, seq)

    def replay(self, start: int, timeout: float = 10.0) -> None:
        """Ask for everything from ``start``; apply it (a snapshot replaces the view)."""
        # DEALER, not REQ: the reply is many messages (REQ would keep only the first).
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        req.send_multipart((b"", start.to_bytes(8, "big")))
        self.replays += 1
        try:
            while True:
                if not req.poll(int(timeout * 1000)):
                    raise TimeoutError("no replay reply")
                _, _, seq, payload = req.recv_multipart()
                if seq == END:
                    return
                self.apply(int.from_bytes(seq, "big"), payload)
        finally:
            req.close(linger=0)

    def poll(self, timeout: float = 0.2) -> bool:
        """Apply what arrived on the subscription; False when nothing came in ``timeout``."""
        got = False
        deadline = time.monotonic() + timeout
        while self.sub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            _, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq <= self.last_seq:
                continue  # already had it by replay
            if seq > self.last_seq + 1:
                self.replay(self.last_seq + 1)
                if seq <= self.last_seq:
                    continue
            self.apply(seq, payload)
            got = True
            deadline = time.monotonic() + timeout
        return got

    def follow(self, until: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, f"view never settled: {self.view}"
            self.poll(0.1)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def ls_view(entries: list[dict[str, object]], node_id: str) -> dict[str, Counter[int | bytes]]:
    """What ``tiered-cache ls --json`` says each tier holds, as the blocks events name."""
    out: dict[str, Counter[int | bytes]] = {}
    for e in entries:
        blocks = e.get("blocks")
        assert blocks is not None, f"chunk {e['key']} was never described"
        c = out.setdefault(f"tiered-cache:{node_id}:{e['tier']}", Counter())
        c.update(blocks)  # type: ignore[arg-type]
    return out
