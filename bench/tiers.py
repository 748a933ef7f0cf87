"""Tier throughput and latency, each as a ratio against a reference measured in the same run.

- DRAM: our client path (reserve slot, copy + checksum, commit / lease, copy out + verify,
  release) against a raw ``memcpy`` (numpy copyto) of the same bytes; one chunk per call,
  and 8 chunks per call as the connector moves one request's chunks (``*_batch``).
- NVMe: ``NVMeTier`` (temp file + fsync + rename, O_DIRECT) against raw O_DIRECT sequential
  write (+fsync) and read of the same bytes.
- S3: ``S3Tier`` against raw boto3 ``put_object``/``get_object`` on the same moto server.

Ratios are reference time / our time (1.0 = as fast as the reference; >1 faster).
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
import uuid
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import FP, MiB, moto_server
from _common import bench_keys as _keys
from _common import chunk_meta as _meta
from _common import stats as _stats
from _common import time_calls as _time

from tiered_cache import codec

BATCH = 8  # chunks per call in the batched DRAM figures: one 2k-token prompt at 256 tokens

# ---------------------------------------------------------------- DRAM


def bench_dram(size: int, iters: int, tmp: Path) -> dict[str, Any]:
    from tiered_cache.client import AgentClient
    from tiered_cache.config import load_config

    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(payload)
    # The reference copies into (and out of) as many distinct buffers as we use slots,
    # so neither side runs cache-hot on a buffer that fits in L3.
    bufs = [np.ones_like(payload) for _ in range(iters + 2)]
    ref_put = _stats(_time(lambda i: np.copyto(bufs[i], payload), iters), size)
    ref_get = _stats(_time(lambda i: np.copyto(dst, bufs[i]), iters), size)
    # Batches of BATCH chunks per call, as the connector stores and loads one request's
    # chunks: the agent round trip is paid once per batch.
    # The reference gets distinct buffers per batch too, as our puts get fresh slots.
    batches = max(3, iters // 4)
    ring = [np.ones_like(payload) for _ in range(BATCH * (batches + 1))]

    def ref_batch_put(i: int) -> None:
        for b in ring[BATCH * (i % (batches + 1)) :][:BATCH]:
            np.copyto(b, payload)

    def ref_batch_get(i: int) -> None:
        for b in ring[BATCH * (i % (batches + 1)) :][:BATCH]:
            np.copyto(dst, b)

    ref_bput = _stats(_time(ref_batch_put, batches), size * BATCH)
    ref_bget = _stats(_time(ref_batch_get, batches), size * BATCH)
    ring.clear()  # free the reference buffers before the agent allocates its pool

    slot = size + codec.HEADER_SIZE
    n_slots = (iters + 2) + BATCH * (batches + 1)
    cfg = load_config(
        {
            "node_id": f"bench-{uuid.uuid4().hex[:6]}",
            # + the slots the agent hands the client ahead of its next put (up to 8)
            "dram": {"capacity": slot * (n_slots + 16) + 8 * MiB, "slot_bytes": slot},
            "agent": {"socket": str(tmp / f"a{size}.sock")},
        }
    )
    import subprocess

    import yaml

    from tiered_cache.agent import spawn_agent

    # The agent runs as its own process, as in production (in-process it would share the
    # GIL with the client's copies).
    cfg_path = tmp / f"agent{size}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    agent = spawn_agent(cfg_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = AgentClient(cfg.socket_path)
    keys = _keys(iters + 2, f"dram{size}")
    bkeys = _keys(BATCH * (batches + 1), f"dramb{size}")
    mv = memoryview(payload)
    try:
        put = _time(lambda i: client.put_many([(_meta(keys[i], size), mv)]), iters)

        def sink(_: int, __: codec.ChunkMeta, view: memoryview) -> None:
            np.copyto(dst, np.frombuffer(view, dtype=np.uint8))  # releases the GIL

        def get(i: int) -> None:
            ok = client.load_many([keys[i]], FP.digest, sink)
            assert ok == [True]

        def batch_keys(i: int) -> list[str]:
            return bkeys[BATCH * (i % (batches + 1)) :][:BATCH]

        def put_batch(i: int) -> None:
            client.put_many([(_meta(k, size), mv) for k in batch_keys(i)])

        def get_batch(i: int) -> None:
            got = client.load_report(batch_keys(i), FP.digest, sink)
            assert got.ok == [True] * BATCH, (i, got)

        got = _time(get, iters)
        bput = _time(put_batch, batches)
        bgot = _time(get_batch, batches)
        client.verify_payload = False  # header still checked; payload trusted in DRAM
        got_nv = _time(get, iters)
        client.verify_payload = True
        assert bytes(dst[:64]) == bytes(payload[:64])
    finally:
        client.close()
        agent.terminate()
        agent.wait(30)
    p, g, gnv = _stats(put, size), _stats(got, size), _stats(got_nv, size)
    bp, bg = _stats(bput, size * BATCH), _stats(bgot, size * BATCH)
    return {
        "ref_memcpy_put": ref_put,
        "ref_memcpy_get": ref_get,
        "put": p,
        "get": g,
        "put_ratio": p["gbps"] / ref_put["gbps"],
        "get_ratio": g["gbps"] / ref_get["gbps"],
        "get_unverified": gnv,
        "get_unverified_ratio": gnv["gbps"] / ref_get["gbps"],
        "ref_memcpy_put_batch": ref_bput,
        "ref_memcpy_get_batch": ref_bget,
        "put_batch": bp,
        "get_batch": bg,
        "put_batch_ratio": bp["gbps"] / ref_bput["gbps"],
        "get_batch_ratio": bg["gbps"] / ref_bget["gbps"],
    }


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
    from tiered_cache.tiers.nvme import NVMeTier

    total = size + codec.HEADER_SIZE
    padded = -(-total // 4096) * 4096
    buf = mmap.mmap(-1, padded)
    rnd = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    blob = codec.encode(_meta("0" * 32, size), rnd)
    buf[: len(blob)] = blob
    raw_dir = root / "raw"
    raw_dir.mkdir()
    w_ref = _time(lambda i: _odirect_write(str(raw_dir / f"{i}.bin"), buf, total), iters)
    r_ref = _time(lambda i: _odirect_read(str(raw_dir / f"{max(i, 0)}.bin"), buf), iters)
    shutil.rmtree(raw_dir)

    tier = NVMeTier(root / "tier", None, o_direct=True)
    keys = _keys(iters + 2, f"nvme{size}")
    blobs = {k: codec.encode(_meta(k, size), rnd) for k in keys}
    loop = asyncio.new_event_loop()
    try:
        w = _time(lambda i: loop.run_until_complete(tier.put(keys[i], blobs[keys[i]])), iters)
        # Reads as the agent promotes a chunk: straight into a (prefaulted) DRAM slot.
        slot = mmap.mmap(-1, padded)
        slot.write(b"\1" * padded)
        view = memoryview(slot)
        r = _time(lambda i: loop.run_until_complete(tier.get_into(keys[max(i, 0)], view)), iters)
        rb = _time(lambda i: loop.run_until_complete(tier.get(keys[max(i, 0)])), iters)
        view.release()
        odirect = tier.o_direct_active
        loop.run_until_complete(tier.close())
    finally:
        loop.close()
    wr, rr, ws, rs, rbs = (_stats(x, total) for x in (w_ref, r_ref, w, r, rb))
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
        blob = codec.encode(_meta("0" * 32, size), rnd)
        p_ref = _time(lambda i: raw.put_object(Bucket="bench", Key=f"raw/{i}", Body=blob), iters)
        g_ref = _time(
            lambda i: raw.get_object(Bucket="bench", Key=f"raw/{max(i, 0)}")["Body"].read(), iters
        )
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
        loop = asyncio.new_event_loop()
        try:
            p = _time(lambda i: loop.run_until_complete(tier.put(keys[i], blob)), iters)
            g = _time(lambda i: loop.run_until_complete(tier.get(keys[max(i, 0)])), iters)
            loop.run_until_complete(tier.close())
        finally:
            loop.close()
    total = len(blob)
    pr, gr, ps, gs = (_stats(x, total) for x in (p_ref, g_ref, p, g))
    return {
        "ref_put": pr,
        "ref_get": gr,
        "put": ps,
        "get": gs,
        "put_ratio": ps["gbps"] / pr["gbps"],
        "get_ratio": gs["gbps"] / gr["gbps"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations and sizes (<1 min)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--sizes", default=None, help="comma list of MiB (default 2,8,32)")
    ap.add_argument("--dir", default=None, help="directory for NVMe files (default: a temp dir)")
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
                        + "  ".join(f"{k}={v:.2f}" for k, v in r.items() if k.endswith("_ratio"))
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
