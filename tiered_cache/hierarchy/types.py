"""What the tiered store's parts pass around: tier slots, hits, the write modes, the peer
fetcher's signature, and ``header_info`` (the prefix information of an encoded chunk)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from policies import AdmissionPolicy, EntryInfo, EvictionPolicy, make_admission, make_eviction
from tiered_cache import codec
from tiered_cache.codec import ChunkMeta
from tiered_cache.tiers.base import Tier

WriteMode = Literal["write_through", "write_back"]
# Fetches an encoded chunk (not yet verified) from another node: (key, node_id) -> None when
# the peer lacks it, else (bytes, seconds the transfer itself took). The fetcher times only the
# request and reply, not its own queueing or connection set-up, which say nothing about the
# source's speed and would skew the estimates.
PeerFetch = Callable[[str, str], Awaitable[tuple[bytes | bytearray, float] | None]]


class Residency(Protocol):
    """Told of every change of which tier holds which key (KV events, ``kv_events``):
    ``added`` once a copy landed, ``removed`` once one is deleted, ``forgot`` when a tier
    let go of a key it still stores (S3's bounded index)."""

    def added(self, tier: str, keys: list[str]) -> None: ...

    def removed(self, tier: str, keys: list[str]) -> None: ...

    def forgot(self, tier: str, key: str) -> None: ...


class PeerSkipped(Exception):
    """A peer fetch given up before it began: the peer's breaker opened while it waited
    for a connection (not a new failure of that peer)."""


def header_info(data: bytes | bytearray | memoryview) -> EntryInfo | None:
    """The prefix information an encoded chunk's header carries, if any."""
    try:
        meta, _, _ = codec.parse_header(memoryview(data)[: codec.HEADER_SIZE])
    except (codec.ChunkError, ValueError):
        return None  # the write path rejects it with the reason
    if not meta.parent and not meta.position:
        return None
    return EntryInfo(meta.parent or None, meta.position)


def header_tenant(data: bytes | bytearray | memoryview) -> str:
    """The tenant an encoded chunk's header names ("" for none, or for a bad header)."""
    try:
        return codec.parse_header(memoryview(data)[: codec.HEADER_SIZE])[0].tenant
    except (codec.ChunkError, ValueError):
        return ""


@dataclass
class TierSlot:
    tier: Tier
    eviction: EvictionPolicy = field(default_factory=lambda: make_eviction("lru"))
    admission: AdmissionPolicy = field(default_factory=lambda: make_admission("always"))
    write_mode: WriteMode = "write_back"  # how chunks reach this tier (top tier: ignored)
    pin_budget_fraction: float = 0.5

    @property
    def name(self) -> str:
        return self.tier.name


@dataclass
class Hit:
    meta: ChunkMeta
    payload: memoryview
    source: str  # tier name, or "peer"
    # The verified encoded chunk ``payload`` points into, when the read produced one: it
    # can be stored in another tier as is, without re-encoding (a copy and a checksum).
    raw: bytes | bytearray | memoryview | None = None

    def encoded(self) -> bytes | bytearray | memoryview:
        """The chunk in its stored form (header + payload)."""
        return self.raw if self.raw is not None else codec.encode(self.meta, self.payload)
