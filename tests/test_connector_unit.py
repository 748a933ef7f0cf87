"""Unit tests of the vLLM connector: block gather/scatter, chunk math, and the scheduler
and worker halves driven by hand on CPU tensors shaped like vLLM's
``[num_blocks, H, block_size, 2*head_size]`` per layer, over ``MemoryChunkStore``.
No vLLM engine is started (vLLM is imported only for the connector tests)."""

from __future__ import annotations

import logging
import time
import uuid
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


def kv_layers(
    num_blocks: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32, bs: int = BS,
    heads: int = H,
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, heads, bs, 2 * HS, generator=g).to(dtype)
        for _ in range(LAYERS)
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


@pytest.mark.parametrize("device_path", [False, True])  # True: the accelerator's copies
@pytest.mark.parametrize("split", [1, 2])  # 2: views of half blocks (kernel blocks)
def test_scatter_into_a_head_range_leaves_the_other_heads(split: int, device_path: bool) -> None:
    """A chunk another TP size wrote fills some of a block's KV heads: the others (from
    another chunk, or not loaded yet) are not touched."""
    backing = torch.zeros(16 * split, LAYERS, 4, BS // split, 2 * HS)
    layers = [backing[:, i] for i in range(LAYERS)]  # one buffer: the stacked path
    kv = PagedKV(layers, block_size=BS)
    kv.on_host = not device_path  # the device branches, run on CPU tensors
    src = torch.randn(LAYERS, 3, 2, BS, 2 * HS)  # heads 1 and 2 of blocks 4, 5 and 9
    kv.scatter([4, 5, 9], src, heads=(1, 3))
    out = torch.empty(kv.payload_shape(3))
    kv.gather([4, 5, 9], out)
    assert torch.equal(out[:, :, 1:3], src)
    assert not out[:, :, 0].any() and not out[:, :, 3].any()
    assert int(backing.count_nonzero()) == src.numel()  # nothing else was written
    with pytest.raises(ValueError, match="shape"):
        kv.scatter([4], src[:, :1], heads=(0, 1))
    with pytest.raises(ValueError, match="outside"):
        kv.scatter([4], src[:, :1], heads=(3, 5))


@pytest.mark.parametrize(("total", "readers", "writers"),
                         [(2, 2, 1), (2, 1, 2), (8, 4, 2), (8, 2, 4), (8, 8, 8), (6, 3, 2)])
def test_head_parts_cover_each_ranks_heads_once(total: int, readers: int, writers: int) -> None:
    """Reader ranks at one TP size take every head, once, from the writer shards of
    another: joined in order they are the model's heads."""
    from connectors.vllm_tp import head_parts

    heads = torch.arange(total)
    shards = heads.chunk(writers)  # shard w holds heads [w*H/W, (w+1)*H/W)
    for r, want in enumerate(heads.chunk(readers)):
        got = torch.full((total // readers,), -1)
        for p in head_parts(total, readers, r, writers):
            got[p.dst[0] : p.dst[1]] = shards[p.shard][p.src[0] : p.src[1]]
        assert torch.equal(got, want), r


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
    more: tuple[list[int], ...] = ()  # the other KV cache groups' blocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids, *self.more)


def sched_output(new: list[tuple[FakeRequest, Any, int, int]]) -> Any:
    """SchedulerOutput stand-in: (request, block ids (a list, or one per KV cache group),
    num computed, num scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                block_ids=tuple(ids) if ids and isinstance(ids[0], list) else (ids,),
                num_computed_tokens=done,
            )
            for r, ids, done, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens={r.request_id: n for r, _, _, n in new},
        total_num_scheduled_tokens=sum(n for *_, n in new),
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


def make_connector(
    mod: Any, role: str, kv_role: str, bs: int = BS, tp: int = 1, mla: bool = False,
    heads: int = H, total_heads: int | None = None, window: int | None = None,
    window_only: bool = False, **extra: Any,
) -> Any:
    """``window``: the even layers get a sliding window of that many tokens, in a KV cache
    group of their own (group 0; the odd layers are group 1), as under vLLM's hybrid
    allocator; with ``window_only``, every layer, in one group."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    ktc = KVTransferConfig(
        kv_connector="TieredCacheConnector",
        kv_connector_module_path="connectors.vllm",
        kv_role=kv_role,
        kv_connector_extra_config={"chunk_size": CHUNK, **extra},
    )
    cfg = SimpleNamespace(
        kv_transfer_config=ktc,
        model_config=SimpleNamespace(model="unit/tiny", dtype=torch.float32,
                                     get_total_num_kv_heads=lambda: total_heads or heads * tp),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout="LBHNC"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=tp),
    )
    kw: dict[str, Any] = dict(block_size=bs, num_kv_heads=heads, head_size=HS,
                              dtype=torch.float32)  # fmt: skip
    spec = MLAAttentionSpec(**kw, max_tp_shards=1) if mla else FullAttentionSpec(**kw)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    groups = [KVCacheGroupSpec(names, spec)]
    if window is not None and window_only:
        groups = [KVCacheGroupSpec(names, SlidingWindowSpec(**kw, sliding_window=window))]
    elif window is not None:
        groups = [KVCacheGroupSpec(names[0::2], SlidingWindowSpec(**kw, sliding_window=window)),
                  KVCacheGroupSpec(names[1::2], spec)]  # fmt: skip
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    kcc.kv_cache_layout = "LBHNC"
    r = KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER
    return mod.TieredCacheConnector(cfg, r, kcc)


class Node:
    """A scheduler-side and a worker-side connector of one vLLM instance."""

    def __init__(self, mod: Any, kv_role: str, seed: int, zero: bool = False,
                 bs: int = BS, blocks: int = 64, **extra: Any):  # fmt: skip
        self.sched = make_connector(mod, "scheduler", kv_role, bs=bs, **extra)
        self.worker = make_connector(mod, "worker", kv_role, bs=bs, **extra)
        layers = kv_layers(blocks, seed, bs=bs)
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
        self.worker.drain_saves()  # commits run on a helper thread; tests want them landed
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
            if not self.worker.worker._inflight:
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
        (2, 16, P_BLOCKS[8:9]),  # the tail's whole blocks, for prompts that extend it
    ]
    done, params = p.sched.request_finished(req, P_BLOCKS)
    assert done is False
    assert params["tiered_cache"]["chunks"] == 3
    assert len(store._data) == 4  # and the tail's block-aligned copy
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
        scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"p1": 70},
        total_num_scheduled_tokens=70,
    )
    m2 = p.step(so)
    assert [(s.index, s.block_ids) for s in m2.saves] == [
        (1, P_BLOCKS[4:8]), (2, P_BLOCKS[8:]), (2, P_BLOCKS[8:9])
    ]


def test_consumer_loads_all_but_last_token(vllm_mod: Any, store: MemoryChunkStore) -> None:
    p = prefill(vllm_mod, store)
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0, async_load=True)
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
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0, async_load=True)
    assert d.sched.get_num_new_matched_tokens(FakeRequest("d", prompt), 0) == (127, True)
    # A different salt is a different cache: nothing to load.
    salted = FakeRequest("d2", prompt, cache_salt="tenant-b")
    assert d.sched.get_num_new_matched_tokens(salted, 0) == (0, False)


def test_corrupted_chunk_reports_its_blocks_and_later_ones(
    vllm_mod: Any, store: MemoryChunkStore, caplog: pytest.LogCaptureFixture
) -> None:
    prefill(vllm_mod, store)
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0, async_load=True)
    req = FakeRequest("d1", PROMPT)
    n, _ = d.sched.get_num_new_matched_tokens(req, 0)
    d.sched.update_state_after_alloc(req, FakeBlocks(D_BLOCKS), n)
    key1 = d.sched.scheduler._reqs["d1"].keys[1]
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
    key0 = d.sched.scheduler._reqs["d1"].keys[0]
    meta, payload = codec.decode(store._data[key0])
    # Same key and fingerprint, but written by a node with another block size.
    bad = codec.ChunkMeta(**{**meta.__dict__, "block_size": 32})
    store.put_many([(bad, bytes(payload))])
    d.step(sched_output([]))  # sync load: errors are reported in the same step
    assert d.worker.get_block_ids_with_load_errors() == set(D_BLOCKS)
    assert not any(t.any() for t in d.layers)


def hint(keys: list[str]) -> dict[str, Any]:
    """The ``kv_transfer_params`` a router passes from a prefill that saved ``keys``."""
    return {"do_remote_prefill": True, "tiered_cache": {"keys": keys}}


def test_consumer_waits_only_for_the_chunks_its_prefill_saved(
    vllm_mod: Any, store: MemoryChunkStore
) -> None:
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0.3,
             lookup_poll_s=0, async_load=True)
    keys = d.sched.scheduler._req_keys(PROMPT, None)
    req = FakeRequest("d1", PROMPT, kv_transfer_params=hint(keys))
    d.sched.on_new_request(req)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (None, False)  # ask again later
    prefill(vllm_mod, store)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, True)
    # A prefill that said it saved chunks that never land: wait out the budget (here the
    # cap: this engine has measured no prefill yet), then recompute.
    other = list(range(300, 400))
    req2 = FakeRequest("d2", other, kv_transfer_params=hint(d.sched.scheduler._req_keys(other, None)))
    d.sched.on_new_request(req2)
    assert d.sched.get_num_new_matched_tokens(req2, 0) == (None, False)
    time.sleep(0.35)
    assert d.sched.get_num_new_matched_tokens(req2, 0) == (0, False)
    assert counters(d.sched.get_kv_connector_stats())["recompute_fallbacks"] == {"deadline": 1}


@pytest.mark.parametrize(
    "params",
    [None, {"do_remote_prefill": True}, hint([])],
    ids=["no-params", "no-hint", "router-skipped-prefill"],
)
def test_consumer_never_waits_for_chunks_nobody_is_saving(
    vllm_mod: Any, store: MemoryChunkStore, params: dict[str, Any] | None
) -> None:
    """The stall of the old rule: a decode waited out the whole deadline for a chunk no
    prefill was writing (the router had skipped the prefill, or it saved fewer)."""
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=30,
             lookup_poll_s=0)
    req = FakeRequest("d1", PROMPT, kv_transfer_params=params)
    d.sched.on_new_request(req)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    # Two of three chunks present, the prefill saved those two: load them, no waiting.
    p = prefill(vllm_mod, store)
    first_two = p.sched.scheduler._req_keys(PROMPT, None)[:2]
    for key in [k for k in store._data if k not in first_two]:  # the tail and its copy
        del store._data[key]
    req2 = FakeRequest("d2", PROMPT, kv_transfer_params=params or hint(
        p.sched.scheduler._req_keys(PROMPT, None)[:2]))  # fmt: skip
    d.sched.on_new_request(req2)
    assert d.sched.get_num_new_matched_tokens(req2, 0) == (128, False)


@pytest.mark.parametrize("bs", [16, 64, 128])
@pytest.mark.parametrize("n", [255, 256, 257, 700])
def test_every_saved_chunk_is_found_and_nothing_is_waited_for(
    vllm_mod: Any, store: MemoryChunkStore, bs: int, n: int
) -> None:
    """The demo's stall: a decode waiting for a last chunk that never came. Prompt
    lengths on and off the 256-token chunk boundary, block sizes 16/64/128, a shared
    prefix and a growing conversation: the decode finds every chunk its prefill listed at
    the first ask (never "ask again"), loads all but the last token, and the KV equals the
    prefill's."""
    cs = 256
    nb = -(-1024 // bs)
    p = Node(vllm_mod, "kv_producer", seed=1, bs=bs, blocks=2 * nb + 8, chunk_size=cs)
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, bs=bs, blocks=2 * nb + 8,
             chunk_size=cs, load_wait_timeout_s=30, lookup_poll_s=0)  # fmt: skip
    base = [(i * 7919) % 500 + 6 for i in range(n)]
    turns = [base, [*base[:200], *range(1000, 1000 + n)], [*base, *range(2000, 2100)]]
    for t, prompt in enumerate(turns):
        m = len(prompt)
        pb = list(range(-(-m // bs)))
        db = [nb + 4 + b for b in pb]
        req = FakeRequest(f"p{t}", prompt)
        p.sched.update_state_after_alloc(req, FakeBlocks(pb), 0)
        p.step(sched_output([(req, pb, 0, m)]))
        params = p.sched.request_finished(req, pb)[1]
        dreq = FakeRequest(f"d{t}", prompt, kv_transfer_params=params)
        d.sched.on_new_request(dreq)
        got = d.sched.get_num_new_matched_tokens(dreq, 0)
        assert got == (m - 1, False), (t, m, got)
        d.sched.update_state_after_alloc(dreq, FakeBlocks(db), m - 1)
        d.step(sched_output([]))
        assert d.worker.get_block_ids_with_load_errors() == set()
        used = -(-(m - 1) // bs)
        for li in range(LAYERS):
            assert torch.equal(d.layers[li][db[:used]], p.layers[li][pb[:used]])
        d.sched.request_finished(dreq, db)
    assert "recompute_fallbacks" not in counters(d.sched.get_kv_connector_stats())


class SourcedStore(MemoryChunkStore):
    """Reports a chosen source per chunk index (as an agent would: dram, s3, ...)."""

    def __init__(self, base: MemoryChunkStore, sources: list[str]) -> None:
        super().__init__()
        self._data = base._data
        self.sources = sources

    def lookup(self, keys: Any) -> list[str]:
        return [self.sources[i] for i in range(len(super().lookup(keys)))]


@pytest.mark.parametrize(
    ("sources", "computed", "want_async"),
    [
        (["s3", "dram", "dram"], 64, False),  # the remote chunk is below vLLM's own hit
        (["dram", "s3", "dram"], 64, True),
        (["s3", "dram", "dram"], 0, True),
    ],
)
def test_sync_or_async_is_decided_once_from_the_chunks_loaded(
    vllm_mod: Any, store: MemoryChunkStore, monkeypatch: pytest.MonkeyPatch,
    sources: list[str], computed: int, want_async: bool,
) -> None:
    """What vLLM is told (async: the request waits in WAITING_FOR_REMOTE_KVS until
    get_finished reports it) is what the worker does. The old code decided "async" from
    every hit chunk but ran the job from the loaded ones: a sync job, never reported, and
    the request waited forever."""
    p = prefill(vllm_mod, store)
    sourced = SourcedStore(store, sources)
    import tiered_cache.client as client

    monkeypatch.setattr(client, "open_store", lambda extra: sourced)
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0)
    req = FakeRequest("d1", PROMPT)
    n, is_async = d.sched.get_num_new_matched_tokens(req, computed)
    assert (n, is_async) == (len(PROMPT) - 1 - computed, want_async)
    d.sched.update_state_after_alloc(req, FakeBlocks(D_BLOCKS), n)
    meta = d.step(sched_output([]))
    assert [job.is_async for job in meta.loads] == [want_async]
    if want_async:
        done, errors = d.finish_loads()
        assert done == {"d1"} and errors == set()
    assert p is not None


def test_kv_both_reuses_its_own_prefix(vllm_mod: Any, store: MemoryChunkStore) -> None:
    n = Node(vllm_mod, "kv_both", seed=3, async_load=True)
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
    assert [(s.index, s.aligned) for s in meta2.saves] == [(2, False), (2, True)]


def test_chunk_size_must_be_a_multiple_of_the_block_size(vllm_mod: Any, store: Any) -> None:
    with pytest.raises(ValueError, match="multiple of vLLM's KV block size"):
        make_connector(vllm_mod, "scheduler", "kv_both", chunk_size=40)


# ------------------------------------------------------------------------- metrics


def counters(stats: Any) -> dict[str, dict[str, float]]:
    return dict(stats.data["counters"]) if stats is not None else {}


def test_metrics_move_after_save_and_load(vllm_mod: Any, store: MemoryChunkStore) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from tiered_cache.metrics import CONNECTOR_METRICS, CONNECTOR_PREFIX

    p = prefill(vllm_mod, store)
    saved = p.worker.get_kv_connector_stats()
    assert counters(saved)["stored_chunks"] == {"": 4}
    assert counters(saved)["stored_bytes"][""] == sum(
        codec.decode(raw)[1].nbytes for raw in store._data.values()
    )
    assert len(saved.data["observations"]["store_seconds"][""]) == 1
    assert p.worker.get_kv_connector_stats() is None  # taken: the next interval is empty

    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0)
    req = FakeRequest("d1", PROMPT)
    n, _ = d.sched.get_num_new_matched_tokens(req, 0)
    d.sched.get_num_new_matched_tokens(req, 0)  # asked again: still one lookup
    d.sched.update_state_after_alloc(req, FakeBlocks(D_BLOCKS), n)
    d.step(sched_output([]))
    d.finish_loads()
    sched = d.sched.get_kv_connector_stats()
    assert counters(sched) == {"lookups": {"hit": 1}, "fetch_decisions": {"load": 1}}
    worker = d.worker.get_kv_connector_stats()
    # MemoryChunkStore does not say who served a chunk: the lookup's source stands in.
    assert counters(worker)["hit_tokens"] == {"dram": len(PROMPT) - 1}
    assert counters(worker)["loaded_chunks"] == {"dram": 3}
    assert "recompute_fallbacks" not in counters(worker)
    assert len(worker.data["observations"]["load_seconds"]["dram"]) == 1

    # What vLLM does with them: aggregate worker and scheduler stats, rebuild them in the
    # API server from the plain dict, record them on its registry.
    reg = CollectorRegistry()

    def bound(cls: Any) -> Any:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(
            self, *a, registry=reg, **kw)})  # fmt: skip

    total = worker.aggregate(sched)
    rebuilt = vllm_mod.TieredCacheConnector.build_kv_connector_stats(total.to_dict())
    assert rebuilt.reduce()["hit_tokens[dram]"] == len(PROMPT) - 1
    prom = vllm_mod.TieredCacheConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)},
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    prom.observe(rebuilt.to_dict(), 0)
    lbl = {"model_name": "tiny", "engine": "0"}
    val = reg.get_sample_value
    assert val("tiered_cache_connector_hit_tokens_total", {**lbl, "tier": "dram"}) == 149
    assert val("tiered_cache_connector_lookups_total", {**lbl, "result": "hit"}) == 1
    assert val("tiered_cache_connector_load_seconds_count", {**lbl, "tier": "dram"}) == 1
    # Every metric is registered and follows Prometheus naming (base units, _total).
    fams = list(reg.collect())
    assert {f.name for f in fams} == {CONNECTOR_PREFIX + n for n in CONNECTOR_METRICS}
    for f in fams:
        if f.type == "histogram":
            assert f.name.endswith("_seconds"), f.name
        else:
            assert f.type == "counter" and all(
                x.name.endswith(("_total", "_created")) for x in f.samples
            ), f.name


def test_fallback_reasons_are_counted(vllm_mod: Any, store: MemoryChunkStore) -> None:
    prefill(vllm_mod, store)
    # Chunks of another block size under the right keys: a layout mismatch.
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0,
             async_load=False)  # fmt: skip
    req = FakeRequest("d1", PROMPT)
    n, _ = d.sched.get_num_new_matched_tokens(req, 0)
    d.sched.update_state_after_alloc(req, FakeBlocks(D_BLOCKS), n)
    key0 = d.sched.scheduler._reqs["d1"].keys[0]
    meta, payload = codec.decode(store._data[key0])
    store.put_many([(codec.ChunkMeta(**{**meta.__dict__, "block_size": 32}), bytes(payload))])
    d.step(sched_output([]))
    c = counters(d.worker.get_kv_connector_stats())
    assert c["recompute_fallbacks"] == {"layout_mismatch": 1} and c["layout_mismatches"] == {"": 1}
    # A chunk gone between lookup and load: "missing".
    req2 = FakeRequest("d2", PROMPT)
    n, _ = d.sched.get_num_new_matched_tokens(req2, 0)
    d.sched.update_state_after_alloc(req2, FakeBlocks(D_BLOCKS), n)
    del store._data[key0]
    d.step(sched_output([]))
    assert counters(d.worker.get_kv_connector_stats())["recompute_fallbacks"] == {"missing": 1}
    # A consumer that waited for a prefill that never came: "deadline", counted once.
    w = Node(vllm_mod, "kv_consumer", seed=2, load_wait_timeout_s=0.05, lookup_poll_s=0)
    other = list(range(300, 400))
    req3 = FakeRequest("d3", other, kv_transfer_params=hint(w.sched.scheduler._req_keys(other, None)))
    w.sched.on_new_request(req3)
    assert w.sched.get_num_new_matched_tokens(req3, 0) == (None, False)
    time.sleep(0.06)
    assert w.sched.get_num_new_matched_tokens(req3, 0) == (0, False)
    assert w.sched.get_num_new_matched_tokens(req3, 0) == (0, False)
    assert counters(w.sched.get_kv_connector_stats()) == {
        "recompute_fallbacks": {"deadline": 1}, "lookups": {"miss": 1},
    }  # fmt: skip


# ------------------------------------------------- against a real (embedded) node agent


@pytest.fixture
def agent_store(tmp_path: Any) -> Iterator[dict[str, Any]]:
    """The store part of the extra config: a real agent, embedded in this process.
    Connectors a test lists under ``extra["_nodes"]`` are shut down first."""
    from tiered_cache import client

    nodes: list[Node] = []
    extra = {"store_dir": str(tmp_path / "store"), "dram_capacity": "8MiB",
             "slot_bytes": "256KiB"}  # fmt: skip
    yield {**extra, "_nodes": nodes}
    for n in nodes:
        n.sched.shutdown()
        n.worker.shutdown()
    client.shutdown_embedded()


def agent_node(mod: Any, kv_role: str, seed: int, store: dict[str, Any], **kw: Any) -> Node:
    extra = {k: v for k, v in store.items() if k != "_nodes"}
    n = Node(mod, kv_role, seed, **kw, **extra)
    store["_nodes"].append(n)
    return n


def cli_cfg(tmp_path: Any, extra: dict[str, Any]) -> str:
    """A CLI config naming the embedded agent's socket."""
    import yaml

    from tiered_cache.client import config_from_extra

    p = tmp_path / "cli.yaml"
    p.write_text(yaml.safe_dump({"agent": {"socket": config_from_extra(extra).socket_path}}))
    return str(p)


def test_pin_by_model_uses_the_registered_fingerprint(
    vllm_mod: Any, agent_store: dict[str, Any], tmp_path: Any
) -> None:
    import json

    import yaml
    from click.testing import CliRunner

    from tiered_cache.cli import main
    from tiered_cache.client import open_store

    def cli(*args: str) -> Any:
        return CliRunner().invoke(main, list(args), catch_exceptions=False)

    cfg = cli_cfg(tmp_path, agent_store)
    toks = ",".join(map(str, PROMPT))
    plain = open_store({k: v for k, v in agent_store.items() if k != "_nodes"})
    # ^ starts the agent, with no vLLM registered yet
    r = cli("pin", "add", "-c", cfg, "--model", "unit/tiny", "--tokens", toks)
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert "no vLLM instance has registered model 'unit/tiny' yet" in r.output
    assert "--kv-layout/--block-size" in r.output

    p = agent_node(vllm_mod, "kv_producer", 1, agent_store)
    req = FakeRequest("p1", PROMPT)
    p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    p.step(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
    _, params = p.sched.request_finished(req, P_BLOCKS)
    written = params["tiered_cache"]["keys"]
    assert plain.lookup(written) == ["dram"] * 3  # the connector really stored them

    models = json.loads(cli("models", "-c", cfg, "--json").output)
    assert [(m["model"], m["kv_layout"], m["block_size"], m["chunk_size"]) for m in models] == [
        ("unit/tiny", "LBHNC@cpu/FullAttentionSpec", BS, CHUNK)
    ]
    r = cli("pin", "add", "-c", cfg, "--model", "unit/tiny", "--tokens", toks, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["fingerprints"] == [p.sched.scheduler._fp.hex]
    pins = yaml.safe_load(cli("pin", "export", "-c", cfg).output)["pins"]
    pinned = next(x for x in pins if x["id"] == info["id"])["keys"]
    assert pinned == written[:2]  # exactly the connector's full chunks (the tail is not pinned)
    # The defaults that built fingerprints before registration name other keys.
    r = cli("pin", "add", "-c", cfg, "--model", "unit/tiny", "--tokens", toks, "--block-size",
            str(BS), "--chunk-size", str(CHUNK), "--json")  # fmt: skip
    by_hand = next(x for x in yaml.safe_load(cli("pin", "export", "-c", cfg).output)["pins"]
                   if x["id"] == json.loads(r.output)["id"])["keys"]  # fmt: skip
    assert not set(by_hand) & set(written)
    r = cli("pin", "add", "-c", cfg, "--model", "other/model", "--tokens", toks)
    assert "no vLLM instance has registered model 'other/model' yet (registered: unit/tiny)" in (
        r.output
    )
    plain.close()


def test_load_log_and_metrics_name_the_serving_tier(
    vllm_mod: Any, agent_store: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    p = agent_node(vllm_mod, "kv_producer", 1, agent_store)
    req = FakeRequest("p1", PROMPT)
    p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    p.step(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
    d = agent_node(vllm_mod, "kv_consumer", 2, agent_store, zero=True, load_wait_timeout_s=0)
    dreq = FakeRequest("d1", PROMPT)
    n, _ = d.sched.get_num_new_matched_tokens(dreq, 0)
    d.sched.update_state_after_alloc(dreq, FakeBlocks(D_BLOCKS), n)
    assert {c.source for c in d.sched.scheduler._pending_loads[0].chunks} == {"dram"}  # the lookup's
    # Between lookup and load the chunks leave DRAM; NVMe (written through) serves them.
    admin = d.sched.scheduler._open_store()
    admin.admin("flush")
    for k in d.sched.scheduler._reqs["d1"].keys:
        admin.admin("evict", key=k, tiers=["dram"])
    with caplog.at_level(logging.INFO):
        d.step(sched_output([]))
        _, errors = d.finish_loads()
    assert errors == set()
    for li in range(LAYERS):
        assert torch.equal(d.layers[li][D_BLOCKS], p.layers[li][P_BLOCKS])
    assert any("loaded 3/3 chunks (149 tokens planned) from nvme in" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]  # fmt: skip
    c = counters(d.worker.get_kv_connector_stats())
    assert c["hit_tokens"] == {"nvme": len(PROMPT) - 1} and c["loaded_chunks"] == {"nvme": 3}


@pytest.mark.parametrize(
    ("mode", "remote", "want_async"),
    [
        ("auto", False, False),  # all chunks in this node's DRAM: load inside the forward
        ("auto", True, True),  # a chunk comes from a peer: load between steps
        ("true", False, True),
        ("false", True, False),
    ],
)
def test_async_load_modes(
    vllm_mod: Any, store: MemoryChunkStore, monkeypatch: pytest.MonkeyPatch,
    mode: str, remote: bool, want_async: bool,
) -> None:
    p = prefill(vllm_mod, store)
    if remote:  # the store says the last chunk sits on another node
        local = store.lookup
        monkeypatch.setattr(store, "lookup", lambda keys: [*local(keys)[:-1], "peer"])
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0, async_load=mode)
    req = FakeRequest("d1", PROMPT)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, want_async)
    d.sched.update_state_after_alloc(req, FakeBlocks(D_BLOCKS), len(PROMPT) - 1)
    meta = d.step(sched_output([]))
    assert len(meta.loads) == 1 and meta.loads[0].is_async is want_async
    if want_async:
        done, errors = d.finish_loads()
        assert done == {"d1"} and errors == set()
    for li in range(LAYERS):  # either way the KV arrives intact
        assert torch.equal(d.layers[li][D_BLOCKS], p.layers[li][P_BLOCKS])


def test_bad_async_load_mode_is_refused(vllm_mod: Any, store: MemoryChunkStore) -> None:
    with pytest.raises(ValueError, match="async_load"):
        Node(vllm_mod, "kv_consumer", seed=2, async_load="sometimes")


@pytest.mark.parametrize("layerwise", [True, False])
def test_zero_copy_save_is_copied_out_before_wait_for_save_returns(
    vllm_mod: Any, agent_store: dict[str, Any], layerwise: bool
) -> None:
    """With an agent, saves are copied layer by layer (as vLLM reports each layer) straight
    into reserved DRAM slots; checksum and commit finish on a helper thread. vLLM may
    reuse the blocks as soon as wait_for_save returns, so overwriting them then must not
    change what lands in the cache."""
    p = agent_node(vllm_mod, "kv_producer", 1, agent_store, layerwise_save=layerwise)
    original = [t.clone() for t in p.layers]
    req = FakeRequest("p1", PROMPT)
    p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    meta = p.sched.build_connector_meta(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
    assert len(meta.saves) == 4
    p.worker.bind_connector_metadata(meta)
    with torch.inference_mode():  # vLLM runs the forward pass (and these hooks) in it
        for i in range(LAYERS):  # what vLLM's attention wrapper does after each layer
            p.worker.save_kv_layer(f"model.layers.{i}.self_attn.attn", p.layers[i], None)
            step = p.worker.worker._step_save
            if layerwise:  # KV in host memory: the layer is in its slots when the hook returns
                assert step is not None and step.res is not None and step.copy is not None
                for idx, dst in zip(step.copy.idx, step.copy.dests, strict=True):
                    assert torch.equal(dst[i], p.layers[i][idx])
        copier = p.worker.worker._copier
        assert copier is not None and copier._pool is None  # no second OpenMP team on a CPU
        step = p.worker.worker._step_save
        assert (step is not None and step.res is not None) is layerwise  # slots reserved
        assert step is None or step.copy is None or len(step.copy.layers) == LAYERS
        p.worker.wait_for_save()
    for t in p.layers:  # vLLM reuses the blocks for another request
        t.zero_()
    p.worker.drain_saves()
    stats = p.worker.get_kv_connector_stats()
    assert stats is not None and not stats.data["counters"].get("store_errors"), stats.data
    assert stats.data["counters"]["stored_chunks"] == {"": 4}
    p.worker.clear_connector_metadata()
    p.sched.request_finished(req, P_BLOCKS)

    d = agent_node(vllm_mod, "kv_consumer", 2, agent_store, zero=True, load_wait_timeout_s=0)
    dreq = FakeRequest("d1", PROMPT)
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (len(PROMPT) - 1, False)
    d.sched.update_state_after_alloc(dreq, FakeBlocks(D_BLOCKS), len(PROMPT) - 1)
    d.step(sched_output([]))
    assert d.worker.get_block_ids_with_load_errors() == set()
    for li in range(LAYERS):
        assert torch.equal(d.layers[li][D_BLOCKS], original[li][P_BLOCKS])


def wait_for_answer(node: Node, req: FakeRequest, computed: int = 0,
                    timeout: float = 20.0) -> tuple[int | None, bool]:
    """Ask the scheduler as vLLM does (again while it answers None), until it answers."""
    deadline = time.monotonic() + timeout
    while True:
        got = node.sched.get_num_new_matched_tokens(req, computed)
        if got[0] is not None or time.monotonic() > deadline:
            return got
        time.sleep(0.005)


def test_remote_chunks_are_copied_into_dram_then_loaded_inside_the_forward(
    vllm_mod: Any, s3_server: Any, s3_bucket: str, tmp_path: Any
) -> None:
    """Chunks only S3 holds: the agent copies them into this node's DRAM while the
    request waits in the queue (no KV blocks held, no worker thread), then they load
    synchronously like a DRAM hit. The hit is counted under the tier it came from."""
    from tiered_cache import client

    extra = {"tiered_cache": {
        "node_id": f"pf-{uuid.uuid4().hex[:6]}",
        "dram": {"capacity": "8MiB", "slot_bytes": "64KiB"},
        "s3": {"enabled": True, "url": f"s3://{s3_bucket}/kv", "region": "us-east-1",
               "endpoint_url": s3_server.endpoint_url, "write_mode": "write_through"},
        "agent": {"socket": str(tmp_path / "agent.sock")},
    }}  # fmt: skip
    nodes: list[Node] = []
    try:
        p = Node(vllm_mod, "kv_producer", seed=1, **extra)
        nodes.append(p)
        req = FakeRequest("p1", PROMPT)
        p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
        p.step(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
        admin = p.sched.scheduler._open_store()
        admin.admin("flush")  # the write-through copies reached S3
        for k in p.sched.scheduler._reqs["p1"].keys:
            admin.admin("evict", key=k, tiers=["dram"])
        d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, **extra)
        nodes.append(d)
        dreq = FakeRequest("d1", PROMPT)
        assert d.sched.get_num_new_matched_tokens(dreq, 0) == (None, False)  # prefetching
        assert wait_for_answer(d, dreq) == (len(PROMPT) - 1, False)  # then a sync load
        d.sched.update_state_after_alloc(dreq, FakeBlocks(D_BLOCKS), len(PROMPT) - 1)
        meta = d.step(sched_output([]))
        assert [job.is_async for job in meta.loads] == [False]
        assert {(c.origin, c.source) for c in meta.loads[0].chunks} == {("s3", "dram")}
        assert d.worker.get_block_ids_with_load_errors() == set()
        for li in range(LAYERS):
            assert torch.equal(d.layers[li][D_BLOCKS], p.layers[li][P_BLOCKS])
        c = counters(d.worker.get_kv_connector_stats())
        assert c["hit_tokens"] == {"s3": len(PROMPT) - 1}
    finally:
        for n in nodes:
            n.sched.shutdown()
            n.worker.shutdown()
        client.shutdown_embedded()


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_dead_agent_costs_requests_nothing_and_is_found_again(
    vllm_mod: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``kill -9`` of the node agent: every request is answered at once (recompute, no
    wait), saves are skipped and counted, the prefill claims no chunks, and the connector
    tries the agent again only on its backoff schedule (counted, not timed). One log line
    when the outage starts, one when it ends."""
    import signal
    import subprocess

    import yaml

    from tiered_cache.agent import spawn_agent

    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "node_id": f"dead-{uuid.uuid4().hex[:6]}", "dram": {"capacity": "8MiB"},
        "agent": {"socket": str(tmp_path / "agent.sock")},
    }))  # fmt: skip
    agent = spawn_agent(cfg, timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    extra = {"config_file": str(cfg), "embedded": "never", "load_wait_timeout_s": 30}
    nodes: list[Node] = []
    try:
        p = Node(vllm_mod, "kv_producer", seed=1, **extra)
        d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, lookup_poll_s=0, **extra)
        nodes += [p, d]
        clock = FakeClock()
        for n in nodes:
            n.sched.scheduler._guard.clock = n.worker.worker._guard.clock = clock
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        before = d.sched.scheduler._guard.attempts
        with caplog.at_level(logging.WARNING, logger="vllm.connectors.tiered_cache"):
            for i in range(20):  # a burst of requests, each waiting for its prefill's chunks
                keys = d.sched.scheduler._req_keys([*PROMPT, i], None)
                r = FakeRequest(f"d{i}", [*PROMPT, i], kv_transfer_params=hint(keys))
                d.sched.on_new_request(r)
                assert d.sched.get_num_new_matched_tokens(r, 0) == (0, False)
            assert d.sched.scheduler._guard.attempts - before == 1  # the first found it down
            preq = FakeRequest("p1", PROMPT)
            p.sched.update_state_after_alloc(preq, FakeBlocks(P_BLOCKS), 0)
            p.step(sched_output([(preq, P_BLOCKS, 0, len(PROMPT))]))
            assert p.sched.request_finished(preq, P_BLOCKS)[1]["tiered_cache"]["keys"] == []
            clock.t += 0.3  # past the first backoff: one probe (off the request's path)
            keys = d.sched.scheduler._req_keys(PROMPT, None)
            r = FakeRequest("dx", PROMPT, kv_transfer_params=hint(keys))
            for _ in range(5):
                assert d.sched.get_num_new_matched_tokens(r, 0) == (0, False)
            d.sched.scheduler._probe.join(10)
            assert d.sched.scheduler._guard.attempts - before == 2 and d.sched.scheduler._guard.down
        # One line per connector that found it down (decode scheduler, prefill scheduler
        # and worker), however many calls each made.
        down = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(down) == 3, [r.getMessage() for r in caplog.records]
        assert [g.outages for g in (d.sched.scheduler._guard, p.sched.scheduler._guard, p.worker.worker._guard)] == [1] * 3
        assert "Traceback" not in caplog.text
        c = counters(d.sched.get_kv_connector_stats())
        assert c["recompute_fallbacks"] == {"unavailable": 21}
        assert counters(p.worker.get_kv_connector_stats())["saves_skipped"] == {"unavailable": 4}
        # The agent comes back: after the backoff the next request finds it again.
        agent = spawn_agent(cfg, timeout=60, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)  # fmt: skip
        clock.t += 60
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm.connectors.tiered_cache"):
            r2 = FakeRequest("d-back", PROMPT)
            # This request does not wait for the probe; the next one uses the cache.
            assert d.sched.get_num_new_matched_tokens(r2, 0) == (0, False)
            d.sched.scheduler._probe.join(10)
        assert any("is back" in r.getMessage() for r in caplog.records)
        assert not d.sched.scheduler._guard.down
        assert d.sched.scheduler._lookup(keys) == []  # answered by the agent (a plain miss)
        assert not d.sched.scheduler._guard.down
    finally:
        for n in nodes:
            n.sched.shutdown()
            n.worker.shutdown()
        agent.kill()
        agent.wait(10)


def next_turn_loads_the_tail(d: Any) -> tuple[FakeRequest, list[int]]:
    """PROMPT's next turn (190 tokens) on node ``d``, after PROMPT was saved: it finds
    chunks 0 and 1 whole and PROMPT's 22-token tail, every token PROMPT computed (not
    only the tail's whole blocks), and loads them."""
    dreq = FakeRequest("d1", [*PROMPT, *range(600, 640)])
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (150, False)
    blocks = [*D_BLOCKS, 50, 51]
    d.sched.update_state_after_alloc(dreq, FakeBlocks(blocks), 150)
    load = d.step(sched_output([])).loads[0]
    assert [(c.index, c.num_tokens) for c in load.chunks] == [(0, 64), (1, 64), (2, 22)]
    return dreq, blocks


def same_150_tokens(got: torch.Tensor, blocks: list[int], want: torch.Tensor) -> bool:
    """PROMPT's 150 tokens: 9 whole blocks and 6 tokens of the tenth."""
    return torch.equal(got[blocks[:9]], want[P_BLOCKS[:9]]) and torch.equal(
        got[blocks[9], :, :6], want[P_BLOCKS[9], :, :6]
    )


def test_a_longer_prompt_loads_the_tail_of_an_earlier_one(
    vllm_mod: Any, agent_store: dict[str, Any]
) -> None:
    """The next turn of a conversation extends the previous prompt. Its chunk at the
    previous prompt's tail is a different (longer) chunk, but the prefill also saved the
    tail's whole blocks: the next turn loads them too, instead of recomputing them."""
    p = agent_node(vllm_mod, "kv_both", 1, agent_store)
    req = FakeRequest("p1", PROMPT)  # 150 tokens: chunks of 64, 64 and a 22-token tail
    p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    meta = p.step(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
    assert [(s.index, s.num_tokens, s.aligned) for s in meta.saves] == [
        (0, 64, False), (1, 64, False), (2, 22, False), (2, 16, True)
    ]
    p.sched.request_finished(req, P_BLOCKS)
    d = agent_node(vllm_mod, "kv_both", 2, agent_store, zero=True)
    dreq, blocks = next_turn_loads_the_tail(d)
    longer = dreq.prompt_token_ids
    assert d.worker.get_block_ids_with_load_errors() == set()
    for li in range(LAYERS):
        assert same_150_tokens(d.layers[li], blocks, p.layers[li])
    # The longer prompt's own chunk 2 is new: it is saved once its tokens are computed.
    meta2 = d.step(sched_output([(dreq, blocks, 150, len(longer) - 150)]))
    assert [(s.index, s.num_tokens, s.aligned) for s in meta2.saves] == [(2, 62, False),
                                                                         (2, 48, True)]


class TP2Node:
    """One vLLM instance at TP=2: the scheduler (rank 0's keys) and a worker per rank,
    each with KV of its own (its fingerprint names its rank, so its keys differ)."""

    def __init__(self, mod: Any, kv_role: str, seed: int, monkeypatch: pytest.MonkeyPatch,
                 zero: bool = False, same_kv: bool = False, heads: int = H,
                 **extra: Any):  # fmt: skip
        import connectors.vllm_common as common

        self.sched = make_connector(mod, "scheduler", kv_role, tp=2, heads=heads, **extra)
        self.workers: list[Any] = []
        self.layers: list[list[torch.Tensor]] = []
        for rank in (0, 1):
            monkeypatch.setattr(common, "_tp_rank", lambda r=rank: r)
            w = make_connector(mod, "worker", kv_role, tp=2, heads=heads, **extra)
            layers = kv_layers(64, 10 * seed + (0 if same_kv else rank), heads=heads)
            if zero:
                layers = [torch.zeros_like(t) for t in layers]
            w.register_kv_caches({f"model.layers.{i}.self_attn.attn": t
                                  for i, t in enumerate(layers)})  # fmt: skip
            self.workers.append(w)
            self.layers.append(layers)
        monkeypatch.setattr(common, "_tp_rank", lambda: 0)

    def step(self, so: Any) -> Any:
        meta = self.sched.build_connector_meta(so)
        for w in self.workers:
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            w.wait_for_save()
            w.drain_saves()
            w.clear_connector_metadata()
        return meta


def test_tp2_every_rank_loads_an_earlier_prompts_tail(
    vllm_mod: Any, store: MemoryChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At TP=2 the metadata names rank 0's keys; rank 1 derives its own from the
    tokens. For the tail an earlier, shorter prompt saved, that is the
    key of those tokens, not of the longer prompt's chunk at that position (which no
    rank has): without it rank 1 failed the load and the request recomputed."""
    p = TP2Node(vllm_mod, "kv_both", 1, monkeypatch)
    req = FakeRequest("p1", PROMPT)  # 150 tokens: chunks of 64, 64 and a 22-token tail
    p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    p.step(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
    p.sched.request_finished(req, P_BLOCKS)
    assert len(store._data) == 2 * 4  # each rank's chunks and aligned tail
    d = TP2Node(vllm_mod, "kv_both", 2, monkeypatch, zero=True)
    _, blocks = next_turn_loads_the_tail(d)
    for rank, w in enumerate(d.workers):
        assert w.get_block_ids_with_load_errors() == set(), f"rank {rank}"
        for li in range(LAYERS):
            assert same_150_tokens(d.layers[rank][li], blocks, p.layers[rank][li]), (rank, li)


def test_mla_is_stored_once_at_any_tp_and_read_at_another(
    vllm_mod: Any, store: MemoryChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLA's latent KV is the same on every rank: at TP=2 only rank 0 saves it, under the
    keys a TP=1 writer uses, so the tier holds one copy and a pool at either TP size
    loads what the other wrote (every rank loading the same chunks)."""
    one = Node(vllm_mod, "kv_both", 1, mla=True)
    req = FakeRequest("p1", PROMPT)
    one.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    one.step(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
    one.sched.request_finished(req, P_BLOCKS)
    written_at_tp1 = dict(store._data)
    assert written_at_tp1
    store._data.clear()

    two = TP2Node(vllm_mod, "kv_both", 1, monkeypatch, same_kv=True, mla=True)
    req = FakeRequest("p2", PROMPT)
    two.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    two.step(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
    two.sched.request_finished(req, P_BLOCKS)
    assert set(store._data) == set(written_at_tp1)  # one copy, not one per rank

    d1 = Node(vllm_mod, "kv_both", 2, zero=True, mla=True)  # TP=1 reads TP=2's chunks
    _, blocks = next_turn_loads_the_tail(d1)
    assert d1.worker.get_block_ids_with_load_errors() == set()
    for li in range(LAYERS):
        assert same_150_tokens(d1.layers[li], blocks, two.layers[0][li]), li

    store._data.clear()
    store._data.update(written_at_tp1)
    d2 = TP2Node(vllm_mod, "kv_both", 3, monkeypatch, zero=True, mla=True)  # and back
    _, blocks = next_turn_loads_the_tail(d2)
    for rank, w in enumerate(d2.workers):
        assert w.get_block_ids_with_load_errors() == set(), f"rank {rank}"
        for li in range(LAYERS):
            assert same_150_tokens(d2.layers[rank][li], blocks, one.layers[li]), (rank, li)


def write_prompt(node: Any, rid: str = "p1", prompt: list[int] = PROMPT) -> None:
    """``node`` (a Node or a TP2Node) computes ``prompt`` into P_BLOCKS and saves it."""
    req = FakeRequest(rid, prompt)
    node.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    node.step(sched_output([(req, P_BLOCKS, 0, len(prompt))]))
    node.sched.request_finished(req, P_BLOCKS)


def test_a_pool_at_another_tp_size_loads_the_heads_it_holds(
    vllm_mod: Any, store: MemoryChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TP=1 pool's chunk holds both KV heads; a TP=2 pool that lists it in
    ``peer_tp_sizes`` finds it under the TP=1 keys and each rank loads its own head of
    it. Back the other way, a TP=1 reader joins the two ranks' chunks. Without the
    setting the pools share nothing."""
    one = Node(vllm_mod, "kv_both", 1)  # 2 KV heads
    write_prompt(one)
    assert len(store._data) == 4
    alone = TP2Node(vllm_mod, "kv_both", 2, monkeypatch, zero=True, heads=1)
    assert alone.sched.get_num_new_matched_tokens(FakeRequest("x", PROMPT), 0) == (0, False)

    two = TP2Node(vllm_mod, "kv_both", 2, monkeypatch, zero=True, heads=1, peer_tp_sizes=[1])
    _, blocks = next_turn_loads_the_tail(two)
    for rank, w in enumerate(two.workers):
        assert w.get_block_ids_with_load_errors() == set(), f"rank {rank}"
        for li in range(LAYERS):
            want = one.layers[li][:, rank : rank + 1]
            assert same_150_tokens(two.layers[rank][li], blocks, want), (rank, li)
            assert not two.layers[rank][li][: blocks[0]].any()  # no other block touched

    store._data.clear()
    writer = TP2Node(vllm_mod, "kv_both", 3, monkeypatch, heads=1)  # a head per rank
    write_prompt(writer)
    assert len(store._data) == 2 * 4
    reader = Node(vllm_mod, "kv_both", 4, zero=True, peer_tp_sizes="2")
    # A chunk is found only once every shard the reader joins is there.
    rank1_chunk1 = writer.workers[1].worker._req_keys(PROMPT, None)[1]
    held = store._data.pop(rank1_chunk1)
    assert reader.sched.get_num_new_matched_tokens(FakeRequest("y", PROMPT), 0) == (64, False)
    store._data[rank1_chunk1] = held
    # So is an earlier prompt's partial chunk (the tail the next turn shares).
    rank1_tail = writer.workers[1].worker._req_keys(PROMPT, None)[2]
    held = store._data.pop(rank1_tail)
    longer = FakeRequest("z", [*PROMPT, *range(600, 640)])
    # Both ranks saved the tail's whole block too: 16 of its 22 tokens load.
    assert reader.sched.get_num_new_matched_tokens(longer, 0) == (144, False)
    store._data[rank1_tail] = held
    _, blocks = next_turn_loads_the_tail(reader)
    assert reader.worker.get_block_ids_with_load_errors() == set()
    for li in range(LAYERS):
        joined = torch.cat([writer.layers[0][li], writer.layers[1][li]], dim=1)
        assert same_150_tokens(reader.layers[li], blocks, joined), li


class S3BackedStore(MemoryChunkStore):
    """A store whose chunks sit in S3 until a prefetch copies them into its DRAM (what
    the agent does), recording each prefetch call: (keys, fingerprint)."""

    def __init__(self) -> None:
        super().__init__()
        self.tiers = ["dram", "s3"]
        self.in_s3: set[str] = set()
        self.asked: list[tuple[list[str], bytes | None]] = []

    def lookup_priced(
        self, keys: Any, nbytes: int = 0, fresh: bool = False
    ) -> tuple[list[str], list[float]]:
        found = self.lookup(keys)
        return ["s3" if k in self.in_s3 else "dram" for k in keys[: len(found)]], [0.0] * len(found)

    def prefetch(self, keys: Any, fingerprint: bytes | None = None, wait_s: float = 0.0) -> int:
        self.asked.append((list(keys), fingerprint))
        self.in_s3 -= set(keys)
        return len(keys)

    def in_dram(self, keys: Any) -> list[bool]:
        return [k in self._data and k not in self.in_s3 for k in keys]


def test_a_join_from_s3_copies_every_shard_into_dram_first(
    vllm_mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of a TP=2 pool in S3, read by a TP=1 pool: the prefetch asks for both
    shards' chunks, each under its own fingerprint, so neither is read from S3 inside
    the forward pass. This pool's own TP=2 chunks are asked for as before (shard 0's:
    the scheduler's keys)."""
    import tiered_cache.client as client

    st = S3BackedStore()
    monkeypatch.setattr(client, "open_store", lambda extra: st)
    writer = TP2Node(vllm_mod, "kv_both", 3, monkeypatch, heads=1)
    write_prompt(writer)
    st.in_s3 = set(st._data)
    reader = Node(vllm_mod, "kv_both", 4, zero=True, peer_tp_sizes=[2])
    req = FakeRequest("r", PROMPT)
    assert reader.sched.get_num_new_matched_tokens(req, 0) == (149, False)
    ranks = [w.worker for w in writer.workers]
    assert [(sorted(k), d) for k, d in st.asked] == [
        (sorted(r._req_keys(PROMPT, None)[:3]), r._fp.digest) for r in ranks
    ]
    reader.sched.update_state_after_alloc(req, FakeBlocks(D_BLOCKS), 149)
    reader.step(sched_output([]))
    assert reader.worker.get_block_ids_with_load_errors() == set()
    for li in range(LAYERS):
        joined = torch.cat([writer.layers[0][li], writer.layers[1][li]], dim=1)
        assert torch.equal(reader.layers[li][D_BLOCKS[:9]], joined[P_BLOCKS[:9]]), li

    st.asked.clear()
    st.in_s3 = set(st._data)
    same = TP2Node(vllm_mod, "kv_both", 5, monkeypatch, heads=1)
    assert same.sched.get_num_new_matched_tokens(FakeRequest("s", PROMPT), 0) == (149, False)
    assert [(sorted(k), d) for k, d in st.asked] == [
        (sorted(ranks[0]._req_keys(PROMPT, None)[:3]), ranks[0]._fp.digest)
    ]


def test_a_later_turn_loads_a_peer_pools_prefix_then_its_own_chunks(
    vllm_mod: Any, store: MemoryChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TP=2 decode loads turn 2's prefix from a TP=1 prefill and saves, under its own
    keys, the chunks it computed. Turn 3 finds both: the prefill's chunks, then the
    decode's own (the lookup goes back and forth between the pools' keys)."""
    one = Node(vllm_mod, "kv_both", 1)
    write_prompt(one)  # PROMPT: 150 tokens
    d = TP2Node(vllm_mod, "kv_both", 2, monkeypatch, zero=True, heads=1, peer_tp_sizes=[1])
    turn2 = FakeRequest("d2", [*PROMPT, *range(600, 650)])  # 200 tokens
    assert d.sched.get_num_new_matched_tokens(turn2, 0) == (150, False)
    blocks = list(range(40, 53))
    d.sched.update_state_after_alloc(turn2, FakeBlocks(blocks), 150)
    d.step(sched_output([]))
    g = torch.Generator().manual_seed(7)
    for layers in d.layers:  # what the decode computes of turn 2: tokens 150-199
        for t in layers:
            t[blocks[9], :, 6:] = torch.randn(t[blocks[9], :, 6:].shape, generator=g)
            t[blocks[10:]] = torch.randn(t[blocks[10:]].shape, generator=g)
    meta = d.step(sched_output([(turn2, blocks, 150, 50)]))
    assert [(s.index, s.num_tokens) for s in meta.saves] == [(2, 64), (3, 8)]
    d.sched.request_finished(turn2, blocks)
    turn3 = FakeRequest("d3", [*turn2.prompt_token_ids, *range(700, 780)])  # 280 tokens
    assert d.sched.get_num_new_matched_tokens(turn3, 0) == (200, False)
    tblocks = list(range(20, 38))
    d.sched.update_state_after_alloc(turn3, FakeBlocks(tblocks), 200)
    load = d.step(sched_output([])).loads[0]
    assert [(c.index, c.num_tokens, c.shards) for c in load.chunks] == [
        (0, 64, 1), (1, 64, 1), (2, 64, 0), (3, 8, 0)  # the prefill's (1 shard), its own
    ]
    for rank, w in enumerate(d.workers):
        assert w.get_block_ids_with_load_errors() == set(), f"rank {rank}"
        for li in range(LAYERS):
            got, want = d.layers[rank][li], one.layers[li][:, rank : rank + 1]
            assert torch.equal(got[tblocks[:8]], want[P_BLOCKS[:8]])
            # Chunks 2 and 3: what the decode had of turn 2 (loaded or computed).
            assert torch.equal(got[tblocks[8:12]], got[blocks[8:12]])
            assert torch.equal(got[tblocks[12], :, :8], got[blocks[12], :, :8])


def test_peer_tp_sizes_it_cannot_serve_are_refused_with_one_line(
    vllm_mod: Any, store: MemoryChunkStore
) -> None:
    """Sizes that do not divide the KV heads, replicated heads and bad values stop the
    connector at start-up; MLA's pools share keys at every size, so it needs none."""
    with pytest.raises(ValueError, match="does not divide this model's 2 KV heads"):
        make_connector(vllm_mod, "scheduler", "kv_both", peer_tp_sizes=[4])
    with pytest.raises(ValueError, match="positive TP sizes"):
        make_connector(vllm_mod, "scheduler", "kv_both", peer_tp_sizes="two")
    with pytest.raises(ValueError, match="replicated"):  # 1 KV head at TP 2: a copy each
        make_connector(vllm_mod, "scheduler", "kv_both", tp=2, heads=1, total_heads=1,
                       peer_tp_sizes=[1])  # fmt: skip
    mla = make_connector(vllm_mod, "scheduler", "kv_both", mla=True, peer_tp_sizes=[2])
    assert mla.scheduler._read_shards == [1]  # one shard at any size: the same keys


def test_kv_groups_take_full_and_sliding_window_and_refuse_the_rest() -> None:
    """Full attention (MLA too) and sliding-window groups are taken, the layers in model
    order; a Mamba state, groups of different block layouts and non-causal (prefix LM)
    layers stop the connector at start-up naming what the model has."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    from connectors.vllm_common import kv_groups

    kw: dict[str, Any] = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    full, swa = FullAttentionSpec(**kw), SlidingWindowSpec(**kw, sliding_window=64)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))

    def cfg(*specs: Any, layers: int = 1) -> Any:
        groups = [KVCacheGroupSpec([f"model.layers.{g + len(specs) * i}.attn"
                                    for i in range(layers)], sp)
                  for g, sp in enumerate(specs)]  # fmt: skip
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

    one = kv_groups(cfg(full))
    assert one.spec is full and not one.grouped and not one.windowed
    mla = MLAAttentionSpec(**{**kw, "num_kv_heads": 1})
    assert kv_groups(cfg(mla)).spec is mla
    # Sliding-window and full layers interleaved (Gemma 2/3, gpt-oss): two groups, every
    # layer in model order, the full group's spec as the layout.
    two = kv_groups(cfg(swa, full, layers=2))
    assert two.spec is full and two.grouped and two.windowed
    assert two.layer_names == tuple(f"model.layers.{i}.attn" for i in range(4))
    assert two.layer_group == (0, 1, 0, 1) and two.windows == (64, None)
    # A window of 64 after 100 tokens: tokens 0..36 are out of it, so blocks 0 and 1 are.
    assert two.first_live_block(100, 16) == 2 and two.first_live_block(64, 16) == 0
    only = kv_groups(cfg(swa))  # a sliding window on every layer: copied as a group
    assert only.windows == (64,) and only.grouped
    with pytest.raises(ValueError, match=r"groups are FullAttentionSpec, MambaSpec"):
        kv_groups(cfg(full, mamba))
    with pytest.raises(ValueError, match="one block layout"):
        kv_groups(cfg(full, SlidingWindowSpec(**{**kw, "head_size": 16}, sliding_window=64)))
    with pytest.raises(ValueError, match=r"non-causal \(prefix LM\)"):
        kv_groups(cfg(FullAttentionSpec(**kw, non_causal=True)))


def test_kv_shards_follow_vllms_replicas() -> None:
    """Ranks holding one KV shard share its keys, as vLLM states it: its
    ``kv_tp_replicas``, else ``max_tp_shards`` (1 for MLA as vLLM builds it; TP=4 over 2
    shards: ranks 0-1 and 2-3), else a shard per rank, an MLA spec without it included
    (unknown: not replicated)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from connectors.vllm_common import kv_shards

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32,
                           max_tp_shards=1)  # fmt: skip
    unknown = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    two = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32,
                            max_tp_shards=2)  # fmt: skip
    assert [kv_shards(full, tp) for tp in (1, 2, 4)] == [1, 2, 4]
    assert [kv_shards(mla, tp) for tp in (1, 2, 4)] == [1, 1, 1]
    assert [kv_shards(two, tp) for tp in (1, 2, 4, 3)] == [1, 2, 2, 3]
    assert [kv_shards(unknown, tp) for tp in (1, 2, 4)] == [1, 2, 4]
    assert [kv_shards(full, 4, replicas) for replicas in (1, 2, 4, 3)] == [4, 2, 1, 4]


@pytest.mark.parametrize("aliases", [True, False], ids=["aliases", "off"])
def test_a_prompt_diverging_inside_a_chunk_loads_its_shared_blocks(
    vllm_mod: Any, agent_store: dict[str, Any], aliases: bool
) -> None:
    """Two prompts over one system prompt that diverge inside a chunk: the whole chunk
    the first saved has another key than the second's, but the first also named its
    block-aligned prefixes (the agent's aliases), so the second loads the shared blocks
    of that chunk, as vLLM's own per-block prefix cache would, instead of recomputing
    them (with ``block_aliases: false``, as before: whole chunks only)."""
    p = agent_node(vllm_mod, "kv_both", 1, agent_store, block_aliases=aliases)
    req = FakeRequest("p1", PROMPT)  # 150 tokens: chunks of 64, 64 and a 22-token tail
    p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    p.step(sched_output([(req, P_BLOCKS, 0, len(PROMPT))]))
    p.sched.request_finished(req, P_BLOCKS)
    # Shares chunk 0 and the first 40 tokens (2 whole blocks and 8 tokens) of chunk 1.
    other = [*PROMPT[:104], *range(700, 760)]
    d = agent_node(vllm_mod, "kv_both", 2, agent_store, zero=True)
    dreq = FakeRequest("d1", other)
    want = 64 + 32 if aliases else 64
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (want, False)
    blocks = [*D_BLOCKS, 50]  # 11 blocks: 164 tokens
    d.sched.update_state_after_alloc(dreq, FakeBlocks(blocks), want)
    load = d.step(sched_output([])).loads[0]
    shared = want // BS
    if aliases:
        # Chunk 1 is the first saved prompt's whole chunk, of which 2 blocks are loaded.
        assert [(c.index, c.key, c.num_tokens, len(c.block_ids)) for c in load.chunks] == [
            (0, load.chunks[0].key, 64, 4),
            (1, p.sched.scheduler._req_keys(PROMPT, None)[1], 64, 2),
        ]
    assert d.worker.get_block_ids_with_load_errors() == set()
    for li in range(LAYERS):
        assert torch.equal(d.layers[li][D_BLOCKS[:shared]], p.layers[li][P_BLOCKS[:shared]])
        # Nothing past the shared blocks was written (a zeroed node's blocks stay zero).
        assert not d.layers[li][D_BLOCKS[shared:]].any()
    # Chunk 1 of the diverging prompt is its own: saved once computed.
    meta = d.step(sched_output([(dreq, blocks, want, len(other) - want)]))
    assert [s.index for s in meta.saves if not s.aligned][:2] == [1, 2]


class RemoteStore(MemoryChunkStore):
    """What a node's agent answers for chunks a peer holds: found on ``peer``, copied
    into DRAM by ``prefetch`` once the test lands them (``landed``)."""

    def __init__(self, data: dict[str, bytes]) -> None:
        super().__init__()
        self._data = data
        self.tiers = ["dram"]
        self.landed = False
        self.asked: list[str] = []
        self.waits: list[float] = []
        self.land_on_wait = False

    def lookup_priced(
        self, keys: list[str], nbytes: int = 0  # type: ignore[override]
    ) -> tuple[list[str], list[float]]:
        found = self.lookup(keys)
        return ["dram" if self.landed else "peer"] * len(found), [0.002] * len(found)

    def prefetch(self, keys: Any, fingerprint: bytes | None = None, wait_s: float = 0.0) -> int:
        self.asked += list(keys)
        if wait_s > 0:  # the agent answers once the copies end: the test's ``land_on_wait``
            self.waits.append(wait_s)
            self.landed = self.landed or self.land_on_wait
        return len(keys)

    def in_dram(self, keys: Any) -> list[bool] | None:
        return [self.landed and k in self._data for k in keys]


@pytest.mark.parametrize("policy", ["auto", "always"])
def test_a_slow_peer_pull_is_waited_for_only_under_fetch_policy_always(
    vllm_mod: Any, store: MemoryChunkStore, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """Before the engine has measured its prefill rate, ``auto`` waits about a second for
    chunks being pulled from a peer, then recomputes; ``always`` loads what is found and
    waits up to ``load_wait_timeout_s`` for it (the 12 MiB peer pulls of the netns e2e
    test took over a second on a loaded host)."""
    import connectors.vllm_scheduler as vs

    prefill(vllm_mod, store)
    remote = RemoteStore(store._data)
    import tiered_cache.client as client

    monkeypatch.setattr(client, "open_store", lambda extra: remote)
    clock = FakeClock()
    monkeypatch.setattr(vs, "time", SimpleNamespace(monotonic=clock, sleep=lambda s: None))
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, lookup_poll_s=0,
             fetch_policy=policy, load_wait_timeout_s=5)  # fmt: skip
    req = FakeRequest("d1", PROMPT)
    d.sched.on_new_request(req)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert remote.asked == d.sched.scheduler._req_keys(PROMPT, None)
    clock.t += 1.5
    got = d.sched.get_num_new_matched_tokens(req, 0)
    if policy == "auto":
        assert got == (0, False)
        c = counters(d.sched.get_kv_connector_stats())
        assert c["recompute_fallbacks"] == {"fetch_deadline": 1}
        return
    assert got == (None, False)  # still waiting, within the cap
    remote.landed = True
    assert d.sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, False)


def test_an_idle_engine_holds_the_scheduler_until_prefetched_chunks_land(
    vllm_mod: Any, store: MemoryChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the engine runs nothing else, a request whose chunks are being pulled from a
    peer holds the scheduler in one prefetch call that the agent answers when they land
    (at most a poll interval), and loads in that same call: no step-a-millisecond spin
    for the agent's CPU, no poll between landing and loading. A busy engine never waits."""
    prefill(vllm_mod, store)
    remote = RemoteStore(store._data)
    import tiered_cache.client as client

    monkeypatch.setattr(client, "open_store", lambda extra: remote)
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, lookup_poll_s=0.05)
    req = FakeRequest("d1", PROMPT)
    d.sched.on_new_request(req)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (None, False)  # prefetch started
    remote.land_on_wait = True
    other = FakeRequest("o1", [7] * 40)
    d.step(sched_output([(other, [40, 41, 42], 0, 40)]))  # the engine is busy: no wait
    assert d.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert remote.waits == []
    d.step(sched_output([]))  # a step that ran nothing: the engine only polls
    assert d.sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT) - 1, False)
    assert len(remote.waits) == 1 and 0 < remote.waits[0] <= 0.05


def decode_step(r: FakeRequest, computed: int) -> Any:
    """SchedulerOutput stand-in: ``r`` (running) decodes one token after ``computed``."""
    cached = SimpleNamespace(req_ids=[r.request_id], new_block_ids=[None],
                             num_computed_tokens=[computed], resumed_req_ids=set())  # fmt: skip
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={r.request_id: 1}, total_num_scheduled_tokens=1)


def test_a_decode_saves_what_it_computes_when_the_router_skipped_the_prefill(
    vllm_mod: Any, store: MemoryChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving is decided per request, not per role. Turn 1 ran through a prefill. Turn 2
    grew inside a chunk, so the router skipped its prefill: the decode loads what turn 1
    saved and computes the rest, and saves that (the chunk and its whole blocks), or turn
    3 would find only turn 1's chunks. A miss is looked up once: the chunks its own
    lookup found are not looked up again when the request is allocated."""
    prefill(vllm_mod, store)  # PROMPT, 150 tokens: chunks 0, 1, a 22-token tail (+16 aligned)
    d = Node(vllm_mod, "kv_consumer", seed=2, load_wait_timeout_s=30, lookup_poll_s=0)
    lookups: list[int] = []
    lookup = store.lookup

    def counted(keys: Any) -> list[str]:
        lookups.append(len(keys))
        return lookup(keys)

    monkeypatch.setattr(store, "lookup", counted)
    turn2 = [*PROMPT, *range(600, 640)]  # 190 tokens: chunk 2 grows to 62
    req = FakeRequest("d2", turn2, kv_transfer_params=hint([]))  # the router skipped
    d.sched.on_new_request(req)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (150, False)
    blocks = [*D_BLOCKS, 50, 51]
    d.sched.update_state_after_alloc(req, FakeBlocks(blocks), 150)
    assert len(lookups) == 1  # the match's lookup only
    d.step(sched_output([]))
    # The step that computes the prompt (and samples the first token) copies nothing out:
    # the save comes a step later, off the request's TTFT.
    assert d.step(sched_output([(req, blocks, 150, len(turn2) - 150)])).saves == []
    meta = d.step(decode_step(req, len(turn2)))
    assert [(s.index, s.num_tokens, s.aligned) for s in meta.saves] == [
        (2, 62, False), (2, 48, True)
    ]
    d.sched.request_finished(req, blocks)
    # Turn 3 (220 tokens, chunk 2 now whole) finds every token turn 2 computed.
    turn3 = [*turn2, *range(700, 730)]
    req3 = FakeRequest("d3", turn3, kv_transfer_params=hint([]))
    d.sched.on_new_request(req3)
    assert d.sched.get_num_new_matched_tokens(req3, 0) == (190, False)
    # A decode whose prefill saved the whole prompt saves nothing; nor does one without
    # the router's hint (a plain consumer).
    p_keys = d.sched.scheduler._req_keys(turn3, None)
    for rid, params in (("d4", hint(p_keys)), ("d5", None)):
        r = FakeRequest(rid, turn3, kv_transfer_params=params)
        d.sched.on_new_request(r)
        got = d.sched.get_num_new_matched_tokens(r, 0)[0] or 0
        b = list(range(-(-len(turn3) // BS)))
        d.sched.update_state_after_alloc(r, FakeBlocks(b), got)
        d.step(sched_output([]))
        m = d.step(sched_output([(r, b, got, len(turn3) - got)]))
        assert m.saves == [] and d.step(decode_step(r, len(turn3))).saves == [], rid
        d.sched.request_finished(r, b)


# ------------------------------------------------------- several KV cache groups (HMA)

WINDOW = 32  # tokens: two blocks of the even (sliding-window) layers


def test_several_groups_save_and_load_each_group_in_its_own_blocks(
    vllm_mod: Any, store: MemoryChunkStore
) -> None:
    """A hybrid model's chunk holds every layer in model order, each read from its own
    group's blocks; a reader writes each group into its own blocks, and a sliding-window
    group only into the blocks of its window (vLLM's null block stands for the others
    and is left as it was). Such loads are async: vLLM takes their failures only per
    request."""
    p = Node(vllm_mod, "kv_producer", seed=1, window=WINDOW)
    sw, full = list(range(20, 30)), list(range(30, 40))
    req = FakeRequest("p1", PROMPT)
    p.sched.update_state_after_alloc(req, FakeBlocks(sw, (full,)), 0)
    meta = p.step(sched_output([(req, [sw, full], 0, len(PROMPT))]))
    assert [(s.index, s.group_ids) for s in meta.saves][:2] == [
        (0, [sw[0:4], full[0:4]]), (1, [sw[4:8], full[4:8]])
    ]
    m, payload = codec.decode(store._data[meta.saves[0].key])
    got = torch.frombuffer(bytearray(payload), dtype=torch.float32).view(m.shape)
    for li in range(LAYERS):
        ids = sw if li % 2 == 0 else full
        assert torch.equal(got[li], p.layers[li][ids[0:4]])

    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0, window=WINDOW)
    dreq = FakeRequest("d1", PROMPT)
    n, is_async = d.sched.get_num_new_matched_tokens(dreq, 0)
    assert (n, is_async) == (len(PROMPT) - 1, True)  # async although async_load is off
    # vLLM's allocation for 149 computed tokens: tokens 0..117 are before the window, so
    # the sliding group's blocks 0..6 are the null block.
    d_sw, d_full = [0] * 7 + [47, 48, 49], list(range(50, 60))
    d.sched.update_state_after_alloc(dreq, FakeBlocks(d_sw, (d_full,)), n)
    d.step(sched_output([]))
    assert d.finish_loads() == ({"d1"}, set())
    for li in range(LAYERS):
        if li % 2:
            assert torch.equal(d.layers[li][d_full], p.layers[li][full])
        else:
            assert torch.equal(d.layers[li][d_sw[7:]], p.layers[li][sw[7:]])
            assert not d.layers[li][0].any()  # the null block: nothing written


def test_a_chunk_before_the_window_is_not_saved(vllm_mod: Any, store: MemoryChunkStore) -> None:
    """Computed 40 tokens a step, a chunk ends after vLLM freed the first blocks of its
    sliding-window layers (a window of 32): it is not saved (it would hold another
    request's KV), nor the chunks after it, and the skip is counted."""
    p = Node(vllm_mod, "kv_producer", seed=1, window=WINDOW)
    sw, full = list(range(20, 30)), list(range(30, 40))
    req = FakeRequest("p1", PROMPT)
    p.sched.update_state_after_alloc(req, FakeBlocks(sw[:3], (full[:3],)), 0)
    assert p.step(sched_output([(req, [sw[:3], full[:3]], 0, 40)])).saves == []

    def step(computed: int, n: int, lo: int, hi: int) -> Any:
        cached = SimpleNamespace(req_ids=["p1"], new_block_ids=[(sw[lo:hi], full[lo:hi])],
                                 num_computed_tokens=[computed], resumed_req_ids=set())
        return p.step(SimpleNamespace(
            scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"p1": n},
            total_num_scheduled_tokens=n,
        ))  # fmt: skip

    # Tokens 40..79: chunk 0 (blocks 0-3) is done and its blocks all held (the window
    # after 40 tokens starts at token 9, in block 0).
    assert [s.index for s in step(40, 40, 3, 5).saves] == [0]
    assert step(80, 40, 5, 8).saves == []
    # Tokens 120..149: chunk 1 (blocks 4-7) is done, but after 120 tokens the window
    # starts at token 89: blocks 0-4 of the sliding layers are freed.
    assert step(120, 30, 8, 10).saves == []
    stats = counters(p.sched.get_kv_connector_stats())
    assert stats["saves_skipped"] == {"window": 2}  # chunk 1 and the tail
    assert len(store._data) == 1


def test_several_groups_report_a_failed_load_per_request(
    vllm_mod: Any, store: MemoryChunkStore
) -> None:
    """Block ids name a different block in each group, so vLLM takes a failed load of a
    hybrid model only as ``failed_recving``: the request recomputes."""
    p = Node(vllm_mod, "kv_producer", seed=1, window=WINDOW)
    sw, full = list(range(20, 30)), list(range(30, 40))
    req = FakeRequest("p1", PROMPT)
    p.sched.update_state_after_alloc(req, FakeBlocks(sw, (full,)), 0)
    p.step(sched_output([(req, [sw, full], 0, len(PROMPT))]))
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0, window=WINDOW)
    dreq = FakeRequest("d1", PROMPT)
    n, _ = d.sched.get_num_new_matched_tokens(dreq, 0)
    d.sched.update_state_after_alloc(dreq, FakeBlocks([0] * 7 + [47, 48, 49],
                                                      (list(range(50, 60)),)), n)  # fmt: skip
    key1 = d.sched.scheduler._reqs["d1"].keys[1]
    raw = bytearray(store._data[key1])
    raw[-5] ^= 0x40
    store._data[key1] = bytes(raw)
    d.step(sched_output([]))
    deadline = time.monotonic() + 10
    while d.worker.worker._inflight and time.monotonic() < deadline:
        time.sleep(0.005)
    res = d.worker.get_transfer_results(set())
    assert res.failed_recving == {"d1"} and res.finished_recving == {"d1"}
    assert d.worker.get_block_ids_with_load_errors() == set()
    # vLLM puts the request back to recompute and asks again: not loaded again (a
    # failure that repeats, a layout mismatch, would loop forever).
    from vllm.v1.outputs import KVConnectorOutput

    d.sched.update_connector_output(KVConnectorOutput(failed_recving=res.failed_recving))
    assert d.sched.get_num_new_matched_tokens(dreq, 0) == (0, False)


def test_grouped_paged_kv_refuses_a_save_of_a_freed_block() -> None:
    from connectors.vllm_kvio import GroupedPagedKV

    layers = kv_layers(8)
    kv = GroupedPagedKV(layers, None, [0, 1, 0], 2)
    out = torch.empty(kv.payload_shape(2))
    kv.gather([[3, 4], [5, 6]], out)
    assert torch.equal(out[1], layers[1][[5, 6]]) and torch.equal(out[2], layers[2][[3, 4]])
    with pytest.raises(ValueError, match="freed"):
        kv.gather([[0, 4], [5, 6]], out)
    with pytest.raises(ValueError, match="one per KV cache group"):
        kv.gather([3, 4], out)


def test_a_sliding_window_on_every_layer_skips_its_null_blocks(
    vllm_mod: Any, store: MemoryChunkStore
) -> None:
    """One sliding-window group (Mistral 7B v0.1 style): still copied as a group, so a
    load writes nothing into vLLM's null block, and its failure is the request's (the
    null block is in every such request's table: as a failed block id it would name
    them all)."""
    p = Node(vllm_mod, "kv_producer", seed=1, window=WINDOW, window_only=True)
    req = FakeRequest("p1", PROMPT)
    p.sched.update_state_after_alloc(req, FakeBlocks(P_BLOCKS), 0)
    meta = p.step(sched_output([(req, [P_BLOCKS], 0, len(PROMPT))]))
    assert meta.saves[0].group_ids == [P_BLOCKS[0:4]]
    d = Node(vllm_mod, "kv_consumer", seed=2, zero=True, load_wait_timeout_s=0, window=WINDOW,
             window_only=True)  # fmt: skip
    dreq = FakeRequest("d1", PROMPT)
    n, is_async = d.sched.get_num_new_matched_tokens(dreq, 0)
    assert (n, is_async) == (len(PROMPT) - 1, True)
    ids = [0] * 7 + D_BLOCKS[7:]
    d.sched.update_state_after_alloc(dreq, FakeBlocks(ids), n)
    d.step(sched_output([]))
    assert d.finish_loads() == ({"d1"}, set())
    for li in range(LAYERS):
        assert torch.equal(d.layers[li][D_BLOCKS[7:]], p.layers[li][P_BLOCKS[7:]])
        assert not d.layers[li][0].any()
