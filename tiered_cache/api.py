"""The synchronous store interfaces that connectors (vLLM, LMCache) program against.

vLLM calls connectors from plain threads, so these are synchronous.

- ``ChunkStore``: look chunks up, get them, put them. Every chunk a store returns has
  been verified against its key and the model fingerprint.
- ``SlotStore``: a ``ChunkStore`` whose chunk bytes move through shared-memory DRAM slots
  (zero-copy puts into reserved slots, loads handed to a sink while the slot is held),
  and that prices its sources. What the vLLM connector uses; the node agent's client
  (``tiered_cache.client.AgentClient``) is the implementation, ``MemoryChunkStore`` a
  dict-backed double for unit tests of connector bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tiered_cache.codec import ChunkMeta

if TYPE_CHECKING:
    from tiered_cache.protocol import Describe

# The names every module uses (configs, metrics labels, the directory, the connector).
TIERS = ("dram", "nvme", "s3")  # a node's tiers, nearest first
# Where a chunk can be loaded from, nearest first. "peer" is another node's agent.
SOURCES = ("dram", "nvme", "peer", "s3")
NODE_TIERS = frozenset({"dram", "nvme"})  # a node's own tiers: peers read them over TCP
SHARED_TIERS = frozenset({"s3"})  # shared by every node: lives on after its writer

PayloadLike = bytes | bytearray | memoryview

# Called with (index in request, meta, payload view) while the slot is held: copy out now.
Sink = Callable[[int, ChunkMeta, memoryview], None]


@dataclass
class LoadReport:
    """Outcome of ``SlotStore.load_report``, per requested key."""

    ok: list[bool]
    sources: list[str]  # the source that served each chunk ("dram", "nvme", "peer", "s3")
    # Why a chunk the store returned was refused here: "mismatch" (key or fingerprint) or
    # "verification" (damaged). Chunks the store did not return are simply missing.
    failures: dict[int, str] = field(default_factory=dict)


@dataclass
class SlotReservation:
    """DRAM slots reserved by ``SlotStore.reserve_payloads``; ``views[i]`` is the payload
    region of slot i (after its header)."""

    slots: list[int | None]
    views: list[memoryview]
    sizes: list[int]
    gen: int


class ChunkStore(Protocol):
    def lookup(self, keys: Sequence[str]) -> list[str]:
        """Source label (see ``SOURCES``) of each *leading* key that can be loaded.

        Stops at the first miss, so ``len(result)`` is the cached prefix length in chunks.
        One round trip per tier, not per chunk.
        """
        ...

    def get_many(
        self, keys: Sequence[str], fingerprint: bytes
    ) -> list[tuple[ChunkMeta, memoryview] | None]:
        """Verified chunks from the nearest source; None for a miss or a chunk that failed
        verification (which is also counted and removed)."""
        ...

    def put_many(
        self,
        items: Sequence[tuple[ChunkMeta, PayloadLike]],
        *,
        wait: bool = False,
    ) -> None:
        """Store chunks (each meta's ``parent`` and ``position`` feed prefix-aware
        policies). Returns once the bytes are copied out of the caller's buffers (the
        caller may reuse them); lower tiers may complete later."""
        ...

    def close(self) -> None: ...


class SlotStore(ChunkStore, Protocol):
    node_id: str
    tiers: list[str]  # the node's tiers, nearest first

    def ping(self) -> None:
        """One round trip to the store (reconnecting first if need be)."""
        ...

    def register_model(self, model: Mapping[str, Any]) -> str:
        """Register a connector's fingerprint (``ModelRegistration`` fields); its hex."""
        ...

    def lookup_priced(
        self, keys: Sequence[str], nbytes: int = 0, fresh: bool = False
    ) -> tuple[list[str], list[float]]:
        """``lookup``, with the expected seconds to load each chunk from its source.
        ``fresh``: not answered from recently remembered misses."""
        ...

    def present(
        self, keys: Sequence[str], nbytes: int = 0
    ) -> list[tuple[str, float, str] | None]:
        """Each key on its own (no prefix rule): (source, expected seconds, the key to
        load: the key itself, or the whole chunk an alias names a prefix of) or None."""
        ...

    def alias(self, targets: Sequence[str], aliases: Sequence[Sequence[str]]) -> None:
        """Register ``aliases[i]`` as keys of prefixes of chunk ``targets[i]``."""
        ...

    # Whether the store publishes KV events, so wants ``describe`` calls.
    takes_descriptions: bool

    def describe(self, req: Describe) -> None:
        """What vLLM calls the blocks of some chunks (the store's KV events)."""
        ...

    def prefetch(
        self, keys: Sequence[str], fingerprint: bytes | None = None, wait_s: float = 0.0
    ) -> int:
        """Copy ``keys`` into the node's DRAM in the background; how many were started.
        ``wait_s``: return once they have landed (or their copies failed), at most then."""
        ...

    def in_dram(self, keys: Sequence[str]) -> list[bool] | None:
        """Which keys DRAM holds now, without a round trip; None when it cannot say."""
        ...

    def load_report(
        self, keys: Sequence[str], fingerprint: bytes | None, sink: Sink
    ) -> LoadReport:
        """Verify each chunk and hand it to ``sink`` while its slot is held."""
        ...

    def reserve_payloads(self, payload_sizes: Sequence[int]) -> SlotReservation | None:
        """One DRAM slot per payload to write into; None when any does not fit."""
        ...

    def commit_payloads(
        self,
        res: SlotReservation,
        metas: Sequence[ChunkMeta],
        *,
        wait: bool = False,
    ) -> None:
        """Checksum each filled payload, write its header and publish it."""
        ...

    def abort_reservation(self, res: SlotReservation) -> None: ...


class MemoryChunkStore:
    """Dict-backed ``SlotStore`` for unit tests of connector bookkeeping: no slots (saves
    take ``put_many``), no DRAM tier (remote sources load asynchronously), sources unpriced
    and not reported."""

    node_id = "memory"

    def __init__(self) -> None:
        from tiered_cache import codec
        from tiered_cache.hierarchy.aliases import AliasMap

        self._codec = codec
        self._data: dict[str, bytes] = {}
        self._aliases = AliasMap()  # bounded, as the agent's
        self.tiers: list[str] = []

    def lookup(self, keys: Sequence[str]) -> list[str]:
        out: list[str] = []
        for k in keys:
            if k not in self._data:
                break
            out.append("dram")
        return out

    def get_many(
        self, keys: Sequence[str], fingerprint: bytes | None
    ) -> list[tuple[ChunkMeta, memoryview] | None]:
        res: list[tuple[ChunkMeta, memoryview] | None] = []
        for k in keys:
            raw = self._data.get(k)
            if raw is None:
                res.append(None)
                continue
            try:
                res.append(self._codec.decode(raw, expect_key=k, expect_fingerprint=fingerprint))
            except self._codec.ChunkError:
                res.append(None)
        return res

    def put_many(
        self,
        items: Sequence[tuple[ChunkMeta, PayloadLike]],
        *,
        wait: bool = False,
    ) -> None:
        for meta, payload in items:
            self._data[meta.key] = self._codec.encode(meta, payload)

    def close(self) -> None:
        self._data.clear()

    def ping(self) -> None:
        return

    def register_model(self, model: Mapping[str, Any]) -> str:
        return ""

    def lookup_priced(
        self, keys: Sequence[str], nbytes: int = 0, fresh: bool = False
    ) -> tuple[list[str], list[float]]:
        found = self.lookup(keys)
        return found, [0.0] * len(found)

    def present(
        self, keys: Sequence[str], nbytes: int = 0
    ) -> list[tuple[str, float, str] | None]:
        out: list[tuple[str, float, str] | None] = []
        for k in keys:
            t = k if k in self._data else self._aliases.target(k)
            out.append(("dram", 0.0, t) if t is not None and t in self._data else None)
        return out

    def alias(self, targets: Sequence[str], aliases: Sequence[Sequence[str]]) -> None:
        self._aliases.add(targets, aliases)

    takes_descriptions = False  # publishes no KV events

    def describe(self, req: Describe) -> None:
        return

    def prefetch(
        self, keys: Sequence[str], fingerprint: bytes | None = None, wait_s: float = 0.0
    ) -> int:
        return 0

    def in_dram(self, keys: Sequence[str]) -> list[bool] | None:
        return None

    def load_report(
        self, keys: Sequence[str], fingerprint: bytes | None, sink: Sink
    ) -> LoadReport:
        rep = LoadReport([False] * len(keys), [""] * len(keys))
        for i, item in enumerate(self.get_many(keys, fingerprint)):
            if item is None:
                break  # vLLM recomputes from the first failed block on: skip the rest
            sink(i, item[0], item[1])
            rep.ok[i] = True
        return rep

    def reserve_payloads(self, payload_sizes: Sequence[int]) -> SlotReservation | None:
        return None

    def commit_payloads(
        self,
        res: SlotReservation,
        metas: Sequence[ChunkMeta],
        *,
        wait: bool = False,
    ) -> None:
        raise RuntimeError("MemoryChunkStore reserves no slots: there is nothing to commit")

    def abort_reservation(self, res: SlotReservation) -> None:
        return
