"""Chunk factory for the NVMe tier tests, and the subprocess side of the crash and
file-size-limit tests::

    python tests/helpers_nvme.py writer DIR START CONCURRENCY fsync|nofsync
    python tests/helpers_nvme.py efbig DIR
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import resource
import signal
import sys

import numpy as np

from tiered_cache import codec
from tiered_cache.tiers.base import TierFull
from tiered_cache.tiers.nvme import NVMeTier

FINGERPRINT = bytes(range(16))


def chunk_key(i: int) -> str:
    return hashlib.sha256(f"nvme-test-{i}".encode()).hexdigest()[:32]


def payload(i: int, size: int) -> bytes:
    return np.random.default_rng(i).bytes(size)


def make_chunk(i: int, size: int) -> tuple[str, bytes]:
    """(key, encoded chunk) with a payload derived from ``i``, so it can be regenerated."""
    key = chunk_key(i)
    meta = codec.ChunkMeta(key=key, fingerprint=FINGERPRINT, num_tokens=size, shape=(size,))
    return key, codec.encode(meta, payload(i, size))


def writer_size(i: int) -> int:
    return 64 * 1024 + (i * 37_813) % (448 * 1024)  # 64 KiB .. 512 KiB, not 4K-aligned


async def _writer(root: str, start: int, concurrency: int, fsync: bool) -> None:
    tier = NVMeTier(root, None, max_concurrency=concurrency, fsync=fsync)
    counter = iter(range(start, 10**9))

    async def worker() -> None:
        for i in counter:
            key, blob = make_chunk(i, writer_size(i))
            await tier.put(key, blob)
            print(i, key, flush=True)  # acknowledged: put has returned

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _efbig(root: str) -> None:
    # Files may not grow past 1 MiB; SIGXFSZ ignored so write() fails with EFBIG instead
    # of killing the process (CPython ignores it already; be explicit).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    tier = NVMeTier(root, 100 << 20)
    out: dict[str, object] = {}
    k0, b0 = make_chunk(0, 300_000)
    await tier.put(k0, b0)
    before = (sorted(tier.entries()), tier.usage().used_bytes)
    k1, b1 = make_chunk(1, 2_000_000)
    try:
        await tier.put(k1, b1)
        out["big_put"] = "stored"
    except TierFull as e:
        out["big_put"] = f"TierFull: {e}"
    out["tmp_after"] = os.listdir(os.path.join(root, ".tmp"))
    out["index_unchanged"] = (sorted(tier.entries()), tier.usage().used_bytes) == before
    out["big_on_disk"] = os.path.exists(os.path.join(root, k1[:2], k1 + ".kvc"))
    k2, b2 = make_chunk(2, 100_000)
    await tier.put(k2, b2)
    out["small_ok"] = (await tier.get(k2)) == b2 and (await tier.get(k0)) == b0
    await tier.close()
    print(json.dumps(out), flush=True)


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "writer":
        start, conc, fsync = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "fsync"
        asyncio.run(_writer(root, start, conc, fsync))
    elif mode == "efbig":
        asyncio.run(_efbig(root))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
