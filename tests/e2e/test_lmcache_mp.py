"""LMCache multiprocess mode on our tiers, end to end: a real ``lmcache server`` with our
L2 adapter (``connectors.lmcache_mp``), a real ``vllm serve`` (CPU) with vLLM's own
``LMCacheMPConnector``, and our node agent as its own process (Redis directory, NVMe).

1. A 1,300-token prompt: LMCache keeps its 5 whole chunks in L1 and our adapter stores
   them in our tiers, under the keys ``prefix_pin`` derives from the tokens.
2. The lmcache server restarts (L1 lost) and our DRAM copies are dropped; vLLM keeps
   running and registers its KV caches with the new server.
3. The same prompt: vLLM reports 1,280 cached tokens, our NVMe tier served them, and the
   output is the one the first run computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from connectors.lmcache_pins import prefix_pin
from e2e.test_pd_handoff import assert_same_generation, make_prompt, parse
from e2e.vllm_harness import VllmServer, free_port, pinned_core
from tiered_cache.tools.lmcache_launch import LMCacheServer, tiered_l2_adapter

pytestmark = [pytest.mark.lmcache, pytest.mark.e2e]

CHUNK = 256
PROMPT_LEN = 1300  # 5 whole chunks; LMCache MP stores whole chunks only
GEN_TOKENS = 8
RECOVERED = "Finished re-registering KV caches after server recovery"  # the worker
RESUMED = "LMCache server is healthy again — resuming normal operation"  # scheduler, worker


def _wait(what: str, cond: Callable[[], bool], timeout: float = 60.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.2)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def agent(agent_procs: Any, redis_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("lmc-mp")
    cfg = {
        "node_id": "lmc-mp-node",
        "redis_url": redis_module.url,
        "dram": {"capacity": "64MiB", "slot_bytes": "1MiB"},
        "nvme": {
            "enabled": True,
            "path": str(root / "nvme"),
            "capacity": "256MiB",
            "write_mode": "write_through",
        },
        "agent": {"socket": str(root / "agent.sock"), "pin_sync_interval_s": 0.5},
    }
    return agent_procs("lmc-mp-node", cfg).start()


@pytest.fixture(scope="module")
def lmcache(agent: Any, log_dir: Path) -> Iterator[LMCacheServer]:
    srv = LMCacheServer(
        log_dir / "lmcache-server.log",
        [tiered_l2_adapter({"agent_socket": agent.socket, "embedded": "never"}, chunk_size=CHUNK)],
        chunk_size=CHUNK,
    )
    srv.start()
    try:
        srv.wait_ready(180)
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


@pytest.mark.timeout(900)
def test_restarted_lmcache_server_is_served_from_our_tiers(
    tiny_model: str, agent: Any, lmcache: LMCacheServer, log_dir: Path
) -> None:
    vllm = VllmServer(
        "lmcache-mp", tiny_model, free_port(), log_dir / "vllm-lmcache-mp.log",
        kv_config=lmcache.kv_transfer_config(heartbeat_interval_s=1.0),
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
    )  # fmt: skip
    vllm.start()
    c = agent.client()
    try:
        vllm.wait_ready(300)
        print(f"[e2e] lmcache server up in {lmcache.startup_s:.1f}s, vllm in {vllm.startup_s:.1f}s")
        prompt = make_prompt(41, PROMPT_LEN)

        t = time.monotonic()
        first = parse(vllm.completion(prompt, max_tokens=GEN_TOKENS))
        cold_s = time.monotonic() - t
        assert not first.cached_tokens

        # The whole chunks reach our NVMe tier under the keys derived from the tokens
        # (the model name is what vLLM reports: its --model).
        pin = prefix_pin(prompt, tiny_model, tiers=["nvme"], chunk_size=CHUNK)
        assert len(pin.keys) == PROMPT_LEN // CHUNK

        def on_nvme() -> set[str]:
            entries = c.admin("ls", prefix="", limit=1000)["entries"]
            return {e["key"] for e in entries if e["tier"] == "nvme"}

        stored_s = _wait("the chunks on our NVMe tier", lambda: set(pin.keys) <= on_nvme())
        # Published in the Redis directory, and pinnable as an LMCache-MP prefix.
        assert all(agent.node_id in nodes for nodes in c.locate(pin.keys))
        c.admin("pin_add", pin=pin.model_dump(), chunk_bytes=0)
        assert c.admin("pin_ls")["residency"][pin.id] == {"nvme": "resident"}

        # L1 lost: restart the server; our DRAM copies go too, so NVMe must serve.
        recovered, resumed = vllm.log_text().count(RECOVERED), vllm.log_text().count(RESUMED)
        t = time.monotonic()
        lmcache.restart()
        restart_s = time.monotonic() - t
        c.admin("clear", tier="dram")
        rereg_s = _wait(
            "vLLM to re-register with the new server",
            lambda: (
                vllm.log_text().count(RECOVERED) > recovered
                and vllm.log_text().count(RESUMED) >= resumed + 2
            ),
        )
        tokens_key = "tiered_cache_hit_tokens_total{tier=nvme}"
        hits, hit_tokens = agent.hits("nvme"), agent.stats().get(tokens_key, 0.0)

        t = time.monotonic()
        second = parse(vllm.completion(prompt, max_tokens=GEN_TOKENS))
        warm_s = time.monotonic() - t
        served = agent.hits("nvme") - hits
        served_tokens = agent.stats().get(tokens_key, 0.0) - hit_tokens
        print(
            f"[e2e] cold {cold_s:.2f}s, chunks on NVMe after {stored_s:.1f}s, "
            f"server restart {restart_s:.1f}s, "
            f"re-registered after {rereg_s:.1f}s, warm {warm_s:.2f}s: "
            f"cached_tokens={second.cached_tokens}, NVMe hits {served:.0f} "
            f"({served_tokens:.0f} tokens)"
        )
        assert second.cached_tokens == (PROMPT_LEN // CHUNK) * CHUNK
        assert served >= PROMPT_LEN // CHUNK and served_tokens >= second.cached_tokens
        assert second.token_ids == first.token_ids
        assert_same_generation(first, second)
        adapters = str(lmcache.status())
        assert "TieredCacheL2Adapter" in adapters, adapters[:2000]
    finally:
        c.close()
        vllm.stop()
