"""Admission policies: decide whether a chunk is written into a tier at all."""

from __future__ import annotations

from collections import OrderedDict

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
