"""Which vLLM blocks each chunk holds, and which of this node's tiers hold each chunk: the
bookkeeping behind the agent's KV events (``BlockStored`` / ``BlockRemoved``).

A chunk key is ours (a chained hash of a chunk of tokens); a consumer knows blocks by the
hashes vLLM computed for them. The connector that saves or loads a chunk has those (the
request's ``block_hashes``) and tells the agent (``describe``). From then on every
residency change of the key in a tier becomes an event on that tier's medium: stored on
put, promotion, demotion, pin warm-up and restart; removed on eviction, delete, clear and
a failed verification.

A chunk that was never described (written by another client, or before events were on)
produces no events: a consumer could not join it with vLLM's blocks anyway; nor does one
described as holding no full block (a prompt's tail of less than a block, which vLLM does
not hash), though ``ls`` shows it described (``blocks: []``). A description
is kept while a tier here holds its key, and, for keys not yet stored (the description
arrives first), in a bounded LRU (``max_pending``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiered_cache.kv_events.wire import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    REMOTE,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

MAX_BLOCKS_PER_CHUNK = 4096  # a description naming more is refused (a chunk is <= 64 Ki tokens)
MAX_BLOCK_SIZE = 4096  # tokens per vLLM block, at most
TOKEN_BYTES = 4  # token ids travel as uint32, little endian


@dataclass(frozen=True)
class TierMedium:
    """How a consumer sees one of our tiers (the fields vLLM's offloading tiers set)."""

    medium: str
    locality: str
    ownership: str


def tier_media(node_id: str, tiers: Iterable[str]) -> dict[str, TierMedium]:
    """DRAM is host memory (``CPU``), NVMe and S3 are ``STORAGE``; S3 is ``REMOTE`` to the
    node (every node reads it). ``ownership`` names the node and tier:
    ``tiered-cache:<node_id>:<tier>``, so a consumer can tell nodes and tiers apart."""
    out: dict[str, TierMedium] = {}
    for t in tiers:
        medium = MEDIUM_CPU if t == "dram" else MEDIUM_STORAGE
        out[t] = TierMedium(medium, REMOTE if t == "s3" else LOCAL, f"tiered-cache:{node_id}:{t}")
    return out


class DescriptionError(ValueError):
    """A description that does not add up (refused, nothing recorded)."""


@dataclass(slots=True)
class Blocks:
    """What vLLM knows one chunk by: the hashes of its full blocks, the hash of the block
    before them, their tokens (``TOKEN_BYTES`` each), and the request's LoRA and extra keys
    (one entry per block, as vLLM publishes them)."""

    hashes: list[BlockHash]
    parent: BlockHash | None
    tokens: bytes
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    topic: str = ""
    tiers: set[str] = field(default_factory=set)  # tiers whose copy was announced

    def check(self) -> None:
        n = len(self.hashes)
        if n > MAX_BLOCKS_PER_CHUNK:
            raise DescriptionError(f"a chunk of {n} blocks (at most {MAX_BLOCKS_PER_CHUNK})")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise DescriptionError(f"block_size {self.block_size} (1 to {MAX_BLOCK_SIZE})")
        if len(self.tokens) != n * self.block_size * TOKEN_BYTES:
            raise DescriptionError(
                f"{len(self.tokens)} token bytes for {n} blocks of {self.block_size} tokens"
            )
        if self.extra_keys is not None and len(self.extra_keys) != n:
            raise DescriptionError(f"{len(self.extra_keys)} extra keys for {n} blocks")

    def token_ids(self) -> list[int]:
        return memoryview(self.tokens).cast("I").tolist()

    def stored(self, m: TierMedium) -> BlockStored:
        extra = None
        if self.extra_keys is not None:
            extra = [tuple(e) if e is not None else None for e in self.extra_keys]
        return BlockStored(
            block_hashes=list(self.hashes),
            parent_block_hash=self.parent,
            token_ids=self.token_ids(),
            block_size=self.block_size,
            lora_id=self.lora_id,
            medium=m.medium,
            lora_name=self.lora_name,
            extra_keys=extra,
            group_idx=0,  # one KV cache group (vLLM's GPU events say 0 too)
            locality=m.locality,
            ownership=m.ownership,
        )

    def removed(self, m: TierMedium) -> BlockRemoved:
        return BlockRemoved(
            block_hashes=list(self.hashes),
            medium=m.medium,
            group_idx=0,
            locality=m.locality,
            ownership=m.ownership,
        )

    def dump(self) -> list[Any]:
        return [self.hashes, self.parent, self.tokens, self.block_size, self.lora_id,
                self.lora_name, self.extra_keys, self.topic]  # fmt: skip

    @classmethod
    def load(cls, v: Sequence[Any]) -> Blocks:
        b = cls(list(v[0]), v[1], bytes(v[2]), int(v[3]), v[4], v[5], v[6], str(v[7]))
        b.check()
        return b


Emit = Callable[[str, KVEvent], None]  # (topic, event)


class BlockBook:
    """Descriptions and announced residencies of this node's chunks; ``emit`` gets each
    event as it happens. ``holds(key)``: the tiers here that hold a key now."""

    def __init__(
        self,
        media: dict[str, TierMedium],
        holds: Callable[[str], list[str]],
        emit: Emit,
        *,
        max_pending: int = 4096,
    ) -> None:
        self.media = media
        self._holds = holds
        self._emit = emit
        self.max_pending = max_pending
        self._resident: dict[str, Blocks] = {}  # announced in at least one tier
        self._pending: OrderedDict[str, Blocks] = OrderedDict()  # described, held nowhere yet

    def __len__(self) -> int:
        return len(self._resident) + len(self._pending)

    def hashes(self, key: str) -> list[BlockHash] | None:
        """The vLLM block hashes ``key`` holds, when described."""
        b = self._resident.get(key) or self._pending.get(key)
        return list(b.hashes) if b is not None else None

    def topics(self) -> set[str]:
        return {b.topic for b in self._resident.values()}

    def describe(self, key: str, blocks: Blocks) -> None:
        """Record what vLLM calls ``key``'s blocks (``DescriptionError`` when they do not
        add up). Tiers that already hold the key are announced now: the put can land
        before its description does."""
        blocks.check()
        if key in self._resident:
            # Announced already: its removals must name the hashes its stores did. (Two
            # vLLM instances name the same tokens alike only with the same PYTHONHASHSEED.)
            self._refresh(key)
            return
        self._pending.pop(key, None)
        held = [t for t in self._holds(key) if t in self.media]
        if not held:
            self._pending[key] = blocks
            self._pending.move_to_end(key)
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
            return
        self._resident[key] = blocks
        for t in held:
            self.added(t, key)

    def _refresh(self, key: str) -> None:
        """Announce ``key`` in tiers that hold it but were not announced yet."""
        for t in self._holds(key):
            if t in self.media:
                self.added(t, key)

    def added(self, tier: str, key: str) -> None:
        b = self._resident.get(key)
        if b is None:
            b = self._pending.pop(key, None)
            if b is None:
                return
            self._resident[key] = b
        m = self.media.get(tier)
        if m is None or tier in b.tiers:
            return
        b.tiers.add(tier)
        if b.hashes:  # a chunk of less than a block holds no block vLLM names
            self._emit(b.topic, b.stored(m))

    def removed(self, tier: str, key: str) -> None:
        b = self._resident.get(key)
        if b is None or tier not in b.tiers:
            return
        b.tiers.discard(tier)
        if not b.tiers:
            del self._resident[key]
        if b.hashes:
            self._emit(b.topic, b.removed(self.media[tier]))

    def forgot(self, tier: str, key: str) -> None:
        """``tier`` stopped tracking ``key`` (S3's bounded index let go, or found the
        object deleted by someone else): announced as a removal. The object may live on,
        but nothing here would announce its deletion, and a consumer counting copies
        must not keep one nobody tracks."""
        self.removed(tier, key)

    def snapshot(
        self, topics: Iterable[str] = ("",), page: int = 1000
    ) -> list[tuple[str, list[KVEvent]]]:
        """The whole announced state as (topic, events) pages: first ``AllBlocksCleared``
        on ``topics`` and every topic in use, then a ``BlockStored`` per chunk per tier."""
        pages: list[tuple[str, list[KVEvent]]] = [
            (t, [AllBlocksCleared()]) for t in sorted(self.topics() | set(topics))
        ]
        by_topic: dict[str, list[KVEvent]] = {}
        for b in self._resident.values():
            if not b.hashes:
                continue
            evs = by_topic.setdefault(b.topic, [])
            evs.extend(b.stored(self.media[t]) for t in sorted(b.tiers))
        for t, evs in by_topic.items():
            pages.extend((t, evs[i : i + page]) for i in range(0, len(evs), page))
        return pages

    def dump(self) -> dict[str, list[Any]]:
        """The descriptions of resident chunks, for the next start (``restore``)."""
        return {k: b.dump() for k, b in self._resident.items()}

    def restore(self, saved: dict[str, Any]) -> int:
        """Take descriptions a previous run saved, announcing nothing (the start's snapshot
        does); a key no tier holds any more is dropped. Returns how many were taken."""
        n = 0
        for key, v in saved.items():
            try:
                b = Blocks.load(v)
            except (DescriptionError, TypeError, ValueError, IndexError):
                continue
            b.tiers = {t for t in self._holds(key) if t in self.media}
            if b.tiers:
                self._resident[key] = b
                n += 1
        return n
