"""The byte budget of a store's background copies (write-through, promotions).

A copy queued in the background holds its chunk's bytes until it lands. Without a bound a
tier slower than the writers (S3 on a bad day) queues copies until the agent runs out of
memory. ``CopyBudget`` bounds the bytes held by queued and running copies: a copy that
would go over is not queued and is counted (``tiered_cache_background_dropped_total``).
The chunk is still in the tier above; a cache may skip a copy, it must not stall its
writers or die.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiered_cache.events import StoreEvents

DEFAULT_BACKGROUND_BYTES = 256 * 2**20


class CopyBudget:
    """Bytes held by background copies, at most ``limit`` (a chunk larger than the limit
    still goes when nothing else is queued, or it could never be copied)."""

    def __init__(self, limit: int, events: StoreEvents) -> None:
        if limit < 1:
            raise ValueError("the background copy budget must be at least 1 byte")
        self.limit = limit
        self.events = events
        self.bytes = 0  # held now by queued and running copies
        self.peak = 0  # the most ever held at once (tests, soak figures)

    def take(self, nbytes: int, kind: str, tiers: Sequence[str]) -> bool:
        """Reserve ``nbytes`` for one copy of ``kind`` (write_through, promotion) to
        ``tiers``; False (counted once per tier) when the budget is spent."""
        if self.bytes and self.bytes + nbytes > self.limit:
            for tier in tiers:
                self.events.background_dropped(kind, tier)
            return False
        self.bytes += nbytes
        self.peak = max(self.peak, self.bytes)
        self.events.background_bytes(self.bytes)
        return True

    def give(self, nbytes: int) -> None:
        """The copy that took ``nbytes`` ended (landed, failed or was cancelled)."""
        self.bytes -= nbytes
        self.events.background_bytes(self.bytes)
