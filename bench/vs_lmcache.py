"""Tier-level side by side against LMCache's storage backends, in one run (issue #4, part 3).

Both sides get the same chunk stream: chunk ``i`` has the same key and the same random
payload for every contender. A chunk is LMCache's layout, shape ``(2, L, 256, 512)``
float32 (256 tokens, ``L`` layers of 4 KV heads x 128), so ``L`` = chunk size in MiB.
Our chunks carry a 256-byte header on top; GB/s counts payload bytes on both sides.
LMCache's backends are driven directly (no ``StorageManager``), sharing one CPU pool and
one event loop thread, as its StorageManager would set them up.

- DRAM: our client path (the agent in its own process; a stashed slot, copy in + xxh3,
  commit; the slot from the shared index, copy out + verify) against LMCache's ``LocalCPUBackend``
  in-process (allocate from its pool, copy in, ``submit_put_task``; ``get_blocking``, copy
  out, ``ref_count_down``). Both copy with ``np.copyto``; the destination is shared.
- NVMe: ``NVMeTier`` against ``LocalDiskBackend`` in sibling directories of one
  filesystem: one chunk at a time, both O_DIRECT (the headline: no page cache on either
  side) and both buffered (reads hit the page cache on both sides, the files were just
  written); and batches of ``BATCH`` chunks with 4 I/O threads a side, O_DIRECT. A put
  is timed until the data is written and indexed (LMCache's write is asynchronous: until
  its completion callback). Ours writes the encoded chunk as the hierarchy demotes it,
  LMCache a chunk already in its pool; ours reads into a prefaulted DRAM slot (the
  promotion path, before the hierarchy's checksum), LMCache into a chunk from its pool.
  LMCache never fsyncs; ours fsyncs the file after the atomic rename unless
  ``fsync=False``, so both durabilities are reported. Raw O_DIRECT write (no fsync) and
  read of the same bytes run beside both, as the device's ceiling.
- S3: ``S3Tier`` against LMCache's S3 connector (awscrt) behind its ``RemoteBackend``,
  naive serde, on the same moto server. That connector only speaks virtual-host
  addressing (``bucket.host:port``); ``lmc.localhost`` is used, and where the system
  resolver does not map ``*.localhost`` to 127.0.0.1 the run re-executes itself with a
  tiny ``LD_PRELOAD`` getaddrinfo shim that does (compiled with ``cc``; nothing else
  changes). LMCache's get knows the size from its own put (no HEAD);
  ``lmcache_head_then_get`` is a reader that did not write the chunk.

Contenders run interleaved (iteration ``i`` runs every contender's op ``i``, rotating who
goes first), so background load on a shared machine hits all alike; only our buffered
fsync'd writes run in a pass of their own (see ``_nvme_mode``).
Ratios are ours/theirs throughput at the median (>1: we are faster); the headline ratio
is the worst over the chunk sizes. ``--quick --json`` takes about a minute; its last line
is one JSON object. ``--e2e`` also runs ``bench/e2e_ttft.py`` and folds in its ratios
(``e2e_ttft_*``: TTFT ours/theirs, <1: we are faster).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import mmap
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (
    FP,
    MiB,
    agent_process,
    bench_keys,
    chunk_meta,
    moto_server,
    stats,
    time_calls,
    time_interleaved,
)

from tiered_cache import codec

WARM = 2
BATCH = 8  # chunks per batch: a 2k-token prompt
HEADS, HEAD_DIM, TOKENS = 4, 128, 256  # one layer of one chunk: 2*256*512*4 B = 1 MiB
LMC_BUCKET, OUR_BUCKET = "lmc", "ours"
_SHIM_ENV = "TC_BENCH_LOCALHOST_SHIM"
_PRELOAD_ENV = "TC_BENCH_ORIG_LD_PRELOAD"
_SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <string.h>
#include <strings.h>
/* Resolve NAME.localhost (and NAME.localhost.) to 127.0.0.1, as systemd's
   nss-myhostname does; every other name goes to the real getaddrinfo. */
typedef int (*gai_fn)(const char *, const char *, const struct addrinfo *,
                      struct addrinfo **);
int getaddrinfo(const char *node, const char *service, const struct addrinfo *hints,
                struct addrinfo **res) {
    static gai_fn real;
    if (!real) real = (gai_fn)dlsym(RTLD_NEXT, "getaddrinfo");
    if (node) {
        size_t n = strlen(node), m = sizeof(".localhost") - 1;
        if (n > 0 && node[n - 1] == '.') n--;
        if (n > m && strncasecmp(node + n - m, ".localhost", m) == 0) node = "127.0.0.1";
    }
    return real(node, service, hints, res);
}
"""


_T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[vs_lmcache {time.monotonic() - _T0:5.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- name resolution


def _resolves(host: str) -> bool:
    try:
        return any(a[4][0] == "127.0.0.1" for a in socket.getaddrinfo(host, 80, socket.AF_INET))
    except OSError:
        return False


def _build_shim() -> str | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    tag = hashlib.sha256(_SHIM_C.encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"tc-bench-localhost-{tag}.so"
    if out.exists() and out.stat().st_uid == os.getuid():  # ours, not planted by another user
        return str(out)
    src = out.with_suffix(f".{os.getpid()}.c")
    tmp = out.with_suffix(f".{os.getpid()}.so")
    src.write_text(_SHIM_C)
    try:
        r = subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(src), "-ldl"],
            capture_output=True,
            timeout=60,
        )
        if r.returncode != 0:
            return None
        os.replace(tmp, out)
        return str(out)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def localhost_resolution(allow_shim: bool) -> tuple[bool, str]:
    """Make ``lmc.localhost`` resolve to 127.0.0.1 for LMCache's S3 connector: natively,
    or by re-executing this run under the getaddrinfo shim. Returns (ok, how)."""
    host = f"{LMC_BUCKET}.localhost"
    if os.environ.get(_SHIM_ENV):
        if _resolves(host):
            return True, "LD_PRELOAD getaddrinfo shim (*.localhost -> 127.0.0.1)"
        return False, "the LD_PRELOAD getaddrinfo shim did not take effect"
    if _resolves(host):
        return True, "system resolver (*.localhost -> 127.0.0.1)"
    if not allow_shim:
        return False, f"{host} does not resolve here and --no-dns-shim was given"
    so = _build_shim()
    if so is None:
        return False, f"{host} does not resolve here and no C compiler to build the shim"
    say(f"{host} does not resolve here; re-running under an LD_PRELOAD getaddrinfo shim")
    env = dict(os.environ)
    env[_SHIM_ENV] = "1"
    env[_PRELOAD_ENV] = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = ":".join(x for x in (so, env[_PRELOAD_ENV]) if x)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]], env)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- the chunk stream


class Stream:
    """Chunks ``-warm .. n-1`` of one size: keys (ours and LMCache's) and payloads."""

    def __init__(self, mib: int, n: int, *, warm: int = WARM, salt: str = "") -> None:
        self.mib, self.size, self.n = mib, mib * MiB, n
        self.keys = bench_keys(n + warm, f"vs-lmcache{salt}-{mib}")
        rng = np.random.default_rng(mib)
        # A few distinct payloads, cycled (contents do not change any timing here).
        self._payloads: list[memoryview] = [
            rng.integers(0, 255, self.size, dtype=np.uint8).data for _ in range(4)
        ]

    def key(self, i: int) -> str:
        return self.keys[i]  # negative i: the warm-up chunks at the end of the list

    def payload(self, i: int) -> memoryview:
        return self._payloads[i % len(self._payloads)]

    def chunk_hash(self, i: int) -> int:
        return int(self.key(i)[:16], 16)  # LMCache keys carry an int chunk hash


# ---------------------------------------------------------------- LMCache side


class LMCache:
    """LMCache 0.5.6's backends driven directly (no StorageManager), on one event loop
    thread and one CPU pool shared by every backend, as its StorageManager would."""

    def __init__(self, pool_bytes: int, first_mib: int) -> None:
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
        import lmcache
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.version = str(getattr(lmcache, "__version__", "unknown"))
        self.torch = torch
        self._Key = CacheEngineKey
        self._fmt = MemoryFormat.KV_2LTD
        self._LocalCPUBackend = LocalCPUBackend
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.pool_gib = pool_bytes / 2**30
        # The primary backend owns the pool; per-size views share its allocator.
        self.cpu = LocalCPUBackend(self.config(), self.metadata(first_mib))
        self._views: list[Any] = []

    def config(self, **kw: Any) -> Any:
        from lmcache.v1.config import LMCacheEngineConfig

        args: dict[str, Any] = {
            "chunk_size": TOKENS,
            "local_cpu": True,
            "max_local_cpu_size": self.pool_gib,
        }
        args.update(kw)
        return LMCacheEngineConfig.from_defaults(**args)

    def metadata(self, mib: int) -> Any:
        from lmcache.v1.metadata import LMCacheMetadata

        return LMCacheMetadata(
            model_name="bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=self.torch.float32,
            kv_shape=(mib, 2, TOKENS, HEADS, HEAD_DIM),
            chunk_size=TOKENS,
            role="worker",
        )

    def cpu_view(self, mib: int, cfg: Any) -> Any:
        """A LocalCPUBackend with ``mib``-sized chunk metadata on the shared pool (the S3
        connector sizes its objects from its CPU backend's metadata)."""
        view = self._LocalCPUBackend(
            cfg, self.metadata(mib), "cpu", None, memory_allocator=self.cpu.memory_allocator
        )
        self._views.append(view)
        return view

    def key(self, s: Stream, i: int) -> Any:
        return self._Key("bench", 1, 0, s.chunk_hash(i), self.torch.float32)

    def allocate(self, mib: int) -> Any:
        shape = self.torch.Size([2, mib, TOKENS, HEADS * HEAD_DIM])
        obj = self.cpu.allocate(shape, self.torch.float32, fmt=self._fmt)
        if obj is None:
            raise MemoryError("LMCache CPU pool exhausted")
        return obj

    def filled(self, s: Stream, i: int) -> Any:
        obj = self.allocate(s.mib)
        np.copyto(np.frombuffer(obj.byte_array, dtype=np.uint8), s.payload(i))
        return obj

    def disk(self, path: Path, mib: int, o_direct: bool) -> Any:
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        cfg = self.config(
            local_disk=str(path),
            max_local_disk_size=64.0,  # never evicts in this run
            extra_config={"use_odirect": o_direct},
        )
        return LocalDiskBackend(cfg, self.loop, self.cpu, "cpu", None, self.metadata(mib))

    def s3(self, endpoint: str, mib: int) -> Any:
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        cfg = self.config(
            remote_url=f"s3://{endpoint}",
            remote_serde="naive",
            extra_config={
                "s3_region": "us-east-1",
                "disable_tls": True,
                "s3_prefer_http2": False,
                # moto takes any key; never hand real credentials to this config.
                "aws_access_key_id": "bench",
                "aws_secret_access_key": "bench",
            },
        )
        cpu = self.cpu_view(mib, cfg)
        rb = RemoteBackend(cfg, self.metadata(mib), self.loop, cpu, "cpu")
        if rb.connection is None:
            raise RuntimeError("LMCache could not create its S3 connector")
        return rb

    def close(self) -> None:
        for v in self._views:
            v.clear()
        self.cpu.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _wait_put(backend: Any, key: Any, obj: Any, timeout: float = 120.0) -> None:
    """Submit an asynchronous LMCache put and wait for its completion callback."""
    done = threading.Event()
    backend.submit_put_task(key, obj, on_complete_callback=lambda _k: done.set())
    if not done.wait(timeout):
        raise TimeoutError(f"{backend} put did not complete in {timeout:.0f} s")


# ---------------------------------------------------------------- helpers


def _prefaulted_slot(size: int) -> memoryview:
    padded = -(-(size + codec.HEADER_SIZE) // 4096) * 4096
    buf = mmap.mmap(-1, padded)
    buf.write(b"\1" * padded)
    return memoryview(buf)


def _summ(times: dict[str, list[float]], nbytes: int) -> dict[str, dict[str, float]]:
    return {k: stats(v, nbytes) for k, v in times.items()}


@contextlib.contextmanager
def _event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


# ---------------------------------------------------------------- DRAM


def bench_dram(s: Stream, lmc: LMCache, tmp: Path) -> dict[str, Any]:

    from tiered_cache.client import AgentClient

    n, size = s.n, s.size
    slot = size + codec.HEADER_SIZE
    dst = np.empty(size, dtype=np.uint8)  # one destination for every contender
    # Room for every chunk, plus slots a client may hold reserved for its next put.
    with agent_process(tmp, slot * (n + WARM + 10) + 8 * MiB, slot) as sock:
        client = AgentClient(sock)
        client_nv = AgentClient(sock, verify_dram_reads=False)
        theirs: dict[int, Any] = {}
        try:

            def ours_put(i: int) -> None:
                client.put_many([(chunk_meta(s.key(i), size), s.payload(i))])

            def lmc_put(i: int) -> None:
                obj = lmc.allocate(s.mib)
                np.copyto(np.frombuffer(obj.byte_array, dtype=np.uint8), s.payload(i))
                lmc.cpu.submit_put_task(theirs.setdefault(i, lmc.key(s, i)), obj)
                obj.ref_count_down()  # the backend holds its own reference now

            def sink(_: int, __: codec.ChunkMeta, view: memoryview) -> None:
                np.copyto(dst, np.frombuffer(view, dtype=np.uint8))

            def ours_get(i: int) -> None:
                assert client.load_many([s.key(i)], FP.digest, sink) == [True]

            def ours_get_nv(i: int) -> None:
                assert client_nv.load_many([s.key(i)], FP.digest, sink) == [True]

            def lmc_get(i: int) -> None:
                obj = lmc.cpu.get_blocking(theirs[i])
                assert obj is not None
                np.copyto(dst, np.frombuffer(obj.byte_array, dtype=np.uint8))
                obj.ref_count_down()

            put = time_interleaved({"ours": ours_put, "lmcache": lmc_put}, n, WARM)
            get = time_interleaved({"ours": ours_get, "lmcache": lmc_get}, n, WARM)
            # A separate pass, so it does not read a slot the verified read just warmed.
            get_nv = time_calls(ours_get_nv, n, WARM)
            assert bytes(dst[:64]) == bytes(s.payload(n - 1)[:64])
        finally:
            client.close()
            client_nv.close()
            for k in theirs.values():
                lmc.cpu.remove(k)
    out: dict[str, Any] = {"put": _summ(put, size), "get": _summ(get, size)}
    out["get"]["ours_unverified"] = stats(get_nv, size)
    return out


def nvme_only_agent(tmp: Path) -> contextlib.AbstractContextManager[str]:
    """A node agent with an NVMe tier and no DRAM tier (LMCache's ``local_cpu: False`` with
    ``local_disk``), in its own process; yields its socket path."""
    return agent_process(tmp, 0, 0, {
        "dram": {"enabled": False},
        "nvme": {"enabled": True, "path": str(tmp / "ours-l2"), "capacity": "64GiB"},
    })  # fmt: skip


def bench_nvme_l2(s: Stream, lmc: LMCache, tmp: Path) -> dict[str, Any]:
    """The NVMe-only L2 (issue 30): our client path through an agent with no DRAM tier
    (a put sends the chunk inline, the agent writes the file; a get reads the file and
    sends it back inline, the client verifies and copies it out), against LMCache's
    ``LocalDiskBackend``, buffered on both sides (the files were just written: reads hit
    the page cache on both)."""
    from tiered_cache.client import AgentClient

    n, size = s.n, s.size
    dst = np.empty(size, dtype=np.uint8)
    disk = lmc.disk(tmp / "lmcache-l2", s.mib, o_direct=False)
    theirs: dict[int, tuple[Any, Any]] = {}
    try:
        with nvme_only_agent(tmp) as sock:
            client = AgentClient(sock)
            try:

                def ours_put(i: int) -> None:
                    client.put_many([(chunk_meta(s.key(i), size), s.payload(i))], wait=True)

                def lmc_put(i: int) -> None:
                    obj = lmc.allocate(s.mib)
                    np.copyto(np.frombuffer(obj.byte_array, dtype=np.uint8), s.payload(i))
                    theirs[i] = (lmc.key(s, i), obj)
                    _wait_put(disk, *theirs[i])

                def sink(_: int, __: codec.ChunkMeta, view: memoryview) -> None:
                    np.copyto(dst, np.frombuffer(view, dtype=np.uint8))

                def ours_get(i: int) -> None:
                    assert client.load_many([s.key(i)], FP.digest, sink) == [True]

                def lmc_get(i: int) -> None:
                    obj = disk.get_blocking(theirs[i][0])
                    assert obj is not None
                    np.copyto(dst, np.frombuffer(obj.byte_array, dtype=np.uint8))
                    obj.ref_count_down()

                put = time_interleaved({"ours": ours_put, "lmcache": lmc_put}, n, WARM)
                get = time_interleaved({"ours": ours_get, "lmcache": lmc_get}, n, WARM)
                assert bytes(dst[:64]) == bytes(s.payload(n - 1)[:64])
            finally:
                client.close()
    finally:
        for _, obj in theirs.values():
            obj.ref_count_down()
        disk.close()
    return {"put": _summ(put, size), "get": _summ(get, size)}


# ---------------------------------------------------------------- NVMe


def _close_nvme(
    disk: Any, ours: dict[str, Any], loop: asyncio.AbstractEventLoop, base: Path
) -> None:
    """Close LMCache's disk backend and our NVMe tiers, and remove their files."""
    if disk is not None:
        disk.close()
    for t in ours.values():
        loop.run_until_complete(t.close())
    for d in base.iterdir():
        shutil.rmtree(d, ignore_errors=True)


def _nvme_mode(
    s: Stream,
    lmc: LMCache,
    base: Path,
    direct: bool,
    loop: asyncio.AbstractEventLoop,
    chunks: dict[int, tuple[bytes, Any, Any]],
    slot: memoryview,
) -> dict[str, Any]:
    """One I/O mode: ours (fsync on, and off) and LMCache's disk backend, same files."""
    from tiered_cache.tiers.nvme import NVMeTier, hugepage_buffer

    n, size, mode = s.n, s.size, "o_direct" if direct else "buffered"
    ours = {
        "ours": NVMeTier(base / f"ours-{mode}", None, o_direct=direct, max_concurrency=4),
        "ours_no_fsync": NVMeTier(
            base / f"ours-{mode}-nofsync", None, o_direct=direct, fsync=False, max_concurrency=4
        ),
    }
    disk: Any = None
    try:
        if direct and not ours["ours"].o_direct_active:
            return {"skipped": "this filesystem refuses O_DIRECT"}
        disk = lmc.disk(base / f"lmcache-{mode}", s.mib, o_direct=direct)

        def our_put(tier: NVMeTier) -> Callable[[int], None]:
            return lambda i: loop.run_until_complete(tier.put(s.key(i), chunks[i][0]))

        def lmc_put(i: int) -> None:
            _wait_put(disk, chunks[i][1], chunks[i][2])

        def our_get(i: int) -> None:
            # As the agent promotes a chunk: straight into a (prefaulted) DRAM slot.
            got = loop.run_until_complete(ours["ours"].get_into(s.key(i), slot))
            assert got == size + codec.HEADER_SIZE

        def lmc_get(i: int) -> None:
            obj = disk.get_blocking(chunks[i][1])  # into a chunk from its CPU pool
            assert obj is not None
            obj.ref_count_down()

        puts = {name: our_put(t) for name, t in ours.items()} | {"lmcache": lmc_put}
        gets = {"ours": our_get, "lmcache": lmc_get}
        if direct:
            # The device's own speed, as a ceiling for both: raw O_DIRECT write (no fsync,
            # as LMCache) of the same bytes to a new file, and read of it.
            raw_dir = base / "raw-o_direct"
            raw_dir.mkdir()
            aligned = hugepage_buffer(-(-(size + codec.HEADER_SIZE) // 4096) * 4096)
            aligned[: size + codec.HEADER_SIZE] = chunks[0][0]

            def raw_put(i: int) -> None:
                fd = os.open(raw_dir / f"{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
                try:
                    os.write(fd, aligned)
                finally:
                    os.close(fd)

            def raw_get(i: int) -> None:
                fd = os.open(raw_dir / f"{i}", os.O_RDONLY | os.O_DIRECT)
                try:
                    os.readv(fd, [aligned])
                finally:
                    os.close(fd)

            puts["raw"], gets["raw"] = raw_put, raw_get
            put = time_interleaved(puts, n, WARM)
        else:
            # Buffered, our fsync'd writes run alone first: interleaved, each fsync would
            # also pay for journal commits of the other contenders' dirty files.
            put = {"ours": time_calls(puts.pop("ours"), n, WARM)}
            put |= time_interleaved(puts, n, WARM)
        out: dict[str, Any] = {
            "put": _summ(put, size),
            "get": _summ(time_interleaved(gets, n, WARM), size),
            "page_cache": "bypassed on both sides (O_DIRECT)"
            if direct
            else "reads hit it on both sides (just written)",
        }
        return out
    finally:
        _close_nvme(disk, ours, loop, base)


def _nvme_batch(
    mib: int, batches: int, lmc: LMCache, base: Path, loop: asyncio.AbstractEventLoop
) -> dict[str, Any]:
    """Request-sized batches: ``BATCH`` chunks stored, then retrieved, concurrently, with
    4 I/O threads on each side (LMCache's default ``disk_io_threads``), both O_DIRECT."""
    from tiered_cache.tiers.nvme import NVMeTier

    s = Stream(mib, BATCH * batches, warm=BATCH, salt="-batch")
    size = s.size

    def idx(b: int) -> range:
        return range(b * BATCH, (b + 1) * BATCH)  # b = -1: the warm-up batch

    heads = {
        i: codec.pack_header(chunk_meta(s.key(i), size), s.payload(i)) for i in range(-BATCH, s.n)
    }
    keys = {i: lmc.key(s, i) for i in range(-BATCH, s.n)}
    ours = {
        "ours": NVMeTier(base / "ours-batch", None, o_direct=True, max_concurrency=4),
        "ours_no_fsync": NVMeTier(
            base / "ours-batch-nofsync", None, o_direct=True, fsync=False, max_concurrency=4
        ),
    }
    disk: Any = None
    staged: list[Any] = []
    slots: list[memoryview] = []
    try:
        if not ours["ours"].o_direct_active:
            return {"skipped": "this filesystem refuses O_DIRECT"}
        disk = lmc.disk(base / "lmcache-batch", mib, o_direct=True)
        # Chunk j of every batch has payload(j) (payloads cycle with a period dividing BATCH).
        staged = [lmc.filled(s, j) for j in range(BATCH)]

        def our_put(tier: NVMeTier) -> Callable[[int], None]:
            async def go(b: int) -> None:
                await asyncio.gather(
                    *(tier.put_parts(s.key(i), [heads[i], s.payload(i)]) for i in idx(b))
                )

            return lambda b: loop.run_until_complete(go(b))

        def lmc_put(b: int) -> None:
            left, mu, done = [BATCH], threading.Lock(), threading.Event()

            def one(_k: Any) -> None:
                with mu:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

            disk.batched_submit_put_task([keys[i] for i in idx(b)], staged, None, one)
            if not done.wait(300):
                raise TimeoutError("LMCache's batched disk put did not complete")

        puts = {name: our_put(t) for name, t in ours.items()} | {"lmcache": lmc_put}
        put = time_interleaved(puts, batches, 1)
        for obj in staged:
            obj.ref_count_down()
        staged = []
        slots = [_prefaulted_slot(size) for _ in range(BATCH)]

        async def our_get_batch(b: int) -> None:
            got = await asyncio.gather(
                *(ours["ours"].get_into(s.key(i), v) for i, v in zip(idx(b), slots, strict=True))
            )
            assert got == [size + codec.HEADER_SIZE] * BATCH

        def lmc_get(b: int) -> None:
            objs = disk.batched_get_blocking([keys[i] for i in idx(b)])
            assert all(o is not None for o in objs)
            for o in objs:
                o.ref_count_down()

        get = time_interleaved(
            {"ours": lambda b: loop.run_until_complete(our_get_batch(b)), "lmcache": lmc_get},
            batches,
            1,
        )
        return {
            "put": _summ(put, BATCH * size),
            "get": _summ(get, BATCH * size),
            "batch_chunks": BATCH,
            "io_threads": 4,
            "page_cache": "bypassed on both sides (O_DIRECT)",
        }
    finally:
        for obj in staged:
            obj.ref_count_down()
        for v in slots:
            v.release()
        _close_nvme(disk, ours, loop, base)


def bench_nvme(s: Stream, lmc: LMCache, base: Path, batches: int) -> dict[str, Any]:
    # Chunk i: our encoded chunk, LMCache's key, and the same payload already in its pool
    # (as the hierarchy demotes from a DRAM slot, and LMCache from its CPU backend).
    chunks = {
        i: (
            codec.encode(chunk_meta(s.key(i), s.size), s.payload(i)),
            lmc.key(s, i),
            lmc.filled(s, i),
        )
        for i in range(-WARM, s.n)
    }
    slot = _prefaulted_slot(s.size)
    try:
        with _event_loop() as loop:
            out = {
                mode: _nvme_mode(s, lmc, base, mode == "o_direct", loop, chunks, slot)
                for mode in ("o_direct", "buffered")
            }
            for _, _, obj in chunks.values():  # room in the pool for the batch reads
                obj.ref_count_down()
            chunks = {}
            out["batch"] = _nvme_batch(s.mib, batches, lmc, base, loop)
            return out
    finally:
        slot.release()
        for _, _, obj in chunks.values():
            obj.ref_count_down()


# ---------------------------------------------------------------- S3


class LMCacheFailed(Exception):
    """LMCache's side failed; the comparison goes on without it and says why."""


def _guard(fn: Callable[[int], None]) -> Callable[[int], None]:
    def go(i: int) -> None:
        try:
            fn(i)
        except Exception as e:
            raise LMCacheFailed(f"{type(e).__name__}: {e}") from e

    return go


def _close_s3(rb: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Stop LMCache's S3 connector. Not ``RemoteBackend.close()``: in 0.5.6 that blocks the
    event loop thread on its own executor's shutdown (``S3Connector.close`` calls the
    synchronous ``AsyncPQExecutor.shutdown`` from a coroutine on that loop), a deadlock."""
    conn = getattr(rb.connection, "_connector", rb.connection)
    pq = getattr(conn, "pq_executor", None)
    if pq is not None and hasattr(pq, "shutdown_async"):
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(pq.shutdown_async(wait=True), loop).result(30)


def bench_s3(s: Stream, lmc: LMCache, url: str, lmc_ok: bool, why: str) -> dict[str, Any]:
    from tiered_cache.tiers.s3 import S3Tier

    n, size = s.n, s.size
    port = url.rsplit(":", 1)[1]
    blobs = {i: codec.encode(chunk_meta(s.key(i), size), s.payload(i)) for i in range(-WARM, n)}
    tiers = {
        # Our defaults (8 MiB ranged GETs, multipart above 16 MiB), the same shape as
        # awscrt's defaults (8 MiB parts) that LMCache's connector runs with.
        "ours": S3Tier(OUR_BUCKET, prefix=f"d{s.mib}", endpoint_url=url, region="us-east-1"),
        # As bench/tiers.py: single-request transfers, fastest on moto.
        "ours_single_request": S3Tier(
            OUR_BUCKET,
            prefix=f"s{s.mib}",
            endpoint_url=url,
            region="us-east-1",
            multipart_threshold=256 * MiB,
            part_size=256 * MiB,
        ),
    }
    rb: Any = None
    staged: dict[int, Any] = {}
    out: dict[str, Any] = {}
    try:
        with _event_loop() as loop:

            def our_put(t: S3Tier) -> Callable[[int], None]:
                return lambda i: loop.run_until_complete(t.put(s.key(i), blobs[i]))

            def our_get(t: S3Tier) -> Callable[[int], None]:
                def go(i: int) -> None:
                    got = loop.run_until_complete(t.get(s.key(i)))
                    assert got is not None and len(got) == size + codec.HEADER_SIZE

                return go

            puts: dict[str, Callable[[int], None]] = {k: our_put(t) for k, t in tiers.items()}
            gets: dict[str, Callable[[int], None]] = {k: our_get(t) for k, t in tiers.items()}
            if lmc_ok:
                try:
                    rb = lmc.s3(f"{LMC_BUCKET}.localhost:{port}", s.mib)
                except Exception as e:
                    lmc_ok, why = False, f"LMCache's S3 backend did not start: {e}"
            if lmc_ok:
                conn = getattr(rb.connection, "_connector", rb.connection)
                keys = {i: lmc.key(s, i) for i in range(-WARM, n)}
                staged = {i: lmc.filled(s, i) for i in range(-WARM, n)}

                def lmc_put(i: int) -> None:
                    rb.submit_put_task(keys[i], staged[i]).result(120)
                    # The connector logs failures and carries on: check it really stored.
                    if conn.object_size_cache.get(keys[i].to_string(), 0) != size:
                        raise RuntimeError("LMCache's S3 put failed (see its log)")

                def lmc_get(i: int) -> None:
                    obj = rb.get_blocking(keys[i])
                    assert obj is not None, "LMCache's S3 get failed (see its log)"
                    obj.ref_count_down()

                def lmc_get_head(i: int) -> None:
                    # A reader that did not write the chunk: HEAD for the size, then GET.
                    conn.object_size_cache.pop(keys[i].to_string(), None)
                    lmc_get(i)

                puts["lmcache"] = _guard(lmc_put)
                gets["lmcache"] = _guard(lmc_get)
            try:
                out["put"] = _summ(time_interleaved(puts, n, WARM), size)
                out["get"] = _summ(time_interleaved(gets, n, WARM), size)
                if lmc_ok:
                    head = time_calls(_guard(lmc_get_head), n, 0)
                    out["get"]["lmcache_head_then_get"] = stats(head, size)
            except LMCacheFailed as e:  # measure ours alone, and say why
                lmc_ok, why = False, f"LMCache's S3 connector failed here: {e}"
                puts.pop("lmcache")
                gets.pop("lmcache")
                out["put"] = _summ(time_interleaved(puts, n, WARM), size)
                out["get"] = _summ(time_interleaved(gets, n, WARM), size)
            if not lmc_ok:
                out["lmcache_skipped"] = why
            for t in tiers.values():
                loop.run_until_complete(t.close())
    finally:
        for obj in staged.values():
            obj.ref_count_down()
        if rb is not None:
            _close_s3(rb, lmc.loop)
    return out


# ---------------------------------------------------------------- e2e


def run_e2e(quick: bool, script: Path | None = None) -> dict[str, Any]:
    """``bench/e2e_ttft.py`` (ours vs LMCache MP, decode TTFT on vLLM CPU), as a child;
    its ratios are TTFT ratios, ours/theirs *time* (<1: we are faster)."""
    env = dict(os.environ)
    if env.pop(_SHIM_ENV, None):  # the child needs no shim
        orig = env.pop(_PRELOAD_ENV, "")
        if orig:
            env["LD_PRELOAD"] = orig
        else:
            env.pop("LD_PRELOAD", None)
    script = script or Path(__file__).with_name("e2e_ttft.py")
    cmd = [sys.executable, str(script), "--json"]
    if quick:
        cmd.append("--quick")
    say("running " + " ".join(cmd[1:]) + " (minutes)")
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    lines = r.stdout.strip().splitlines()
    try:
        got = json.loads(lines[-1])
        assert isinstance(got, dict)
    except (IndexError, ValueError, AssertionError):
        return {
            "returncode": r.returncode,
            "error": "no JSON last line",
            "stdout_tail": lines[-20:],
        }
    cases = got.get("cases", {})
    return {
        "returncode": r.returncode,
        "ratios_meaning": "TTFT ours / TTFT theirs (<1: we are faster)",
        "ratios": got.get("ratios", {}),
        "lmcache_cases": {k: v for k, v in cases.items() if "lmcache" in k},
        "result": got,
    }


# ---------------------------------------------------------------- report


def _ratio(tier: dict[str, Any], op: str, ours: str, theirs: str = "lmcache") -> float | None:
    try:
        return float(tier[op][ours]["gbps"] / tier[op][theirs]["gbps"])
    except (KeyError, TypeError):
        return None


RATIOS: dict[str, tuple[str, str | None, str, str] | tuple[str, str | None, str, str, str]] = {
    # name: (tier, mode, op, our contender[, the reference: "lmcache" unless given])
    "dram_put_vs_lmcache_cpu": ("dram", None, "put", "ours"),
    "dram_get_vs_lmcache_cpu": ("dram", None, "get", "ours"),
    "dram_get_unverified_vs_lmcache_cpu": ("dram", None, "get", "ours_unverified"),
    "nvme_write_vs_lmcache_disk": ("nvme", "o_direct", "put", "ours"),
    "nvme_write_no_fsync_vs_lmcache_disk": ("nvme", "o_direct", "put", "ours_no_fsync"),
    "nvme_read_vs_lmcache_disk": ("nvme", "o_direct", "get", "ours"),
    "nvme_buffered_write_vs_lmcache_disk": ("nvme", "buffered", "put", "ours"),
    "nvme_buffered_write_no_fsync_vs_lmcache_disk": ("nvme", "buffered", "put", "ours_no_fsync"),
    "nvme_buffered_read_vs_lmcache_disk": ("nvme", "buffered", "get", "ours"),
    "nvme_batch_write_vs_lmcache_disk": ("nvme", "batch", "put", "ours"),
    "nvme_batch_write_no_fsync_vs_lmcache_disk": ("nvme", "batch", "put", "ours_no_fsync"),
    "nvme_batch_read_vs_lmcache_disk": ("nvme", "batch", "get", "ours"),
    # Ceilings: how close each side gets to raw O_DIRECT I/O of the same bytes. When
    # LMCache reaches 1/1.5 of raw, 1.5x LMCache is beyond the device.
    "nvme_write_no_fsync_vs_raw_odirect": ("nvme", "o_direct", "put", "ours_no_fsync", "raw"),
    "lmcache_disk_write_vs_raw_odirect": ("nvme", "o_direct", "put", "lmcache", "raw"),
    "nvme_read_vs_raw_odirect": ("nvme", "o_direct", "get", "ours", "raw"),
    "lmcache_disk_read_vs_raw_odirect": ("nvme", "o_direct", "get", "lmcache", "raw"),
    # The NVMe-only L2 (no DRAM tier): the client path against LMCache's disk backend.
    "nvme_only_l2_put_vs_lmcache_disk": ("nvme_l2", None, "put", "ours"),
    "nvme_only_l2_get_vs_lmcache_disk": ("nvme_l2", None, "get", "ours"),
    "s3_put_vs_lmcache_s3": ("s3", None, "put", "ours"),
    "s3_get_vs_lmcache_s3": ("s3", None, "get", "ours"),
    "s3_put_single_request_vs_lmcache_s3": ("s3", None, "put", "ours_single_request"),
    "s3_get_single_request_vs_lmcache_s3": ("s3", None, "get", "ours_single_request"),
}


def summarise(res: dict[str, Any]) -> None:
    sizes: list[int] = res["sizes_mib"]
    ratios: dict[str, float | None] = {}
    by_size: dict[str, dict[int, float | None]] = {}
    reasons: dict[str, str] = {}
    p99: dict[str, dict[int, dict[str, float]]] = {}
    for name, spec in RATIOS.items():
        tier, mode, op, ours = spec[:4]
        theirs = spec[4] if len(spec) > 4 else "lmcache"
        vals: dict[int, float | None] = {}
        for mib in sizes:
            t = res[tier].get(mib, {})
            if mode is not None:
                t = t.get(mode, {})
            vals[mib] = _ratio(t, op, ours, theirs)
            if vals[mib] is None:
                reasons[name] = str(
                    t.get("skipped")
                    or t.get("lmcache_skipped")
                    or res[tier].get(mib, {}).get("error")
                    or res[tier].get("skipped")
                    or "not measured"
                )
            else:
                p99.setdefault(name.split("_vs_")[0], {})[mib] = {
                    "ours": t[op][ours]["p99_ms"],
                    theirs: t[op][theirs]["p99_ms"],
                }
        by_size[name] = vals
        got = [v for v in vals.values() if v is not None]
        ratios[name] = min(got) if got and len(got) == len(vals) else None
    res["ratios"] = ratios
    res["ratios_by_size"] = by_size
    res["ratio_reasons"] = reasons
    res["p99_ms"] = p99


def print_table(res: dict[str, Any]) -> None:
    rows: list[tuple[str, ...]] = []
    for name, spec in RATIOS.items():
        tier, mode, op, ours = spec[:4]
        theirs = spec[4] if len(spec) > 4 else "lmcache"
        for mib in res["sizes_mib"]:
            t = res[tier].get(mib, {})
            if mode is not None:
                t = t.get(mode, {})
            r = res["ratios_by_size"][name][mib]
            if r is None:
                continue
            o, th = t[op][ours], t[op][theirs]
            vs = "" if theirs == "lmcache" else f" vs {theirs}"
            label = f"{tier}{'/' + mode if mode else ''} {op} [{ours}{vs}]"
            rows.append(
                (
                    label,
                    f"{mib}",
                    f"{o['gbps']:.2f}",
                    f"{o['p50_ms']:.1f}/{o['p99_ms']:.1f}",
                    f"{th['gbps']:.2f}",
                    f"{th['p50_ms']:.1f}/{th['p99_ms']:.1f}",
                    f"{r:.2f}",
                )
            )
    head = (
        "tier op [ours]",
        "MiB",
        "ours GB/s",
        "p50/p99 ms",
        "LMC|raw GB/s",
        "p50/p99 ms",
        "ratio",
    )
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    for name, why in res["ratio_reasons"].items():
        print(f"{name}: not measured: {why}")


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (about a minute)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--sizes", default=None, help="comma list of MiB (default 2,8,32)")
    ap.add_argument("--dir", default=None, help="directory for the disk files (default: temp dir)")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 comparison")
    ap.add_argument("--no-dns-shim", action="store_true", help="never use the getaddrinfo shim")
    ap.add_argument("--e2e", action="store_true", help="also run bench/e2e_ttft.py (minutes)")
    a = ap.parse_args()
    s3_ok, s3_how = (False, "--no-s3") if a.no_s3 else localhost_resolution(not a.no_dns_shim)

    sizes = [int(x) for x in (a.sizes or "2,8,32").split(",")]
    iters = {
        "dram": 8 if a.quick else 30,
        "nvme": 5 if a.quick else 15,
        "s3": 3 if a.quick else 8,
        "batch": 2 if a.quick else 4,  # NVMe batches of BATCH chunks
    }
    t0 = time.monotonic()
    big = max(sizes) * MiB
    lmc = LMCache(big * (max(iters["dram"], iters["nvme"], BATCH) + WARM + 4), sizes[0])
    say(
        f"LMCache {lmc.version} pool of {lmc.pool_gib:.2f} GiB ready in {time.monotonic() - t0:.1f} s"
    )
    res: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg": os.getloadavg(),
        },
        "lmcache_version": lmc.version,
        "sizes_mib": sizes,
        "iters": iters,
        "chunk": "LMCache KV_2LTD (2, L=MiB, 256 tokens, 4 heads x 128) float32",
        "lmcache_backends": "LocalCPUBackend, LocalDiskBackend, RemoteBackend(S3Connector), "
        "driven directly (no StorageManager)",
        "s3_host_resolution": s3_how,
        "dram": {},
        "nvme": {},
        "nvme_l2": {},
        "s3": {},
    }
    errors: list[str] = []

    def section(tier: str, mib: int, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
        """One measurement; a failure is recorded (its ratios become null) and the run
        goes on, exiting non-zero at the end."""
        try:
            res[tier][mib] = fn(*args)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            say(f"{mib} MiB {tier} failed: {msg}")
            res[tier][mib] = {"error": msg}
            errors.append(f"{tier} {mib} MiB: {msg}")

    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="tc-vs-lmc-", dir="/var/tmp"))
    res["nvme_dir"] = str(base)
    try:
        for mib in sizes:
            d = base / f"dram{mib}"
            d.mkdir(parents=True, exist_ok=True)
            say(f"{mib} MiB: DRAM")
            section("dram", mib, bench_dram, Stream(mib, iters["dram"]), lmc, d)
            shutil.rmtree(d, ignore_errors=True)
            say(f"{mib} MiB: NVMe")
            d = base / f"nvme{mib}"
            d.mkdir()
            section("nvme", mib, bench_nvme, Stream(mib, iters["nvme"]), lmc, d, iters["batch"])
            shutil.rmtree(d, ignore_errors=True)
            say(f"{mib} MiB: NVMe-only L2 (no DRAM tier)")
            d = base / f"nvme-l2-{mib}"
            d.mkdir()
            section("nvme_l2", mib, bench_nvme_l2, Stream(mib, iters["nvme"]), lmc, d)
            shutil.rmtree(d, ignore_errors=True)
        if a.no_s3:
            res["s3"]["skipped"] = "--no-s3"
        else:
            import boto3

            with moto_server() as url:
                raw = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
                raw.create_bucket(Bucket=OUR_BUCKET)
                raw.create_bucket(Bucket=LMC_BUCKET)
                for mib in sizes:
                    say(f"{mib} MiB: S3 (moto)")
                    why = f"LMCache's S3 connector needs {LMC_BUCKET}.localhost: {s3_how}"
                    section("s3", mib, bench_s3, Stream(mib, iters["s3"]), lmc, url, s3_ok, why)
    finally:
        lmc.close()
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    res["elapsed_s"] = round(time.monotonic() - t0, 1)
    summarise(res)
    if a.e2e:
        res["e2e"] = run_e2e(a.quick)
        for k, v in res["e2e"].get("ratios", {}).items():
            res["ratios"][f"e2e_ttft_{k}"] = v
    res["errors"] = errors
    if a.json:
        print(json.dumps(res))
    else:
        print_table(res)
        print(json.dumps(res["ratios"], indent=1))
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
