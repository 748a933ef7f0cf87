"""Admission policies: decide whether a chunk is written into a tier at all."""

from __future__ import annotations

from collections import OrderedDict

import xxhash

from policies.base import AdmissionPolicy


class AlwaysAdmit(AdmissionPolicy):
    name = "always"

    def admit(self, key: str, size: int) -> bool:
        return True


class FrequencyThreshold(AdmissionPolicy):
    """Admit after ``k`` sightings (Dynamo KVBM uses k=2 to spare SSDs).

    Sightings are counted in a bounded LRU table so memory stays O(max_tracked).
    """

    name = "frequency"

    def __init__(self, k: int = 2, max_tracked: int = 1_000_000) -> None:
        if k < 1:
            raise ValueError("frequency admission needs k >= 1")
        self.k = k
        self.max_tracked = max_tracked
        self._seen: OrderedDict[str, int] = OrderedDict()

    def on_access(self, key: str) -> None:
        self._seen[key] = self._seen.get(key, 0) + 1
        self._seen.move_to_end(key)
        if len(self._seen) > self.max_tracked:
            self._seen.popitem(last=False)

    def admit(self, key: str, size: int) -> bool:
        self.on_access(key)
        return self._seen.get(key, 0) >= self.k


_HALVE = bytes(i >> 1 for i in range(256))
_MASK32 = 0xFFFFFFFF


class TinyLFU(AdmissionPolicy):
    """TinyLFU admission (Einziger, Friedman & Manes, ToS'17), O(depth) per operation.

    Frequencies are estimated by a count-min sketch (``depth`` rows of ``width`` 4-bit
    counters, capped at 15) behind a doorkeeper Bloom filter: a key's first sighting in
    a window only sets its doorkeeper bits, later ones increment the sketch, so one-hit
    wonders never reach the sketch. After ``sample_factor * width`` sightings every
    counter is halved and the doorkeeper cleared (the "reset" that ages old history).
    ``estimate(key)`` is the sketch minimum plus one if the doorkeeper has seen the key.

    ``admit(key, size)`` records the sighting (like ``FrequencyThreshold``) and admits
    when ``estimate >= threshold``. A tier that knows which entry it would evict can call
    ``admit_against(key, size, victim)`` instead: TinyLFU's original rule, admit only if
    the newcomer is estimated more frequent than the victim. Hashing is xxh3, so results
    are reproducible across processes.
    """

    name = "tinylfu"

    def __init__(
        self,
        threshold: int = 2,
        width: int = 1 << 16,
        depth: int = 4,
        sample_factor: int = 10,
        doorkeeper: bool = True,
        count_on_admit: bool = True,
    ) -> None:
        if threshold < 1:
            raise ValueError("tinylfu threshold must be >= 1")
        if width < 16 or depth < 1 or sample_factor < 1:
            raise ValueError("tinylfu needs width >= 16, depth >= 1, sample_factor >= 1")
        self.threshold = threshold
        self.width = 1 << (width - 1).bit_length()  # power of two
        self.depth = depth
        self.sample_size = sample_factor * self.width
        self.count_on_admit = count_on_admit
        self._mask = self.width - 1
        self._counters = bytearray(self.depth * self.width)
        self._door_bits = 1 << (8 * self.sample_size - 1).bit_length() if doorkeeper else 0
        self._door = bytearray(self._door_bits // 8) if doorkeeper else None
        self._additions = 0
        self.resets = 0

    def _hashes(self, key: str) -> tuple[int, int]:
        h = xxhash.xxh3_64_intdigest(key.encode())
        return h & _MASK32, (h >> 32) | 1

    def _door_slots(self, h1: int, h2: int) -> list[int]:
        m = self._door_bits - 1
        return [(h2 + i * h1) & m for i in range(3)]

    def _in_door(self, h1: int, h2: int) -> bool:
        door = self._door
        if door is None:
            return False
        return all(door[s >> 3] & (1 << (s & 7)) for s in self._door_slots(h1, h2))

    def _sketch_min(self, h1: int, h2: int) -> int:
        c, w, mask = self._counters, self.width, self._mask
        return min(c[r * w + ((h1 + r * h2) & mask)] for r in range(self.depth))

    def estimate(self, key: str) -> int:
        h1, h2 = self._hashes(key)
        return self._sketch_min(h1, h2) + (1 if self._in_door(h1, h2) else 0)

    def record(self, key: str) -> None:
        h1, h2 = self._hashes(key)
        door = self._door
        if door is not None and not self._in_door(h1, h2):
            for s in self._door_slots(h1, h2):
                door[s >> 3] |= 1 << (s & 7)
        else:
            c, w, mask = self._counters, self.width, self._mask
            for r in range(self.depth):
                i = r * w + ((h1 + r * h2) & mask)
                if c[i] < 15:
                    c[i] += 1
        self._additions += 1
        if self._additions >= self.sample_size:
            self._reset()

    def _reset(self) -> None:
        self._counters = self._counters.translate(_HALVE)
        if self._door is not None:
            self._door = bytearray(len(self._door))
        self._additions //= 2
        self.resets += 1

    def on_access(self, key: str) -> None:
        self.record(key)

    def admit(self, key: str, size: int) -> bool:
        if self.count_on_admit:
            self.record(key)
        return self.estimate(key) >= self.threshold

    def admit_against(self, key: str, size: int, victim: str | None) -> bool:
        """Admit iff ``key`` is estimated more frequent than the would-be ``victim``."""
        if self.count_on_admit:
            self.record(key)
        if victim is None:
            return True
        return self.estimate(key) > self.estimate(victim)
