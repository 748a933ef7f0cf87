"""Pins: which chunks each tier must keep, and the pin budget that bounds them."""

from __future__ import annotations

import time
from collections.abc import Iterable

from policies import EntryInfo
from tiered_cache.directory import Pin
from tiered_cache.events import StoreEvents
from tiered_cache.hierarchy.types import TierSlot


class PinRefused(ValueError):
    """A pin does not fit the pin budget of one of its tiers."""


class PinsMixin:
    """Owns the pin bookkeeping of a ``TieredStore``: the pin set, the keys each tier must
    keep (taken out of the tier's eviction policy while pinned) and the pin budgets."""

    # TieredStore's attributes this part uses.
    slots: list[TierSlot]
    by_name: dict[str, TierSlot]
    events: StoreEvents
    _info: dict[str, EntryInfo]
    _pinned: dict[str, dict[str, set[str]]]  # tier -> key -> ids of pins covering it
    _pins: dict[str, Pin]

    def _is_pinned(self, tier: str, key: str) -> bool:
        return key in self._pinned[tier]

    def pin_budget(self, tier: str) -> int | None:
        slot = self.by_name[tier]
        cap = slot.tier.usage().capacity_bytes
        return None if cap is None else int(cap * slot.pin_budget_fraction)

    def pinned_bytes(self, tier: str) -> int:
        t = self.by_name[tier].tier
        return sum(t.size_of(k) or 0 for k in self._pinned[tier])

    def check_pin(self, pin: Pin, chunk_bytes: int) -> None:
        """Raise PinRefused when ``pin`` would exceed a tier's pin budget on this node."""
        for tier in pin.tiers:
            if tier not in self.by_name:
                continue  # a tier this node does not have: other nodes honour it
            budget = self.pin_budget(tier)
            if budget is None:
                continue
            others = {k for p in self._pins.values() if p.id != pin.id for k in p.keys}
            new = [k for k in pin.keys if k not in others]
            need = self.pinned_bytes_of(tier, others) + len(new) * chunk_bytes
            if need > budget:
                raise PinRefused(
                    f"pin needs {need} B in {tier} but its pin budget is {budget} B "
                    f"({self.by_name[tier].pin_budget_fraction:.0%} of capacity)"
                )

    def pinned_bytes_of(self, tier: str, keys: Iterable[str]) -> int:
        t = self.by_name[tier].tier
        return sum(t.size_of(k) or 0 for k in keys)

    def apply_pins(self, pins: Iterable[Pin]) -> None:
        """Make the pin set current: pinned keys leave their tiers' eviction policies;
        unpinned ones rejoin them."""
        now = time.time()
        self._pins = {p.id: p for p in pins if not p.expired(now)}
        want: dict[str, dict[str, set[str]]] = {s.name: {} for s in self.slots}
        for p in self._pins.values():
            for tier in p.tiers:
                if tier in want:
                    for k in p.keys:
                        want[tier].setdefault(k, set()).add(p.id)
        for slot in self.slots:
            old, new = self._pinned[slot.name], want[slot.name]
            self._pinned[slot.name] = new
            for k in new.keys() - old.keys():
                slot.eviction.on_remove(k)
            for k in old.keys() - new.keys():
                size = slot.tier.size_of(k)
                if size is not None:
                    slot.eviction.on_insert(k, size, self._info.get(k))
            self.events.pinned(slot.name, self.pinned_bytes(slot.name))

    def pinned_keys(self, tier: str) -> set[str]:
        return set(self._pinned[tier])
