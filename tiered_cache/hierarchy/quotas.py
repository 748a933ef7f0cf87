"""Tenants' quotas in the tiered store (``tenancy``): what a quota eviction may pick, the
check after a chunk whose tenant was known only once stored, and the per-tenant gauges.
The quota itself is applied by ``TieredStore._make_room``, with the tier's capacity."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tiered_cache.events import StoreEvents
from tiered_cache.hierarchy.types import TierSlot
from tiered_cache.tenancy import TenantBook
from tiered_cache.tiers.base import TierFull

log = logging.getLogger("tiered_cache.hierarchy")  # one logger for the package, as before


class QuotasMixin:
    # TieredStore's attributes this part uses.
    tenants: TenantBook
    events: StoreEvents
    _locks: dict[str, asyncio.Lock]
    _tenants_seen: set[str]

    if TYPE_CHECKING:  # defined by TieredStore

        async def _make_room(
            self, slot: TierSlot, nbytes: int, tenant: str = ""
        ) -> Callable[[], Awaitable[object]] | None: ...

    def _not_of(self, slot: TierSlot, tenant: str) -> set[str]:
        """What a quota eviction of ``tenant`` in ``slot`` must step over: every chunk of
        another tenant (or none), and any a reader holds. Built per eviction: O(chunks in
        the tier), paid only by a tenant at its quota."""
        leased = slot.tier.leased()
        owner = self.tenants.owner
        return {k for k, _ in slot.tier.entries() if k in leased or owner(slot.name, k) != tenant}

    async def _enforce_quota(self, slot: TierSlot, tenant: str) -> None:
        """Bring ``tenant`` back within its quota in ``slot`` after a chunk whose tenant
        was known only once stored (a client-filled DRAM slot) took it over."""
        while self.tenants.over(slot.name, tenant, 0):
            async with self._locks[slot.name]:
                try:
                    pending = await self._make_room(slot, 0, tenant)
                except TierFull as e:  # over until a reader lets go: the next put evicts
                    log.debug("%s", e)
                    return
            if pending is None:
                return
            await pending()

    def _report_tenants(self) -> None:
        """Each tenant's bytes and quota per tier, to the gauges. Tenants seen before stay
        reported (at 0 once they hold nothing): no stale series."""
        self._tenants_seen.update(self.tenants.tenants())
        for tenant in sorted(self._tenants_seen):
            for tier, tu in self.tenants.usage(tenant).items():
                self.events.tenant_usage(tier, tenant, tu["used_bytes"] or 0, tu["quota_bytes"])
