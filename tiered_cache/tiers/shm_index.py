"""A shared-memory index of the DRAM pool, so a client finds a chunk's slot with no
round trip to the agent.

The agent is the only writer; clients read it optimistically, seqlock style:

- each slot has a row ``(gen, length, key)``. ``gen`` is odd while the slot holds no
  published chunk (free, reserved, being written, dropped) and even while it holds one;
  it only ever grows, so a slot that was dropped and reused never reads as unchanged;
- a linear-probing hash table maps a key to its slot.

A reader finds the slot, notes an even ``gen``, copies the chunk out, and then checks that
``gen`` did not move and the index is still live. If either changed the copy is discarded
and the client asks the agent instead, as it does for anything the index does not answer
(a probe that races a deletion, a chunk that lives below DRAM). That final check is what
makes a copy safe: a slot's bytes change only while its ``gen`` is odd, and only after the
index has gone dead when a new agent takes the pool over. The header (key, fingerprint)
and payload checksum are verified as on every other path; they catch damage at rest, not
races (the hash and the copy read the slot at different moments).

Ordering: the owner writes a row's key and length before making ``gen`` even, and makes
``gen`` odd before a slot can be reused. Readers rely on stores becoming visible in that
order, which x86 guarantees; elsewhere the agent's socket round trips between a drop and
a reuse of the slot (reserve, then the writer's copy) act as the barrier.

An index is live while its owner runs. The next owner marks a dead owner's index dead
before replacing it, so a client still attached to it stops trusting it and asks the
agent (and its reconnect then finds the new one).

Layout (little-endian): 64-byte header ``magic, version, num_slots, nbuckets, live``;
``num_slots`` rows of 32 bytes ``gen u64, length u64, key 16 bytes``; ``nbuckets`` u32
buckets holding ``slot + 1`` (0 = empty).
"""

from __future__ import annotations

import contextlib
import struct
from multiprocessing import shared_memory

from tiered_cache.keys import is_valid_key

MAGIC = b"TCIX"
VERSION = 1
HEADER = 64
ROW = 32
MAX_PROBE = 64  # a reader gives up (and asks the agent) after this many buckets
_HDR = struct.Struct("<4sIII")
_LIVE = 16  # header offset of the u32 live flag
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_GEN_LEN = struct.Struct("<QQ")


def index_name(pool_name: str) -> str:
    return f"{pool_name}_ix"


def _nbuckets(num_slots: int) -> int:
    n = 8
    while n < 2 * num_slots:  # load factor <= 0.5: short probes
        n *= 2
    return n


def _home(key: str, mask: int) -> int:
    return int(key[:16], 16) & mask  # keys are hashes already: their bits are uniform


class SlotIndex:
    """Owner side, kept by ``DRAMTier`` in step with its own (authoritative) index."""

    def __init__(self, pool_name: str, num_slots: int) -> None:
        self.num_slots = num_slots
        self.nbuckets = _nbuckets(num_slots)
        self._mask = self.nbuckets - 1
        self._boff = HEADER + ROW * num_slots
        size = self._boff + 4 * self.nbuckets
        name = index_name(pool_name)
        with contextlib.suppress(FileNotFoundError):  # a dead owner's index: start over
            old = shared_memory.SharedMemory(name=name, create=False)
            if old.buf is not None and old.size >= HEADER:
                _U32.pack_into(old.buf, _LIVE, 0)  # clients still attached stop using it
            old.close()
            old.unlink()
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        assert self._shm.buf is not None
        self._buf = memoryview(self._shm.buf)[:size]
        self._buf[:] = bytes(size)
        self._keys: list[str | None] = [None] * num_slots  # what each bucket's slot holds
        for s in range(num_slots):
            _U64.pack_into(self._buf, HEADER + ROW * s, 1)  # odd: nothing published
        _HDR.pack_into(self._buf, 0, MAGIC, VERSION, num_slots, self.nbuckets)
        _U32.pack_into(self._buf, _LIVE, 1)
        self._closed = False

    @property
    def name(self) -> str:
        return self._shm.name

    def _gen(self, slot: int) -> int:
        return int(_U64.unpack_from(self._buf, HEADER + ROW * slot)[0])

    def _bucket(self, b: int) -> int:
        return int(_U32.unpack_from(self._buf, self._boff + 4 * b)[0])

    def _set_bucket(self, b: int, v: int) -> None:
        _U32.pack_into(self._buf, self._boff + 4 * b, v)

    def publish(self, key: str, slot: int, length: int) -> None:
        """``slot`` now holds ``key`` (``length`` bytes); replaces any bucket for ``key``.
        ``key`` must be a valid chunk key: ``DRAMTier`` checks it before changing state."""
        row = HEADER + ROW * slot
        gen = self._gen(slot)
        if not gen & 1:  # published already (not expected): retract it first
            self.unpublish(slot)
            gen = self._gen(slot)
        _U64.pack_into(self._buf, row + 8, length)
        self._buf[row + 16 : row + 32] = bytes.fromhex(key)
        self._keys[slot] = key
        _U64.pack_into(self._buf, row, gen + 1)  # even: readable, after key and length
        b = _home(key, self._mask)
        for _ in range(self.nbuckets):
            v = self._bucket(b)
            if v == 0 or self._keys[v - 1] == key:
                self._set_bucket(b, slot + 1)
                return
            b = (b + 1) & self._mask
        raise AssertionError("slot index full")  # cannot happen: buckets >= 2 x slots

    def unpublish(self, slot: int) -> None:
        """``slot`` no longer holds a readable chunk (dropped, evicted, zombied)."""
        gen = self._gen(slot)
        if gen & 1:
            return
        _U64.pack_into(self._buf, HEADER + ROW * slot, gen + 1)  # odd first: readers back off
        key = self._keys[slot]
        self._keys[slot] = None
        if key is None:
            return
        b = _home(key, self._mask)
        for _ in range(self.nbuckets):
            v = self._bucket(b)
            if v == 0:
                return  # the bucket already points at the key's newer slot
            if v == slot + 1:
                self._delete_at(b)
                return
            b = (b + 1) & self._mask

    def _delete_at(self, i: int) -> None:
        """Backward-shift deletion, so lookups need no tombstones. A reader probing during
        the shift may miss a key: it then asks the agent."""
        mask = self._mask
        j = i
        while True:
            j = (j + 1) & mask
            v = self._bucket(j)
            if v == 0:
                break
            k = self._keys[v - 1]
            home = _home(k, mask) if k is not None else j
            # Move j's entry into the hole at i unless its home lies cyclically in (i, j].
            if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                self._set_bucket(i, v)
                i = j
        self._set_bucket(i, 0)

    def close(self, unlink: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if unlink:
            _U32.pack_into(self._buf, _LIVE, 0)
        with contextlib.suppress(BufferError):
            self._buf.release()
            self._shm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()


class SlotIndexReader:
    """Client side: find a key's slot, and later check the slot did not change."""

    def __init__(self, shm: shared_memory.SharedMemory, num_slots: int | None = None) -> None:
        assert shm.buf is not None
        self._shm = shm
        buf = memoryview(shm.buf)
        ok = buf.nbytes >= HEADER
        if ok:
            magic, version, n, nb = _HDR.unpack_from(buf, 0)
            ok = (
                magic == MAGIC
                and version == VERSION
                and nb > 0
                and not nb & (nb - 1)
                and buf.nbytes >= HEADER + ROW * n + 4 * nb
                and (num_slots is None or n == num_slots)
            )
        if not ok:
            buf.release()
            shm.close()
            raise ValueError(f"shared-memory index {shm.name} has an unknown layout")
        self._buf = buf
        self._closed = False
        self.num_slots = n
        self._mask = nb - 1
        self._boff = HEADER + ROW * n

    @property
    def live(self) -> bool:
        """False once the agent that kept this index is gone (the next owner marked it)."""
        return not self._closed and bool(_U32.unpack_from(self._buf, _LIVE)[0])

    def find(self, key: str) -> tuple[int, int, int] | None:
        """``(slot, gen, length)`` of ``key``'s published copy, or None (ask the agent)."""
        buf = self._buf
        if not _U32.unpack_from(buf, _LIVE)[0] or not is_valid_key(key):
            return None  # the agent that kept it is gone (or no such key can be here)
        kb = bytes.fromhex(key)
        b = _home(key, self._mask)
        for _ in range(MAX_PROBE):
            v = _U32.unpack_from(buf, self._boff + 4 * b)[0]
            if v == 0:
                return None
            s = v - 1
            if s < self.num_slots:
                row = HEADER + ROW * s
                gen, length = _GEN_LEN.unpack_from(buf, row)
                if not gen & 1 and buf[row + 16 : row + 32] == kb:
                    return s, gen, length
            b = (b + 1) & self._mask
        return None

    def unchanged(self, slot: int, gen: int) -> bool:
        """The slot still holds what ``find`` saw. Live is read after ``gen``: a new owner
        retires the index before it reuses any slot, without touching old generations."""
        buf = self._buf
        return bool(
            _U64.unpack_from(buf, HEADER + ROW * slot)[0] == gen and _U32.unpack_from(buf, _LIVE)[0]
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(BufferError):
            self._buf.release()
            self._shm.close()
