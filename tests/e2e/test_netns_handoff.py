"""P/D handoff between two nodes at different addresses, with chunks of real-model size.

* a prefill node and a decode node, each a network namespace (``tiered_cache.netns``) with
  its own agent (peer port bound on 0.0.0.0, as the shipped configs do) and its own
  ``vllm serve``; Redis on the bridge is their directory;
* the model is ``wide`` (48 KiB of KV a token): every 256-token chunk is 12 MiB, over
  the 8 MiB that every earlier test stayed under;
* a monolithic ``vllm serve`` of the same model is the reference.

The decode node has no chunk of its own: every chunk must come over TCP from the prefill
node's agent, and the decode's log must say so.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.test_pd_handoff import assert_same_generation, make_prompt, parse
from e2e.vllm_harness import VllmServer, free_port, kv_transfer_config, pinned_core, start_servers
from tiered_cache.netns import NetNodes, unavailable_reason

CHUNK = 256
PROMPT_LEN = 700  # 2 full chunks and a tail of 188 tokens
GEN_TOKENS = 8
CHUNK_BYTES = 48 * 1024 * CHUNK  # 12 MiB


@dataclass
class Nodes:
    net: NetNodes
    prefill: VllmServer
    decode: VllmServer
    mono: VllmServer
    agents: dict[str, Any]


@pytest.fixture(scope="module")
def nodes(
    wide_model: str, agent_procs: Any, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Nodes]:
    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"needs network namespaces: {why}")
    from conftest import _spawn_redis  # tests/conftest.py

    root = tmp_path_factory.mktemp("nsh")
    tag = uuid.uuid4().hex[:6]
    net = NetNodes(["prefill", "decode"], hosts={"redis.internal": "host"})
    redis_port = free_port()
    redis = _spawn_redis(redis_port, bind=net.host_ip)
    servers: list[VllmServer] = []
    try:
        agents: dict[str, Any] = {}
        for node in ("prefill", "decode"):
            a = agent_procs(f"ns-{node}", {
                "node_id": f"{node}-{tag}",
                "chunk_size": CHUNK,
                "redis_url": f"redis://redis.internal:{redis_port}/0",
                "dram": {"capacity": "512MiB"},  # default slot size: auto
                "agent": {"socket": str(root / f"{node}.sock"), "peer_host": "0.0.0.0",
                          "peer_port": 7480, "peer_secret": "e2e-netns-peer-secret"},
            })  # fmt: skip
            a.prefix = net.prefix(node)
            agents[node] = a.start()

        def store(node: str) -> dict[str, Any]:
            return {"config_file": str(agents[node].cfg_path), "embedded": "never"}

        prefill = VllmServer(
            "ns-prefill", wide_model, free_port(), log_dir / "ns-prefill.log",
            kv_config=kv_transfer_config("kv_producer", store("prefill"), chunk_size=CHUNK),
            env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
            host=net.addr("prefill"), prefix=net.prefix("prefill"),
        )  # fmt: skip
        decode = VllmServer(
            "ns-decode", wide_model, free_port(), log_dir / "ns-decode.log",
            kv_config=kv_transfer_config(
                "kv_consumer", store("decode"), policy="recompute", chunk_size=CHUNK,
                fetch_policy="always",  # the path is under test, not the choice
            ),
            env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(1)},
            host=net.addr("decode"), prefix=net.prefix("decode"),
        )  # fmt: skip
        mono = VllmServer(
            "wide-mono", wide_model, free_port(), log_dir / "wide-mono.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
        )
        servers = [prefill, decode, mono]
        start_servers(servers)
        yield Nodes(net, prefill, decode, mono, agents)
    finally:
        for s in servers:
            s.stop()
        for a in agents.values():
            a.stop()
        redis.terminate()
        redis.wait(10)
        net.close()


def test_decode_node_pulls_12mib_chunks_from_its_peer_and_matches_monolithic(
    nodes: Nodes,
) -> None:
    prompt = make_prompt(4242, PROMPT_LEN)
    ref = parse(nodes.mono.completion(prompt, max_tokens=GEN_TOKENS))
    pre = nodes.prefill.completion(
        prompt, max_tokens=1,
        extra={"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
    )  # fmt: skip
    params = pre.json()["kv_transfer_params"]
    assert params["tiered_cache"]["chunks"] == 3
    got = parse(nodes.decode.completion(
        prompt, max_tokens=GEN_TOKENS, extra={"kv_transfer_params": params}
    ))  # fmt: skip
    assert_same_generation(ref, got)
    assert got.cached_tokens == PROMPT_LEN - 1  # all but the last token came from the cache
    log = nodes.decode.log_text()
    m = re.search(r"loaded (\d+)/(\d+) chunks \((\d+) tokens planned\) from (\S+) in", log)
    assert m is not None, log[-3000:]
    assert m.group(1) == m.group(2) == "3" and m.group(4) == "peer", m.group(0)
    dec = nodes.agents["decode"].stats()
    assert dec["tiered_cache_hits_total{tier=peer}"] == 3
    assert dec["tiered_cache_read_bytes_total{tier=peer}"] > 2 * CHUNK_BYTES
    pre_stats = nodes.agents["prefill"].stats()
    assert pre_stats["tiered_cache_peer_transfers_total{direction=out}"] == 3
