"""Models with several KV cache groups (sliding-window and full-attention layers, as
Gemma 2/3 and gpt-oss interleave them) under real ``vllm serve`` on CPU.

The connector declares ``SupportsHMA``, so vLLM keeps its hybrid allocator on: a request
holds only its window's blocks of the sliding-window layers. A chunk holds every layer;
a load writes each group into its own blocks (a sliding-window group only its window's),
and a chunk whose window blocks were freed before it could be copied is not saved.

Servers (the ``window`` model: 4 layers, a 128-token window on layers 0 and 2; 32-token
blocks, as vLLM frees a window's blocks whole): ``mono`` (no connector, the reference),
``prefill``, ``decode`` and ``onegroup`` (``kv_both`` over one store; ``onegroup`` with
vLLM's hybrid allocator off, as for a connector without ``SupportsHMA``); ``decode``
computes at most 64
tokens a step (chunked prefill), so a prompt it computes itself moves its window past its
first chunk's first blocks before that chunk is done.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.test_pd_handoff import assert_same_generation, make_prompt, parse, wait_metric
from e2e.vllm_harness import (
    SharedStore,
    VllmServer,
    free_port,
    kv_transfer_config,
    pinned_core,
    start_servers,
)

CHUNK = 256
PROMPT_LEN = 600  # chunks of 256, 256 and an 88-token tail; the window is 128
GEN_TOKENS = 8


@dataclass
class Rig:
    mono: VllmServer
    prefill: VllmServer
    decode: VllmServer
    onegroup: VllmServer  # vLLM's hybrid allocator off: every layer in one group
    store: SharedStore


@pytest.fixture(scope="module")
def rig(window_model: str, shared_store: SharedStore, log_dir: Path) -> Iterator[Rig]:
    kv = kv_transfer_config("kv_both", shared_store.config, policy="recompute",
                            chunk_size=CHUNK)  # fmt: skip

    def srv(name: str, core: int, cfg: dict | None, *extra: str) -> VllmServer:
        return VllmServer(
            name, window_model, free_port(), log_dir / f"window-{name}.log", kv_config=cfg,
            extra_args=["--block-size", "32", *extra], env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(core)},
        )  # fmt: skip

    r = Rig(
        mono=srv("mono", 0, None),
        prefill=srv("prefill", 1, kv),
        decode=srv("decode", 0, kv, "--max-num-batched-tokens", "64"),
        onegroup=srv("onegroup", 1, kv, "--disable-hybrid-kv-cache-manager"),
        store=shared_store,
    )
    servers = [r.mono, r.prefill, r.decode, r.onegroup]
    start_servers(servers)
    try:
        yield r
    finally:
        for s in servers:
            s.stop()


def prefill(r: Rig, prompt: list[int], via: VllmServer | None = None) -> list[str]:
    """``prompt`` through the prefill server (or ``via``; one token); its chunks' keys,
    once stored."""
    g = parse((via or r.prefill).completion(prompt, max_tokens=1))
    keys = list(((g.body.get("kv_transfer_params") or {}).get("tiered_cache") or {})["keys"])
    assert len(keys) == 3, g.body
    deadline = time.monotonic() + 10  # saves commit just after the forward pass
    while r.store.present(keys) < len(keys) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.store.present(keys) == len(keys)
    return keys


def test_hybrid_allocator_stays_on(rig: Rig) -> None:
    """vLLM keeps its hybrid KV cache manager (it turns it off for a connector without
    ``SupportsHMA``, and with it the sliding window's memory saving)."""
    for s in (rig.prefill, rig.decode):
        log = s.log_text()
        assert "Turning off hybrid kv cache manager" not in log
        assert "Hybrid KV cache manager is disabled" not in log
    assert "Hybrid KV cache manager is disabled" in rig.onegroup.log_text()


def test_handoff_loads_every_group_and_matches_mono(rig: Rig) -> None:
    """The decode loads all but the last prompt token (its sliding-window layers only
    their window's blocks) and generates what the reference does."""
    for seed in (1, 2):
        prompt = make_prompt(seed, PROMPT_LEN)
        ref = parse(rig.mono.completion(prompt, max_tokens=GEN_TOKENS))
        prefill(rig, prompt)
        got = parse(rig.decode.completion(prompt, max_tokens=GEN_TOKENS))
        assert got.cached_tokens == PROMPT_LEN - 1
        assert_same_generation(ref, got)


def test_chunks_are_shared_with_vllms_one_group_fallback(rig: Rig) -> None:
    """With the hybrid allocator off vLLM makes every layer full attention in one group;
    the chunk bytes and keys are the same, so either writes what the other loads."""
    for seed, writer, reader in ((5, rig.onegroup, rig.decode), (6, rig.prefill, rig.onegroup)):
        prompt = make_prompt(seed, PROMPT_LEN)
        ref = parse(rig.mono.completion(prompt, max_tokens=GEN_TOKENS))
        prefill(rig, prompt, via=writer)
        got = parse(reader.completion(prompt, max_tokens=GEN_TOKENS))
        assert got.cached_tokens == PROMPT_LEN - 1, (writer.name, reader.name)
        assert_same_generation(ref, got)


def test_a_failed_load_recomputes_the_whole_request(rig: Rig) -> None:
    """With several groups vLLM takes a failed load only per request: a damaged chunk
    makes the decode recompute the prompt, and its output is still the reference's."""
    prompt = make_prompt(3, PROMPT_LEN)
    ref = parse(rig.mono.completion(prompt, max_tokens=GEN_TOKENS))
    rig.store.corrupt(prefill(rig, prompt)[1:2])
    got = parse(rig.decode.completion(prompt, max_tokens=GEN_TOKENS))
    assert_same_generation(ref, got)
    assert "not loaded" in rig.decode.log_text()


def test_chunks_whose_window_was_freed_are_not_saved(rig: Rig) -> None:
    """The decode computes a new prompt 64 tokens a step: by the step its first chunk is
    done (tokens 192..255), the window (128) has freed that chunk's first two blocks of
    the sliding-window layers, so it saves none of the prompt (counted), and a reader
    recomputes it rather than load another request's KV."""
    prompt = make_prompt(4, PROMPT_LEN)
    ref = parse(rig.mono.completion(prompt, max_tokens=GEN_TOKENS))
    got = parse(rig.decode.completion(prompt, max_tokens=GEN_TOKENS))
    assert_same_generation(ref, got)
    assert wait_metric(rig.decode, "tiered_cache_connector_saves_skipped_total", 3,
                       reason="window") >= 3  # fmt: skip
    again = parse(rig.prefill.completion(prompt, max_tokens=GEN_TOKENS))
    assert again.cached_tokens in (None, 0)
    assert_same_generation(ref, again)
