"""DRAM tier: a fixed-capacity shared-memory pool carved into fixed-size slots.

The pool is allocated once (POSIX shared memory) and owned by the node agent; vLLM
processes on the node attach it by name and copy KV in and out of it directly, so a
prefill and a decode process on one node hand off without a disk round trip.

A chunk occupies a *run* of consecutive slots (``ceil(size / slot_bytes)``), named by its
first slot, so chunks of any model size fit without tuning: Llama-3-70B at TP 1 writes
80 MiB chunks, a tiny test model 256 KiB ones. Free slots are kept as extents and a run
is taken best-fit; with ``slot_bytes: auto`` (0, the default) the slot is the pool's
capacity / 65536, at least 64 KiB, so a pool has at most 65,536 slots to track.

Safety rules (no torn reads, no double frees):
- a writer fills a *reserved* run, and only ``commit`` makes it visible under a key;
- readers in the agent take a lease (``acquire``) and ``release`` it after copying; a run
  deleted or replaced while leased becomes a zombie and returns to the free extents on its
  last release;
- clients read without a lease, through the shared index (``shm_index``): they find the
  run, copy, and keep the copy only if its generation did not move meanwhile;
- every run begins with a self-describing chunk header, so after an agent crash or a
  clean stop the pool can be re-attached and its index rebuilt by scanning slots
  (``recover=True``).

Ownership: ``/dev/shm`` is world-writable, so a segment under the pool's name may have
been made by someone else. It is adopted only if it is ours (our euid) and closed to
group and others (0600, as it is created); a segment of another user's is refused
(``UnsafePath``: we must not unlink another user's pool, nor serve bytes they can
change), and one of ours that others could reach is replaced by a fresh pool, since its
contents cannot be trusted.

Lifetime: a pool opened with ``recover=True`` (the agent's) is kept out of Python's
resource tracker, which would otherwise unlink it when the process dies, crash or not;
with ``keep_on_close`` a clean ``close()`` leaves it for the next owner too.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import stat
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

from tiered_cache import codec
from tiered_cache.keys import is_valid_key
from tiered_cache.private_dir import UnsafePath, refuse_foreign
from tiered_cache.tiers.base import SlotTier, TierFull, TierUsage
from tiered_cache.tiers.shm_index import SlotIndex, index_name

log = logging.getLogger(__name__)

_ALIGN = 4096
AUTO_MIN_SLOT = 64 * 2**10
AUTO_MAX_SLOTS = 65536


def auto_slot_bytes(capacity_bytes: int) -> int:
    """The slot size ``slot_bytes: auto`` picks: a power of two >= 64 KiB that cuts the
    pool into at most 65,536 slots (bookkeeping stays small; a run wastes < 1 slot)."""
    n = AUTO_MIN_SLOT
    while capacity_bytes // n > AUTO_MAX_SLOTS:
        n *= 2
    return n


# Segments this process's resource tracker holds (it unlinks them when the process
# ends). An attach must leave them tracked; anything else it must untrack.
_OWNED: set[str] = set()


def _tracker_name(name: str) -> str:
    return "/" + name if os.name == "posix" else name  # how SharedMemory registers it


def _set_tracked(name: str, tracked: bool) -> None:
    if tracked and name not in _OWNED:
        resource_tracker.register(_tracker_name(name), "shared_memory")
        _OWNED.add(name)
    elif not tracked and name in _OWNED:
        with contextlib.suppress(Exception):
            resource_tracker.unregister(_tracker_name(name), "shared_memory")
        _OWNED.discard(name)


def _unlink(shm: shared_memory.SharedMemory) -> None:
    # SharedMemory.unlink unregisters it: an untracked name must be registered first, or
    # the tracker prints a KeyError traceback.
    _set_tracked(shm.name, True)
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()
    _OWNED.discard(shm.name)


def attach_shm(name: str) -> shared_memory.SharedMemory:
    """Attach an existing pool without letting this process's resource tracker unlink it
    at exit (a CPython <3.13 pitfall: attaching processes would destroy the owner's pool)."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    if shm.name not in _OWNED:
        with contextlib.suppress(Exception):
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _existing(name: str) -> tuple[shared_memory.SharedMemory, os.stat_result] | None:
    """The segment already under ``name`` and its owner and mode, or None; UnsafePath if
    it is another user's (refused: see the module docstring)."""
    where = f"shared memory /dev/shm/{name}"
    try:
        shm = attach_shm(name)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise UnsafePath(
            f"{where} exists and this user cannot open it: another user's; remove it or set"
            " dram.shm_name"
        ) from None
    except ValueError:  # mmap of an empty segment: not a pool anyone made
        raise UnsafePath(f"{where} exists but is empty (not a pool); remove it") from None
    st = os.fstat(shm._fd)  # type: ignore[attr-defined]  # the very segment we mapped
    try:
        why = "not adopted (another user's pool, or one planted to be); remove it or set"
        refuse_foreign(where, st, why + " dram.shm_name")
    except UnsafePath:
        shm.close()
        raise
    return shm, st


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


@dataclass
class _Run:
    pages: int  # slots it spans
    key: str | None = None  # None while reserved
    length: int = 0
    leases: int = 0
    zombie: bool = False  # deleted/replaced while leased: free on last release


class _Extents:
    """Free slots as maximal extents, for best-fit allocation of runs: O(log n) to find
    the smallest extent that fits, O(1) merges with both neighbours on free."""

    def __init__(self) -> None:
        self._start: dict[int, int] = {}  # first slot -> length
        self._end: dict[int, int] = {}  # one past the last slot -> first slot
        self._sizes: list[tuple[int, int]] = []  # (length, first slot), sorted
        self.free = 0

    def _remove(self, first: int) -> int:
        n = self._start.pop(first)
        del self._end[first + n]
        self._sizes.pop(bisect.bisect_left(self._sizes, (n, first)))
        self.free -= n
        return n

    def add(self, first: int, n: int) -> None:
        if first in self._end:  # merge with the extent just below
            below = self._end[first]
            n += self._remove(below)
            first = below
        if first + n in self._start:  # ... and with the one just above
            n += self._remove(first + n)
        self._start[first] = n
        self._end[first + n] = first
        bisect.insort(self._sizes, (n, first))
        self.free += n

    def take(self, n: int) -> int | None:
        i = bisect.bisect_left(self._sizes, (n, -1))
        if i == len(self._sizes):
            return None
        length, first = self._sizes[i]
        self._remove(first)
        if length > n:
            self.add(first + n, length - n)
        return first

    @property
    def largest(self) -> int:
        return self._sizes[-1][0] if self._sizes else 0


class DRAMTier(SlotTier):
    name = "dram"

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int = 0,
        *,
        shm_name: str | None = None,
        recover: bool = False,
        keep_on_close: bool = False,
    ) -> None:
        """``recover``: adopt (re-index) a pool of ours left under ``shm_name``, and let
        the pool outlive this process. ``keep_on_close``: ``close()`` keeps the pool for
        the next owner (a warm restart) instead of removing it."""
        if slot_bytes == 0:
            slot_bytes = auto_slot_bytes(capacity_bytes)
        slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        n = capacity_bytes // slot_bytes
        if n < 1:
            raise ValueError(
                f"DRAM capacity {capacity_bytes} B holds no {slot_bytes} B slot; raise capacity"
            )
        self.slot_bytes = slot_bytes
        self.num_slots = n
        self.pool_bytes = n * slot_bytes
        self.keep_on_close = keep_on_close
        self._closed = False
        if shm_name and (ix := _existing(index_name(shm_name))) is not None:
            ix[0].close()  # ours: SlotIndex retires and replaces it (another's is refused)
        self._shm, created = self._open_shm(shm_name, self.pool_bytes, recover)
        # Untracked, or the resource tracker unlinks it when this process dies.
        self._outlives = recover or keep_on_close
        if self._outlives:
            _set_tracked(self._shm.name, False)
        assert self._shm.buf is not None
        self._buf = memoryview(self._shm.buf)[: self.pool_bytes]
        if created:
            prefault(self._buf, write=True)
        # Never page-locked here: the agent copies nothing to a GPU, and registering would
        # create a CUDA context in it. The GPU worker pins its own mapping (client.pin_pool).
        self._runs: dict[int, _Run] = {}  # first slot -> run (committed, reserved, zombie)
        self._index: dict[str, int] = {}
        self._leased: set[int] = set()  # slots of runs with leases > 0
        self._recovered: dict[str, tuple[str, int, str]] = {}
        self._free = _Extents()
        self._used_bytes = 0
        # Published copy of the index, read by clients without asking the agent. Made
        # before _rebuild frees any slot: it retires a dead owner's index first.
        try:
            self.shared_index = SlotIndex(self._shm.name, n)
        except BaseException:
            self._buf.release()
            self._shm.close()
            if created:
                _unlink(self._shm)
            raise
        _OWNED.add(self.shared_index.name)  # created tracked: an attach must not untrack it
        if self._outlives:  # left for the next owner to retire, as the pool to adopt
            _set_tracked(self.shared_index.name, False)
        if recover and not created:
            self._rebuild()
        else:
            self._free.add(0, n)

    @staticmethod
    def _open_shm(
        name: str | None, size: int, recover: bool
    ) -> tuple[shared_memory.SharedMemory, bool]:
        got = _existing(name) if name else None
        if got is not None:
            old, st = got
            if st.st_mode & 0o077:
                log.warning(
                    "DRAM pool %s was open to other users (mode %04o): its contents are not"
                    " trusted; starting with a fresh pool",
                    name,
                    stat.S_IMODE(st.st_mode),
                )
            elif recover and old.size >= size:
                return old, False
            old.close()
            _unlink(old)
        # O_CREAT | O_EXCL, mode 0600: a name someone took meanwhile fails here.
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        _OWNED.add(shm.name)
        return shm, True

    def _pages(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.slot_bytes))

    def _rebuild(self) -> None:
        """Re-index complete, verified chunks left in the pool by a previous owner."""
        i = 0
        free_from: int | None = None
        while i < self.num_slots:
            off = i * self.slot_bytes
            mv = self._buf[off:]
            try:
                meta, plen, _ = codec.parse_header(mv[: codec.HEADER_SIZE])
                length = codec.HEADER_SIZE + plen
                if length > mv.nbytes:
                    raise codec.ChunkCorrupt("length exceeds the pool")
                if not is_valid_key(meta.key):
                    raise codec.ChunkCorrupt("not a chunk key")
                if meta.key in self._index:  # a replaced copy: keep one
                    raise codec.ChunkCorrupt("duplicate")
                codec.decode(mv[:length])
            except codec.ChunkError:
                mv[:4] = b"\0\0\0\0"
                if free_from is None:
                    free_from = i
                i += 1
                continue
            if free_from is not None:
                self._free.add(free_from, i - free_from)
                free_from = None
            pages = self._pages(length)
            self._runs[i] = _Run(pages, meta.key, length)
            self._index[meta.key] = i
            if meta.parent or meta.position or meta.tenant:
                self._recovered[meta.key] = (meta.parent, meta.position, meta.tenant)
            self._used_bytes += length
            self.shared_index.publish(meta.key, i, length)
            i += pages
        if free_from is not None:
            self._free.add(free_from, self.num_slots - free_from)
        log.info("recovered %d chunks from DRAM pool %s", len(self._index), self.shm_name)

    # -- shared-memory slot protocol (used in-process and by the agent for clients) --

    @property
    def shm_name(self) -> str:
        return self._shm.name

    def slot_view(self, slot: int) -> memoryview:
        """The bytes of the run that starts at ``slot`` (one slot if none does)."""
        run = self._runs.get(slot)
        off = slot * self.slot_bytes
        return self._buf[off : off + self.slot_bytes * (run.pages if run else 1)]

    def reserve(self, nbytes: int = 1) -> int:
        """Take a free run for a writer of ``nbytes``; TierFull when no free extent is
        long enough (the caller evicts first)."""
        pages = self._pages(nbytes)
        first = self._free.take(pages)
        if first is None:
            raise TierFull(f"no free DRAM run of {pages} slots")
        self._runs[first] = _Run(pages)
        return first

    def abort(self, slot: int) -> None:
        self._release_slot(slot)

    def commit(self, key: str, slot: int, length: int) -> None:
        """Publish a filled run under ``key``; the old copy is freed (or zombied)."""
        run = self._runs.get(slot)
        if run is None or run.key is not None:
            raise ValueError(f"slot {slot} is not reserved")
        if not 0 < length <= run.pages * self.slot_bytes:
            raise ValueError(
                f"chunk of {length} B does not fit its {run.pages * self.slot_bytes} B run"
            )
        if not is_valid_key(key):  # before any state changes: a refused commit leaks nothing
            raise ValueError(f"invalid chunk key {key!r}")
        old = self._index.get(key)
        run.key, run.length, run.zombie = key, length, False
        self._index[key] = slot
        self._used_bytes += length
        self.shared_index.publish(key, slot, length)
        if old is not None:
            self._drop(old)

    def acquire(self, key: str) -> tuple[int, int] | None:
        """Lease the run holding ``key``: (slot, length). Pair with ``release``."""
        slot = self._index.get(key)
        if slot is None:
            return None
        run = self._runs[slot]
        run.leases += 1
        self._leased.add(slot)
        return slot, run.length

    def take_recovered(self) -> dict[str, tuple[str, int, str]]:
        got, self._recovered = self._recovered, {}
        return got

    def leased(self) -> Set[str]:
        runs = self._runs
        return {k for s in self._leased if not runs[s].zombie and (k := runs[s].key) is not None}

    def release(self, slot: int) -> None:
        run = self._runs.get(slot)
        if run is None or run.leases <= 0:
            raise RuntimeError(f"release of unleased slot {slot}")
        run.leases -= 1
        if run.leases == 0:
            self._leased.discard(slot)
            if run.zombie:
                self._release_slot(slot)

    def _drop(self, slot: int) -> None:
        self.shared_index.unpublish(slot)  # first: a lock-free reader must see it go
        run = self._runs[slot]
        self._used_bytes -= run.length
        if run.leases:
            run.zombie = True
        else:
            self._release_slot(slot)

    def _release_slot(self, slot: int) -> None:
        run = self._runs.pop(slot)
        off = slot * self.slot_bytes
        self._buf[off : off + 4] = b"\0\0\0\0"  # not a chunk any more, for crash recovery
        self._free.add(slot, run.pages)

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
        if not is_valid_key(key):  # before reserving: commit would refuse it, the run leak
            raise ValueError(f"invalid chunk key {key!r}")
        if not self.fits(mv.nbytes):
            raise TierFull(
                f"chunk of {mv.nbytes} B exceeds the DRAM pool ({self.pool_bytes} B)"
            )
        slot = self.reserve(mv.nbytes)
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
        return TierUsage(self._used_bytes, self.pool_bytes, len(self._index))

    def entries(self) -> Iterator[tuple[str, int]]:
        for k, slot in list(self._index.items()):
            yield k, self._runs[slot].length

    def size_of(self, key: str) -> int | None:
        slot = self._index.get(key)
        return None if slot is None else self._runs[slot].length

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.pool_bytes

    def has_room(self, nbytes: int) -> bool:
        return self._free.largest >= self._pages(nbytes)

    @property
    def free_slots(self) -> int:
        return self._free.free

    def accounting(self) -> dict[str, int]:
        """The pool's books, for leak checks (the agent's ``stats``): O(runs), off the hot
        path. Idle, ``reserved_runs`` and ``leases`` are 0 and ``free_slots`` plus the
        chunks' slots is ``num_slots``."""
        runs = self._runs.values()
        return {
            "num_slots": self.num_slots,
            "free_slots": self._free.free,
            "chunks": len(self._index),
            "chunk_slots": sum(r.pages for r in runs if r.key is not None and not r.zombie),
            "reserved_runs": sum(r.key is None for r in runs),
            "zombie_runs": sum(r.zombie for r in runs),
            "leases": sum(r.leases for r in runs),
            "used_bytes": self._used_bytes,
        }

    async def close(self, unlink: bool | None = None) -> None:
        """``unlink=True``: remove the pool. ``False``: leave pool and index exactly as
        they are (what a crash leaves). ``None`` (default): keep the pool if
        ``keep_on_close``, else remove it."""
        if self._closed:
            return
        self._closed = True
        keep = self.keep_on_close if unlink is None else not unlink
        if unlink is False:
            self.shared_index.close(False)
        else:  # retired and removed: clients still attached stop trusting it
            _set_tracked(self.shared_index.name, True)  # its unlink unregisters it
            self.shared_index.close(True)
        if keep and unlink is None:
            self._hand_over()
        with contextlib.suppress(BufferError):  # views still held elsewhere: let GC unmap
            self._buf.release()
            self._shm.close()
        if not keep:
            _unlink(self._shm)

    def _hand_over(self) -> None:
        """Leave the pool as the next owner's scan adopts it: every committed chunk, and
        nothing else (runs still reserved, or dropped while leased, lose their header)."""
        for slot, run in self._runs.items():
            if run.key is None or run.zombie:
                off = slot * self.slot_bytes
                self._buf[off : off + 4] = b"\0\0\0\0"
        n = len(self._index)
        log.info("kept DRAM pool %s with %d chunks for the next start", self.shm_name, n)
