"""DRAM tier: a fixed-capacity shared-memory pool carved into fixed-size slots.

The pool is allocated once (POSIX shared memory) and owned by the node agent; vLLM
processes on the node attach it by name and copy KV in and out of slots directly, so a
prefill and a decode process on one node hand off without a disk round trip.

Safety rules (no torn reads, no double frees):
- a writer fills a *reserved* slot, and only ``commit`` makes it visible under a key;
- readers in the agent take a lease (``acquire``) and ``release`` it after copying; a slot
  deleted or replaced while leased becomes a zombie and returns to the free list on its
  last release;
- clients read without a lease, through the shared index (``shm_index``): they find the
  slot, copy, and keep the copy only if the slot's generation did not move meanwhile;
- every slot begins with a self-describing chunk header, so after an agent crash the pool
  can be re-attached and its index rebuilt by scanning slots (``recover=True``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

from tiered_cache import codec
from tiered_cache.keys import is_valid_key
from tiered_cache.tiers.base import Tier, TierFull, TierUsage
from tiered_cache.tiers.shm_index import SlotIndex

log = logging.getLogger(__name__)

_ALIGN = 4096
_OWNED: set[str] = set()  # pools created by this process (their tracker entry must stay)


def attach_shm(name: str) -> shared_memory.SharedMemory:
    """Attach an existing pool without letting this process's resource tracker unlink it
    at exit (a CPython <3.13 pitfall: attaching processes would destroy the owner's pool)."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    if shm.name not in _OWNED:
        with contextlib.suppress(Exception):
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def prefault(buf: memoryview, *, write: bool) -> None:
    """Map every page now, so first-touch faults do not land on the hot path.

    The owner writes (allocating the pages); an attaching process reads one byte a page
    (mapping the already-allocated pages into its own page table).
    """
    import numpy as np

    arr = np.frombuffer(buf, dtype=np.uint8)
    if write:
        arr.fill(0)
    else:
        int(arr[::4096].sum())


def maybe_pin_host_memory(buf: memoryview) -> bool:
    """Page-lock the pool for fast H2D/D2H DMA when CUDA is present; no-op otherwise."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import ctypes

        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        rc = torch.cuda.cudart().cudaHostRegister(addr, buf.nbytes, 0)
        return int(rc) == 0
    except Exception as e:  # pinning is an optimisation, never a failure
        log.debug("cudaHostRegister unavailable: %s", e)
        return False


@dataclass
class _Slot:
    key: str | None = None
    length: int = 0
    leases: int = 0
    zombie: bool = False  # deleted/replaced while leased: free on last release


class DRAMTier(Tier):
    name = "dram"

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        shm_name: str | None = None,
        recover: bool = False,
    ) -> None:
        if slot_bytes <= codec.HEADER_SIZE:
            raise ValueError(f"slot_bytes must exceed the {codec.HEADER_SIZE}-byte chunk header")
        slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        n = capacity_bytes // slot_bytes
        if n < 1:
            raise ValueError(
                f"DRAM capacity {capacity_bytes} B holds no {slot_bytes} B slot; raise capacity"
            )
        self.slot_bytes = slot_bytes
        self.num_slots = n
        self._shm, created = self._open_shm(shm_name, n * slot_bytes, recover)
        assert self._shm.buf is not None
        self._buf = memoryview(self._shm.buf)[: n * slot_bytes]
        if created:
            prefault(self._buf, write=True)
        self.pinned_host = maybe_pin_host_memory(self._buf)
        self._slots = [_Slot() for _ in range(n)]
        self._index: dict[str, int] = {}
        self._free: list[int] = list(range(n - 1, -1, -1))
        self._used_bytes = 0
        # Published copy of the index, read by clients without asking the agent. Made
        # before _rebuild frees any slot: it retires a dead owner's index first.
        try:
            self.shared_index = SlotIndex(self._shm.name, n)
        except BaseException:
            self._buf.release()
            self._shm.close()
            if created:
                self._shm.unlink()
            raise
        _OWNED.add(self.shared_index.name)  # an attach in this process must not untrack it
        if recover and not created:
            self._rebuild()

    @staticmethod
    def _open_shm(
        name: str | None, size: int, recover: bool
    ) -> tuple[shared_memory.SharedMemory, bool]:
        if name and recover:
            try:
                shm = shared_memory.SharedMemory(name=name, create=False)
                if shm.size >= size:
                    _OWNED.add(shm.name)
                    return shm, False
                shm.close()
                shm.unlink()
            except FileNotFoundError:
                pass
        if name:
            with contextlib.suppress(FileNotFoundError):
                old = shared_memory.SharedMemory(name=name, create=False)
                old.close()
                old.unlink()
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        _OWNED.add(shm.name)
        return shm, True

    def _rebuild(self) -> None:
        """Re-index complete, verified chunks left in the pool by a previous owner."""
        self._free = []
        for i in range(self.num_slots - 1, -1, -1):
            mv = self.slot_view(i)
            try:
                meta, plen, _ = codec.parse_header(mv[: codec.HEADER_SIZE])
                if codec.HEADER_SIZE + plen > self.slot_bytes:
                    raise codec.ChunkCorrupt("length exceeds slot")
                if not is_valid_key(meta.key):
                    raise codec.ChunkCorrupt("not a chunk key")
                codec.decode(mv[: codec.HEADER_SIZE + plen])
            except codec.ChunkError:
                mv[:4] = b"\0\0\0\0"
                self._free.append(i)
                continue
            if meta.key in self._index:  # a replaced copy: keep one
                mv[:4] = b"\0\0\0\0"
                self._free.append(i)
                continue
            s = self._slots[i]
            s.key, s.length = meta.key, codec.HEADER_SIZE + plen
            self._index[meta.key] = i
            self._used_bytes += s.length
            self.shared_index.publish(meta.key, i, s.length)
        log.info("recovered %d chunks from DRAM pool %s", len(self._index), self.shm_name)

    # -- shared-memory slot protocol (used in-process and by the agent for clients) --

    @property
    def shm_name(self) -> str:
        return self._shm.name

    def slot_view(self, slot: int) -> memoryview:
        off = slot * self.slot_bytes
        return self._buf[off : off + self.slot_bytes]

    def reserve(self) -> int:
        """Take a free slot for a writer; TierFull when none (the caller evicts first)."""
        if not self._free:
            raise TierFull("no free DRAM slot")
        return self._free.pop()

    def abort(self, slot: int) -> None:
        self._release_slot(slot)

    def commit(self, key: str, slot: int, length: int) -> None:
        """Publish a filled slot under ``key``; the old copy is freed (or zombied)."""
        if length > self.slot_bytes:
            raise ValueError(f"chunk of {length} B exceeds slot size {self.slot_bytes} B")
        if not is_valid_key(key):  # before any state changes: a refused commit leaks nothing
            raise ValueError(f"invalid chunk key {key!r}")
        old = self._index.get(key)
        s = self._slots[slot]
        s.key, s.length, s.zombie = key, length, False
        self._index[key] = slot
        self._used_bytes += length
        self.shared_index.publish(key, slot, length)
        if old is not None:
            self._drop(old)

    def acquire(self, key: str) -> tuple[int, int] | None:
        """Lease the slot holding ``key``: (slot, length). Pair with ``release``."""
        slot = self._index.get(key)
        if slot is None:
            return None
        s = self._slots[slot]
        s.leases += 1
        return slot, s.length

    def is_leased(self, key: str) -> bool:
        slot = self._index.get(key)
        return slot is not None and self._slots[slot].leases > 0

    def release(self, slot: int) -> None:
        s = self._slots[slot]
        if s.leases <= 0:
            raise RuntimeError(f"release of unleased slot {slot}")
        s.leases -= 1
        if s.leases == 0 and s.zombie:
            self._release_slot(slot)

    def _drop(self, slot: int) -> None:
        self.shared_index.unpublish(slot)  # first: a lock-free reader must see it go
        s = self._slots[slot]
        self._used_bytes -= s.length
        if s.leases:
            s.zombie = True
        else:
            self._release_slot(slot)

    def _release_slot(self, slot: int) -> None:
        s = self._slots[slot]
        s.key, s.length, s.zombie = None, 0, False
        self.slot_view(slot)[:4] = b"\0\0\0\0"  # not a chunk any more, for crash recovery
        self._free.append(slot)

    # -- Tier interface --

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [k in self._index for k in keys]

    async def get(self, key: str) -> bytes | None:
        lease = self.acquire(key)
        if lease is None:
            return None
        slot, length = lease
        try:
            return bytes(self.slot_view(slot)[:length])
        finally:
            self.release(slot)

    def read_into(self, key: str, out: memoryview) -> int | None:
        lease = self.acquire(key)
        if lease is None:
            return None
        slot, length = lease
        try:
            out[:length] = self.slot_view(slot)[:length]
            return length
        finally:
            self.release(slot)

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        if mv.nbytes > self.slot_bytes:
            raise TierFull(f"chunk of {mv.nbytes} B exceeds DRAM slot size {self.slot_bytes} B")
        slot = self.reserve()
        try:
            self.slot_view(slot)[: mv.nbytes] = mv
        except BaseException:
            self.abort(slot)
            raise
        self.commit(key, slot, mv.nbytes)

    async def delete(self, key: str) -> bool:
        slot = self._index.pop(key, None)
        if slot is None:
            return False
        self._drop(slot)
        return True

    def usage(self) -> TierUsage:
        return TierUsage(self._used_bytes, self.num_slots * self.slot_bytes, len(self._index))

    def entries(self) -> Iterator[tuple[str, int]]:
        for k, slot in list(self._index.items()):
            yield k, self._slots[slot].length

    def size_of(self, key: str) -> int | None:
        slot = self._index.get(key)
        return None if slot is None else self._slots[slot].length

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def has_room(self, nbytes: int) -> bool:
        return bool(self._free)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    async def close(self, unlink: bool = True) -> None:
        self.shared_index.close(unlink)
        with contextlib.suppress(BufferError):  # views still held elsewhere: let GC unmap
            self._buf.release()
            self._shm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
