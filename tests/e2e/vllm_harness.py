"""End-to-end helpers: the vLLM process launcher lives in ``tiered_cache.tools.vllm_launch``
(shared with the demo and the TTFT benchmark); this adds the shared test store."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiered_cache.tools.vllm_launch import (
    CONNECTOR,
    CONNECTOR_MODULE,
    REPO,
    VllmServer,
    free_port,
    kv_transfer_config,
    pinned_core,
    server_env,
    start_servers,
)

__all__ = [
    "CONNECTOR",
    "CONNECTOR_MODULE",
    "REPO",
    "SharedStore",
    "VllmServer",
    "free_port",
    "kv_transfer_config",
    "pinned_core",
    "server_env",
    "start_servers",
]


class SharedStore:
    """The store the servers of a test module share. The test process hosts the node
    agent (so no two servers race to start one) and keeps a client for fault injection."""

    def __init__(self, root: Path, config: Mapping[str, Any]) -> None:
        from tiered_cache import client as tc_client

        self.root = root
        self.config = dict(config)
        self.client: Any = tc_client.open_store(self.config)
        self._tc_client = tc_client

    def present(self, keys: list[str]) -> int:
        """How many leading ``keys`` the store can serve."""
        return len(self.client.lookup(keys))

    def _file(self, key: str, timeout: float = 20.0) -> Path:
        """The chunk's file in the NVMe tier (written behind DRAM: wait for it)."""
        deadline = time.monotonic() + timeout
        while True:
            hits = list(self.root.rglob(f"{key}.kvc"))
            if hits:
                return hits[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"chunk {key} never reached the NVMe tier")
            time.sleep(0.05)

    def corrupt(self, keys: list[str]) -> None:
        """Damage each chunk's payload on disk and drop its DRAM copy, so the next read
        comes from the damaged file."""
        for key in keys:
            f = self._file(key)
            data = bytearray(f.read_bytes())
            for off in range(300, len(data), 4096):  # past the 256-byte header
                data[off] ^= 0xFF
            f.write_bytes(bytes(data))
            self.client.admin("evict", key=key, tiers=["dram"])

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self._tc_client.shutdown_embedded()


def start_pd_agent(
    agent_procs: Any, root: Path, prefix: str, chunk: int, **sections: Any
) -> tuple[Any, dict[str, str]]:
    """The node agent of a P/D rig (``agent_procs``: tests/e2e/conftest.py): 64 MiB of DRAM
    over a write-through NVMe tier under ``root``; ``sections`` replace those. Returns the
    started agent and the connector's store settings for it."""
    import uuid

    node = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cfg: dict[str, Any] = {
        "node_id": node,
        "chunk_size": chunk,
        "dram": {"capacity": "64MiB", "slot_bytes": "512KiB"},  # a chunk is 256 KiB
        "nvme": {"enabled": True, "path": str(root / "nvme"), "capacity": "256MiB",
                 "write_mode": "write_through"},
        "agent": {"socket": str(root / "agent.sock"), "usage_log_interval_s": 30},
        **sections,
    }  # fmt: skip
    agent = agent_procs(node, cfg).start()
    return agent, {"config_file": str(agent.cfg_path), "embedded": "never"}
