"""The P/D handoff on every mix of our tiers, end to end (issue 30): a prefill
``vllm serve`` (CPU, ``kv_both``) and a decode ``vllm serve`` (``kv_consumer``), both with
``TieredCacheConnector`` on one node agent run as its own process (Redis directory, NVMe in
a temporary directory, S3 on a moto server over HTTP).

Both servers for the module; the tier mix is switched by replacing the agent behind the
same socket (the connectors' clients reconnect). Per mix:

1. a 1,300-token prompt of its own is prefilled with ``max_tokens=1`` and
   ``do_remote_decode``, as ``tiered-cache router`` does; the answer's
   ``kv_transfer_params`` list the 6 chunks saved (5 whole and the tail);
2. the DRAM copies are dropped where a lower tier should serve (and, for NVMe + S3, the
   NVMe copies too, so that S3 serves);
3. the decode server gets the prompt with those ``kv_transfer_params``: it loads all of the
   prompt but its last token from the expected tier (the agent's hit counters), no load
   fails, and the output is the prefill server's own generation of the prompt.

Without the fix, every mix without DRAM recomputed: each load raised ``no DRAM tier``.
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
PROMPT_LEN = 1300  # 5 whole chunks and a 20-token tail
CHUNKS = PROMPT_LEN // CHUNK
GEN_TOKENS = 8
WAIT_S = 10.0  # the decode's wait for the chunks its prefill listed (all landed before)


@pytest.fixture(scope="module")
def agents(
    agent_procs: Any, redis_module: Any, s3_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> Agents:
    return Agents(agent_procs, tmp_path_factory.mktemp("pdmix"), redis_module.url, s3_server)


@pytest.fixture(scope="module")
def servers(
    tiny_model: str, agents: Agents, log_dir: Path
) -> Iterator[tuple[VllmServer, VllmServer]]:
    agents.switch("nvme")
    store = {"agent_socket": agents.socket, "embedded": "never"}
    # The read path is under test, not the choice: a tiny model recomputes faster than S3
    # answers, so ``auto`` could rightly skip the load.
    prefill = VllmServer(
        "pd-mix-prefill", tiny_model, free_port(), log_dir / "vllm-pd-mix-prefill.log",
        kv_config=kv_transfer_config("kv_both", store, chunk_size=CHUNK, fetch_policy="always"),
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
    )  # fmt: skip
    decode = VllmServer(
        "pd-mix-decode", tiny_model, free_port(), log_dir / "vllm-pd-mix-decode.log",
        kv_config=kv_transfer_config(
            "kv_consumer", store, policy="recompute", chunk_size=CHUNK,
            load_wait_timeout_s=WAIT_S, fetch_policy="always",
        ),
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(1)},
    )  # fmt: skip
    both = [prefill, decode]
    try:
        for s in both:
            s.start()
        for s in both:
            s.wait_ready(300)
        yield prefill, decode
    finally:
        for s in both:
            s.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mix", list(MIXES))
def test_pd_handoff_reads_every_tier_mix(
    mix: str, agents: Agents, servers: tuple[VllmServer, VllmServer]
) -> None:
    prefill, decode = servers
    serves, drop = MIXES[mix]
    agent = agents.switch(mix)
    c = agent.client()
    try:
        prompt = make_prompt(500 + list(MIXES).index(mix), PROMPT_LEN)
        # 1. The prefill stage, as the router sends it.
        pre = parse(prefill.completion(
            prompt, max_tokens=1,
            extra={"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
        ))  # fmt: skip
        assert not pre.cached_tokens
        params = dict(pre.body.get("kv_transfer_params") or {})
        tc = params.get("tiered_cache") or {}
        keys = list(tc.get("keys") or [])
        assert tc.get("chunks") == CHUNKS + 1 and len(keys) == CHUNKS + 1, params
        lowest = [t for t in ("dram", "nvme", "s3") if t in mix.split("+")][-1]

        def on(tier: str) -> set[str]:
            entries = c.admin("ls", prefix="", limit=1000)["entries"]
            return {e["key"] for e in entries if e["tier"] == tier}

        _wait(f"the chunks on our {lowest} tier", lambda: set(keys) <= on(lowest))

        # 2. Only the tier under test keeps the chunks.
        if "dram" in mix and serves != "dram":
            c.admin("clear", tier="dram")
        if drop is not None:
            for k in keys:
                c.admin("evict", key=k, tiers=[drop])
        hit_key = f"tiered_cache_hits_total{{tier={serves}}}"
        fail_key = "tiered_cache_client_load_failures_total"
        before = agent.stats()

        # 3. The decode stage, with what the prefill answered.
        t = time.monotonic()
        got = parse(decode.completion(
            prompt, max_tokens=GEN_TOKENS, extra={"kv_transfer_params": params}
        ))  # fmt: skip
        decode_s = time.monotonic() - t
        failed = sum(v for k, v in agent.stats().items() if k.startswith(fail_key))
        print(
            f"[e2e] P/D, mix {mix}: decode {decode_s:.2f}s, "
            f"cached_tokens={got.cached_tokens}, failed loads {failed:.0f}"
        )
        # Hits read straight from the DRAM pool reach the agent in a batch a moment later.
        _wait(
            f"{CHUNKS + 1} hits on {serves}",
            lambda: agent.stats().get(hit_key, 0.0) - before.get(hit_key, 0.0) >= CHUNKS + 1,
            timeout=10,
        )
        after = agent.stats()
        served = after.get(hit_key, 0.0) - before.get(hit_key, 0.0)
        failed = sum(v for k, v in after.items() if k.startswith(fail_key))
        print(f"[e2e] P/D, mix {mix}: {serves} hits {served:.0f}, failed loads {failed:.0f}")
        # The reference: the prefill server's own generation (its KV, computed there).
        ref = parse(prefill.completion(prompt, max_tokens=GEN_TOKENS))
        assert pre.token_ids[0] == ref.token_ids[0]
        assert got.cached_tokens is not None and got.cached_tokens >= CHUNKS * CHUNK
        assert got.cached_tokens == PROMPT_LEN - 1
        assert served >= CHUNKS + 1  # the 5 whole chunks and the tail
        assert failed == 0
        assert_same_generation(ref, got)
    finally:
        c.close()
