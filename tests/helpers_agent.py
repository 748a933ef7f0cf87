"""A real node agent for tests: its config file, the process, the CLI, and chunk
factories. Shared by the agent, CLI, pin-file and shared-index tests (the ``agent``
fixture is in conftest.py)."""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tiered_cache import codec
from tiered_cache.agent import spawn_agent
from tiered_cache.keys import ModelFingerprint

FP = ModelFingerprint("agent-test", chunk_size=32, block_size=16)
N = 64 * 1024  # payload bytes per chunk


def meta(k: str, n: int = N, fp: ModelFingerprint = FP) -> codec.ChunkMeta:
    return codec.ChunkMeta(
        key=k,
        fingerprint=fp.digest,
        num_tokens=fp.chunk_size,
        dtype="uint8",
        shape=(n,),
        kv_layout="LBHNC",
        block_size=16,
    )


def payload(i: int, n: int = N) -> bytes:
    return np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8).tobytes()


# The DRAM pools of the configs written here: an agent keeps its pool when it stops
# (a warm restart), so the test session removes them when it ends.
_POOLS: set[str] = set()


def pool_name(cfg: dict[str, Any]) -> str:
    """The pool's shared-memory name, as ``CacheConfig.dram_shm_name`` makes it."""
    dram = cfg.get("dram") or {}
    return dram.get("shm_name") or "tiered_cache_" + re.sub(r"[^A-Za-z0-9_]", "_", cfg["node_id"])


def drop_pool(name: str) -> None:
    for seg in (name, f"{name}_ix"):
        Path("/dev/shm", seg).unlink(missing_ok=True)


@atexit.register
def _drop_pools() -> None:
    for name in _POOLS:
        drop_pool(name)


def write_cfg(tmp: Path, **over: Any) -> Path:
    """``tmp/cfg.yaml``: a small DRAM pool over a write-back NVMe tier, a socket in
    ``tmp``; top-level sections in ``over`` replace the defaults'."""
    cfg: dict[str, Any] = {
        "node_id": f"t-{uuid.uuid4().hex[:8]}",
        "dram": {"capacity": "2MiB", "slot_bytes": "128KiB"},
        "nvme": {
            "enabled": True,
            "path": str(tmp / "nvme"),
            "capacity": "64MiB",
            "write_mode": "write_back",
        },
        "agent": {"socket": str(tmp / "agent.sock"), "usage_log_interval_s": 1},
    }
    cfg.update(over)
    _POOLS.add(pool_name(cfg))
    p = tmp / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def socket_of(cfg: Path) -> str:
    return str(yaml.safe_load(cfg.read_text())["agent"]["socket"])


def start_agent(cfg: Path, *args: str) -> subprocess.Popen[str]:
    """The agent on ``cfg``, once its socket answers; output on ``stdout`` (text)."""
    return spawn_agent(
        cfg, *args, timeout=60, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiered_cache.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


class Output:
    """A process's stdout, read as it comes: a test waits for the line that says the
    process acted, instead of sleeping and hoping it did."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()

    def wait_for(self, text: str, timeout: float = 15.0, count: int = 1) -> None:
        """Until ``count`` lines hold ``text``."""
        with self._cv:
            seen = self._cv.wait_for(
                lambda: sum(text in ln for ln in self.lines) >= count, timeout
            )
        assert seen, f"no line with {text!r} within {timeout}s:\n{''.join(self.lines)}"

    def stop(self) -> str:
        """SIGTERM (if still running), then everything it wrote."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        return "".join(self.lines)
