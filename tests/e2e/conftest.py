"""Fixtures for the end-to-end tests: the tiny model, a shared chunk store, server logs.

``_store_config`` is the store part of ``kv_connector_extra_config`` that every server of
a module shares. Switching the suite from the provisional directory store to the real
configuration is that one line, e.g. ``return {"config_file": str(write_yaml(tmp))}`` with
the YAML's NVMe path under ``tmp`` (``SharedStore.corrupt`` damages files there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.vllm_harness import REPO, SharedStore


def _store_config(tmp: Path) -> dict[str, Any]:
    return {"store_dir": str(tmp / "store")}  # the store part of kv_connector_extra_config


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Marked, never skipped: without vllm these tests fail (the e2e suite is part of
    # `make test`, and CI installs the vllm extra).
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.e2e)


def _model(preset: str, out: Path, dtype: str = "float32") -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(out),
         "--preset", preset, "--dtype", dtype],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        timeout=300,
    )
    return str(out)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny float32 Llama, built once by scripts/make_tiny_model.py and cached
    (``TC_TINY_MODEL_DIR`` overrides where)."""
    return _model("tiny", Path(
        os.environ.get("TC_TINY_MODEL_DIR")
        or Path(tempfile.gettempdir()) / "tiered-cache-models" / "tiny-float32"
    ))


@pytest.fixture(scope="session")
def wide_model() -> str:
    """A float32 Llama with 48 KiB of KV a token: a 256-token chunk is 12 MiB."""
    return _model("wide", Path(tempfile.gettempdir()) / "tiered-cache-models" / "wide-float32")


@pytest.fixture(scope="session")
def mla_model() -> str:
    """A DeepSeek-V2 (MLA) model, bfloat16: vLLM's CPU MLA kernels take no float32."""
    return _model(
        "mla", Path(tempfile.gettempdir()) / "tiered-cache-models" / "mla-bfloat16", "bfloat16"
    )


@pytest.fixture(scope="session")
def window_model() -> str:
    """The tiny Llama with sliding-window (128 tokens) and full-attention layers
    interleaved: two KV cache groups under vLLM's hybrid allocator."""
    return _model("window", Path(tempfile.gettempdir()) / "tiered-cache-models" / "window-float32")


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedStore]:
    root = tmp_path_factory.mktemp("tc-store")
    st = SharedStore(root, _store_config(root))
    yield st
    st.close()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = os.environ.get("TC_E2E_LOG_DIR")
    if d:
        p = Path(d)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.mktemp("vllm-logs")


# ------------------------------------------------------------------------------------
# Fixtures for test_multinode.py and test_router.py: a session-wide monolithic reference
# server, a module-wide redis-server, and node agents as real processes.


@pytest.fixture(scope="session")
def mono_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A ``vllm serve`` without a connector: the reference every module compares with.

    Session-scoped, so modules share it. A module starting its own servers should start
    them first and then request this fixture (``request.getfixturevalue``) so the
    startups overlap."""
    from e2e.vllm_harness import VllmServer, free_port, pinned_core

    logs = Path(os.environ.get("TC_E2E_LOG_DIR") or tmp_path_factory.mktemp("mono-logs"))
    srv = VllmServer(
        "mono-ref", tiny_model, free_port(), logs / "mono-ref.log",
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
    )
    srv.start()
    try:
        srv.wait_ready(300)
        srv.completion([7], max_tokens=1, logprobs=0).raise_for_status()
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def redis_module() -> Iterator[Any]:
    """A private redis-server for one module (the ``redis_server`` fixture's, module-wide)."""
    from conftest import RedisServer, _spawn_redis, free_port  # tests/conftest.py

    port = free_port()
    srv = RedisServer(port, _spawn_redis(port))
    yield srv
    srv.stop()


class AgentProc:
    """``tiered-cache agent -c <yaml>`` as its own process (a node's agent)."""

    def __init__(self, name: str, cfg: dict[str, Any], root: Path) -> None:
        self.name = name
        self.cfg = cfg
        self.cfg_path = root / f"{name}.yaml"
        self.log_path = root / f"agent-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.prefix: list[str] = []  # e.g. ``ip netns exec NS``: the agent's node
        import yaml

        self.cfg_path.write_text(yaml.safe_dump(cfg))

    @property
    def node_id(self) -> str:
        return str(self.cfg["node_id"])

    @property
    def socket(self) -> str:
        return str(self.cfg["agent"]["socket"])

    def start(self, timeout: float = 60.0) -> AgentProc:
        from tiered_cache.agent import spawn_agent

        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        with open(self.log_path, "ab") as log:
            try:
                self.proc = spawn_agent(
                    self.cfg_path, timeout=timeout, cwd=str(REPO), env=env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True, prefix=self.prefix,
                )
            except TimeoutError:
                raise AssertionError(
                    f"agent {self.name} did not start:\n{self.log_tail()}"
                ) from None
        return self

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: a crash (no write-back, no unpublish, heartbeat left to age out)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM: a clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self) -> Any:
        from tiered_cache.client import AgentClient

        return AgentClient(self.socket, attach_pool=False)

    def stats(self) -> dict[str, float]:
        c = self.client()
        try:
            return dict(c.admin("stats")["metrics"])
        finally:
            c.close()

    def hits(self, tier: str) -> float:
        return self.stats().get(f"tiered_cache_hits_total{{tier={tier}}}", 0.0)


@pytest.fixture(scope="module")
def agent_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Factory ``make(name, cfg) -> AgentProc`` (not started); every agent is stopped and
    its shared-memory pool removed at the end of the module."""
    root = tmp_path_factory.mktemp("agents")
    made: list[AgentProc] = []

    def make(name: str, cfg: dict[str, Any]) -> AgentProc:
        a = AgentProc(name, cfg, root)
        made.append(a)
        return a

    yield make
    for a in made:
        a.stop()
        safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in a.node_id)
        # A killed agent leaves its pool behind.
        Path(f"/dev/shm/tiered_cache_{safe}").unlink(missing_ok=True)
