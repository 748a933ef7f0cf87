"""The shared-memory DRAM index: clients find slots with no agent round trip, and a read
that races a writer is retried through the agent, never delivered torn."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import yaml
from helpers_agent import FP, N, meta, payload
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_cache import codec
from tiered_cache.client import AgentClient
from tiered_cache.keys import chunk_keys
from tiered_cache.tiers.dram import DRAMTier, attach_shm
from tiered_cache.tiers.shm_index import SlotIndex, SlotIndexReader, index_name


def _key(home: int, tag: int) -> str:
    # The first 16 hex digits pick the bucket: few distinct homes force long probe runs,
    # wrap-around and backward-shift deletions through them.
    return f"{home:016x}{tag:016x}"


# Three homes at the start of the 16-bucket table and three at its end, whose runs wrap
# around into bucket 0.
_HOMES = [0, 1, 2, 13, 14, 15]

ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "del"]), st.integers(0, 5), st.integers(0, 11), st.integers(1, 99)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops)
def test_reader_agrees_with_the_owner(ops: list[tuple[str, int, int, int]]) -> None:
    slots = 8  # 16 buckets
    model: dict[str, tuple[int, int]] = {}  # key -> (slot, length)
    free = list(range(slots))
    with _index(slots) as (_, ix, reader):
        for op, home, tag, length in ops:
            k = _key(_HOMES[home], tag)
            if op == "put" and (free or k in model):
                slot = free.pop() if free else model[k][0]
                old = model.get(k)
                ix.publish(k, slot, length)
                if old is not None and old[0] != slot:
                    ix.unpublish(old[0])  # as DRAMTier.commit: new copy first, then the old
                    free.append(old[0])
                model[k] = (slot, length)
            elif op == "del" and k in model:
                slot, _ = model.pop(k)
                ix.unpublish(slot)
                free.append(slot)
            for key in {_key(h, t) for h in _HOMES for t in range(12)}:
                got = reader.find(key)
                if key in model:
                    assert got is not None and (got[0], got[2]) == model[key], key
                else:
                    assert got is None, key


@contextlib.contextmanager
def _index(slots: int) -> Iterator[tuple[str, SlotIndex, SlotIndexReader]]:
    """An owner's index and a reader attached to it, as agent and client hold them."""
    name = f"tc_ix_{uuid.uuid4().hex[:10]}"
    ix = SlotIndex(name, slots)
    reader = SlotIndexReader(attach_shm(index_name(name)))
    try:
        yield name, ix, reader
    finally:
        reader.close()
        ix.close()


def _published(
    ix: SlotIndex, reader: SlotIndexReader, k: str, slot: int, length: int
) -> tuple[int, int, int]:
    """Publish ``k`` and return what a reader then finds for it."""
    ix.publish(k, slot, length)
    found = reader.find(k)
    assert found is not None
    return found


def test_a_dropped_and_reused_slot_never_reads_unchanged() -> None:
    with _index(4) as (_, ix, reader):
        k = _key(7, 1)
        slot, gen, _ = _published(ix, reader, k, 2, 100)
        assert reader.unchanged(slot, gen)
        ix.unpublish(2)
        ix.publish(k, 2, 100)  # same key, same slot, same length: still a new generation
        assert not reader.unchanged(slot, gen)
        assert reader.find(k) is not None


def test_a_new_owner_retires_the_old_index() -> None:
    with _index(4) as (name, first, reader):
        k = _key(3, 3)
        found = _published(first, reader, k, 1, 10)
        # The agent died without closing (kill -9); a restarted one replaces the index. A
        # client still attached to the old one must stop trusting it.
        second = SlotIndex(name, 4)
        try:
            assert reader.find(k) is None
            # A copy begun before the restart is refused too: the new owner may reuse the
            # slot without ever touching the old index's generations.
            assert not reader.unchanged(found[0], found[1])
        finally:
            second.close()


async def test_dram_tier_keeps_the_index_in_step() -> None:
    t = DRAMTier(4 * 8192, 8192, shm_name=f"tc_ix_{uuid.uuid4().hex[:8]}")
    reader = SlotIndexReader(attach_shm(t.shared_index.name))
    try:
        keys = [_key(i, i) for i in range(5)]
        for k in keys[:4]:
            await t.put(k, b"x" * 100)
        assert all(reader.find(k) is not None for k in keys[:4])
        assert reader.find(keys[4]) is None
        assert await t.delete(keys[1])
        assert reader.find(keys[1]) is None
        # A leased chunk that is replaced leaves the index at once (its slot is a zombie).
        got = t.acquire(keys[0])
        assert got is not None
        await t.put(keys[0], b"y" * 200)
        found = reader.find(keys[0])
        assert found is not None and found[0] != got[0] and found[2] == 200
        t.release(got[0])
    finally:
        reader.close()
        await t.close()


def test_client_reads_dram_hits_without_the_agent(
    agent: tuple[Path, subprocess.Popen[str]],
) -> None:
    cfg, proc = agent
    sock = yaml.safe_load(cfg.read_text())["agent"]["socket"]
    c = AgentClient(sock, timeout=5)  # a regression asks the stopped agent: fail fast
    keys = chunk_keys(np.arange(32 * 4), FP)
    c.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)])
    hit = "tiered_cache_hits_total{tier=dram}"
    before = c.admin("stats")["metrics"].get(hit, 0.0)
    out: dict[int, bytes] = {}
    proc.send_signal(signal.SIGSTOP)  # the agent cannot answer anything now
    try:
        got = c.load_report(keys, FP.digest, lambda i, _, v: out.__setitem__(i, bytes(v)))
    finally:
        proc.send_signal(signal.SIGCONT)
    assert got.ok == [True] * 4 and got.sources == ["dram"] * 4
    assert [out[i] for i in range(4)] == [payload(i) for i in range(4)]
    # The hits reach the agent one-way once it runs again, though this client stays idle
    # (another client reads the counter: a call of this one would flush them itself).
    other = AgentClient(sock, attach_pool=False)
    deadline = time.monotonic() + 5
    while other.admin("stats")["metrics"].get(hit, 0.0) - before < 4:
        assert time.monotonic() < deadline, "direct hits were never reported"
        time.sleep(0.05)
    assert other.admin("stats")["metrics"][hit] - before == 4
    other.close()
    c.close()


def test_a_read_that_races_a_writer_is_retried_through_the_agent(
    agent: tuple[Path, subprocess.Popen[str]],
) -> None:
    cfg, _ = agent
    sock = yaml.safe_load(cfg.read_text())["agent"]["socket"]
    reader, writer = AgentClient(sock), AgentClient(sock)
    k = chunk_keys(np.arange(32), FP)[0]
    old, new = payload(1), payload(2)
    writer.put_many([(meta(k), old)])
    seen: list[bytes] = []

    def sink(_: int, __: codec.ChunkMeta, view: memoryview) -> None:
        seen.append(bytes(view))
        if len(seen) == 1:  # mid-copy, the chunk is evicted and stored anew
            writer.admin("evict", key=k, tiers=["dram"])
            writer.put_many([(meta(k), new)])

    got = reader.load_report([k], FP.digest, sink)
    # The first copy came from a slot that changed under it: it is not the answer. The
    # agent then served the chunk's current bytes.
    assert got.ok == [True] and not got.failures
    assert seen == [old, new]
    reader.close()
    writer.close()


def test_readers_racing_writers_never_get_torn_or_foreign_bytes(
    agent: tuple[Path, subprocess.Popen[str]],
) -> None:
    """A writer keeps evicting chunks and storing them anew with other bytes, so DRAM slots
    are reused under readers that do not verify payloads: every chunk a reader accepts is
    one whole copy of that key."""
    cfg, _ = agent
    sock = yaml.safe_load(cfg.read_text())["agent"]["socket"]
    keys = chunk_keys(np.arange(32 * 4), FP)
    versions = {k: [bytes([j]) * N for j in range(4 * i, 4 * i + 4)] for i, k in enumerate(keys)}
    writer = AgentClient(sock)
    readers = [AgentClient(sock, verify_dram_reads=False) for _ in range(2)]
    writer.put_many([(meta(k), versions[k][0]) for k in keys])
    stop = threading.Event()
    bad: list[str] = []
    served = [0, 0]

    def read(n: int) -> None:
        got: dict[int, bytes] = {}

        def slow_copy(i: int, _: codec.ChunkMeta, v: memoryview) -> None:
            head = bytes(v[: N // 2])
            time.sleep(0.002)  # widen the window in which the writer may reuse the slot
            got[i] = head + bytes(v[N // 2 :])

        while not stop.is_set():
            got.clear()
            rep = readers[n].load_report(keys, FP.digest, slow_copy)
            for i, ok in enumerate(rep.ok):
                if ok:
                    served[n] += 1
                    if got[i] not in versions[keys[i]]:
                        bad.append(f"{keys[i]}: {set(got[i][:: N // 64])}")

    threads = [threading.Thread(target=read, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    j = 0
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            k = keys[j % 4]
            writer.admin("evict", key=k, tiers=["dram"])
            writer.put_many([(meta(k), versions[k][j % 4])])
            j += 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not bad, bad[:3]
    assert min(served) > 0 and j > 10
    for c in (writer, *readers):
        c.close()
