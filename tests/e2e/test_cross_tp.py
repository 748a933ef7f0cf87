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
from pathlib import Path
from typing import Any

import pytest

from e2e.test_mla_tp import Rig, handoff, tp_rig
from e2e.vllm_harness import SharedStore, kv_transfer_config

CHUNK = 256


@pytest.fixture(scope="module")
def rig(tiny_model: str, shared_store: SharedStore, log_dir: Path) -> Iterator[Rig]:
    def kv(tp: int) -> dict[str, Any]:  # each pool reads the other's chunks
        return kv_transfer_config("kv_both", shared_store.config, policy="recompute",
                                  chunk_size=CHUNK, peer_tp_sizes=[3 - tp])  # fmt: skip

    yield from tp_rig(tiny_model, shared_store, log_dir, kv)


def test_pools_at_different_tp_sizes_load_each_others_chunks(rig: Rig) -> None:
    """TP=1 writes, TP=2 reads; then TP=2 writes, TP=1 reads. Each read loads prompt - 1
    tokens and matches the TP=1 reference; a TP=2 write stores a chunk per rank, of half
    the size (the reader's own saves add nothing: it loaded every chunk)."""
    at_tp1 = handoff(rig, rig.tp1, rig.tp2, seed=11, via_router=True)
    at_tp2 = handoff(rig, rig.tp2, rig.tp1, seed=12, via_router=True)
    print(f"[e2e] chunks stored: TP=1 write {at_tp1}, TP=2 write {at_tp2}")
    assert at_tp1 >= 3
    assert at_tp2 == 2 * at_tp1
