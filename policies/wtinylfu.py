"""W-TinyLFU (Einziger, Friedman & Manes, ToS'17; Caffeine's policy): amortised O(1).

Three LRU queues and a frequency sketch:

- New entries enter a small *window* LRU (``window_ratio`` of the capacity), so a burst
  of new chunks that are read again soon still hits.
- The rest is a segmented LRU: *probation* and *protected* (``protected_ratio`` of the
  main part). A read in probation promotes to protected; protected overflow falls back
  to probation's head.
- When the window is over its share, its oldest entry (the candidate) competes with
  probation's oldest (the main victim): the one with the higher TinyLFU frequency
  estimate stays. So a one-hit wonder leaves through the window, while a chunk with a
  history (even from long before it was last evicted: the sketch remembers keys that are
  not resident, and ages by halving) displaces a colder resident.

The sketch is ``policies.admission.TinyLFU`` (count-min + doorkeeper, reset every
``sample_factor x width`` sightings). It records every insert and read.

``victim()`` performs the queue moves of that competition (they do not change which
keys are resident) and returns the entry that would leave; it returns the same entry
until the next insert, read or removal.

Capacity (entries) is ``capacity_hint`` if given, else the largest resident count seen.
The sketch is sized from ``capacity_hint`` (width = next power of two >= 4 x capacity,
at least 4096), or 2**16 counters per row without a hint.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from policies._util import DEFAULT_DETACHED, Detached, first_free
from policies.admission import TinyLFU
from policies.base import NOTHING, EntryInfo, EvictionPolicy

WINDOW, PROBATION, PROTECTED = 0, 1, 2
STEP = 0.0625  # first window resize, as a fraction of the capacity (Caffeine's value)
STEP_DECAY = 0.98
RESTART = 0.05  # a hit-ratio change this large restarts the climb with a full step
MAX_WINDOW = 0.8


class WTinyLFU(EvictionPolicy):
    name = "wtinylfu"

    def __init__(
        self,
        capacity_hint: int | None = None,
        window_ratio: float = 0.01,
        protected_ratio: float = 0.8,
        adaptive: bool = True,
    ) -> None:
        if capacity_hint is not None and capacity_hint < 1:
            raise ValueError("wtinylfu capacity_hint must be >= 1")
        if not 0.0 < window_ratio < 1.0 or not 0.0 < protected_ratio < 1.0:
            raise ValueError("wtinylfu ratios must be in (0, 1)")
        self.capacity_hint = capacity_hint
        self.window_ratio = window_ratio
        self.protected_ratio = protected_ratio
        self.adaptive = adaptive
        # hill climber state (fractions of the capacity)
        self._step = STEP
        self._prev_rate: float | None = None
        self._hits = 0
        self._misses = 0
        width = max(4096, 4 * capacity_hint) if capacity_hint else 1 << 16
        self.sketch = TinyLFU(width=width, count_on_admit=False)
        self._q: tuple[OrderedDict[str, None], ...] = (OrderedDict(), OrderedDict(), OrderedDict())
        self._where: dict[str, int] = {}
        self._peak = 0
        self._detached: Detached[int] = Detached(max(DEFAULT_DETACHED, capacity_hint or 0))

    @property
    def capacity(self) -> int:
        return self.capacity_hint if self.capacity_hint is not None else max(1, self._peak)

    @property
    def window_target(self) -> int:
        return max(1, round(self.window_ratio * self.capacity))

    @property
    def protected_target(self) -> int:
        return max(1, int(self.protected_ratio * (self.capacity - self.window_target)))

    def queue_of(self, key: str) -> str | None:
        """'window', 'probation' or 'protected' (for tests and introspection)."""
        q = self._where.get(key)
        return None if q is None else ("window", "probation", "protected")[q]

    def _count(self, hit: bool) -> None:
        """Hill climbing (Caffeine's adaptive window): once per sample of ``capacity``
        events, move the window size in the direction that raised the hit ratio last
        time, or reverse if it fell; steps decay, and restart after a large change."""
        if hit:
            self._hits += 1
        else:
            self._misses += 1
        n = self._hits + self._misses
        if not self.adaptive or n < max(64, self.capacity):
            return
        rate = self._hits / n
        self._hits = self._misses = 0
        if self._prev_rate is None:
            amount = self._step
        else:
            delta = rate - self._prev_rate
            amount = self._step if delta >= 0 else -self._step
            self._step = (
                (STEP if amount >= 0 else -STEP) if abs(delta) >= RESTART else STEP_DECAY * amount
            )
        self._prev_rate = rate
        self.window_ratio = min(MAX_WINDOW, max(0.0, self.window_ratio + amount))

    def _put(self, key: str, q: int) -> None:
        self._q[q][key] = None
        self._where[key] = q

    def _promote(self, key: str) -> None:
        """Probation -> protected; protected overflow goes back to probation."""
        del self._q[PROBATION][key]
        self._put(key, PROTECTED)
        prot = self._q[PROTECTED]
        while len(prot) > self.protected_target:
            old, _ = prot.popitem(last=False)
            self._put(old, PROBATION)

    def on_insert(self, key: str, size: int, info: EntryInfo | None = None) -> None:
        if key in self._where:
            self.on_access(key)
            return
        self._pending = None
        self.sketch.record(key)
        self._count(False)
        q = self._detached.pop(key)
        self._put(key, WINDOW if q is None else q)
        self._peak = max(self._peak, len(self._where))

    def on_access(self, key: str) -> None:
        self._pending = None
        q = self._where.get(key)
        if q is None:
            if key in self._detached:  # read while pinned: the sketch still counts it
                self.sketch.record(key)
            return
        self.sketch.record(key)
        self._count(True)
        if q == PROBATION:
            self._promote(key)
        else:
            self._q[q].move_to_end(key)

    def on_remove(self, key: str) -> None:
        q = self._where.pop(key, None)
        if q is None:
            return
        del self._q[q][key]
        if key != self._pending:
            self._detached.put(key, q)
        self._pending = None

    def victim(self, protected: Set[str] = NOTHING) -> str | None:
        if self._pending is not None and self._pending not in protected:
            return self._pending  # stable until the next insert, read or removal
        window, probation, prot = self._q
        key: str | None
        target = self.window_target
        # Window overflow beyond one candidate moves to probation without a contest: the
        # main part still has room for it (only while the cache first fills up).
        while len(window) > target + 1:
            old, _ = window.popitem(last=False)
            self._put(old, PROBATION)
        cand = first_free(window, protected) if len(window) > target else None
        other = first_free(probation, protected)
        if other is None:
            other = first_free(prot, protected)
        if cand is not None and other is not None:
            if self.sketch.estimate(cand) > self.sketch.estimate(other):
                del window[cand]
                self._put(cand, PROBATION)
                key = other
            else:
                key = cand
        else:
            key = other if other is not None else first_free(window, protected)
        self._pending = key
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)
