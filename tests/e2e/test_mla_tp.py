"""MLA stored once, read at any TP size, under real ``vllm serve`` on CPU.

DeepSeek-style MLA caches one latent vector a token, the same on every TP rank. So at
TP=2 only rank 0 saves it, under the keys a TP=1 writer uses (``vllm_common.kv_shards``):
the tier holds one copy, and a pool at TP=1 loads what a TP=2 pool wrote, and back.

Servers (bfloat16, 32-token blocks: vLLM's CPU MLA kernels take no float32 and blocks in
multiples of 32): ``mono`` (TP=1, no connector, the reference), ``tp2`` (TP=2, one worker
per core) and ``tp1`` (TP=1), both ``kv_both`` over one store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.test_pd_handoff import Gen, make_prompt, parse
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
# bfloat16, and TP=2 sums its heads' outputs in another order than TP=1: the same KV gives
# logprobs this close (measured: within 0.004 on these prompts), and a greedy pick may
# differ only where the reference's top two are this close.
LOGPROB_TOL = 0.05


@dataclass
class Rig:
    mono: VllmServer
    tp2: VllmServer
    tp1: VllmServer
    store: SharedStore


def tp_rig(
    model: str, store: SharedStore, log_dir: Path, kv: Callable[[int], dict[str, Any]],
    dtype: str = "float32", extra_args: Sequence[str] = (),
) -> Iterator[Rig]:
    """``mono`` (TP=1, no connector), ``tp2`` (TP=2, a worker per core) and ``tp1``
    (TP=1), the latter two with connector config ``kv(tp)``; stopped after the yield."""

    def srv(name: str, tp: int, cores: str, cfg: dict[str, Any] | None) -> VllmServer:
        return VllmServer(
            name, model, free_port(), log_dir / f"{name}.log", kv_config=cfg, dtype=dtype,
            extra_args=["--tensor-parallel-size", str(tp), *extra_args],
            env={"VLLM_CPU_OMP_THREADS_BIND": cores},
        )  # fmt: skip

    r = Rig(
        mono=srv("mono", 1, pinned_core(0), None),
        tp2=srv("tp2", 2, f"{pinned_core(0)}|{pinned_core(1)}", kv(2)),
        tp1=srv("tp1", 1, pinned_core(1), kv(1)),
        store=store,
    )
    servers = [r.mono, r.tp2, r.tp1]
    start_servers(servers)
    try:
        yield r
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def rig(mla_model: str, shared_store: SharedStore, log_dir: Path) -> Iterator[Rig]:
    kv = kv_transfer_config("kv_both", shared_store.config, policy="recompute",
                            chunk_size=CHUNK)  # fmt: skip
    yield from tp_rig(mla_model, shared_store, log_dir, lambda tp: kv, "bfloat16",
                      ["--block-size", "32"])  # fmt: skip


def chunks_held(r: Rig) -> int:
    usage = r.store.client.admin("stats")["usage"]
    return int(usage["dram"]["chunks"])


def handoff(
    r: Rig, writer: VllmServer, reader: VllmServer, seed: int, via_router: bool = False
) -> int:
    """The prompt through ``writer`` (one token, as a prefill), then on ``reader``: the
    reader loads all but its last token and generates what the reference does. Returns
    how many chunks the store gained. ``via_router``: the reader gets the writer's
    ``kv_transfer_params`` as a router passes them on, and waits for every chunk they
    name; else the writer's chunks are waited for here first."""
    prompt = make_prompt(seed, PROMPT_LEN)
    ref = parse(r.mono.completion(prompt, max_tokens=GEN_TOKENS))
    before = chunks_held(r)
    g = parse(writer.completion(prompt, max_tokens=1))
    params = g.body.get("kv_transfer_params") or {}
    keys = list((params.get("tiered_cache") or {})["keys"])
    assert len(keys) == 3, params
    extra = {"kv_transfer_params": params} if via_router else None
    if not via_router:
        deadline = time.monotonic() + 10  # saves commit just after the forward pass
        while r.store.present(keys) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.store.present(keys) == len(keys)
    got = parse(reader.completion(prompt, max_tokens=GEN_TOKENS, extra=extra))
    assert got.cached_tokens == PROMPT_LEN - 1  # all but the last token, from the cache
    assert_close(ref, got)
    # Counted after the reader's request (many engine steps after the writer's commits):
    # the reader's own saves of the prompt name the same keys, so add nothing.
    return chunks_held(r) - before


def assert_close(ref: Gen, got: Gen) -> None:
    same = [i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)) if a == b]
    worst = max((abs(ref.logprobs[i] - got.logprobs[i]) for i in same), default=0.0)
    print(f"[e2e] {len(same)}/{len(ref.token_ids)} tokens equal, max |dlogprob| {worst:.3f}")
    for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)):
        if a != b:
            top = ref.top[i]
            assert top[0] - top[1] <= LOGPROB_TOL, f"token {i}: {b} vs {a}, top-2 {top[:2]}"
            return  # a near tie: the sequences may part here
        assert abs(ref.logprobs[i] - got.logprobs[i]) <= LOGPROB_TOL, (i, ref.logprobs,
                                                                       got.logprobs)  # fmt: skip


def test_mla_is_stored_once_and_loads_at_either_tp(rig: Rig) -> None:
    """TP=1 writes, TP=2 reads; then TP=2 writes, TP=1 reads. Each loads prompt - 1
    tokens and matches the reference, and a TP=2 write adds as many chunks as a TP=1
    write (without sharing, rank 1 adds its own copy of each)."""
    at_tp1 = handoff(rig, rig.tp1, rig.tp2, seed=1)
    at_tp2 = handoff(rig, rig.tp2, rig.tp1, seed=2)
    print(f"[e2e] chunks stored: TP=1 write {at_tp1}, TP=2 write {at_tp2}")
    assert at_tp1 >= 3
    assert at_tp2 == at_tp1
