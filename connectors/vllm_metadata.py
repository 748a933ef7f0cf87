"""What the two halves of the vLLM connector tell each other: the scheduler's per-step
plan for the workers (``TieredCacheConnectorMetadata``: chunks to load and to save), and
the workers' timing of each step for the scheduler (``TieredCacheWorkerMeta``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

if TYPE_CHECKING:
    from connectors.vllm_kvio import BlockIds


@dataclass
class SaveChunk:
    """Worker: copy blocks ``block_ids`` (the whole chunk) out and store under ``key``."""

    req_id: str
    index: int
    key: str
    num_tokens: int
    block_ids: list[int]
    parent: str | None = None  # previous chunk's key (prefix chain), for the store's policies
    # A block-aligned copy of the prompt's partial tail chunk: what a longer prompt that
    # extends this one (the next turn of a conversation) can find and load.
    aligned: bool = False
    tenant: str = ""  # the request's tenant (its cache_salt's: ``tiered_cache.tenancy``)
    # A model with several KV cache groups: every group's blocks (``blocks``).
    group_ids: list[list[int]] = field(default_factory=list)


@dataclass
class LoadChunk:
    """Worker: fetch ``key`` (a payload of ``n_blocks`` blocks) and write its blocks
    [lo, lo + len(block_ids)) into ``block_ids``."""

    index: int
    key: str
    num_tokens: int
    n_blocks: int
    lo: int
    block_ids: list[int]
    source: str = ""  # where the scheduler's lookup found it
    tokens: int = 0  # prompt tokens this load provides to the request
    origin: str = ""  # where it came from, when prefetched into DRAM for this load
    # The writer's KV shards when a pool at another TP size wrote it (``key`` is its
    # shard 0's; connectors.vllm_tp); 0: this pool's own shards.
    shards: int = 0
    # A model with several KV cache groups: every group's blocks (``blocks``).
    group_ids: list[list[int]] = field(default_factory=list)


def blocks(c: SaveChunk | LoadChunk) -> BlockIds:
    """A chunk's vLLM blocks as the block copies take them (``connectors.vllm_kvio``):
    ``block_ids``, the first KV cache group's (how many, and the only ones for most
    models), or for a model with several groups every group's (``group_ids``; vLLM's null
    block where a sliding window freed one: a load skips those)."""
    return c.group_ids or c.block_ids


@dataclass
class LoadJob:
    req_id: str
    chunks: list[LoadChunk]
    is_async: bool
    num_tokens: int
    # Only with tensor parallelism > 1, or chunks another TP size wrote: ranks derive
    # the keys of their shards from them.
    token_ids: list[int] | None = None
    cache_salt: str | None = None


@dataclass
class TieredCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveChunk] = field(default_factory=list)
    # Tensor parallelism > 1: prompt tokens and salt of the requests in ``saves``.
    save_tokens: dict[str, tuple[list[int], str | None]] = field(default_factory=dict)
    step_tokens: int = 0  # tokens this step computes: the worker times the forward


@dataclass
class TieredCacheWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: (tokens, forward seconds) of the engine's recent steps, from
    which the scheduler learns what recomputing a prompt costs (``RecomputeRate``)."""

    steps: list[tuple[int, float]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Tensor-parallel ranks run the same steps: the slowest rank sets each one's time.
        if not isinstance(other, TieredCacheWorkerMeta) or not other.steps:
            return self
        if len(other.steps) != len(self.steps):
            return self if self.steps else other
        return TieredCacheWorkerMeta(
            [(t, max(a, b)) for (t, a), (_, b) in zip(self.steps, other.steps, strict=True)]
        )
