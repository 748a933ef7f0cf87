"""NVMe tier: one file per chunk on a local filesystem.

Layout: ``<root>/<key[:2]>/<key>.kvc`` holds one encoded chunk (codec header + payload);
``<root>/.tmp/`` holds writes in flight; ``<root>/.lock`` is flock'ed by the one process
that owns the directory (a second owner would delete the first's in-flight temp files and
double-book the disk, so opening an owned directory raises ``TierError``).

Permissions: the root is made (or, if ours, narrowed to) 0700 and every file in it is
0600: chunks are prompts' KV. A root that belongs to another user is refused
(``UnsafePath``): its owner could read and replace our chunks.

Lifecycle: the constructor *is* the open. It takes the lock, deletes ``.tmp`` leftovers and
rebuilds the in-memory index from disk before returning; there is nothing else to call.
``close()`` shuts the I/O pool down and releases the lock.

Crash safety: a put writes a unique temp file, renames it over the final name, then
fsyncs the file. Rename is atomic, so a reader (or a restart after ``kill -9``) sees the
old chunk, the new one, or none, never a torn file. The one fsync after the rename makes
the bytes and the name durable in one journal commit on ext4 and XFS; on a filesystem
where it does not cover the name, a power cut can lose the name (a future miss, and the
restart scan drops any file whose size or header does not check out). A reader that opened the old
file keeps reading the old inode, so a put racing a get cannot tear it either.

Restart scan: every ``*.kvc`` has its 256-byte header parsed and checked (header checksum,
key == file name, file size == header + payload length; for an at-rest envelope, the
envelope's clear header: ``at_rest.describe``); anything else is deleted and
counted in ``verification_failures{tier="nvme"}``. The *payload* checksum is not verified
here: that would mean reading the whole disk (100s of GB) before serving. ``get`` returns
bytes unverified, and the hierarchy verifies each chunk with ``codec.decode`` when it is
read, turning a damaged payload into a miss.

I/O runs on a bounded thread pool (``max_concurrency`` workers), one large contiguous
write per chunk (``os.writev`` of the caller's buffers, no per-element work). With
``o_direct=True`` reads and writes bypass the page cache through per-thread page-aligned
buffers backed by huge pages where the kernel allows (``hugepage_buffer``), padded to
4096 bytes; the file is then truncated to its real length; a filesystem
that refuses O_DIRECT is detected at open and the tier falls back to buffered I/O with a
warning (``o_direct_active`` tells which is in use).

The tier never evicts: ``put`` raises ``TierFull`` when the chunk does not fit in
``capacity_bytes`` (replacing a key counts only the size difference) or when the disk
itself is full (ENOSPC, EDQUOT, EFBIG); the hierarchy evicts with ``delete`` and retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tiered_cache import at_rest, codec
from tiered_cache.keys import is_valid_key
from tiered_cache.metrics import Metrics
from tiered_cache.private_dir import refuse_foreign
from tiered_cache.tiers.base import Tier, TierError, TierFull, TierUsage

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")

ALIGN = 4096  # O_DIRECT offset/length/address alignment (covers 512 and 4K sectors)
SUFFIX = ".kvc"
_TMP = ".tmp"
_LOCK = ".lock"
_NSTRIPES = 256  # one lock per key[:2] directory: same-key ops serialise, others rarely wait
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _address(buf: memoryview) -> int:
    # from_buffer needs a writable buffer, which readinto targets are anyway.
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@dataclass(frozen=True)
class ScanReport:
    """What the open-time scan found."""

    chunks: int
    bytes: int
    discarded: int  # partial/corrupt/misnamed .kvc files deleted
    tmp_removed: int  # leftovers of writes interrupted by a crash


def hugepage_buffer(n: int) -> mmap.mmap:
    """A page-aligned private buffer that transparent huge pages may back.

    O_DIRECT pins the buffer's pages and hands the device one segment per physically
    contiguous run. From 4 KiB-page memory (shared memory, or ``mmap.mmap(-1, n)``, which
    is shared too) a virtio disk here moved 8 MiB 2.4x slower on reads and 1.7x slower on
    writes than from 2 MiB pages. So O_DIRECT goes through one of these, at the cost of a
    memcpy (~0.4 ms per 8 MiB)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, n, flags=flags) if flags else mmap.mmap(-1, n)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # no THP here: plain pages still work
            buf.madvise(advice)
    return buf


class NVMeTier(Tier):
    name = "nvme"
    counts_write_errors = frozenset({"full", "io"})

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | None,
        *,
        max_concurrency: int = 8,
        o_direct: bool = False,
        fsync: bool = True,
        read_bounce: bool = True,
        metrics: Metrics | None = None,
    ) -> None:
        """Open (creating if needed) the tier at ``path`` and rebuild its index.

        Blocking: scans the directory, so call it before serving (or via ``asyncio.to_thread``).
        ``fsync=False`` keeps crash safety against process death (rename is still atomic)
        but not against power loss. ``read_bounce`` (O_DIRECT only): ``get_into`` reads
        into a huge-page buffer and copies, rather than straight into the caller's buffer
        (see ``hugepage_buffer``); turn it off where DMA into the caller's memory is as fast.
        """
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0 or None")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self.root = Path(path)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.read_bounce = read_bounce
        self._metrics = metrics
        self._tmp = self.root / _TMP
        self._mu = threading.Lock()  # guards _index, _used, _reserved
        self._stripes = [threading.Lock() for _ in range(_NSTRIPES)]
        self._index: dict[str, int] = {}
        self._recovered: dict[str, tuple[str, int, str]] = {}
        self._used = 0
        self._reserved = 0  # bytes promised to puts in flight, so concurrent puts can't overbook
        self._closed = False
        self._tls = threading.local()  # per-I/O-thread aligned buffers (O_DIRECT)

        try:
            self._private_root()
            self._lock_fd = os.open(self.root / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise TierError(f"cannot open NVMe tier at {self.root}: {e}") from e
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            raise TierError(f"{self.root} is already owned by another NVMeTier: {e}") from e

        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="nvme-io")
        try:
            self._prepare_dirs()
            self.o_direct_active = o_direct and self._probe_o_direct()
            self.last_scan = self._scan()
        except BaseException:
            self._pool.shutdown(wait=True)
            os.close(self._lock_fd)
            raise
        if metrics is not None:
            metrics.capacity_bytes.labels(tier=self.name).set(capacity_bytes or 0)
        self._publish_used()

    # ------------------------------------------------------------------ open-time work

    def _private_root(self) -> None:
        """Create the root 0700 (its missing parents too), or check an existing one."""
        if not self.root.exists():
            self.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                self.root.mkdir(mode=0o700)
        st = self.root.stat()
        why = "its owner could read and replace our chunks; chown it or set nvme.path"
        refuse_foreign(f"NVMe directory {self.root}", st, why)
        if st.st_mode & 0o077:
            log.warning(
                "NVMe directory %s was open to other users (mode %04o): made 0700",
                self.root,
                stat.S_IMODE(st.st_mode),
            )
            os.chmod(self.root, 0o700)

    def _prepare_dirs(self) -> None:
        created = False
        self._tmp.mkdir(mode=0o700, exist_ok=True)
        tmp_removed = 0
        for entry in os.scandir(self._tmp):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                tmp_removed += 1
        self._tmp_removed = tmp_removed
        # All 256 fan-out directories up front: a put then never creates a directory, so
        # it only has to fsync the one directory it renames into.
        for i in range(_NSTRIPES):
            d = self.root / f"{i:02x}"
            if not d.is_dir():
                d.mkdir(mode=0o700)
                created = True
        if created:
            self._fsync_dir(self.root)

    def _probe_o_direct(self) -> bool:
        if not _O_DIRECT:
            log.warning("O_DIRECT is not available on this platform; NVMe tier uses buffered I/O")
            return False
        probe = self._tmp / f"odirect-probe.{uuid.uuid4().hex}"
        buf = mmap.mmap(-1, ALIGN)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600)
            try:
                os.write(fd, buf)
            finally:
                os.close(fd)
            fd = os.open(probe, os.O_RDONLY | _O_DIRECT)
            try:
                os.readv(fd, [buf])
            finally:
                os.close(fd)
            return True
        except OSError as e:
            log.warning(
                "filesystem at %s refused O_DIRECT (%s); NVMe tier falls back to buffered I/O",
                self.root,
                e,
            )
            return False
        finally:
            buf.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(probe)

    def _scan(self) -> ScanReport:
        candidates: list[tuple[str, str, str]] = []  # (path, dir name, file name)
        for d in os.scandir(self.root):
            if d.name.startswith(".") or not d.is_dir(follow_symlinks=False):
                continue
            for f in os.scandir(d.path):
                if f.name.endswith(SUFFIX):
                    candidates.append((f.path, d.name, f.name))
        # Header reads are latency-bound: overlap them on the I/O pool.
        results = list(self._pool.map(self._check_file, candidates))
        discarded = 0
        for (fpath, _, fname), got in zip(candidates, results, strict=True):
            if got is None:
                discarded += 1
                if self._metrics is not None:
                    self._metrics.verification_failures.labels(tier=self.name).inc()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(fpath)
                continue
            key, (size, parent, position, tenant) = fname[: -len(SUFFIX)], got
            self._index[key] = size
            if parent or position or tenant:
                self._recovered[key] = (parent, position, tenant)
        self._used = sum(self._index.values())
        report = ScanReport(len(self._index), self._used, discarded, self._tmp_removed)
        log.info("NVMe tier %s opened: %s", self.root, report)
        if self.capacity_bytes is not None and self._used > self.capacity_bytes:
            log.warning(
                "NVMe tier %s holds %d bytes, over its capacity %d; the hierarchy must evict",
                self.root,
                self._used,
                self.capacity_bytes,
            )
        return report

    def _check_file(self, item: tuple[str, str, str]) -> tuple[int, str, int, str] | None:
        """(size, parent, position, tenant) of a well-formed chunk file, or None (with the reason
        logged)."""
        fpath, dname, fname = item
        key = fname[: -len(SUFFIX)]
        try:
            if not is_valid_key(key) or key[:2] != dname:
                raise codec.ChunkCorrupt("file name is not <key[:2]>/<key>.kvc")
            with open(fpath, "rb", buffering=0) as f:
                header = f.read(codec.HEADER_SIZE)
                size = os.fstat(f.fileno()).st_size
            if at_rest.is_envelope(header):  # compressed or sealed: its clear fields say
                info = at_rest.describe(header)
                meta_key, want, fields = info.key, info.size, (info.parent, info.position,
                                                               info.tenant)  # fmt: skip
            else:
                meta, payload_len, _ = codec.parse_header(header)
                meta_key, want = meta.key, codec.HEADER_SIZE + payload_len
                fields = (meta.parent, meta.position, meta.tenant)
            if meta_key != key:
                raise codec.ChunkCorrupt(f"header is for key {meta_key}")
            if size != want:
                raise codec.ChunkCorrupt(f"size {size} != {want} (its header's length)")
            return size, *fields
        except (OSError, ValueError, codec.ChunkError) as e:  # ValueError: undecodable text
            log.warning("discarding NVMe chunk %s: %s", fpath, e)
            return None

    # ------------------------------------------------------------------ helpers

    def _path(self, key: str) -> str:
        # The regex check is the path-traversal guard: nothing but 32 hex chars gets in.
        if not is_valid_key(key):
            raise ValueError(f"invalid chunk key {key!r}")
        return os.path.join(self.root, key[:2], key + SUFFIX)

    def _stripe(self, key: str) -> threading.Lock:
        return self._stripes[int(key[:2], 16)]

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("NVMe tier is closed")

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        self._check_open()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    def _fsync_dir(self, d: str | os.PathLike[str]) -> None:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _publish_used(self) -> None:
        if self._metrics is not None:
            self._metrics.used_bytes.labels(tier=self.name).set(self._used)

    def _count(self, counter: str, n: float = 1, **labels: str) -> None:
        if self._metrics is not None:
            getattr(self._metrics, counter).labels(tier=self.name, **labels).inc(n)

    # ------------------------------------------------------------------ Tier API

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        for k in keys:
            if not is_valid_key(k):
                raise ValueError(f"invalid chunk key {k!r}")
        with self._mu:
            return [k in self._index for k in keys]

    def usage(self) -> TierUsage:
        with self._mu:
            return TierUsage(self._used, self.capacity_bytes, len(self._index))

    def take_recovered(self) -> dict[str, tuple[str, int, str]]:
        got, self._recovered = self._recovered, {}
        return got

    def entries(self) -> Iterator[tuple[str, int]]:
        with self._mu:
            snapshot = list(self._index.items())
        return iter(snapshot)

    def size_of(self, key: str) -> int | None:
        with self._mu:
            return self._index.get(key)

    async def put(self, key: str, data: Buffer) -> None:
        await self.put_parts(key, [data])

    async def put_parts(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` (e.g. ``[pack_header(...), payload]``) as
        one chunk, written with a single ``writev``: no concatenation copy in Python.

        Raises ``TierFull`` (capacity or disk full: nothing changes) or ``TierError``.
        """
        path = self._path(key)
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        await self._run(self._put_sync, key, path, views, size)

    async def get(self, key: str) -> bytes | None:
        path = self._path(key)
        self._check_open()
        if self.size_of(key) is None:  # misses cost no I/O
            return None
        return await self._run(self._get_sync, path)

    async def get_into(self, key: str, out: memoryview) -> int | None:
        """Read the chunk straight into ``out`` (writable, at least ``size_of(key)`` bytes);
        returns the chunk's length, or None when absent. Raises ValueError if ``out`` is
        too small. With O_DIRECT the read lands in ``out`` without a bounce copy when
        ``out`` is 4096-aligned and has room for the length rounded up to 4096."""
        path = self._path(key)
        self._check_open()
        if self.size_of(key) is None:
            return None
        return await self._run(self._get_into_sync, path, memoryview(out).cast("B"))

    async def delete(self, key: str) -> bool:
        path = self._path(key)
        return await self._run(self._delete_sync, key, path)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._pool.shutdown, True)
        os.close(self._lock_fd)

    # ------------------------------------------------------------------ blocking work

    def _put_sync(self, key: str, path: str, views: list[memoryview], size: int) -> None:
        with self._stripe(key):  # same-key puts/deletes serialise, so old size is stable
            with self._mu:
                delta = size - self._index.get(key, 0)
                if (
                    self.capacity_bytes is not None
                    and self._used + self._reserved + delta > self.capacity_bytes
                ):
                    raise TierFull(
                        f"nvme: chunk of {size} bytes does not fit (used {self._used}, "
                        f"in flight {self._reserved}, capacity {self.capacity_bytes})"
                    )
                reserve = max(delta, 0)
                self._reserved += reserve
            tmp = os.path.join(self._tmp, f"{key}.{uuid.uuid4().hex}")
            committed = False
            fd = -1
            try:
                fd = self._write_file(tmp, views, size)
                os.rename(tmp, path)
                tmp = path  # what to remove if the fsync below fails
                if self.fsync:
                    # After the rename: one journal commit makes both the bytes and the
                    # new name durable (ext4, XFS), where fsync-then-rename-then-fsync-dir
                    # costs two. Readers may open the file before it: it is already whole.
                    os.fsync(fd)
                committed = True
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                if e.errno in _FULL_ERRNOS:
                    self._count("write_errors", reason="full")
                    raise TierFull(f"nvme: disk full writing {size} bytes: {e}") from e
                self._count("write_errors", reason="io")
                raise TierError(f"nvme: write of {key} failed: {e}") from e
            finally:
                if fd >= 0:
                    os.close(fd)
                with self._mu:
                    self._reserved -= reserve
                    if committed:
                        self._index[key] = size
                        self._used += delta
                    elif tmp == path and self._index.pop(key, None) is not None:
                        self._used -= size - delta  # the old copy went with the rename
                self._publish_used()
        self._count("bytes_written", size)

    def _write_file(self, tmp: str, views: list[memoryview], size: int) -> int:
        """Write the chunk to a new file ``tmp``; return its open fd (the caller fsyncs and
        closes it), or raise with nothing left open."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        direct = self.o_direct_active
        fd = os.open(tmp, flags | (_O_DIRECT if direct else 0), 0o600)
        try:
            if not direct:
                self._write_all(fd, views)
                return fd
            padded = _round_up(size)
            if padded:
                # A per-thread page-aligned buffer, reused: a fresh mmap per write cost
                # a page fault per 4 KiB (as much as the copy itself).
                with memoryview(self._aligned(padded))[:padded] as buf:
                    off = 0
                    for v in views:
                        buf[off : off + v.nbytes] = v  # one memcpy per part
                        off += v.nbytes
                    n = os.write(fd, buf)
                if n != padded:
                    # A short write to a regular file means space (or the file size
                    # limit) ran out, and O_DIRECT cannot resume at an odd offset.
                    raise OSError(errno.ENOSPC, f"short O_DIRECT write ({n} of {padded})")
            os.ftruncate(fd, size)  # drop the alignment padding
            return fd
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _write_all(fd: int, views: list[memoryview]) -> None:
        pending = [v for v in views if v.nbytes]
        while pending:
            n = os.writev(fd, pending)  # normally the whole chunk in one call
            if n <= 0:
                raise OSError(errno.EIO, "write made no progress")
            while n:
                head = pending[0]
                if n >= head.nbytes:
                    n -= head.nbytes
                    pending.pop(0)
                else:
                    pending[0] = head[n:]
                    n = 0

    def _open_read(self, path: str) -> int | None:
        flags = os.O_RDONLY | (_O_DIRECT if self.o_direct_active else 0)
        try:
            return os.open(path, flags)
        except FileNotFoundError:  # deleted or replaced-then-deleted under us: a miss
            return None

    def _read_error(self, path: str, e: OSError) -> TierError:
        self._count("read_errors")
        return TierError(f"nvme: read of {path} failed: {e}")

    def _aligned(self, n: int) -> mmap.mmap:
        """This I/O thread's page-aligned scratch buffer, grown to at least ``n`` bytes."""
        buf: mmap.mmap | None = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < n:
            if buf is not None:
                buf.close()
            buf = hugepage_buffer(n)
            self._tls.buf = buf
        return buf

    def _get_sync(self, path: str) -> bytes | None:
        try:
            fd = self._open_read(path)
            if fd is None:
                return None
            try:
                size = os.fstat(fd).st_size
                if self.o_direct_active:
                    # O_DIRECT reads whole aligned blocks: read the padded length into an
                    # aligned buffer (the kernel stops at EOF) and keep the real bytes.
                    buf = self._aligned(max(_round_up(size), ALIGN))
                    got = self._read_all(fd, buf, size)
                    data = buf[:got]
                else:
                    # os.read fills a fresh bytes object directly: one copy from the kernel.
                    data = os.read(fd, size)
                    while len(data) < size:
                        more = os.read(fd, size - len(data))
                        if not more:
                            break
                        data += more
            finally:
                os.close(fd)
        except OSError as e:
            raise self._read_error(path, e) from e
        self._count("bytes_read", len(data))
        return data

    def _get_into_sync(self, path: str, out: memoryview) -> int | None:
        try:
            fd = self._open_read(path)
            if fd is None:
                return None
            try:
                size = os.fstat(fd).st_size
                if out.nbytes < size:
                    raise ValueError(f"buffer of {out.nbytes} bytes too small for {size}")
                padded = _round_up(size)
                if not self.o_direct_active or (
                    not self.read_bounce and out.nbytes >= padded and _address(out) % ALIGN == 0
                ):  # straight into the caller's buffer
                    got = self._read_all(fd, out, size)
                else:  # through this thread's huge-page buffer, then one copy
                    buf = self._aligned(max(padded, ALIGN))
                    got = self._read_all(fd, buf, size)
                    with memoryview(buf) as mv, mv[:got] as src:
                        out[:got] = src
            finally:
                os.close(fd)
        except OSError as e:
            raise self._read_error(path, e) from e
        self._count("bytes_read", got)
        return got

    @staticmethod
    def _read_all(fd: int, target: memoryview | mmap.mmap, size: int) -> int:
        """Read the file from offset 0 into ``target``, whose length past ``size`` (O_DIRECT
        alignment) the kernel may fill up to EOF; returns ``size`` unless the file shrank.

        Sub-views are released before returning, even on error, so the caller can close
        an mmap ``target`` (an export kept alive by a traceback would make close() fail)."""
        with memoryview(target) as whole:
            limit = min(whole.nbytes, _round_up(size))
            got = 0
            while got < size:
                with whole[got:limit] as rest:
                    n = os.preadv(fd, [rest], got)
                if n == 0:
                    break
                got += n
        return min(got, size)

    def _delete_sync(self, key: str, path: str) -> bool:
        with self._stripe(key):
            try:
                os.unlink(path)
                removed = True
            except FileNotFoundError:
                removed = False
            except OSError as e:
                raise TierError(f"nvme: delete of {key} failed: {e}") from e
            with self._mu:
                size = self._index.pop(key, None)
                if size is not None:
                    self._used -= size
            self._publish_used()
        # No directory fsync: a delete lost to a power cut resurrects a valid chunk,
        # which the next scan indexes again. Harmless for a cache.
        return removed
