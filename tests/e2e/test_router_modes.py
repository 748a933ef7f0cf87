"""The router's replica and adaptive modes in front of real ``vllm serve`` processes.

One module-scoped set of processes: a node agent (DRAM) shared by two vLLM servers, both
``kv_both`` (a core each), and two routers over them: ``--replica`` (each request whole
on one, by cached prefix and load) and ``--prefill A --decode B`` with ``router.split:
auto`` (per request, whole or split by the cost model). Checked: every answer equals the
session's monolithic reference, what each router decided, and its ``/metrics``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.test_pd_handoff import assert_same_generation, parse
from e2e.test_router import CHUNK, completion_body, min_cached, ref_completion, text_prompt
from e2e.vllm_harness import (
    REPO,
    VllmServer,
    free_port,
    kv_transfer_config,
    pinned_core,
    start_pd_agent,
)


class Proc:
    """``tiered-cache router ARGS`` as its own process."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"{name}.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiered_cache.cli", "router", "--port", str(self.port),
             *args],
            cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1"),
        )  # fmt: skip
        log.close()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text(errors="replace")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"router {name} did not come up")

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/router/stats", timeout=10).json())

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(20)


@dataclass
class Rig:
    a: VllmServer
    b: VllmServer
    mono: VllmServer
    replicas: Proc
    auto: Proc


@pytest.fixture(scope="module")
def rig(
    request: pytest.FixtureRequest,
    tiny_model: str,
    agent_procs: Callable[[str, dict[str, Any]], Any],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Rig]:
    root = tmp_path_factory.mktemp("modes")
    agent, store = start_pd_agent(agent_procs, root, "modes", CHUNK,
                                  nvme={"enabled": False}, router={"split": "auto"})
    servers = [
        VllmServer(
            f"rm-{x}", tiny_model, free_port(), log_dir / f"rm-{x}.log",
            kv_config=kv_transfer_config("kv_both", store, policy="recompute",
                                         chunk_size=CHUNK),
            env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(i)},
        )
        for i, x in enumerate("ab")
    ]
    for s in servers:
        s.start()
    routers: list[Proc] = []
    try:
        mono = request.getfixturevalue("mono_server")
        for s in servers:
            s.wait_ready(300)
        a, b = servers
        cfg = str(agent.cfg_path)
        routers.append(Proc("rm-replicas",
                            ["--replica", a.url, "--replica", b.url, "-c", cfg], log_dir))
        routers.append(Proc("rm-auto", ["--prefill", a.url, "--decode", b.url, "-c", cfg],
                            log_dir))  # fmt: skip
        yield Rig(a, b, mono, routers[0], routers[1])
    finally:
        for r in routers:
            r.stop()
        for s in servers:
            s.stop()


def _through(router: Proc, rig: Rig, seed: int) -> Any:
    ref = ref_completion(rig, seed)  # type: ignore[arg-type]  # needs .mono only
    got = parse(httpx.post(router.url + "/v1/completions",
                           json=completion_body(text_prompt(seed)), timeout=120))  # fmt: skip
    assert_same_generation(ref, got)
    return got


def test_replica_router_serves_whole_on_both_and_matches_monolithic(rig: Rig) -> None:
    for seed in (31, 32, 33, 34):
        _through(rig.replicas, rig, seed)
    st = rig.replicas.stats()
    assert st["decisions"] == {"whole": 4}, st
    assert st["split"] == "whole" and st["errors"] == 0
    # Idle servers: ties rotate, so both served.
    assert {rig.a.url, rig.b.url} <= set(st["per_backend"]), st["per_backend"]
    # A prompt served before: its chunks are in the shared DRAM tier, or the server's own
    # prefix cache, wherever it lands.
    again = _through(rig.replicas, rig, 31)
    n = again.body["usage"]["prompt_tokens"]
    assert (again.cached_tokens or 0) >= min_cached(n), again.body["usage"]


def test_auto_router_decides_per_request_and_matches_monolithic(rig: Rig) -> None:
    for seed in (41, 42, 43):
        _through(rig.auto, rig, seed)
    st = rig.auto.stats()
    assert st["split"] == "auto" and st["errors"] == 0
    assert sum(st["decisions"].values()) == 3 and set(st["decisions"]) <= {"split", "whole"}
    # Requests ran one at a time: no decode was running when one arrived, so once the
    # router can price a prompt (it learns the fingerprint from the first split, or from
    # the connectors' registrations), a handoff only adds its cost: served whole.
    assert st["decisions"].get("whole", 0) >= 2, st["decisions"]
    text = httpx.get(rig.auto.url + "/metrics", timeout=10).text
    assert 'tiered_cache_router_decisions_total{kind="whole"}' in text
    assert 'tiered_cache_router_phase_seconds_count{phase="tokenize"}' in text
    assert 'tiered_cache_router_phase_seconds_count{phase="lookup"}' in text
    print(f"[modes] auto: decisions {st['decisions']}, rates {st['rates']}")
