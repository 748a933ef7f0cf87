"""Start and stop an LMCache multiprocess-mode server (``lmcache server``) with our L2
adapter, for the end-to-end tests, the demo and benchmarks. Process handling (own process
group, SIGTERM then SIGKILL of the group) is ``tiered_cache.tools.vllm_launch``'s.

On the CPU backend vLLM's ``LMCacheMPConnector`` uses engine-driven transfers, so the
server runs with ``--supported-transfer-mode auto`` (the default, lmcache-driven, leaves
vLLM hanging at "Registering kv caches"). Every port (ZMQ, HTTP, Prometheus) is chosen
free, so servers of parallel tests never collide.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tiered_cache.tools.vllm_launch import LoggedProcess, free_port, spawn, stop_group

ADAPTER_MODULE = "connectors.lmcache_mp"
ADAPTER_CLASS = "TieredCacheL2Adapter"
ADAPTER_CONFIG_CLASS = "TieredCacheL2AdapterConfig"
MP_CONNECTOR = "LMCacheMPConnector"


def tiered_l2_adapter(
    store: Mapping[str, Any], *, durable: bool = False, chunk_size: int = 256
) -> dict[str, Any]:
    """``--l2-adapter`` JSON for our adapter; ``store`` holds ``open_store`` keys
    (``config_file``, ``agent_socket``, ``store_dir``, ``embedded``, ...)."""
    return {
        "type": "plugin",
        "module_path": ADAPTER_MODULE,
        "class_name": ADAPTER_CLASS,
        "config_class_name": ADAPTER_CONFIG_CLASS,
        "adapter_params": {**store, "durable": durable, "chunk_size": chunk_size},
    }


def mp_kv_transfer_config(
    port: int, host: str = "tcp://127.0.0.1", *, heartbeat_interval_s: float | None = None
) -> dict[str, Any]:
    """vLLM ``--kv-transfer-config`` for ``LMCacheMPConnector`` talking to ``port``.

    vLLM notices a restarted server (and registers its KV caches again) on its next
    heartbeat, every 10 s by default; ``heartbeat_interval_s`` shortens that."""
    extra: dict[str, Any] = {"lmcache.mp.host": host, "lmcache.mp.port": port}
    if heartbeat_interval_s is not None:
        extra["lmcache.mp.heartbeat_interval"] = heartbeat_interval_s
    return {"kv_connector": MP_CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": extra}


@dataclass
class LMCacheServer(LoggedProcess):
    """One ``lmcache server`` process. ``l2_adapters`` are ``--l2-adapter`` specs (see
    ``tiered_l2_adapter``); ports default to free ones and survive ``restart``."""

    log_path: Path
    l2_adapters: Sequence[Mapping[str, Any]] = ()
    l1_size_gb: float = 1.0
    chunk_size: int = 256
    eviction_policy: str = "LRU"
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    prometheus_port: int = field(default_factory=free_port)
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def kv_transfer_config(self, heartbeat_interval_s: float | None = None) -> dict[str, Any]:
        return mp_kv_transfer_config(self.port, heartbeat_interval_s=heartbeat_interval_s)

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "lmcache.cli.main", "server",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--http-host", "127.0.0.1",
            "--http-port", str(self.http_port),
            "--prometheus-port", str(self.prometheus_port),
            "--chunk-size", str(self.chunk_size),
            "--l1-size-gb", str(self.l1_size_gb),
            "--eviction-policy", self.eviction_policy,
            "--supported-transfer-mode", "auto",
        ]  # fmt: skip
        for spec in self.l2_adapters:
            cmd += ["--l2-adapter", json.dumps(dict(spec))]
        return cmd + list(self.extra_args)

    def start(self) -> LMCacheServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {"LMCACHE_DISABLE_BANNER": "1", **self.env}
        self.proc = spawn(self.command(), self.log_path, env)
        return self

    def wait_ready(self, timeout: float = 120.0) -> LMCacheServer:
        """Until ``/healthcheck`` answers 200 (the engine, with its L2 adapters, is up)."""
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"lmcache server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.http_url + "/healthcheck", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return self
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"lmcache server not healthy after {timeout}s:\n{self.log_tail()}")

    def status(self) -> dict[str, Any]:
        """``GET /status``: L1, L2 adapters (ours reports its agent and errors), sessions."""
        r = httpx.get(self.http_url + "/status", timeout=10)
        r.raise_for_status()
        return dict(r.json())

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers."""
        proc, self.proc = self.proc, None
        stop_group(proc)

    def restart(self, timeout: float = 120.0) -> LMCacheServer:
        """Stop and start again on the same ports: L1 is lost, L2 (our tiers) is not."""
        self.stop()
        return self.start().wait_ready(timeout)
