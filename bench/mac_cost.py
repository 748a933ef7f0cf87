"""What signing and checking chunks costs (issue 15, item 3): per chunk size, the time of
the keyed MAC (``codec``'s HMAC-SHA256; keyed BLAKE2b for comparison) against the unkeyed
xxh3-64 checksum and a plain copy (numpy ``copyto``: what moving the chunk costs anyway).

Single thread, payload already in memory (warm caches for small sizes, not for 32 MiB).
Reports the median of ``--repeat`` calls per size, in ms and GB/s; the last line with
``--json`` is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import xxhash

from tiered_cache import codec

MiB = 1 << 20


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(size_mib: int, repeat: int) -> dict[str, dict[str, float]]:
    n = size_mib * MiB
    payload = np.frombuffer(os.urandom(n), dtype=np.uint8)
    dst = np.empty_like(payload)
    key = codec.chunk_mac_key(b"bench-secret-0123456789")
    meta = codec.ChunkMeta(key="ab" * 16, fingerprint=b"\0" * 16, num_tokens=256, shape=(n,))
    mv = payload.data
    fns: dict[str, Callable[[], object]] = {
        "memcpy": lambda: np.copyto(dst, payload),
        "xxh3": lambda: xxhash.xxh3_64_intdigest(mv),
        "blake2b_mac": lambda: hashlib.blake2b(mv, key=key, digest_size=16).digest(),
        "hmac_sha256": lambda: hmac.digest(key, mv, "sha256"),
        "header_unsigned": lambda: codec.pack_header(meta, mv),  # xxh3 + header
        "header_signed": lambda: codec.pack_header(meta, mv, mac_key=key),  # + MAC
    }
    out = {}
    for name, fn in fns.items():
        s = _median_s(fn, repeat)
        out[name] = {"ms": round(s * 1e3, 3), "gbps": round(n / s / 1e9, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2,8,32", help="comma list of MiB")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    a = ap.parse_args()
    res = {f"{s}MiB": measure(int(s), a.repeat) for s in a.sizes.split(",")}
    for size, row in res.items():
        cells = "  ".join(f"{k} {v['ms']:.2f} ms ({v['gbps']:.1f} GB/s)" for k, v in row.items())
        print(f"{size:>6}: {cells}")
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
