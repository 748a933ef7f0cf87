"""Unit tests of the vLLM connector: block gather/scatter, chunk math, and the scheduler
and worker halves driven by hand on CPU tensors shaped like vLLM's
``[num_blocks, H, block_size, 2*head_size]`` per layer, over ``MemoryChunkStore``.
No vLLM engine is started (vLLM is imported only for the connector tests)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from connectors.vllm_kvio import (
    HostStaging,
    PagedKV,
    chunk_spans,
    load_block_ranges,
    loadable_spans,
    payload_tensor,
)
from tiered_cache import codec
from tiered_cache.api import MemoryChunkStore

BS = 16  # block size
H, HS = 2, 8  # KV heads, head size
LAYERS = 3
CHUNK = 64


def kv_layers(num_blocks: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, H, BS, 2 * HS, generator=g).to(dtype) for _ in range(LAYERS)
    ]


# ------------------------------------------------------------------------- chunk math


def test_chunk_spans_full_and_tail() -> None:
    spans = chunk_spans(150, CHUNK, BS)
    assert [(s.start, s.end) for s in spans] == [(0, 64), (64, 128), (128, 150)]
    assert [(s.first_block, s.end_block) for s in spans] == [(0, 4), (4, 8), (8, 10)]
    assert spans[-1].num_blocks == 2 and spans[-1].num_tokens == 22
    assert len(chunk_spans(150, CHUNK, BS, include_partial=False)) == 2
    with pytest.raises(ValueError, match="multiple"):
        chunk_spans(10, 40, BS)


def test_loadable_spans_leave_the_last_token() -> None:
    # A tail chunk holding only the last prompt token is useless to load.
    assert [s.end for s in loadable_spans(129, CHUNK, BS)] == [64, 128]
    assert [s.end for s in loadable_spans(130, CHUNK, BS)] == [64, 128, 130]
    assert [s.end for s in loadable_spans(128, CHUNK, BS)] == [64, 128]
    assert loadable_spans(1, CHUNK, BS) == []


def test_load_block_ranges_skip_local_hit_and_cover_unaligned_end() -> None:
    spans = chunk_spans(150, CHUNK, BS)
    # Local prefix hit of 32 tokens (2 blocks); load up to token 149 (all but the last).
    rs = load_block_ranges(spans, 32, 149)
    assert [(r.span.index, r.lo, r.hi) for r in rs] == [(0, 2, 4), (1, 4, 8), (2, 8, 10)]
    # Only the chunks overlapping the range; whole blocks.
    assert [(r.span.index, r.lo, r.hi) for r in load_block_ranges(spans, 70, 100)] == [
        (1, 4, 7)
    ]


# ---------------------------------------------------------------- gather / scatter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter_roundtrip_whole_blocks(dtype: torch.dtype) -> None:
    src = PagedKV(kv_layers(dtype=dtype))
    dst_layers = [torch.zeros_like(t) for t in src.layers]
    dst = PagedKV(dst_layers)
    ids = [5, 1, 9, 2]
    staging = HostStaging().reserve(src.payload_nbytes(len(ids)))
    out = staging[: src.payload_nbytes(len(ids))].view(dtype).view(src.payload_shape(len(ids)))
    src.gather(ids, out)
    # Payload is [layers, blocks, H, block_size, 2*head_size]: whole blocks, K and V together.
    for li in range(LAYERS):
        assert torch.equal(out[li], src.layers[li][ids])
    # Through bytes (as the store sees it) and back into other block ids.
    raw = bytes(out.view(torch.uint8).reshape(-1).numpy())
    back = payload_tensor(raw, dtype, src.payload_shape(len(ids)))
    dst.scatter([10, 11, 12, 13], back)
    for li in range(LAYERS):
        assert torch.equal(dst_layers[li][10:14], src.layers[li][ids])
        assert not dst_layers[li][:10].any() and not dst_layers[li][14:].any()


def test_scatter_rejects_bad_shape_and_ids() -> None:
    kv = PagedKV(kv_layers(8))
    with pytest.raises(ValueError, match="shape"):
        kv.scatter([0, 1], torch.zeros(LAYERS, 3, H, BS, 2 * HS))
    with pytest.raises(IndexError):
        kv.scatter([8], torch.zeros(LAYERS, 1, H, BS, 2 * HS))


def test_paged_kv_works_on_strided_layer_views() -> None:
    # vLLM's layer views may be strided into one buffer (block-major physical layouts).
    backing = torch.randn(32, LAYERS, H, BS, 2 * HS)
    layers = [backing[:, i] for i in range(LAYERS)]
    kv = PagedKV(layers)
    out = torch.empty(kv.payload_shape(2))
    kv.gather([3, 7], out)
    assert torch.equal(out[1], backing[[3, 7], 1])
    kv.scatter([0, 1], out)
    assert torch.equal(backing[[0, 1], 2], backing[[3, 7], 2])


# ------------------------------------------------------------------- the connector


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    mm_features: list[Any] = field(default_factory=list)
    lora_request: Any = None


@dataclass
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def sched_output(new: list[tuple[FakeRequest, list[int], int, int]]) -> Any:
    """SchedulerOutput stand-in: (request, block ids, num computed, num scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                block_ids=(ids,),
                num_computed_tokens=done,
            )
            for r, ids, done, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens={r.request_id: n for r, _, _, n in new},
    )


@pytest.fixture(scope="module")
def vllm_mod() -> Any:
    pytest.importorskip("vllm")
    import connectors.vllm as mod

    return mod


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryChunkStore]:
    st = MemoryChunkStore()
    import tiered_cache.client as client

    monkeypatch.setattr(client, "open_store", lambda extra: st)
    yield st


def make_connector(mod: Any, role: str, kv_role: str, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    ktc = KVTransferConfig(
        kv_connector="TieredCacheConnector",
        kv_connector_module_path="connectors.vllm",
        kv_role=kv_role,
        kv_connector_extra_config={"chunk_size": CHUNK, **extra},
    )
    cfg = SimpleNamespace(
        kv_transfer_config=ktc,
        model_config=SimpleNamespace(model="unit/tiny", dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout="LBHNC"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=HS, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kcc = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    kcc.kv_cache_layout = "LBHNC"
    r = KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER
    return mod.TieredCacheConnector(cfg, r, kcc)


class Node:
    """A scheduler-side and a worker-side connector of one vLLM instance."""

    def __init__(self, mod: Any, kv_role: str, seed: int, zero: bool = False, **extra: Any):
        self.sched = make_connector(mod, "scheduler", kv_role, **extra)
        self.worker = make_connector(mod, "worker", kv_role, **extra)
        layers = kv_layers(64, seed)
        if zero:
            layers = [torch.zeros_like(t) for t in layers]
        self.layers = layers
        self.worker.register_kv_caches(
            {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)}
        )

    def step(self, so: Any) -> Any:
        meta = self.sched.build_connector_meta(so)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        return meta

    def finish_loads(self, timeout: float = 10.0) -> tuple[set[str], set[int]]:
        done: set[str] = set()
        errors: set[int] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, recv = self.worker.get_finished(set())
            errors |= self.worker.get_block_ids_with_load_errors()
            done |= recv or set()
            if not self.worker._inflight:
                return done, errors
            time.sleep(0.005)
        raise TimeoutError("loads did not finish")


PROMPT = list(range(100, 250))  # 150 tokens: chunks of 64, 64 and a 22-token tail
P_BLOCKS = list(range(20, 30))  # producer's block table (10 blocks)
D_BLOCKS = list(range(40, 50))  # consumer's block table


def prefill(mod: Any, store: MemoryChunkStore) -> Node:
    p = Node(mod, "kv_producer", seed=1)
    req = FakeRequest("p1", PROMPT)
    assert p.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # producers never load
    p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    meta = p.step(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
    assert [(s.index, s.num_tokens, s.block_ids) for s in meta.saves] == [
        (0, 64, P_BLOCKS[0:4]),
        (1, 64, P_BLOCKS[4:8]),
        (2, 22, P_BLOCKS[8:10]),
    ]
    done, params = p.sched.request_finished(req, P_BLOCKS)
    assert done is False
    assert params["tiered_cache"]["chunks"] == 3
    assert len(store._data) == 3
    return p


def test_producer_saves_full_chunks_and_tail(vllm_mod: Any, store: MemoryChunkStore) -> None:
    p = prefill(vllm_mod, store)
    meta, _payload = codec.decode(next(iter(store._data.values())))
    assert meta.shape == (LAYERS, 4, H, BS, 2 * HS)
    assert meta.dtype == "float32" and meta.kv_layout == "LBHNC" and meta.block_size == BS
    # Saving is idempotent across requests: a second prefill of the same prompt finds
    # its chunks present and plans no copy.
    req2 = FakeRequest("p2", PROMPT)
    p.sched.update_state_after_alloc(req2, FakeBlocks(P_BLOCKS), 0)
    meta2 = p.step(sched_output([(req2, P_BLOCKS, 0, len(PROMPT))]))
    assert meta2.saves == []


def test_producer_saves_progressively_with_chunked_prefill(
    vllm_mod: Any, store: MemoryChunkStore
) -> None:
    p = Node(vllm_mod, "kv_producer", seed=1)
    req = FakeRequest("p1", PROMPT)
    p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS[:5]), 0)
    m1 = p.step(sched_output([(req, P_BLOCKS[:5], 0, 80)]))  # 80 tokens: chunk 0 done
    assert [s.index for s in m1.saves] == [0]
    cached = SimpleNamespace(
        req_ids=["p1"], new_block_ids=[(P_BLOCKS[5:],)], num_computed_tokens=[80],
        resumed_req_ids=set(),
    )
    so = SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"p1": 70}
    )
    m2 = p.step(so)
    assert [(s.index, s.block_ids) for s in m2.saves] == [(1, P_BLOCKS[4:8]), (2, P_BLOCKS[8:])]


def test_consumer_loads_all_but_last_token(vllm_mod: Any, store: MemoryChunkStore) -> None:
    p = prefill(vllm_mod, store)
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0)
    req = FakeRequest("d1", PROMPT)
    before = dict(store._data)
    # Side-effect free and repeatable.
    assert d.sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, True)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, True)
    assert store._data == before
    # With a 32-token local prefix hit, only the rest is claimed and loaded.
    assert d.sched.get_num_new_matched_tokens(req, 32) == (len(PROMPT) - 1 - 32, True)
    d.sched.get_num_new_matched_tokens(req, 0)
    d.sched.update_state_after_alloc(req, FakeBlocks(D_BLOCKS), len(PROMPT) - 1)
    srcs = d.sched.get_external_cache_hit_sources(req, len(PROMPT) - 1)
    assert sum(srcs.values()) == len(PROMPT) - 1
    assert [str(k.value) for k in srcs] == ["host"]
    meta = d.step(sched_output([]))
    assert len(meta.loads) == 1 and meta.loads[0].is_async
    done, errors = d.finish_loads()
    assert done == {"d1"} and errors == set()
    for li in range(LAYERS):
        assert torch.equal(d.layers[li][D_BLOCKS], p.layers[li][P_BLOCKS])


def test_prompt_of_whole_chunks_never_claims_last_token(
    vllm_mod: Any, store: MemoryChunkStore
) -> None:
    p = Node(vllm_mod, "kv_producer", seed=1)
    prompt = list(range(128))
    req = FakeRequest("p", prompt)
    p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS[:8]), 0)
    p.step(sched_output([(req, P_BLOCKS[:8], 0, 128)]))
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0)
    assert d.sched.get_num_new_matched_tokens(FakeRequest("d", prompt), 0) == (127, True)
    # A different salt is a different cache: nothing to load.
    salted = FakeRequest("d2", prompt, cache_salt="tenant-b")
    assert d.sched.get_num_new_matched_tokens(salted, 0) == (0, False)


def test_corrupted_chunk_reports_its_blocks_and_later_ones(
    vllm_mod: Any, store: MemoryChunkStore, caplog: pytest.LogCaptureFixture
) -> None:
    prefill(vllm_mod, store)
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0)
    req = FakeRequest("d1", PROMPT)
    n, _ = d.sched.get_num_new_matched_tokens(req, 0)
    d.sched.update_state_after_alloc(req, FakeBlocks(D_BLOCKS), n)
    key1 = d.sched._reqs["d1"].keys[1]
    raw = bytearray(store._data[key1])
    raw[-5] ^= 0x40  # one flipped bit in the payload of chunk 1
    store._data[key1] = bytes(raw)
    with caplog.at_level(logging.WARNING):
        d.step(sched_output([]))
        done, errors = d.finish_loads()
    assert done == {"d1"}
    # Chunk 0 loaded; chunk 1 failed verification, so it and everything after it is
    # reported for recomputation.
    assert errors == set(D_BLOCKS[4:])
    assert not any(t[D_BLOCKS[4:]].any() for t in d.layers)  # nothing garbage written
    assert any("vLLM recomputes it" in r.getMessage() for r in caplog.records)
    # After the failure vLLM re-asks; the connector does not try the bad chunk again.
    from vllm.v1.outputs import KVConnectorOutput

    d.sched.update_connector_output(KVConnectorOutput(invalid_block_ids=errors))
    assert d.sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_header_mismatch_is_refused(vllm_mod: Any, store: MemoryChunkStore) -> None:
    prefill(vllm_mod, store)
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0,
             async_load=False)
    req = FakeRequest("d1", PROMPT)
    n, is_async = d.sched.get_num_new_matched_tokens(req, 0)
    assert is_async is False
    d.sched.update_state_after_alloc(req, FakeBlocks(D_BLOCKS), n)
    key0 = d.sched._reqs["d1"].keys[0]
    meta, payload = codec.decode(store._data[key0])
    # Same key and fingerprint, but written by a node with another block size.
    bad = codec.ChunkMeta(**{**meta.__dict__, "block_size": 32})
    store.put_many([(bad, bytes(payload))])
    d.step(sched_output([]))  # sync load: errors are reported in the same step
    assert d.worker.get_block_ids_with_load_errors() == set(D_BLOCKS)
    assert not any(t.any() for t in d.layers)


def test_consumer_waits_for_prefill_then_falls_back(
    vllm_mod: Any, store: MemoryChunkStore
) -> None:
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0.3,
             lookup_poll_s=0)
    req = FakeRequest("d1", PROMPT)
    d.sched.on_new_request(req)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (None, False)  # ask again later
    prefill(vllm_mod, store)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, True)
    # A prompt nobody prefills: wait until the deadline, then recompute.
    req2 = FakeRequest("d2", list(range(300, 400)))
    d.sched.on_new_request(req2)
    assert d.sched.get_num_new_matched_tokens(req2, 0) == (None, False)
    time.sleep(0.35)
    assert d.sched.get_num_new_matched_tokens(req2, 0) == (0, False)


def test_kv_both_reuses_its_own_prefix(vllm_mod: Any, store: MemoryChunkStore) -> None:
    n = Node(vllm_mod, "kv_both", seed=3)
    req = FakeRequest("a", PROMPT)
    assert n.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # kv_both never waits
    n.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    n.step(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
    n.sched.request_finished(req, P_BLOCKS)
    # A longer prompt sharing the first two chunks loads them and saves only the rest.
    longer = [*PROMPT[:128], *range(900, 960)]
    req2 = FakeRequest("b", longer)
    assert n.sched.get_num_new_matched_tokens(req2, 0) == (128, True)
    n.sched.update_state_after_alloc(req2, FakeBlocks([*D_BLOCKS, 50, 51]), 128)
    meta = n.step(sched_output([]))
    assert [c.index for c in meta.loads[0].chunks] == [0, 1]
    _, errors = n.finish_loads()
    assert errors == set()
    meta2 = n.step(sched_output([(req2, [*D_BLOCKS, 50, 51], 128, len(longer) - 128)]))
    assert [s.index for s in meta2.saves] == [2]


def test_chunk_size_must_be_a_multiple_of_the_block_size(vllm_mod: Any, store: Any) -> None:
    with pytest.raises(ValueError, match="multiple of vLLM's KV block size"):
        make_connector(vllm_mod, "scheduler", "kv_both", chunk_size=40)
