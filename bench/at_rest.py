"""What at-rest envelopes cost and save (tiered_cache.at_rest), against a memcpy and the
chunk checksum of the same bytes in the same run.

For each codec, sealed and not: bytes stored per byte of chunk, the largest error over
the largest value (0 but for the lossy ``fp8``), and wrap (write side) and
unwrap (read side) throughput on one core, as a ratio of a memcpy of the chunk. The chunk
is an encoded chunk whose payload is bf16 values of unit-normal activations (the top
16 bits of float32s). A trained model's KV is not unit-normal; its exponent plane is what
the byte-plane codec compresses, and how far it compresses there is for ``bench/tiers.py``
to measure on KV that vLLM computes (issue 28).

    python bench/at_rest.py [--mib 4] [--repeats 20] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiered_cache import at_rest, codec
from tiered_cache.at_rest import AtRest, KeyRing


def chunk(mib: int) -> bytes:
    n = mib * 2**20 // 2
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    payload = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    shape = (16, 4, 8, 16, n // 8192)  # [layers, blocks, heads, tokens, C], as the connector's
    meta = codec.ChunkMeta(key="ab" * 16, fingerprint=hashlib.md5(b"m").digest(),
                           num_tokens=64, dtype="bfloat16", shape=shape, tenant="acme")  # fmt: skip
    return codec.encode(meta, payload)


def max_rel_error(blob: bytes, got: bytes) -> float:
    """The largest |error| over the largest |value|: 0 for a lossless codec."""

    def values(b: bytes) -> np.ndarray:
        bits = np.frombuffer(b, dtype=np.uint16, offset=codec.HEADER_SIZE).astype(np.uint32)
        return (bits << 16).view(np.float32)

    x, y = values(blob), values(got)
    return round(float(np.abs(y - x).max() / np.abs(x).max()), 5)


def gbps(fn: Callable[[], object], nbytes: int, repeats: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=4, help="chunk size (MiB)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    a = ap.parse_args()
    if a.mib < 1 or a.repeats < 1:
        ap.error("--mib and --repeats must be at least 1")
    blob = chunk(a.mib)
    n = len(blob)
    src = np.frombuffer(blob, dtype=np.uint8)
    dst = np.empty_like(src)
    memcpy = gbps(lambda: np.copyto(dst, src), n, a.repeats)
    xxh = gbps(lambda: codec.checksum(blob), n, a.repeats)
    print(f"{a.mib} MiB chunk: memcpy {memcpy:.2f} GB/s, xxh3 {xxh:.2f} GB/s", file=sys.stderr)
    ring = KeyRing.parse("1 " + bytes(range(32)).hex(), "bench")
    rows: list[dict[str, Any]] = []
    print(f"{'codec':12s} {'sealed':6s} {'stored':>7s} {'max err':>8s} {'wrap GB/s':>10s} "
          f"{'x memcpy':>9s} {'unwrap GB/s':>12s} {'x memcpy':>9s}", file=sys.stderr)  # fmt: skip
    for name in at_rest.CODECS:
        for sealed in (False, True):
            ar = AtRest(codec=name, keys=ring if sealed else None)
            stored = ar.wrap(blob)
            err = max_rel_error(blob, bytes(ar.unwrap(stored)))
            assert name not in at_rest.LOSSLESS or err == 0
            w = gbps(lambda ar=ar: ar.wrap(blob), n, a.repeats)  # type: ignore[misc]
            r = gbps(lambda ar=ar, s=stored: ar.unwrap(s), n, a.repeats)  # type: ignore[misc]
            row = {"codec": name, "sealed": sealed, "stored_ratio": round(len(stored) / n, 4),
                   "max_rel_error": err, "wrap_gbps": round(w, 3), "unwrap_gbps": round(r, 3),
                   "wrap_vs_memcpy": round(w / memcpy, 3), "unwrap_vs_memcpy": round(r / memcpy, 3)}  # fmt: skip
            rows.append(row)
            print(f"{name:12s} {sealed!s:6s} {row['stored_ratio']:7.3f} {err:8.4f} {w:10.2f} "
                  f"{w / memcpy:9.3f} {r:12.2f} {r / memcpy:9.3f}", file=sys.stderr)  # fmt: skip
    if a.json:
        print(json.dumps({"chunk_bytes": n, "memcpy_gbps": round(memcpy, 3),
                          "xxh3_gbps": round(xxh, 3), "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
