"""Tier throughput and latency, each as a ratio against a reference measured in the same run.

- DRAM: our client path (put: a stashed slot, copy + checksum, commit; get: the slot from
  the shared index, copy out + verify) against a raw ``memcpy`` (numpy copyto) of the same
  bytes into private memory, and, for context, into shared memory like the pool's; one
  chunk per call, and 8 chunks per call as the connector moves one request's chunks
  (``*_batch``).
- NVMe: ``NVMeTier`` (temp file, rename, fsync; O_DIRECT) against raw O_DIRECT sequential
  write (+fsync) and read of the same bytes.
- S3: ``S3Tier`` against raw boto3 ``put_object``/``get_object`` on the same moto server.

Ratios are reference time / our time (1.0 = as fast as the reference; >1 faster). Each
reference runs interleaved with ours, call by call, so machine noise hits both alike.
``--quick --json`` finishes in well under a minute; its last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import FP, MiB, agent_process, moto_server
from _common import bench_keys as _keys
from _common import chunk_meta as _meta
from _common import stats as _stats
from _common import time_interleaved as _interleaved

from tiered_cache import codec
from tiered_cache.at_rest import CodecName

BATCH = 8  # chunks per call in the batched DRAM figures: one 2k-token prompt at 256 tokens

# ---------------------------------------------------------------- DRAM


def bench_dram(size: int, iters: int, tmp: Path) -> dict[str, Any]:
    from multiprocessing import shared_memory

    from tiered_cache.client import AgentClient

    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    mv = memoryview(payload.data)
    dst = np.empty_like(payload)
    batches = max(3, iters // 4)
    groups = batches + 2  # + the warm-up calls, which must not pre-store timed batches
    n_single, n_batch = iters + 2, BATCH * groups
    # The reference copies into (and out of) as many distinct buffers as we use slots,
    # so neither side runs cache-hot on a buffer that fits in L3. A second reference
    # does the same in shared memory, the kind the pool is made of (4 KiB pages where a
    # private buffer may get transparent huge pages): the gap between the two is what
    # sharing the memory costs, before any of our code runs.
    ref = [np.ones_like(payload) for _ in range(n_single)]
    ref_b = [np.ones_like(payload) for _ in range(n_batch)]
    shm = shared_memory.SharedMemory(create=True, size=size * n_single)
    assert shm.buf is not None
    shm_arr = np.frombuffer(shm.buf, dtype=np.uint8)
    shm_arr.fill(1)
    ref_shm = [shm_arr[i * size : (i + 1) * size] for i in range(n_single)]

    slot = size + codec.HEADER_SIZE
    keys = _keys(n_single, f"dram{size}")
    bkeys = _keys(n_batch, f"dramb{size}")

    def batch_of(seq: list[Any], i: int) -> list[Any]:
        return seq[BATCH * (i % groups) :][:BATCH]

    def sink(_: int, __: codec.ChunkMeta, view: memoryview) -> None:
        np.copyto(dst, np.frombuffer(view, dtype=np.uint8))  # releases the GIL

    # The agent runs as its own process, as in production; + the slots it may hand the
    # client ahead of its next put.
    with agent_process(tmp, slot * (n_single + n_batch + 16) + 8 * MiB, slot) as sock:
        client = AgentClient(sock)
        try:

            def get(i: int) -> None:
                assert client.load_many([keys[i]], FP.digest, sink) == [True]

            def get_batch(i: int) -> None:
                got = client.load_report(batch_of(bkeys, i), FP.digest, sink)
                assert got.ok == [True] * BATCH, (i, got)

            def ref_put_batch(i: int) -> None:
                for b in batch_of(ref_b, i):
                    np.copyto(b, payload)

            def ref_get_batch(i: int) -> None:
                for b in batch_of(ref_b, i):
                    np.copyto(dst, b)

            put = _interleaved(
                {
                    "ref": lambda i: np.copyto(ref[i], payload),
                    "ref_shm": lambda i: np.copyto(ref_shm[i], payload),
                    "ours": lambda i: client.put_many([(_meta(keys[i], size), mv)]),
                },
                iters,
            )
            got = _interleaved(
                {
                    "ref": lambda i: np.copyto(dst, ref[i]),
                    "ref_shm": lambda i: np.copyto(dst, ref_shm[i]),
                    "ours": get,
                },
                iters,
            )
            bput = _interleaved(
                {
                    "ref": ref_put_batch,
                    "ours": lambda i: client.put_many(
                        [(_meta(k, size), mv) for k in batch_of(bkeys, i)]
                    ),
                },
                batches,
            )
            bget = _interleaved({"ref": ref_get_batch, "ours": get_batch}, batches)
            client.verify_dram_reads = False  # header still checked; payload trusted in DRAM
            got_nv = _interleaved({"ref": lambda i: np.copyto(dst, ref[i]), "ours": get}, iters)
            client.verify_dram_reads = True
            assert bytes(dst[:64]) == bytes(payload[:64])
        finally:
            client.close()
    ref_shm.clear()  # the views must go before the mapping can close
    del shm_arr
    shm.close()
    shm.unlink()
    out: dict[str, Any] = {}
    for name, runs, n in (
        ("put", put, size),
        ("get", got, size),
        ("get_unverified", got_nv, size),
        ("put_batch", bput, size * BATCH),
        ("get_batch", bget, size * BATCH),
    ):
        st = {k: _stats(v, n) for k, v in runs.items()}
        out[name] = st["ours"]
        out[f"ref_memcpy_{name}"] = st["ref"]
        out[f"{name}_ratio"] = st["ours"]["gbps"] / st["ref"]["gbps"]
        if "ref_shm" in st:
            out[f"ref_memcpy_shm_{name}"] = st["ref_shm"]
            out[f"{name}_vs_shm_memcpy"] = st["ours"]["gbps"] / st["ref_shm"]["gbps"]
    return out


# ---------------------------------------------------------------- NVMe


def _odirect_write(path: str, buf: mmap.mmap, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        mv = memoryview(buf)
        off = 0
        while off < len(mv):
            off += os.write(fd, mv[off:])
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def _odirect_read(path: str, buf: mmap.mmap) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        os.readv(fd, [buf])
    finally:
        os.close(fd)


def bench_nvme(size: int, iters: int, root: Path) -> dict[str, Any]:
    from tiered_cache.tiers.nvme import NVMeTier, hugepage_buffer

    total = size + codec.HEADER_SIZE
    padded = -(-total // 4096) * 4096
    # The reference's buffer is the fastest kind for O_DIRECT here (huge pages), the same
    # the tier bounces through.
    buf = hugepage_buffer(padded)
    rnd = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    blob = codec.encode(_meta("0" * 32, size), memoryview(rnd.data))
    buf[: len(blob)] = blob
    raw_dir = root / "raw"
    raw_dir.mkdir()

    def raw(i: int) -> str:
        return str(raw_dir / f"{max(i, -2) + 2}.bin")  # warm-up calls get files too

    tier = NVMeTier(root / "tier", None, o_direct=True)
    keys = _keys(iters + 2, f"nvme{size}")
    blobs = {k: codec.encode(_meta(k, size), memoryview(rnd.data)) for k in keys}

    def key(i: int) -> str:
        return keys[max(i, -2) + 2]

    loop = asyncio.new_event_loop()
    # Reads as the agent promotes a chunk: straight into a (prefaulted) DRAM slot.
    slot = mmap.mmap(-1, padded)
    slot.write(b"\1" * padded)
    view = memoryview(slot)
    try:
        w = _interleaved(
            {
                "ref": lambda i: _odirect_write(raw(i), buf, total),
                "ours": lambda i: loop.run_until_complete(tier.put(key(i), blobs[key(i)])),
            },
            iters,
        )
        r = _interleaved(
            {
                "ref": lambda i: _odirect_read(raw(i), buf),
                "ours": lambda i: loop.run_until_complete(tier.get_into(key(i), view)),
                "ours_new_bytes": lambda i: loop.run_until_complete(tier.get(key(i))),
            },
            iters,
        )
        odirect = tier.o_direct_active
        loop.run_until_complete(tier.close())
    finally:
        view.release()
        loop.close()
        shutil.rmtree(raw_dir)
    wr, rr, ws, rs, rbs = (
        _stats(x, total) for x in (w["ref"], r["ref"], w["ours"], r["ours"], r["ours_new_bytes"])
    )
    return {
        "o_direct": odirect,
        "ref_write": wr,
        "ref_read": rr,
        "write": ws,
        "read": rs,
        "read_to_new_bytes": rbs,
        "write_ratio": ws["gbps"] / wr["gbps"],
        "read_ratio": rs["gbps"] / rr["gbps"],
    }


# ---------------------------------------------------------------- S3


def bench_s3(size: int, iters: int) -> dict[str, Any]:
    import boto3

    from tiered_cache.tiers.s3 import S3Tier

    with moto_server() as url:
        raw = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        raw.create_bucket(Bucket="bench")
        rnd = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8)
        blob = codec.encode(_meta("0" * 32, size), memoryview(rnd.data))
        # moto is one CPU-bound process that re-reads the whole object for every range:
        # parallel parts only add work there, so the bench uses single-request transfers
        # (against real S3, keep the default 8 MiB ranged/multipart transfers).
        tier = S3Tier(
            "bench",
            prefix="tier",
            endpoint_url=url,
            region="us-east-1",
            multipart_threshold=256 * MiB,
            part_size=256 * MiB,
        )
        keys = _keys(iters + 2, f"s3{size}")

        def key(i: int) -> str:
            return keys[max(i, -2) + 2]

        loop = asyncio.new_event_loop()
        try:
            p = _interleaved(
                {
                    "ref": lambda i: raw.put_object(Bucket="bench", Key=f"raw/{i}", Body=blob),
                    "ours": lambda i: loop.run_until_complete(tier.put(key(i), blob)),
                },
                iters,
            )
            g = _interleaved(
                {
                    "ref": lambda i: raw.get_object(Bucket="bench", Key=f"raw/{i}")["Body"].read(),
                    "ours": lambda i: loop.run_until_complete(tier.get(key(i))),
                },
                iters,
            )
            loop.run_until_complete(tier.close())
        finally:
            loop.close()
    total = len(blob)
    pr, gr, ps, gs = (_stats(x, total) for x in (p["ref"], g["ref"], p["ours"], g["ours"]))
    return {
        "ref_put": pr,
        "ref_get": gr,
        "put": ps,
        "get": gs,
        "put_ratio": ps["gbps"] / pr["gbps"],
        "get_ratio": gs["gbps"] / gr["gbps"],
    }


# ---------------------------------------------------------------- at rest (issue 28)


def _kv_chunk(key: str, size: int) -> bytes:
    """A chunk of ``size`` payload bytes of bf16 unit-normal values in a connector chunk's
    shape ([layers, blocks, heads, tokens, C]), so every codec has something to work on."""
    n = size // 2
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    vals = (x.view(np.uint32) >> 16).astype(np.uint16)
    shape = (16, 4, 8, 16, n // 8192) if n % 8192 == 0 else (n,)
    meta = codec.ChunkMeta(key=key, fingerprint=FP.digest, num_tokens=64, dtype="bfloat16",
                           shape=shape, kv_layout="LBHNC", block_size=16)  # fmt: skip
    return codec.encode(meta, vals.tobytes())


AT_REST: tuple[tuple[CodecName, bool], ...] = (
    ("none", True), ("zstd", False), ("zstd-planes", False), ("fp8", False), ("fp8", True),
)  # fmt: skip


def bench_at_rest(size: int, iters: int, root: Path) -> dict[str, Any]:
    """Reads as the hierarchy does them, per codec against plaintext in the same run:
    NVMe (plain: straight into a DRAM slot, then verify; enveloped: read, open, verify,
    copy into the slot) and S3 (get, open, verify). Reads only: writes go to NVMe and S3
    behind the request (write-back or write-through after the DRAM put)."""
    from tiered_cache.at_rest import AtRest, KeyRing
    from tiered_cache.tiers.enveloped import EnvelopedTier
    from tiered_cache.tiers.nvme import NVMeTier
    from tiered_cache.tiers.s3 import S3Tier

    ring = KeyRing.parse("1 " + bytes(range(32)).hex(), "bench")
    keys = _keys(iters + 2, f"ar{size}")
    blobs = {k: _kv_chunk(k, size) for k in keys}
    total = len(blobs[keys[0]])
    slot = mmap.mmap(-1, -(-total // 4096) * 4096)
    view = memoryview(slot)

    def key(i: int) -> str:
        return keys[max(i, -2) + 2]

    def label(name: str, sealed: bool) -> str:
        return name + ("+aes" if sealed else "")

    loop = asyncio.new_event_loop()
    out: dict[str, Any] = {"nvme": {}, "s3": {}}
    try:
        tiers: dict[str, Any] = {}
        plain = NVMeTier(root / "plain", None, o_direct=True)
        for name, sealed in AT_REST:
            inner = NVMeTier(root / label(name, sealed), None, o_direct=True)
            tiers[label(name, sealed)] = EnvelopedTier(
                inner, AtRest(codec=name, keys=ring if sealed else None)
            )
        for k in keys:
            loop.run_until_complete(plain.put(k, blobs[k]))
            for t in tiers.values():
                loop.run_until_complete(t.put(k, blobs[k]))

        def plain_read(i: int) -> None:
            n = loop.run_until_complete(plain.get_into(key(i), view))
            codec.decode(view[: n or 0])

        def enveloped(t: Any) -> Callable[[int], None]:
            def read(i: int) -> None:
                raw = loop.run_until_complete(t.get(key(i)))
                codec.decode(raw)
                view[: len(raw)] = raw

            return read

        # A request's chunks are read together (the prefetch's batch): BATCH at once, so
        # one chunk's read overlaps another's opening on the other cores.
        slots = [mmap.mmap(-1, len(view)) for _ in range(BATCH)]

        def batch_keys(i: int) -> list[str]:
            return [keys[(max(i, -2) + 2 + j) % len(keys)] for j in range(BATCH)]

        def plain_batch(i: int) -> None:
            async def one(k: str, m: mmap.mmap) -> None:
                mv = memoryview(m)
                n = await plain.get_into(k, mv)
                codec.decode(mv[: n or 0])
                mv.release()

            async def go() -> None:
                await asyncio.gather(
                    *(one(k, m) for k, m in zip(batch_keys(i), slots, strict=True))
                )

            loop.run_until_complete(go())

        def enveloped_batch(t: Any) -> Callable[[int], None]:
            async def one(k: str, m: mmap.mmap) -> None:
                raw = await t.get(k)
                codec.decode(raw)
                m[: len(raw)] = raw

            def read(i: int) -> None:
                async def go() -> None:
                    await asyncio.gather(
                        *(one(k, m) for k, m in zip(batch_keys(i), slots, strict=True))
                    )

                loop.run_until_complete(go())

            return read

        r = _interleaved({"none": plain_read, **{n: enveloped(t) for n, t in tiers.items()}},
                         iters)  # fmt: skip
        rb = _interleaved({"none": plain_batch,
                           **{n: enveloped_batch(t) for n, t in tiers.items()}}, iters)  # fmt: skip
        ref, refb = _stats(r["none"], total), _stats(rb["none"], BATCH * total)
        out["nvme"]["none"] = {**ref, "stored_ratio": 1.0, "batch_gbps": refb["gbps"]}
        for n, t in tiers.items():
            st, sb = _stats(r[n], total), _stats(rb[n], BATCH * total)
            used = t.usage().used_bytes / t.usage().num_chunks
            out["nvme"][n] = {**st, "stored_ratio": used / total,
                              "read_vs_none": st["gbps"] / ref["gbps"],
                              "batch_gbps": sb["gbps"],
                              "batch_read_vs_none": sb["gbps"] / refb["gbps"]}  # fmt: skip
        for t in [plain, *tiers.values()]:
            loop.run_until_complete(t.close())
        with moto_server() as url:
            import boto3

            boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(
                Bucket="bench"
            )
            big = {"multipart_threshold": 256 * MiB, "part_size": 256 * MiB}
            s3 = {label(n, e): EnvelopedTier(
                      S3Tier("bench", prefix=label(n, e), endpoint_url=url, region="us-east-1",
                             **big),  # type: ignore[arg-type]
                      AtRest(codec=n, keys=ring if e else None))
                  for n, e in AT_REST}  # fmt: skip
            s3_plain = S3Tier("bench", prefix="plain", endpoint_url=url, region="us-east-1",
                              **big)  # type: ignore[arg-type]  # fmt: skip
            for k in keys:
                loop.run_until_complete(s3_plain.put(k, blobs[k]))
                for t in s3.values():
                    loop.run_until_complete(t.put(k, blobs[k]))

            def s3_read(t: Any) -> Callable[[int], None]:
                def read(i: int) -> None:
                    codec.decode(loop.run_until_complete(t.get(key(i))))

                return read

            g = _interleaved({"none": s3_read(s3_plain),
                              **{n: s3_read(t) for n, t in s3.items()}}, iters)  # fmt: skip
            ref = _stats(g["none"], total)
            out["s3"]["none"] = ref
            for n in s3:
                st = _stats(g[n], total)
                out["s3"][n] = {**st, "read_vs_none": st["gbps"] / ref["gbps"]}
            for t in [s3_plain, *s3.values()]:
                loop.run_until_complete(t.close())
    finally:
        view.release()
        slot.close()
        loop.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations and sizes (<1 min)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--sizes", default=None, help="comma list of MiB (default 2,8,32)")
    ap.add_argument("--dir", default=None, help="directory for NVMe files (default: a temp dir)")
    ap.add_argument("--at-rest", action="store_true",
                    help="only the at-rest codecs' reads, each against plaintext (issue 28)")  # fmt: skip
    a = ap.parse_args()
    sizes = [int(x) for x in (a.sizes or "2,8,32").split(",")]
    iters = {
        "dram": 10 if a.quick else 40,
        "nvme": 6 if a.quick else 20,
        "s3": 4 if a.quick else 10,
    }
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "sizes_mib": sizes,
        "iters": iters,
        "dram": {},
        "nvme": {},
        "s3": {},
    }
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="tc-bench-", dir="/var/tmp"))
    if a.at_rest:
        try:
            res = {"sizes_mib": sizes, "iters": iters["nvme"], "chunk": "bf16 unit-normal"}
            for mib in sizes:
                got = bench_at_rest(mib * MiB, iters["nvme"], base / f"ar{mib}")
                res[str(mib)] = got
                for tier, rows in got.items():
                    for n, row in rows.items():
                        batch = (f"  batch of {BATCH}: {row['batch_gbps']:6.2f} GB/s x none "
                                 f"{row.get('batch_read_vs_none', 1.0):.2f}"
                                 if "batch_gbps" in row else "")  # fmt: skip
                        print(f"{tier:5} {mib:3} MiB {n:12} {row['gbps']:6.2f} GB/s  "
                              f"x none {row.get('read_vs_none', 1.0):.2f}{batch}",
                              file=sys.stderr)  # fmt: skip
        finally:
            if not a.dir:
                shutil.rmtree(base, ignore_errors=True)
        print(json.dumps(res) if a.json else json.dumps(res, indent=1))
        return
    try:
        for mib in sizes:
            n = mib * MiB
            d = base / f"s{mib}"
            d.mkdir(parents=True, exist_ok=True)
            results["dram"][mib] = bench_dram(n, iters["dram"], d)
            results["nvme"][mib] = bench_nvme(n, iters["nvme"], d)
            results["s3"][mib] = bench_s3(n, iters["s3"])
            if not a.json:
                for tier in ("dram", "nvme", "s3"):
                    r = results[tier][mib]
                    print(
                        f"{tier:5} {mib:3} MiB  "
                        + "  ".join(
                            f"{k}={v:.2f}"
                            for k, v in r.items()
                            if k.endswith(("_ratio", "_vs_shm_memcpy"))
                        )
                    )
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)

    def worst(tier: str, kind: str) -> float:
        return min(results[tier][m][f"{kind}_ratio"] for m in sizes)

    results["ratios"] = {
        "dram_put": worst("dram", "put"),
        "dram_get": worst("dram", "get"),
        "dram_get_unverified": worst("dram", "get_unverified"),
        "dram_put_batch": worst("dram", "put_batch"),
        "dram_get_batch": worst("dram", "get_batch"),
        "nvme_write": worst("nvme", "write"),
        "nvme_read": worst("nvme", "read"),
        "s3_put": worst("s3", "put"),
        "s3_get": worst("s3", "get"),
    }
    if a.json:
        print(json.dumps(results))
    else:
        print(json.dumps(results["ratios"], indent=1))


if __name__ == "__main__":
    main()
