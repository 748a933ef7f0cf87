"""KV events with real vLLM (issue 25): a prefill (``kv_both``) and a decode
(``kv_consumer``) behind the router serve a chat workload (growing conversations over two
shared system prompts, a few at once) through one agent that publishes KV events.
Afterwards a consumer built on vLLM's own classes sees in each tier exactly what
``tiered-cache ls`` lists, and every block hash our events name is one vLLM itself
published for its GPU blocks: a router can join the two streams."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers_kv_events import Consumer, ls_view

from e2e.test_pd_handoff import parse
from e2e.test_router import RouterProc, completion_body
from e2e.vllm_harness import VllmServer, free_port, kv_transfer_config, pinned_core, start_pd_agent

CHUNK = 256


def _ls(cfg: Path) -> list[dict[str, Any]]:
    r = subprocess.run(
        [sys.executable, "-m", "tiered_cache.cli", "ls", "--config", str(cfg), "--json",
         "--limit", "100000"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["entries"])


def _chat(n: int, seed: int = 25) -> list[list[int]]:
    """Conversations over two shared system prompts, each turn the last one plus an
    answer and a new question (bench/serve.py's ``chat``, smaller)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(6, 500) for _ in range(600)] for _ in range(2)]
    convs = [list(systems[u % 2]) for u in range(4)]
    out: list[list[int]] = []
    while len(out) < n:
        u = rng.randrange(4)
        convs[u] += [rng.randrange(6, 500) for _ in range(rng.randrange(40, 120))]
        out.append(list(convs[u]))
        convs[u] += [rng.randrange(6, 500) for _ in range(8)]
    return out


def test_the_events_match_ls_and_join_vllms_own(
    tiny_model: str,
    agent_procs: Callable[[str, dict[str, Any]], Any],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("kvev")
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    agent, store = start_pd_agent(
        agent_procs, root, "kvev", CHUNK,
        kv_events={"enabled": True, "endpoint": pub, "replay_endpoint": rep,
                   "state_path": str(root / "kvevents")},
    )  # fmt: skip
    ours = Consumer(pub, rep)
    ours.replay(0)
    gpu_ports = [free_port(), free_port()]
    gpu = [Consumer(f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{free_port()}") for p in gpu_ports]

    def events_args(port: int) -> list[str]:
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
               "endpoint": f"tcp://*:{port}"}  # vLLM binds only a wildcard  # fmt: skip
        return ["--enable-prefix-caching", "--kv-events-config", json.dumps(cfg)]

    # One hash seed for both engines: vLLM names the same tokens alike only then.
    env = {"PYTHONHASHSEED": "0"}
    prefill = VllmServer(
        "kvev-prefill", tiny_model, free_port(), log_dir / "kvev-prefill.log",
        kv_config=kv_transfer_config("kv_both", store, policy="recompute", chunk_size=CHUNK),
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
        extra_args=events_args(gpu_ports[0]),
    )
    decode = VllmServer(
        "kvev-decode", tiny_model, free_port(), log_dir / "kvev-decode.log",
        kv_config=kv_transfer_config("kv_consumer", store, policy="recompute",
                                     chunk_size=CHUNK, load_wait_timeout_s=4.0),
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": pinned_core(1)},
        extra_args=events_args(gpu_ports[1]),
    )  # fmt: skip
    router = None
    try:
        for s in (prefill, decode):
            s.start()
        for s in (prefill, decode):
            s.wait_ready(400)
        router = RouterProc("kvev-router", [prefill.url], [decode.url], log_dir,
                            config=agent.cfg_path).wait_up()  # fmt: skip
        prompts = _chat(9)
        with ThreadPoolExecutor(3) as pool:  # a few at once
            for got in pool.map(lambda p: parse(router.post("/v1/completions",
                                                            completion_body(p))), prompts):
                assert got.body["usage"]["prompt_tokens"] > 0

        node = str(agent.node_id)

        def settled() -> bool:
            ours.poll(0.3)
            want = {k: v for k, v in ls_view(_ls(agent.cfg_path), node).items() if v}
            return {k: v for k, v in ours.view.items() if v} == want

        ours.follow(settled, timeout=30)
        assert ours.view.get(f"tiered-cache:{node}:dram")
        assert ours.view.get(f"tiered-cache:{node}:nvme")  # write-through: both tiers
        for g in gpu:
            g.poll(1.0)
        vllm_hashes = {h for g in gpu for e in g.stored_events for h in e.block_hashes}
        our_hashes = {h for c in ours.view.values() for h in c}
        assert vllm_hashes, "vLLM published no KV events"
        missing = our_hashes - vllm_hashes
        assert not missing, f"{len(missing)} of {len(our_hashes)} hashes vLLM never named"
        ev = next(e for e in ours.stored_events if e.medium == "CPU")
        assert ev.block_size == 128 and len(ev.token_ids) == 128 * len(ev.block_hashes)
        print(f"[kv_events] {len(our_hashes)} blocks in our tiers, all among vLLM's "
              f"{len(vllm_hashes)}; {ours.batches} batches")  # fmt: skip
    finally:
        if router is not None:
            router.stop()
        for s in (prefill, decode):
            s.stop()
        for c in (ours, *gpu):
            c.close()
