from __future__ import annotations

import logging
import multiprocessing as mp
import os
import stat
import uuid
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from tiered_cache import codec
from tiered_cache.private_dir import UnsafePath
from tiered_cache.tiers.base import TierFull
from tiered_cache.tiers.dram import DRAMTier, attach_shm

FP = b"\x01" * 16


def blob(key: str, n: int = 1000, fill: int = 7) -> bytes:
    meta = codec.ChunkMeta(key=key, fingerprint=FP, num_tokens=16, dtype="uint8", shape=(n,))
    return codec.encode(meta, bytes([fill]) * n)


def k(i: int) -> str:
    return f"{i:032x}"


@pytest.fixture
def dram():
    t = DRAMTier(4 * 8192, 8192, shm_name=f"tc_test_{uuid.uuid4().hex[:8]}")
    yield t
    import asyncio

    asyncio.run(t.close())


async def test_roundtrip_and_usage(dram: DRAMTier) -> None:
    await dram.put(k(1), blob(k(1)))
    assert await dram.get(k(1)) == blob(k(1))
    assert await dram.contains_many([k(1), k(2)]) == [True, False]
    assert dram.usage().num_chunks == 1
    assert dram.usage().used_bytes == len(blob(k(1)))
    assert await dram.delete(k(1))
    assert await dram.get(k(1)) is None
    assert not await dram.delete(k(1))
    assert dram.usage().used_bytes == 0


async def test_slots_run_out_and_oversize_refused(dram: DRAMTier) -> None:
    for i in range(4):
        await dram.put(k(i), blob(k(i)))
    assert not dram.has_room(100)
    with pytest.raises(TierFull):
        await dram.put(k(9), blob(k(9)))
    with pytest.raises(TierFull, match="exceeds the DRAM pool"):
        await dram.put(k(10), blob(k(10), n=4 * 8192))
    await dram.delete(k(0))
    await dram.put(k(9), blob(k(9)))


async def test_lease_defers_free_no_double_free(dram: DRAMTier) -> None:
    await dram.put(k(1), blob(k(1), fill=1))
    slot, length = dram.acquire(k(1))  # type: ignore[misc]
    await dram.delete(k(1))
    free_before = dram.free_slots
    # The leased slot is not reused while the reader holds it: its bytes stay intact.
    for i in range(2, 2 + free_before):
        await dram.put(k(i), blob(k(i), fill=2))
    assert bytes(dram.slot_view(slot)[:length]) == blob(k(1), fill=1)
    with pytest.raises(TierFull):
        await dram.put(k(99), blob(k(99)))
    dram.release(slot)
    assert dram.free_slots == 1
    with pytest.raises(RuntimeError):
        dram.release(slot)


async def test_replace_while_leased_keeps_reader_consistent(dram: DRAMTier) -> None:
    await dram.put(k(1), blob(k(1), fill=1))
    slot, length = dram.acquire(k(1))  # type: ignore[misc]
    await dram.put(k(1), blob(k(1), fill=3))
    assert bytes(dram.slot_view(slot)[:length]) == blob(k(1), fill=1)
    assert await dram.get(k(1)) == blob(k(1), fill=3)
    dram.release(slot)
    assert dram.usage().num_chunks == 1
    assert dram.free_slots == 3


def _child_reads(name: str, slot: int, slot_bytes: int, length: int, q: mp.Queue) -> None:
    shm = attach_shm(name)
    off = slot * slot_bytes
    q.put(bytes(shm.buf[off : off + length]))
    shm.close()


async def test_other_process_reads_pool_and_pool_survives_it(dram: DRAMTier) -> None:
    await dram.put(k(5), blob(k(5), fill=5))
    slot, length = dram.acquire(k(5))  # type: ignore[misc]
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_child_reads, args=(dram.shm_name, slot, dram.slot_bytes, length, q))
    p.start()
    assert q.get(timeout=30) == blob(k(5), fill=5)
    p.join(30)
    dram.release(slot)
    # The child's exit must not have unlinked the owner's pool.
    again = attach_shm(dram.shm_name)
    again.close()


async def test_recover_rebuilds_index_from_slots() -> None:
    name = f"tc_test_{uuid.uuid4().hex[:8]}"
    t = DRAMTier(4 * 8192, 8192, shm_name=name)
    await t.put(k(1), blob(k(1), fill=1))
    await t.put(k(2), blob(k(2), fill=2))
    await t.put(k(3), blob(k(3), fill=3))
    await t.delete(k(2))
    slot3 = t.acquire(k(3))[0]  # type: ignore[index]
    t.slot_view(slot3)[codec.HEADER_SIZE + 10] ^= 0xFF  # corrupt chunk 3's payload
    t.release(slot3)
    await t.close(unlink=False)  # simulate a crashed owner: the segment stays
    r = DRAMTier(4 * 8192, 8192, shm_name=name, recover=True)
    try:
        assert await r.contains_many([k(1), k(2), k(3)]) == [True, False, False]
        assert await r.get(k(1)) == blob(k(1), fill=1)
        assert r.free_slots == 3
    finally:
        await r.close()


async def test_chunk_larger_than_a_slot_takes_a_run(dram: DRAMTier) -> None:
    """A chunk is stored across consecutive slots and reads back byte-exact."""
    big = blob(k(1), n=3 * 8192 - 1000, fill=9)  # 3 slots
    await dram.put(k(1), big)
    assert await dram.get(k(1)) == big
    assert dram.free_slots == 1
    assert not dram.has_room(2 * 8192)
    assert dram.has_room(8000)
    await dram.put(k(2), blob(k(2)))
    assert dram.free_slots == 0
    slot, length = dram.acquire(k(1))  # type: ignore[misc]
    assert length == len(big) and bytes(dram.slot_view(slot)[:length]) == big
    dram.release(slot)


async def test_freed_runs_merge_and_best_fit_keeps_long_extents() -> None:
    t = DRAMTier(8 * 4096, 4096, shm_name=f"tc_test_{uuid.uuid4().hex[:8]}")
    try:
        for i in range(8):
            await t.put(k(i), blob(k(i), n=3000))  # one slot each
        for i in (1, 2, 3, 6):
            await t.delete(k(i))
        # Free: [1, 4) and [6, 7). A one-slot chunk goes to the short hole (best fit) ...
        await t.put(k(20), blob(k(20), n=3000))
        assert t.acquire(k(20))[0] == 6  # type: ignore[index]
        # ... so a three-slot chunk still fits in the long one.
        assert t.has_room(3 * 4096 - 100)
        await t.put(k(21), blob(k(21), n=3 * 4096 - 400))
        assert t.acquire(k(21))[0] == 1  # type: ignore[index]
        # Neighbours merge: slots 4 and 5, freed one after the other, make one run of 2.
        for i in (4, 5):
            await t.delete(k(i))
        assert t.has_room(2 * 4096 - 100) and not t.has_room(3 * 4096 - 100)
    finally:
        await t.close()


async def test_recover_rebuilds_runs() -> None:
    name = f"tc_test_{uuid.uuid4().hex[:8]}"
    t = DRAMTier(8 * 4096, 4096, shm_name=name)
    a, b = blob(k(1), n=3 * 4096 - 400, fill=1), blob(k(2), n=2 * 4096 - 400, fill=2)
    await t.put(k(1), a)
    await t.put(k(2), b)
    await t.close(unlink=False)
    r = DRAMTier(8 * 4096, 4096, shm_name=name, recover=True)
    try:
        assert await r.get(k(1)) == a and await r.get(k(2)) == b
        assert r.free_slots == 3 and r.has_room(3 * 4096 - 400)
    finally:
        await r.close()


def test_auto_slot_size_bounds_the_slot_count() -> None:
    from tiered_cache.tiers.dram import auto_slot_bytes

    assert auto_slot_bytes(2**30) == 64 * 2**10  # 1 GiB: 16,384 slots of 64 KiB
    assert auto_slot_bytes(64 * 2**30) == 2**20  # 64 GiB: 65,536 slots of 1 MiB
    assert auto_slot_bytes(2**20) == 64 * 2**10


# ------------------------------------------- handing the pool over (issue 15, items 9 and 13)


def _mode(name: str) -> int:
    return stat.S_IMODE(os.stat(Path("/dev/shm", name)).st_mode)


async def test_clean_close_hands_over_only_committed_chunks() -> None:
    """``keep_on_close``: the next owner adopts every committed chunk, and neither a run
    still reserved (though it holds a whole chunk) nor one deleted while leased."""
    name = f"tc_test_{uuid.uuid4().hex[:8]}"
    t = DRAMTier(8 * 4096, 4096, shm_name=name, recover=True, keep_on_close=True)
    for i in (1, 2, 3):
        await t.put(k(i), blob(k(i), n=3000, fill=i))
    t.acquire(k(2))  # a reader that never releases: its run becomes a zombie ...
    await t.delete(k(2))  # ... and must not come back
    slot = t.reserve(4000)
    whole = blob(k(4), n=3000, fill=4)
    t.slot_view(slot)[: len(whole)] = whole  # written, never committed
    await t.close()
    assert _mode(name) == 0o600
    r = DRAMTier(8 * 4096, 4096, shm_name=name, recover=True)
    try:
        assert await r.contains_many([k(1), k(2), k(3), k(4)]) == [True, False, True, False]
        assert await r.get(k(3)) == blob(k(3), n=3000, fill=3)
        assert r.free_slots == 6
    finally:
        await r.close()
    assert not Path("/dev/shm", name).exists()


def _plant(name: str, size: int) -> shared_memory.SharedMemory:
    """A segment under ``name`` holding a valid chunk ``k(7)`` in slot 0, as a squatter
    would leave it for an agent to adopt."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    planted = blob(k(7), fill=7)
    assert shm.buf is not None
    shm.buf[: len(planted)] = planted
    return shm


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a segment away needs root")
@pytest.mark.parametrize("what", ["pool", "index"])
async def test_a_segment_of_another_user_is_refused(what: str) -> None:
    """A pool (or index) under our name that another user owns is neither adopted nor
    removed: the agent stops with an error that names it."""
    name = f"tc_test_{uuid.uuid4().hex[:8]}"
    seg = name if what == "pool" else f"{name}_ix"
    shm = _plant(seg, 4 * 8192)
    try:
        os.fchown(shm._fd, 65534, 65534)  # type: ignore[attr-defined]
        with pytest.raises(UnsafePath, match=f"/dev/shm/{seg} belongs to uid 65534"):
            DRAMTier(4 * 8192, 8192, shm_name=name, recover=True)
        assert Path("/dev/shm", seg).exists()
        assert not Path("/dev/shm", name if what == "index" else f"{name}_ix").exists()
    finally:
        shm.close()
        shm.unlink()


async def test_a_pool_open_to_others_is_replaced(caplog: pytest.LogCaptureFixture) -> None:
    """Our own pool, but readable and writable by everyone (0666): its contents may have
    been planted, so the agent starts with a fresh 0600 pool instead of adopting them."""
    name = f"tc_test_{uuid.uuid4().hex[:8]}"
    shm = _plant(name, 4 * 8192)
    os.fchmod(shm._fd, 0o666)  # type: ignore[attr-defined]
    shm.close()
    with caplog.at_level(logging.WARNING, logger="tiered_cache.tiers.dram"):
        t = DRAMTier(4 * 8192, 8192, shm_name=name, recover=True)
    try:
        assert await t.contains_many([k(7)]) == [False]
        assert t.free_slots == 4
        assert _mode(name) == 0o600
        assert "was open to other users (mode 0666)" in caplog.text
    finally:
        await t.close()
