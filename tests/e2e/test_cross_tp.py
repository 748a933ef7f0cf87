"""Prefill and decode at different TP sizes, under real ``vllm serve`` on CPU.

The tiny Llama has 2 KV heads: a TP=1 pool's chunk holds both, each rank of a TP=2 pool
writes its own head's chunk. With ``peer_tp_sizes`` each pool finds the other's chunks
under the other's keys and loads the heads its ranks hold (``connectors.vllm_tp``): a
TP=2 rank takes a head slice of the TP=1 chunk, a TP=1 reader joins the two ranks'.

Servers (float32): ``mono`` (TP=1, no connector: the reference), ``tp2`` (TP=2, one
worker per core) and ``tp1`` (TP=1), both ``kv_both`` over one store. The reader gets
the writer's ``kv_transfer_params`` as a router passes them on, so it waits for every
chunk the writer saved (each of its ranks commits on its own).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.test_mla_tp import assert_close
from e2e.test_pd_handoff import make_prompt, parse
from e2e.vllm_harness import (
    SharedStore,
    VllmServer,
    free_port,
    kv_transfer_config,
    pinned_core,
    start_servers,
)

CHUNK = 256
PROMPT_LEN = 600  # chunks of 256, 256 and an 88-token tail
GEN_TOKENS = 8


@dataclass
class Rig:
    mono: VllmServer
    tp2: VllmServer
    tp1: VllmServer
    store: SharedStore


@pytest.fixture(scope="module")
def rig(tiny_model: str, shared_store: SharedStore, log_dir: Path) -> Iterator[Rig]:
    def kv(peer: int) -> dict[str, Any]:
        return kv_transfer_config("kv_both", shared_store.config, policy="recompute",
                                  chunk_size=CHUNK, peer_tp_sizes=[peer])  # fmt: skip

    def srv(name: str, tp: int, cores: str, cfg: dict[str, Any] | None) -> VllmServer:
        return VllmServer(
            name, tiny_model, free_port(), log_dir / f"{name}.log", kv_config=cfg,
            extra_args=["--tensor-parallel-size", str(tp)],
            env={"VLLM_CPU_OMP_THREADS_BIND": cores},
        )  # fmt: skip

    r = Rig(
        mono=srv("mono", 1, pinned_core(0), None),
        tp2=srv("tp2", 2, f"{pinned_core(0)}|{pinned_core(1)}", kv(1)),
        tp1=srv("tp1", 1, pinned_core(1), kv(2)),
        store=shared_store,
    )
    servers = [r.mono, r.tp2, r.tp1]
    start_servers(servers)
    try:
        yield r
    finally:
        for s in servers:
            s.stop()


def chunks_held(r: Rig) -> int:
    return int(r.store.client.admin("stats")["usage"]["dram"]["chunks"])


def handoff(r: Rig, writer: VllmServer, reader: VllmServer, seed: int) -> int:
    """The prompt through ``writer`` (one token, as a prefill), then on ``reader`` with
    the writer's ``kv_transfer_params``: the reader loads all but its last token and
    generates what the reference does. Returns how many chunks the writer stored."""
    prompt = make_prompt(seed, PROMPT_LEN)
    ref = parse(r.mono.completion(prompt, max_tokens=GEN_TOKENS))
    before = chunks_held(r)
    g = parse(writer.completion(prompt, max_tokens=1))
    params = g.body.get("kv_transfer_params") or {}
    assert len(params["tiered_cache"]["keys"]) == 3, params
    got = parse(reader.completion(prompt, max_tokens=GEN_TOKENS,
                                  extra={"kv_transfer_params": params}))  # fmt: skip
    assert got.cached_tokens == PROMPT_LEN - 1  # all but the last token, from the cache
    assert_close(ref, got)
    return chunks_held(r) - before


def test_pools_at_different_tp_sizes_load_each_others_chunks(rig: Rig) -> None:
    """TP=1 writes, TP=2 reads; then TP=2 writes, TP=1 reads. Each read loads prompt - 1
    tokens and matches the TP=1 reference; a TP=2 write stores a chunk per rank, of half
    the size (the reader's own saves add nothing: it loaded every chunk)."""
    at_tp1 = handoff(rig, rig.tp1, rig.tp2, seed=11)
    at_tp2 = handoff(rig, rig.tp2, rig.tp1, seed=12)
    print(f"[e2e] chunks stored: TP=1 write {at_tp1}, TP=2 write {at_tp2}")
    assert at_tp1 >= 3
    assert at_tp2 == 2 * at_tp1

