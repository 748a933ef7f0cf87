"""Our vLLM connector on every mix of our tiers, end to end (issue 30): a real
``vllm serve`` (CPU) with ``TieredCacheConnector`` (``kv_both``) and our node agent as its
own process (NVMe in a temporary directory, S3 on a moto server over HTTP).

One vLLM for the module; the tier mix is switched by replacing the agent behind the same
socket (the connector's client reconnects). Per mix: a 1,300-token prompt of its own is
saved; the DRAM copies are dropped where a lower tier should serve (and, for NVMe + S3, the
NVMe copies too, so that S3 serves); the same prompt then loads its 5 whole chunks from the
expected tier (the agent's hit counters), no load fails, and the output is the first run's.

Before the fix, every mix without DRAM recomputed: each load raised ``no DRAM tier``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.test_pd_handoff import assert_same_generation, make_prompt, parse
from e2e.test_tier_matrix_lmcache import MIXES, Agents, _wait
from e2e.vllm_harness import VllmServer, free_port, kv_transfer_config, pinned_core

CHUNK = 256
PROMPT_LEN = 1300
CHUNKS = PROMPT_LEN // CHUNK
GEN_TOKENS = 8


@pytest.fixture(scope="module")
def agents(
    agent_procs: Any, redis_module: Any, s3_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> Agents:
    return Agents(agent_procs, tmp_path_factory.mktemp("vmix"), redis_module.url, s3_server)


@pytest.fixture(scope="module")
def server(tiny_model: str, agents: Agents, log_dir: Path) -> Iterator[VllmServer]:
    agents.switch("nvme")
    store = {"agent_socket": agents.socket, "embedded": "never"}
    vllm = VllmServer(
        "tc-mix", tiny_model, free_port(), log_dir / "vllm-tier-mix.log",
        # The read path is under test, not the choice: a tiny model recomputes faster
        # than S3 answers, so ``auto`` could rightly skip the load.
        kv_config=kv_transfer_config("kv_both", store, chunk_size=CHUNK, fetch_policy="always"),
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
    )  # fmt: skip
    vllm.start()
    try:
        vllm.wait_ready(300)
        yield vllm
    finally:
        vllm.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mix", list(MIXES))
def test_vllm_connector_reads_every_tier_mix(mix: str, agents: Agents, server: VllmServer) -> None:
    serves, drop = MIXES[mix]
    agent = agents.switch(mix)
    c = agent.client()
    try:
        prompt = make_prompt(400 + list(MIXES).index(mix), PROMPT_LEN)
        first = parse(server.completion(prompt, max_tokens=GEN_TOKENS))
        assert not first.cached_tokens
        lowest = [t for t in ("dram", "nvme", "s3") if t in mix.split("+")][-1]

        def on(tier: str) -> list[str]:
            entries = c.admin("ls", prefix="", limit=1000)["entries"]
            return [e["key"] for e in entries if e["tier"] == tier]

        _wait(f"the chunks on our {lowest} tier", lambda: len(on(lowest)) >= CHUNKS)
        if "dram" in mix and serves != "dram":
            c.admin("clear", tier="dram")
        if drop is not None:
            for k in on(drop):
                c.admin("evict", key=k, tiers=[drop])
        hit_key = f"tiered_cache_hits_total{{tier={serves}}}"
        fail_key = "tiered_cache_client_load_failures_total"
        before = agent.stats()
        t = time.monotonic()
        second = parse(server.completion(prompt, max_tokens=GEN_TOKENS))
        warm_s = time.monotonic() - t
        # Hits read straight from the DRAM pool reach the agent in a batch a moment later.
        _wait(
            f"{CHUNKS} hits on {serves}",
            lambda: agent.stats().get(hit_key, 0.0) - before.get(hit_key, 0.0) >= CHUNKS,
            timeout=10,
        )
        after = agent.stats()
        served = after.get(hit_key, 0.0) - before.get(hit_key, 0.0)
        failed = sum(v for k, v in after.items() if k.startswith(fail_key))
        print(
            f"[e2e] vLLM connector, mix {mix}: warm {warm_s:.2f}s, "
            f"cached_tokens={second.cached_tokens}, {serves} hits {served:.0f}, "
            f"failed loads {failed:.0f}"
        )
        assert second.cached_tokens is not None and second.cached_tokens >= CHUNKS * CHUNK
        assert served >= CHUNKS
        assert failed == 0
        assert second.token_ids == first.token_ids  # 0 mismatches
        assert_same_generation(first, second)
    finally:
        c.close()
