"""LMCache multiprocess mode on every mix of our tiers, end to end (issue 30): a real
``lmcache server`` with our L2 adapter, a real ``vllm serve`` (CPU) with vLLM's own
``LMCacheMPConnector``, and our node agent as its own process (Redis directory, NVMe in a
temporary directory, S3 on a moto server over HTTP).

One vLLM and one lmcache server for the module; the tier mix is switched by replacing the
agent behind the same socket (the adapter's clients reconnect). Per mix:

1. a 1,300-token prompt of its own: LMCache stores its 5 whole chunks through our adapter;
2. the lmcache server restarts (L1 lost) and our DRAM copies are dropped (unless DRAM is
   the only tier), and, where S3 sits under NVMe and is to serve, the NVMe copies too;
3. the same prompt: vLLM reports 1,280 cached tokens, the expected tier served the 5
   chunks (the agent's hit counters), no load failed, and the output is the first run's.

Before the fix, every mix without DRAM failed step 3: each L2 load raised ``no DRAM tier``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connectors.lmcache_pins import prefix_pin
from e2e.test_lmcache_mp import _wait
from e2e.test_pd_handoff import assert_same_generation, make_prompt, parse
from e2e.vllm_harness import VllmServer, free_port, pinned_core
from tiered_cache.tools.lmcache_launch import LMCacheServer, tiered_l2_adapter

pytestmark = [pytest.mark.lmcache, pytest.mark.e2e]

CHUNK = 256
PROMPT_LEN = 1300  # 5 whole chunks; LMCache MP stores whole chunks only
CHUNKS = PROMPT_LEN // CHUNK
GEN_TOKENS = 8
RECOVERED = "Finished re-registering KV caches after server recovery"  # the worker
RESUMED = "LMCache server is healthy again — resuming normal operation"  # scheduler, worker

# mix -> the tier that serves after the restart (and the tier dropped first, if any).
MIXES: dict[str, tuple[str, str | None]] = {
    "nvme": ("nvme", None),
    "s3": ("s3", None),
    "nvme+s3": ("s3", "nvme"),  # NVMe copies dropped: S3 serves through the adapter
    "dram": ("dram", None),
    "dram+nvme+s3": ("nvme", None),
}


class Agents:
    """One agent at a time behind ``socket``, on the tier mix asked for."""

    def __init__(self, make: Any, root: Path, redis_url: str, s3: Any) -> None:
        self.make, self.root, self.redis_url, self.s3 = make, root, redis_url, s3
        self.socket = str(root / "agent.sock")
        self.current: Any = None

    def switch(self, mix: str) -> Any:
        if self.current is not None:
            self.current.stop()
        tiers = set(mix.split("+"))
        name = "mx-" + mix.replace("+", "-")
        bucket = f"tc-e2e-{name}-{uuid.uuid4().hex[:6]}"
        if "s3" in tiers:
            self.s3.client().create_bucket(Bucket=bucket)
        cfg = {
            "node_id": name,
            "redis_url": self.redis_url,
            "dram": {"enabled": "dram" in tiers, "capacity": "64MiB", "slot_bytes": "1MiB",
                     "keep_on_stop": False},
            "nvme": {"enabled": "nvme" in tiers, "path": str(self.root / name / "nvme"),
                     "capacity": "256MiB", "write_mode": "write_through"},
            "s3": {"enabled": "s3" in tiers, "url": f"s3://{bucket}/kv",
                   "endpoint_url": self.s3.endpoint_url, "region": "us-east-1",
                   "write_mode": "write_through"},
            "agent": {"socket": self.socket},
        }  # fmt: skip
        self.current = self.make(name, cfg).start()
        return self.current


@pytest.fixture(scope="module")
def agents(
    agent_procs: Any, redis_module: Any, s3_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> Agents:
    return Agents(agent_procs, tmp_path_factory.mktemp("mix"), redis_module.url, s3_server)


@pytest.fixture(scope="module")
def servers(tiny_model: str, agents: Agents, log_dir: Path) -> Iterator[tuple[Any, Any]]:
    agents.switch("nvme")  # the adapter checks at start-up that the agent serves loads
    lmc = LMCacheServer(
        log_dir / "lmcache-server-mix.log",
        [tiered_l2_adapter({"agent_socket": agents.socket, "embedded": "never"}, chunk_size=CHUNK)],
        chunk_size=CHUNK,
    )
    vllm = VllmServer(
        "lmcache-mix", tiny_model, free_port(), log_dir / "vllm-lmcache-mix.log",
        kv_config=lmc.kv_transfer_config(heartbeat_interval_s=1.0),
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
    )  # fmt: skip
    lmc.start()
    try:
        lmc.wait_ready(180)
        vllm.start()
        vllm.wait_ready(300)
        yield lmc, vllm
    finally:
        vllm.stop()
        lmc.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mix", list(MIXES))
def test_lmcache_server_reads_every_tier_mix(
    mix: str, tiny_model: str, agents: Agents, servers: tuple[Any, Any]
) -> None:
    lmc, vllm = servers
    serves, drop = MIXES[mix]
    agent = agents.switch(mix)
    c = agent.client()
    try:
        prompt = make_prompt(300 + list(MIXES).index(mix), PROMPT_LEN)
        first = parse(vllm.completion(prompt, max_tokens=GEN_TOKENS))
        assert not first.cached_tokens
        keys = prefix_pin(prompt, tiny_model, tiers=["nvme"], chunk_size=CHUNK).keys
        assert len(keys) == CHUNKS
        lowest = [t for t in ("dram", "nvme", "s3") if t in mix.split("+")][-1]

        def on(tier: str) -> set[str]:
            entries = c.admin("ls", prefix="", limit=1000)["entries"]
            return {e["key"] for e in entries if e["tier"] == tier}

        _wait(f"the chunks on our {lowest} tier", lambda: set(keys) <= on(lowest))

        # L1 lost; our DRAM copies too where a lower tier should serve.
        recovered, resumed = vllm.log_text().count(RECOVERED), vllm.log_text().count(RESUMED)
        lmc.restart()
        if "dram" in mix and serves != "dram":
            c.admin("clear", tier="dram")
        if drop is not None:
            for k in keys:
                c.admin("evict", key=k, tiers=[drop])
        _wait(
            "vLLM to re-register with the new server",
            lambda: (
                vllm.log_text().count(RECOVERED) > recovered
                and vllm.log_text().count(RESUMED) >= resumed + 2
            ),
        )
        tokens_key = f"tiered_cache_hit_tokens_total{{tier={serves}}}"
        fail_key = "tiered_cache_client_load_failures_total"
        before = agent.stats()

        t = time.monotonic()
        second = parse(vllm.completion(prompt, max_tokens=GEN_TOKENS))
        warm_s = time.monotonic() - t
        # Hits read straight from the DRAM pool reach the agent in a batch a moment later.
        hit_key = f"tiered_cache_hits_total{{tier={serves}}}"
        _wait(
            f"{CHUNKS} hits on {serves}",
            lambda: agent.stats().get(hit_key, 0.0) - before.get(hit_key, 0.0) >= CHUNKS,
            timeout=10,
        )
        after = agent.stats()
        served = after.get(f"tiered_cache_hits_total{{tier={serves}}}", 0.0) - before.get(
            f"tiered_cache_hits_total{{tier={serves}}}", 0.0
        )
        served_tokens = after.get(tokens_key, 0.0) - before.get(tokens_key, 0.0)
        failed = sum(v for k, v in after.items() if k.startswith(fail_key))
        print(
            f"[e2e] mix {mix}: warm {warm_s:.2f}s, cached_tokens={second.cached_tokens}, "
            f"{serves} hits {served:.0f} ({served_tokens:.0f} tokens), failed loads {failed:.0f}"
        )
        assert second.cached_tokens == CHUNKS * CHUNK
        assert served >= CHUNKS and served_tokens >= second.cached_tokens
        assert failed == 0
        assert second.token_ids == first.token_ids  # 0 mismatches
        assert_same_generation(first, second)
    finally:
        c.close()
