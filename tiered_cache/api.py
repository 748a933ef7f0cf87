"""The synchronous store API that connectors (vLLM, LMCache) program against.

vLLM calls connectors from plain threads, so this facade is synchronous. Implementations:
``tiered_cache.hierarchy.TieredStore`` through ``tiered_cache.client`` (embedded, in-process)
and the node-agent client (shared memory + local IPC). Both verify every chunk they return.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tiered_cache.codec import ChunkMeta

# Where a chunk was found, nearest first. "peer" is another node's agent.
SOURCES = ("dram", "nvme", "peer", "s3")

PayloadLike = bytes | bytearray | memoryview


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

    def put_many(self, items: Sequence[tuple[ChunkMeta, PayloadLike]]) -> None:
        """Store chunks. Returns once the bytes are copied out of the caller's buffers
        (the caller may reuse them); lower tiers may complete later."""
        ...

    def close(self) -> None: ...


class MemoryChunkStore:
    """Dict-backed ChunkStore for unit tests of connector bookkeeping only."""

    def __init__(self) -> None:
        from tiered_cache import codec

        self._codec = codec
        self._data: dict[str, bytes] = {}

    def lookup(self, keys: Sequence[str]) -> list[str]:
        out: list[str] = []
        for k in keys:
            if k not in self._data:
                break
            out.append("dram")
        return out

    def get_many(
        self, keys: Sequence[str], fingerprint: bytes
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

    def put_many(self, items: Sequence[tuple[ChunkMeta, PayloadLike]]) -> None:
        for meta, payload in items:
            self._data[meta.key] = self._codec.encode(meta, payload)

    def close(self) -> None:
        self._data.clear()
