"""Helpers shared by the benchmarks in ``bench/``: timing, percentiles, chunk keys and
headers, a moto S3 server and a node agent process.

Every benchmark prints a human-readable table, and with ``--json`` one JSON object as its
last line.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiered_cache import codec
from tiered_cache.keys import ModelFingerprint, chunk_keys

MiB = 2**20
FP = ModelFingerprint("bench", chunk_size=256, block_size=16)


def stats(times: list[float], nbytes: int) -> dict[str, float]:
    """GB/s at the median time, and p50/p99 latency in ms."""
    s = sorted(times)
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return {
        "gbps": nbytes / statistics.median(s) / 1e9,
        "p50_ms": statistics.median(s) * 1e3,
        "p99_ms": p99 * 1e3,
    }


def time_calls(fn: Callable[[int], Any], n: int, warm: int = 2) -> list[float]:
    """Wall time of ``fn(0) .. fn(n-1)``, after untimed ``fn(-1) .. fn(-warm)``."""
    for i in range(warm):
        fn(-1 - i)
    out = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return out


def time_interleaved(
    fns: Mapping[str, Callable[[int], Any]], n: int, warm: int = 2
) -> dict[str, list[float]]:
    """Like ``time_calls`` for several contenders at once: iteration ``i`` runs every
    ``fn(i)`` back to back, rotating which one goes first, so a noisy neighbour (or a
    warming disk) hits every contender alike."""
    names = list(fns)
    for i in range(warm):
        for name in names:
            fns[name](-1 - i)
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t = time.perf_counter()
            fns[name](i)
            out[name].append(time.perf_counter() - t)
    return out


def chunk_meta(key: str, n: int) -> codec.ChunkMeta:
    """Header metadata for an opaque ``n``-byte payload under ``key``."""
    return codec.ChunkMeta(
        key=key,
        fingerprint=FP.digest,
        num_tokens=256,
        dtype="uint8",
        shape=(n,),
        kv_layout="LBHNC",
        block_size=16,
    )


def bench_keys(n: int, salt: str) -> list[str]:
    """``n`` distinct chunk keys (a 256n-token prompt's chain)."""
    return chunk_keys(np.arange(256 * n), FP, cache_salt=salt)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on a free local port (with dummy credentials in the environment);
    yields its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    for k, v in (
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(k, v)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@contextlib.contextmanager
def agent_process(
    tmp: Path, capacity: int, slot_bytes: int, sections: Mapping[str, Any] | None = None
) -> Iterator[str]:
    """A node agent with a DRAM tier only (or the config ``sections`` given instead), in
    its own process as in production (in-process it would share the GIL with the client's
    copies); yields its socket path."""
    import yaml

    from tiered_cache.agent import spawn_agent
    from tiered_cache.config import load_config
    from tiered_cache.tiers.shm_index import index_name

    name = uuid.uuid4().hex[:6]
    cfg = load_config(
        {
            "node_id": f"bench-{name}",
            # A clean stop keeps the pool for a warm restart by default; a bench must not
            # leave GiBs in /dev/shm (they add up across runs until the OOM killer acts).
            "dram": {"capacity": capacity, "slot_bytes": slot_bytes, "keep_on_stop": False},
            "agent": {"socket": str(tmp / f"agent-{name}.sock")},
            **(sections or {}),
        }
    )
    cfg_path = tmp / f"agent-{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = spawn_agent(cfg_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield cfg.socket_path
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        for shm in (cfg.dram_shm_name, index_name(cfg.dram_shm_name)):  # killed: not dropped
            Path("/dev/shm", shm).unlink(missing_ok=True)
