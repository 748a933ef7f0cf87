"""Belady's offline optimum (MIN) for unit-size blocks, O(n log n).

``belady_hits(accesses, capacity)`` replays a sequence of block ids and returns, per
access, whether it hit. On a miss the block is admitted and, when the cache is full, the
resident block whose next use is farthest in the future (never used again = infinitely
far) is evicted: classic demand paging, where MIN maximises hits among all policies that
admit every missed block.

With ``bypass=True`` a missed block whose own next use is at least as far as every
resident's is not admitted (the farthest-next-use choice then falls on the newcomer
itself). That is the optimum when a policy may decline to cache a block (e.g. with an
admission policy). It never does worse than demand paging: it is the same decision rule
with the newcomer included among the candidates.

Which the simulator uses: the trace simulator's "belady" baseline is demand paging
(``bypass=False``), which is what the reference numbers in /work/shared/traces/README.md
describe ("evict the block whose next use is farthest"); the bypass variant is reported
as the bound for policies with admission control.

Implementation: next-use indices are computed in one backward pass; residents sit in a
max-heap keyed by next use with lazy deletion (an item is live if the block is resident
and the item's next use is the block's current one).

Note: for *prefix* hit ratios (a request only benefits from its leading run of cached
blocks) block-level MIN is a strong reference, not a proven upper bound.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence


def next_uses(accesses: Sequence[Hashable]) -> list[int]:
    """For each index i, the next index j > i with the same block, or len(accesses)."""
    n = len(accesses)
    nxt = [n] * n
    last: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(accesses[i], n)
        last[accesses[i]] = i
    return nxt


def belady_hits(accesses: Sequence[Hashable], capacity: int, bypass: bool = False) -> list[bool]:
    """Per access: hit (True) or miss under Belady's MIN at ``capacity`` blocks."""
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    n = len(accesses)
    nxt = next_uses(accesses)
    resident: dict[Hashable, int] = {}  # block -> index of its next use
    heap: list[tuple[int, int, Hashable]] = []  # (-next_use, tie, block)
    hits: list[bool] = []
    for i, block in enumerate(accesses):
        # Blocks never used again get distinct "infinite" next uses (n + i) so the
        # tuples never compare the (possibly unorderable) block ids.
        use = nxt[i] if nxt[i] < n else n + i
        if block in resident:
            hits.append(True)
            resident[block] = use
            heapq.heappush(heap, (-use, i, block))
            continue
        hits.append(False)
        if capacity == 0:
            continue
        if len(resident) >= capacity:
            while True:
                far, _, cand = heap[0]
                if resident.get(cand) == -far:
                    break
                heapq.heappop(heap)
            if bypass and use >= -far:
                continue
            heapq.heappop(heap)
            del resident[cand]
        resident[block] = use
        heapq.heappush(heap, (-use, i, block))
        if len(heap) > 2 * len(resident) + 64:
            heap = [(-u, j, b) for j, (b, u) in enumerate(resident.items())]
            heapq.heapify(heap)
    return hits


def belady_hit_ratio(accesses: Sequence[Hashable], capacity: int, bypass: bool = False) -> float:
    hits = belady_hits(accesses, capacity, bypass)
    return sum(hits) / len(hits) if hits else 0.0
