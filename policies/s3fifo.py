"""S3-FIFO (Yang et al., SOSP'23): three static FIFO queues, amortised O(1) per operation.

- New entries go to the small queue S (~10% of capacity) unless their key is in the ghost
  queue G, in which case they go straight to the main queue M.
- Reads bump a 2-bit frequency counter (capped at 3); nothing moves on a hit.
- Eviction: while S holds at least its share, look at S's oldest entry: if it was read
  since insertion it moves to M (counter cleared), otherwise it is the victim and its key
  enters G. Otherwise look at M's oldest entry: if its counter is non-zero it is
  reinserted at M's head with the counter decremented, otherwise it is the victim.
  One-hit wonders therefore leave through S quickly without disturbing M.

``victim()`` performs those queue moves (they do not change which keys are resident) and
returns the entry that would leave; the ghost insertion happens in ``on_remove`` when the
hierarchy actually evicts it. Each move consumes a frequency unit or an S->M transfer,
both bounded by earlier inserts/reads, hence amortised O(1).

Capacity (entries) is ``capacity_hint`` if given, else the largest resident count seen.
G holds at most as many keys as M's share (``capacity - small``), as in the paper.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from policies._util import DEFAULT_DETACHED, Detached, SmallMainGhost
from policies.base import NOTHING, EntryInfo, EvictionPolicy

MAX_FREQ = 3


class S3FIFO(SmallMainGhost, EvictionPolicy):
    name = "s3fifo"

    def __init__(self, capacity_hint: int | None = None, small_ratio: float = 0.1) -> None:
        if capacity_hint is not None and capacity_hint < 1:
            raise ValueError("s3fifo capacity_hint must be >= 1")
        if not 0.0 < small_ratio < 1.0:
            raise ValueError("s3fifo small_ratio must be in (0, 1)")
        self.capacity_hint = capacity_hint
        self.small_ratio = small_ratio
        self._small: OrderedDict[str, None] = OrderedDict()  # first = oldest
        self._main: OrderedDict[str, None] = OrderedDict()
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._freq: dict[str, int] = {}
        self._peak = 0
        # key -> (freq, was in main)
        self._detached: Detached[tuple[int, bool]] = Detached(
            max(DEFAULT_DETACHED, capacity_hint or 0)
        )

    @property
    def ghost_limit(self) -> int:
        return max(1, self.capacity - self.small_target)

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        if key in self._freq:
            self.on_access(key)
            return
        state = self._detached.pop(key)
        if state is not None:
            freq, in_main = state
            (self._main if in_main else self._small)[key] = None
            self._freq[key] = freq
        else:
            if key in self._ghost:
                del self._ghost[key]
                self._main[key] = None
            else:
                self._small[key] = None
            self._freq[key] = 0
        self._peak = max(self._peak, len(self._freq))

    def on_access(self, key: str) -> None:
        f = self._freq.get(key)
        if f is not None:
            if f < MAX_FREQ:
                self._freq[key] = f + 1
            return
        state = self._detached.get(key)
        if state is not None:
            self._detached.put(key, (min(MAX_FREQ, state[0] + 1), state[1]))

    def on_remove(self, key: str) -> None:
        freq = self._freq.pop(key, None)
        if freq is None:
            return
        evicted = key == self._pending
        self._pending = None
        if key in self._small:
            del self._small[key]
            if evicted:
                self._ghost[key] = None
                self._ghost.move_to_end(key)
                limit = self.ghost_limit
                while len(self._ghost) > limit:
                    self._ghost.popitem(last=False)
            else:
                self._detached.put(key, (freq, False))
        else:
            del self._main[key]
            if not evicted:
                self._detached.put(key, (freq, True))

    def victim(self, protected: Set[str] = NOTHING) -> str | None:
        small, main, freq = self._small, self._main, self._freq
        # Protected entries met at a queue's head are set aside and put back in front,
        # in order: where they were, with their counters untouched.
        held_s: list[str] = []
        held_m: list[str] = []
        key: str | None = None
        while small or main:
            if small and (len(small) + len(held_s) >= self.small_target or not main):
                key = next(iter(small))
                if key in protected:
                    del small[key]
                    held_s.append(key)
                    continue
                if freq[key] >= 1:  # read while in S: promote to M
                    del small[key]
                    main[key] = None
                    freq[key] = 0
                    continue
            else:
                key = next(iter(main))
                if key in protected:
                    del main[key]
                    held_m.append(key)
                    continue
                if freq[key] > 0:  # second chance in M
                    freq[key] -= 1
                    main.move_to_end(key)
                    continue
            break
        else:
            key = None
        for queue, held in ((small, held_s), (main, held_m)):
            for k in reversed(held):
                queue[k] = None
                queue.move_to_end(k, last=False)
        self._pending = key
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)
