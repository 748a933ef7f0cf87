"""The handoff under a little traffic: concurrent multi-turn clients through the router.

What a new user saw before: 19 of 24 requests waited out a 5 s deadline for a last chunk
no prefill was writing (the router had skipped the prefill: every full chunk was cached),
and with the agent killed every request took ~19 s and printed tracebacks. Here:

* one agent (DRAM + NVMe), a prefill and a decode ``vllm serve`` with ``--block-size 64``
  behind ``tiered-cache router``, and a monolithic reference with the same block size;
* 3 clients, 2 shared system prompts, conversations that grow by turns, prompt lengths on
  and off the 256-token chunk boundary, some prompts repeated (the router skips their
  prefill);
* then the agent is killed (``kill -9``) and the clients go on: the router stops
  splitting requests, since a decode could only recompute what a prefill computed.

Every output equals the reference; no request waits for a chunk that is not coming
(``recompute_fallbacks{reason=deadline}`` stays 0); with the agent dead nothing fails and
each connector logs the outage once, with no traceback.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.test_pd_handoff import Gen, assert_same_generation, parse
from e2e.test_router import WORDS, RouterProc, completion_body
from e2e.vllm_harness import VllmServer, free_port, kv_transfer_config, pinned_core, start_servers

CHUNK = 256
BLOCK = ["--block-size", "64"]
CLIENTS = 3


@dataclass
class Stack:
    agent: Any
    prefill: VllmServer
    decode: VllmServer
    mono: VllmServer
    router: RouterProc


@pytest.fixture(scope="module")
def stack(
    tiny_model: str,
    agent_procs: Callable[[str, dict[str, Any]], Any],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("nostall")
    node = f"ns-{uuid.uuid4().hex[:6]}"
    agent = agent_procs(node, {
        "node_id": node, "chunk_size": CHUNK, "dram": {"capacity": "64MiB"},
        "nvme": {"enabled": True, "path": str(root / "nvme"), "capacity": "256MiB",
                 "write_mode": "write_through"},
        "agent": {"socket": str(root / "agent.sock")},
    }).start()  # fmt: skip
    store = {"config_file": str(agent.cfg_path), "embedded": "never"}
    prefill = VllmServer(
        "ns-pf", tiny_model, free_port(), log_dir / "nostall-prefill.log", extra_args=BLOCK,
        kv_config=kv_transfer_config("kv_producer", store, chunk_size=CHUNK),
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
    )
    decode = VllmServer(
        "ns-dec", tiny_model, free_port(), log_dir / "nostall-decode.log", extra_args=BLOCK,
        kv_config=kv_transfer_config("kv_consumer", store, policy="recompute",
                                     chunk_size=CHUNK),
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(1)},
    )
    mono = VllmServer(
        "ns-mono", tiny_model, free_port(), log_dir / "nostall-mono.log", extra_args=BLOCK,
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
    )
    servers = [prefill, decode, mono]
    start_servers(servers)
    router = None
    try:
        router = RouterProc("nostall-router", [prefill.url], [decode.url], log_dir,
                            config=agent.cfg_path).wait_up()  # fmt: skip
        yield Stack(agent, prefill, decode, mono, router)
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()


def workload(seed: int, n: int) -> list[str]:
    """Prompts of growing conversations over two shared system prompts, some repeated."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    systems = [f"System {i}: " + text(230 + 40 * i) for i in range(2)]
    convs = {c: systems[c % 2] for c in range(4)}
    out: list[str] = []
    while len(out) < n:
        c = rng.randrange(4)
        convs[c] += f"\nUser: {text(rng.randrange(15, 60))}\nAssistant:"
        out.append(convs[c])
        if rng.random() < 0.25:
            out.append(convs[c])  # asked again: every full chunk is cached, prefill skipped
        convs[c] += " " + text(rng.randrange(5, 30))
    return out[:n]


def run_clients(stack: Stack, prompts: list[str]) -> list[tuple[Gen, Gen]]:
    """(through the router, reference) per prompt, ``CLIENTS`` requests at a time."""

    def one(p: str) -> tuple[Gen, Gen]:
        got = parse(httpx.post(stack.router.url + "/v1/completions", json=completion_body(p),
                               timeout=120))  # fmt: skip
        return got, parse(stack.mono.completion(p, max_tokens=8))

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, prompts))


def counter(s: VllmServer, reason: str) -> float:
    return sum(
        v for k, v in s.metrics().items()
        if k.startswith("tiered_cache_connector_recompute_fallbacks_total{")
        and f'reason="{reason}"' in k
    )  # fmt: skip


def test_concurrent_multi_turn_clients_never_wait_for_missing_chunks(stack: Stack) -> None:
    prompts = workload(1, 18)
    results = run_clients(stack, prompts)
    for got, ref in results:
        assert_same_generation(ref, got)
    assert sum(1 for got, _ in results if (got.cached_tokens or 0) > 0) >= len(prompts) // 2
    st = stack.router.stats()
    assert st["errors"] == 0 and st["prefill_skipped"] >= 1, st
    # A wait that ran out (for a prefill's chunk, or a copy into DRAM) logs "did not
    # arrive" and counts recompute_fallbacks{deadline|fetch_deadline}.
    assert "did not arrive" not in stack.decode.log_text()


def test_a_killed_agent_fails_no_request_and_logs_the_outage_once(stack: Stack) -> None:
    stack.agent.kill()
    prompts = workload(2, 9)
    results = run_clients(stack, prompts)
    for got, ref in results:
        assert_same_generation(ref, got)
        assert got.cached_tokens in (None, 0)  # recomputed: the cache is gone
    st = stack.router.stats()
    # No request is split while the cache is down (a decode would only recompute what
    # the prefill computed): each is served whole by one server.
    assert st["errors"] == 0 and st["fallbacks"].get("cache_down") == len(prompts), st
    for srv in (stack.prefill, stack.decode):
        log = srv.log_text()
        # One line per connector process that met the outage (scheduler and worker).
        assert 1 <= log.count("unavailable (") <= 2, log[-3000:]
        assert "Traceback" not in log
    deadline = time.monotonic() + 15  # stats reach /metrics with the engine's next update
    while counter(stack.decode, "unavailable") < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counter(stack.decode, "unavailable") >= 1
