"""KV events for our tiers in vLLM's format (``tiered_cache.kv_events``), through a real
agent, decoded by a consumer built on vLLM's own classes (``helpers_kv_events``): after
puts, demotions, evictions, a clear, a dropped subscriber, a late one and a restart, the
consumer's view of each tier is what ``tiered-cache ls`` lists."""

from __future__ import annotations

import asyncio
import json
from array import array
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq
from conftest import free_port
from helpers_agent import Output, cli, meta, payload, socket_of, start_agent, write_cfg
from helpers_kv_events import Consumer, ls_view
from vllm.distributed.kv_events import BlockStored

from tiered_cache.client import AgentClient
from tiered_cache.kv_events import BlockBook, Blocks, DescriptionError, EventPublisher, tier_media
from tiered_cache.kv_events.wire import BlockStored as OurBlockStored
from tiered_cache.kv_events.wire import KVEvent
from tiered_cache.protocol import Describe

BS = 16  # vLLM block size of the descriptions (FP's chunks are 32 tokens: two blocks)


def _cfg(tmp: Path, **kv: Any) -> tuple[Path, str, str]:
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = write_cfg(
        tmp,
        kv_events={"enabled": True, "endpoint": pub, "replay_endpoint": rep,
                   "state_path": str(tmp / "kvevents.state"), **kv},
    )  # fmt: skip
    return cfg, pub, rep


def _key(i: int) -> str:
    return f"{i:032x}"


def _describe(keys: list[str], base: int = 0) -> Describe:
    """Fake vLLM hashes: chunk i holds blocks 1000i and 1000i+1 (tokens i*32 ..)."""
    hs: list[list[int | bytes]] = []
    toks: list[bytes] = []
    parents: list[int | bytes | None] = []
    for k in keys:
        i = int(k, 16) + base
        hs.append([1000 * i, 1000 * i + 1])
        parents.append(1000 * i - 1 if i else None)
        toks.append(array("I", range(32 * i, 32 * i + 32)).tobytes())
    return Describe(keys, hs, parents, toks, BS, "m")


def _ls(cfg: Path) -> list[dict[str, Any]]:
    r = cli("ls", "--config", str(cfg), "--json", "--limit", "100000")
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["entries"])


def _node(cfg: Path) -> str:
    return str(yaml.safe_load(cfg.read_text())["node_id"])


def _settled(c: Consumer, cfg: Path) -> bool:
    want = ls_view(_ls(cfg), _node(cfg))
    c.poll(0.3)
    return {k: v for k, v in c.view.items() if v} == {k: v for k, v in want.items() if v}


def test_the_view_follows_puts_demotions_evictions_and_a_clear(tmp_path: Path) -> None:
    cfg, pub, rep = _cfg(tmp_path)
    proc = start_agent(cfg)
    c = Consumer(pub, rep)
    client = AgentClient(socket_of(cfg))
    try:
        assert client.takes_descriptions
        c.replay(0)  # the start's snapshot: nothing held yet
        assert c.last_seq >= 0 and not any(c.view.values())
        keys = [_key(i) for i in range(40)]  # 40 x 64 KiB through a 2 MiB DRAM: demotions
        client.describe(_describe(keys[:20]))  # described before the put ...
        client.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)], wait=True)
        client.describe(_describe(keys[20:]))  # ... and after: both are announced
        c.follow(lambda: _settled(c, cfg))
        node = _node(cfg)
        tiers = {e["tier"] for e in _ls(cfg)}
        assert tiers == {"dram", "nvme"}  # some were demoted, some stayed
        assert set(c.view) == {f"tiered-cache:{node}:dram", f"tiered-cache:{node}:nvme"}
        ev = next(e for e in c.stored_events if e.block_hashes == [0, 1])
        assert (ev.medium, ev.locality, ev.block_size) == ("CPU", "LOCAL", BS)
        assert ev.token_ids == list(range(32)) and ev.parent_block_hash is None
        # An eviction and a whole tier dropped: removals.
        client.admin("evict", key=keys[-1])
        r = cli("flush", "--config", str(cfg), "--tier", "nvme", "--yes")
        assert r.returncode == 0, r.stderr + r.stdout
        c.follow(lambda: _settled(c, cfg))
        assert not c.view.get(f"tiered-cache:{node}:nvme")
        # A description that does not add up is refused; nothing else changes.
        bad = _describe([keys[0]])
        client.describe(Describe(bad.keys, bad.hashes, bad.parents, [b"\0" * 12], BS))
        st = client.admin("stats")
        assert st["metrics"]["tiered_cache_kv_event_descriptions_refused_total"] == 1
        assert st["kv_events"]["descriptions"] == len(_ls(cfg))  # DRAM only now: one each
        assert st["kv_events"]["endpoint"] == pub
        c.follow(lambda: _settled(c, cfg))
        # What an operator sees: the history from seq 0, a JSON line per event.
        r = cli("events", "-c", str(cfg), "--from-start", "--json", "--timeout", "0.5")
        assert r.returncode == 0, r.stderr
        shown = [json.loads(line) for line in r.stdout.splitlines()]
        kinds = [e["type"] for e in shown]
        assert kinds[0] == "AllBlocksCleared" and "BlockRemoved" in kinds
        assert kinds.count("BlockStored") == sum(1 for e in c.stored_events)
    finally:
        client.close()
        c.close()
        proc.kill()
        proc.wait()


def test_a_dropped_subscriber_replays_and_a_late_one_gets_a_snapshot(tmp_path: Path) -> None:
    cfg, pub, rep = _cfg(tmp_path, buffer_steps=1, flush_s=0.001, batch_events=1)
    proc = start_agent(cfg)
    client = AgentClient(socket_of(cfg))
    a = Consumer(pub, rep)
    try:
        a.replay(0)
        keys = [_key(i) for i in range(10)]
        client.describe(_describe(keys))
        client.put_many([(meta(k), payload(i)) for i, k in enumerate(keys[:5])], wait=True)
        a.follow(lambda: _settled(a, cfg))
        seen = a.last_seq
        a.sub.close(linger=0)  # drops out ...
        client.put_many([(meta(k), payload(i)) for i, k in enumerate(keys[5:])], wait=True)
        client.admin("evict", key=keys[0])
        # ... and asks for what it missed: more than the one buffered batch: a snapshot.
        a.replay(seen + 1)
        assert {k: v for k, v in a.view.items() if v} == ls_view(_ls(cfg), _node(cfg))
        late = Consumer(pub, rep)
        late.replay(0)  # long rotated out of the buffer: a snapshot too
        assert {k: v for k, v in late.view.items() if v} == ls_view(_ls(cfg), _node(cfg))
        # Within the buffer, a replay sends the batches themselves.
        late.follow(lambda: _settled(late, cfg))
        seen = late.last_seq
        late.sub.close(linger=0)
        client.admin("evict", key=keys[1])  # one event, one batch
        late.replay(seen + 1)
        assert late.last_seq == seen + 1
        assert {k: v for k, v in late.view.items() if v} == ls_view(_ls(cfg), _node(cfg))
        late.close()
        stats = client.admin("stats")["metrics"]
        assert stats['tiered_cache_kv_event_replays_total{result=snapshot}'] >= 2
        assert stats['tiered_cache_kv_event_replays_total{result=replayed}'] >= 1
    finally:
        client.close()
        a.close()
        proc.kill()
        proc.wait()


def test_a_restart_publishes_what_it_kept(tmp_path: Path) -> None:
    cfg, pub, rep = _cfg(tmp_path)
    proc = start_agent(cfg)
    client = AgentClient(socket_of(cfg))
    keys = [_key(i) for i in range(12)]
    client.describe(_describe(keys))
    client.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)], wait=True)
    client.close()
    Output(proc).stop()  # SIGTERM: DRAM kept for a warm restart, NVMe on disk
    proc = start_agent(cfg)
    c = Consumer(pub, rep)
    try:
        c.replay(0)  # the new run's snapshot
        entries = _ls(cfg)
        assert len(entries) >= len(keys)
        assert {k: v for k, v in c.view.items() if v} == ls_view(entries, _node(cfg))
    finally:
        c.close()
        proc.kill()
        proc.wait()


def test_malformed_and_oversized_replay_requests_are_refused(tmp_path: Path) -> None:
    cfg, pub, rep = _cfg(tmp_path)
    proc = start_agent(cfg)
    ctx = zmq.Context()
    try:
        bad = ctx.socket(zmq.DEALER)
        bad.connect(rep)
        bad.send_multipart((b"", b"abc"))  # not 8 bytes: refused with the end marker
        assert bad.poll(10_000)
        assert bad.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True)
        bad.send_multipart((b"x", b"y", b"z", b"w"))  # no delimiter: dropped
        big = ctx.socket(zmq.DEALER)
        big.connect(rep)
        big.send_multipart((b"", b"\0" * (1 << 20)))  # over ZMQ_MAXMSGSIZE: disconnected
        c = Consumer(pub, rep)  # everyone else is served as before
        c.replay(0)
        assert c.last_seq >= 0
        client = AgentClient(socket_of(cfg))
        client.describe(_describe([_key(1)]))
        client.put_many([(meta(_key(1)), payload(1))], wait=True)
        c.follow(lambda: _settled(c, cfg))
        stats = client.admin("stats")["metrics"]
        assert stats['tiered_cache_kv_event_replays_total{result=refused}'] >= 1
        client.close()
        c.close()
        for s in (bad, big):
            s.close(linger=0)
    finally:
        ctx.term()
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- the parts on their own


def _blocks(i: int, n: int = 2) -> Blocks:
    return Blocks([10 * i + j for j in range(n)], None, array("I", range(n * BS)).tobytes(), BS)


def test_the_book_announces_once_held_and_removes_only_what_it_announced() -> None:
    held: dict[str, list[str]] = {}
    out: list[tuple[str, KVEvent]] = []
    book = BlockBook(tier_media("n", ["dram", "nvme", "s3"]), lambda k: held.get(k, []),
                     lambda t, e: out.append((t, e)), max_pending=2)  # fmt: skip
    book.removed("dram", "a")  # never described: nothing
    book.describe("a", _blocks(1))
    assert out == [] and len(book) == 1  # pending: no tier holds it yet
    held["a"] = ["dram"]
    book.added("dram", "a")
    book.added("dram", "a")  # once per tier
    assert [type(e).__name__ for _, e in out] == ["BlockStored"]
    held["b"] = ["nvme", "s3"]
    book.describe("b", _blocks(2))  # held already: announced at once, in both tiers
    assert [(e.medium, e.locality) for _, e in out[1:]] == [("STORAGE", "LOCAL"),
                                                           ("STORAGE", "REMOTE")]  # fmt: skip
    book.removed("nvme", "b")
    book.removed("nvme", "b")
    assert [type(e).__name__ for _, e in out].count("BlockRemoved") == 1
    n = len(out)
    book.forgot("s3", "b")  # S3's index let go: announced gone, memory given back
    assert [type(e).__name__ for _, e in out[n:]] == ["BlockRemoved"]
    assert book.hashes("b") is None
    for k in "cde":  # pending descriptions are bounded
        book.describe(k, _blocks(3))
    assert len(book) == 1 + 2
    with pytest.raises(DescriptionError):
        book.describe("x", Blocks([1], None, b"\0" * 8, BS))
    held["x"] = ["dram"]
    n = len(out)
    book.describe("x", Blocks([], None, b"", BS))  # less than a block: described, silent
    assert book.hashes("x") == [] and len(out) == n
    book.removed("dram", "x")
    assert len(out) == n
    pages = book.snapshot(["t"])
    assert [type(e).__name__ for _, evs in pages for e in evs] == [
        "AllBlocksCleared", "AllBlocksCleared", "BlockStored"]  # fmt: skip


def test_the_publisher_holds_bounded_memory_with_no_subscriber() -> None:
    async def main() -> None:
        pub = EventPublisher(f"tcp://127.0.0.1:{free_port()}", None, lambda: [],
                             buffer_steps=8, batch_events=64)  # fmt: skip
        await pub.start()
        ev = OurBlockStored([1, 2], None, list(range(32)), BS, None, "CPU", None)
        for i in range(100_000):
            pub.emit("", ev)
            assert pub._n_pending < 8 * 64  # a loop that never yields: still bounded
            if i % 1000 == 0:
                await asyncio.sleep(0)  # the loop runs the scheduled flushes
        assert len(pub._buffer) == 8
        await pub.close()
        assert pub.metrics.value("tiered_cache_kv_events_total", type="BlockStored") == 100_000

    asyncio.run(main())


def test_our_events_decode_as_vllms() -> None:
    b = _blocks(7)
    b.extra_keys = [("salt",), None]
    ev = b.stored(tier_media("node", ["nvme"])["nvme"])
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch as VBatch

    from tiered_cache.kv_events.wire import KVEventBatch, encode_batch

    got = msgspec.msgpack.Decoder(VBatch).decode(encode_batch(KVEventBatch(1.0, [ev])))
    (v,) = got.events
    assert isinstance(v, BlockStored)
    assert v.block_hashes == [70, 71] and v.extra_keys == [("salt",), None]
    assert (v.medium, v.ownership) == ("STORAGE", "tiered-cache:node:nvme")


def test_the_publisher_connects_to_a_consumer_that_binds() -> None:
    """llm-d's indexer at a fixed address binds its SUB socket; publishers connect."""
    import zmq

    from tiered_cache.kv_events.wire import decode_batch

    async def main() -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        port = free_port()
        sub.bind(f"tcp://127.0.0.1:{port}")
        pub = EventPublisher(f"tcp://127.0.0.1:{port}", None, lambda: [], bind=False)
        await pub.start()
        ev = OurBlockStored([1], None, list(range(BS)), BS, None, "CPU", None)
        for _ in range(200):  # until the connection is up (ZMQ drops before it is)
            pub.emit("", ev)
            pub.flush()
            if sub.poll(50):
                break
        _, _, payload = sub.recv_multipart()
        assert decode_batch(payload).events[0] == ev
        await pub.close()
        sub.close(linger=0)
        ctx.term()

    asyncio.run(main())


# ---------------------------------------------------------------- the router's index


def _prompt_events(tokens: list[int], salt: str | None = None) -> list[Any]:
    """What an agent announces for ``tokens``'s two 32-token chunks held in DRAM."""
    from tiered_cache.kv_events.wire import KVEventBatch

    out: list[tuple[str, KVEvent]] = []
    held = {"a": ["dram"], "b": ["dram"]}
    book = BlockBook(tier_media("n", ["dram"]), lambda k: held.get(k, []),
                     lambda t, e: out.append((t, e)))  # fmt: skip
    tok = [array("I", tokens[i : i + 32]).tobytes() for i in (0, 32)]
    extra = [(salt,), None] if salt else None
    h = 100 if salt else 10  # a salt changes every hash vLLM computes
    book.describe("a", Blocks([h + 1, h + 2], None, tok[0], BS, extra_keys=extra))
    book.describe("b", Blocks([h + 3, h + 4], h + 2, tok[1], BS))
    batch = KVEventBatch(0.0, [e for _, e in out])
    book.removed("dram", "b")
    return [batch, KVEventBatch(0.0, [e for _, e in out[len(batch.events):]])]


def test_the_index_walks_a_prompt_block_by_block() -> None:
    from tiered_cache.kv_events.index import BlockIndex

    toks = list(range(100, 170))  # 4 whole blocks of 16 and a tail
    stored, removed = _prompt_events(toks)
    ix = BlockIndex()
    assert ix.cached_blocks(toks) == 0  # knows no block size yet
    ix.apply("agent-1", stored)
    assert ix.block_size == BS and ix.cached_blocks(toks) == 4
    assert ix.cached_blocks(toks[:40]) == 2  # a shorter prompt: its whole blocks
    assert ix.cached_blocks([7, *toks[1:]]) == 0  # another first block: nothing
    assert ix.cached_blocks(toks, salt="s") == 0  # another tenant's salt: nothing
    ix.apply("agent-1", removed)  # chunk b evicted: the walk stops before it
    assert ix.cached_blocks(toks) == 2
    salted, _ = _prompt_events(toks, salt="s")
    ix.apply("agent-2", salted)
    assert ix.cached_blocks(toks, salt="s") == 4 and ix.cached_blocks(toks) == 2
    ix.clear("agent-1")  # one publisher's AllBlocksCleared leaves the other's blocks
    assert ix.cached_blocks(toks) == 0 and ix.cached_blocks(toks, salt="s") == 4


def test_the_router_index_follows_a_real_agent(tmp_path: Path) -> None:
    from tiered_cache.kv_events.index import BlockIndex, EventSubscriber

    cfg, pub, rep = _cfg(tmp_path)
    proc = start_agent(cfg)
    client = AgentClient(socket_of(cfg))
    toks = list(range(1000, 1000 + 64))
    keys = [_key(0), _key(1)]
    d = _describe(keys)  # chunk i: blocks 1000i, 1000i+1 of tokens 32i ..: re-token them
    d = Describe(keys, [[1, 2], [3, 4]], [None, 2],
                 [array("I", toks[:32]).tobytes(), array("I", toks[32:]).tobytes()], BS)
    client.describe(d)
    client.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)], wait=True)

    async def main() -> None:
        ix = BlockIndex()
        sub = EventSubscriber(ix, pub, rep)
        sub.start()  # joins late: catches up by replay
        for _ in range(200):
            if ix.cached_blocks(toks) == 4:
                break
            await asyncio.sleep(0.05)
        assert ix.cached_blocks(toks) == 4
        await asyncio.to_thread(client.admin, "evict", key=keys[0])
        for _ in range(200):  # the removal arrives on the stream
            if ix.cached_blocks(toks) == 0:
                break
            await asyncio.sleep(0.05)
        assert ix.cached_blocks(toks) == 0 and len(ix) == 2
        await asyncio.to_thread(put_again)
        await until(lambda: ix.cached_blocks(toks) == 4)
        # The agent restarts (its sequence numbers start over; DRAM is kept), then evicts:
        # the index follows the new run, not only the old one's numbering.
        await asyncio.to_thread(restart)
        await asyncio.to_thread(lambda: AgentClient(socket_of(cfg)).admin("evict", key=keys[1]))
        await until(lambda: ix.cached_blocks(toks) == 2)
        await sub.close()

    async def until(cond: Any) -> None:
        for _ in range(300):
            if cond():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the index never caught up")

    def put_again() -> None:
        client.describe(d)
        client.put_many([(meta(keys[0]), payload(0))], wait=True)

    def restart() -> None:
        nonlocal proc
        client.close()
        Output(proc).stop()
        proc = start_agent(cfg)

    try:
        asyncio.run(main())
    finally:
        client.close()
        proc.kill()
        proc.wait()


def test_the_router_refuses_events_lookup_without_a_stream(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path, router={"lookup": "events"})
    r = cli("router", "-c", str(cfg), "--prefill", "http://a:1", "--decode", "http://b:2")
    assert r.returncode != 0 and "kv_event_sources" in r.stderr
