"""Killed vLLM servers leave multiprocessing segments in /dev/shm (160-240 MiB each):
``VllmServer.stop`` unlinks the new ones no live process maps, and only those."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

from tiered_cache.tools.vllm_launch import drop_mp_shm, mp_shm

HOLD = """
import mmap, sys
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
sys.stdin.read()
"""


def test_drop_mp_shm_keeps_mapped_and_older_segments() -> None:
    tag = uuid.uuid4().hex[:8]
    old, orphan, live = (Path(f"/dev/shm/psm_tctest_{tag}_{n}") for n in ("old", "orphan", "live"))
    sem = Path(f"/dev/shm/sem.mp-tctest{tag}")
    holder = None
    try:
        old.write_bytes(b"\0" * 4096)
        before = mp_shm()
        for f in (orphan, live, sem):
            f.write_bytes(b"\0" * 4096)
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(live)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert holder.stdout is not None and holder.stdout.readline().strip() == "mapped"
        assert drop_mp_shm(before) >= 2
        assert not orphan.exists() and not sem.exists()
        assert live.exists(), "a segment a live process maps was unlinked"
        assert old.exists(), "a segment from before was unlinked"
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        for f in (old, orphan, live, sem):
            f.unlink(missing_ok=True)
