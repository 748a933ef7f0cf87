"""Keys of block-aligned prefixes of whole chunks, each naming its chunk.

A chunk's key chains over all its tokens, so a prompt that shares only the first blocks
of a chunk (two conversations over one system prompt that diverge inside a chunk) finds
nothing at that position, and recomputes up to a chunk of tokens vLLM's own per-block
prefix cache would have kept. The connector that saves a whole chunk also registers the
keys of its block-aligned prefixes (``keys.partial_keys``, the same keys a partial chunk
of those tokens has); ``present`` answers such a key with the whole chunk, whose first
blocks the other prompt then loads. Kept by the agent only (not in the directory), and
bounded: the least recently used go first (an alias that finds its chunk counts as used,
so a hot shared prefix keeps its aliases however many chunks are saved after it), and an
alias of a chunk no tier holds any more is a miss, and dropped."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# About 200 B each: 256 Ki aliases take ~50 MiB, 17,000 chunks' worth (15 a chunk at the
# default 256-token chunks and 16-token blocks).
MAX_ALIASES = 1 << 18


class AliasMap:
    def __init__(self, cap: int = MAX_ALIASES) -> None:
        self._cap = cap
        self._map: OrderedDict[str, str] = OrderedDict()

    def add(self, targets: Sequence[str], aliases: Sequence[Sequence[str]]) -> None:
        m = self._map
        for target, names in zip(targets, aliases, strict=True):
            for a in names:
                if a != target:
                    m[a] = target
                    m.move_to_end(a)
        while len(m) > self._cap:
            m.popitem(last=False)

    def target(self, key: str) -> str | None:
        return self._map.get(key)

    def used(self, key: str) -> None:
        """``key`` found its chunk: it goes last in line for eviction."""
        if key in self._map:
            self._map.move_to_end(key)

    def drop(self, key: str) -> None:
        """``key``'s chunk is gone (keys name content: it comes back with a new save,
        which names its aliases again)."""
        self._map.pop(key, None)

    def __len__(self) -> int:
        return len(self._map)
