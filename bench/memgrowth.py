"""Memory growth of a node agent fed distinct chunks (issue 15, item 5).

A real agent (its own process) with a small DRAM pool is fed many distinct chunks
through the socket client, so it evicts all the while; its RSS is sampled as it goes.
A cache that forgets what it evicted holds steady after warm-up; a structure that keeps
something per chunk ever written grows linearly with the chunks fed.

    python bench/memgrowth.py            # 300,000 chunks of 32 KiB, 64 MiB pool
    python bench/memgrowth.py --quick    # 60,000 chunks
    python bench/memgrowth.py --json     # last line: one JSON object
    python bench/memgrowth.py --s3       # with a write-through S3 tier (moto) below DRAM

With ``--s3`` the lower tier is a local moto server, slower than the writers: copies to it
queue (bounded by ``agent.max_background_bytes``, the rest skipped and counted) and its
index fills (bounded by ``s3.index_max_entries``).

Figures: RSS at the end of warm-up (the first ``--warmup`` fraction of the chunks: the
pool and Python's allocator are then at their working size), at the end, the growth
between them (MiB, %) and per chunk fed after warm-up (bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import boto3
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import MiB, free_port, moto_server

from tiered_cache import codec
from tiered_cache.agent import spawn_agent
from tiered_cache.client import AgentClient
from tiered_cache.config import load_config


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (the pool's touched pages included)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric_values(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the agent's series ``names`` (absent ones: not exported by this build)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out: dict[str, float] = {}
    for line in text.decode().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run(
    chunks: int, chunk_kib: int, pool_mib: int, batch: int, warmup: float, s3: str | None
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tcb_memgrowth_"))
    name = f"tcb_mem_{uuid.uuid4().hex[:6]}"
    port = free_port()
    raw: dict[str, Any] = {
        "node_id": name,
        # keep_on_stop false: the pool goes with the agent (a bench leaves no /dev/shm).
        "dram": {"capacity": pool_mib * MiB, "keep_on_stop": False},
        "agent": {
            "socket": str(tmp / "agent.sock"),
            "usage_log_interval_s": 3600,
            "metrics_port": port,
        },
    }
    if s3 is not None:
        bucket = f"tcb-mem-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=s3, region_name="us-east-1").create_bucket(Bucket=bucket)
        raw["s3"] = {
            "enabled": True,
            "url": f"s3://{bucket}",
            "endpoint_url": s3,
            "region": "us-east-1",
            "write_mode": "write_through",
        }
    cfg = load_config(raw)
    cfg_path = tmp / "agent.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = spawn_agent(cfg_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    payload = os.urandom(chunk_kib * 1024)
    samples: list[tuple[int, int]] = []
    try:
        client = AgentClient(cfg.socket_path, timeout=60)
        every = max(batch, chunks // 50)
        t0 = time.perf_counter()
        fed = 0
        next_sample = 0
        prompt_chunks = 16
        key, pos = "", prompt_chunks - 1
        while fed < chunks:
            n = min(batch, chunks - fed)
            items = []
            for _ in range(n):
                # Prompts of ``prompt_chunks`` chained chunks, as a prefix cache sees them.
                pos = 0 if pos + 1 >= prompt_chunks else pos + 1
                parent = "" if pos == 0 else key
                key = uuid.uuid4().hex
                meta = codec.ChunkMeta(
                    key=key,
                    fingerprint=b"\0" * 16,
                    num_tokens=256,
                    dtype="uint8",
                    shape=(len(payload),),
                    kv_layout="LBHNC",
                    block_size=16,
                    parent=parent,
                    position=pos,
                )
                items.append((meta, payload))
            client.put_many(items)
            fed += n
            if fed >= next_sample or fed == chunks:
                next_sample += every
                samples.append((fed, rss_bytes(proc.pid)))
                rate = fed / (time.perf_counter() - t0)
                print(
                    f"  {fed:>9,} chunks  agent RSS {samples[-1][1] / MiB:8.1f} MiB"
                    f"  ({rate:,.0f} chunks/s)",
                    file=sys.stderr,
                    flush=True,
                )
        seconds = time.perf_counter() - t0
        client.close()
        series = metric_values(
            port, ("tiered_cache_background_bytes", "tiered_cache_background_dropped_total")
        )
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # e.g. still copying its queue to a slow S3
            proc.kill()
            proc.wait(10)
        for seg in (cfg.dram_shm_name, f"{cfg.dram_shm_name}_ix"):  # a killed agent's pool
            Path("/dev/shm", seg).unlink(missing_ok=True)
    warm_at = int(warmup * chunks)
    warm = next(s for s in samples if s[0] >= warm_at)
    end = samples[-1]
    growth = end[1] - warm[1]
    after = max(1, end[0] - warm[0])
    return {
        "chunks": chunks,
        "chunk_kib": chunk_kib,
        "pool_mib": pool_mib,
        "seconds": round(seconds, 1),
        "chunks_per_s": round(chunks / seconds),
        "rss_start_mib": round(samples[0][1] / MiB, 1),
        "rss_warm_mib": round(warm[1] / MiB, 1),
        "rss_end_mib": round(end[1] / MiB, 1),
        "rss_growth_mib": round(growth / MiB, 1),
        "rss_growth": round(growth / warm[1], 4),
        "bytes_per_chunk": round(growth / after, 1),
        "s3": s3 is not None,
        "background_bytes": series.get("tiered_cache_background_bytes"),
        "background_dropped": series.get(
            "tiered_cache_background_dropped_total",
            0.0 if "tiered_cache_background_bytes" in series else None,  # none skipped yet
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=300_000)
    ap.add_argument("--chunk-kib", type=int, default=32)
    ap.add_argument("--pool-mib", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="chunks per put_many")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of chunks")
    ap.add_argument("--quick", action="store_true", help="60,000 chunks (--s3: 20,000)")
    ap.add_argument("--s3", action="store_true", help="a write-through S3 tier (moto) below")
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    a = ap.parse_args()
    chunks = (20_000 if a.s3 else 60_000) if a.quick else a.chunks
    print(
        f"agent with a {a.pool_mib} MiB pool{' over write-through S3' if a.s3 else ''} fed"
        f" {chunks:,} distinct {a.chunk_kib} KiB chunks",
        file=sys.stderr,
    )
    with moto_server() if a.s3 else contextlib.nullcontext() as endpoint:
        r = run(chunks, a.chunk_kib, a.pool_mib, a.batch, a.warmup, endpoint)
    print(
        f"RSS {r['rss_warm_mib']} MiB after warm-up -> {r['rss_end_mib']} MiB at the end: "
        f"{r['rss_growth_mib']:+} MiB ({100 * r['rss_growth']:+.1f} %), "
        f"{r['bytes_per_chunk']} B per chunk; {r['chunks_per_s']:,} chunks/s"
    )
    if r["background_dropped"] is not None:
        print(
            f"background copies: {r['background_dropped']:,.0f} skipped over the byte budget,"
            f" {r['background_bytes']:,.0f} B queued at the end"
        )
    if a.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
