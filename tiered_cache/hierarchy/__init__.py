"""The tiered store (DRAM -> NVMe -> S3), one module a concern: ``store`` (``TieredStore``:
tiers, eviction, the write path, admin), ``pins``, ``reads`` (the read path), ``remote``
(other nodes' copies), ``slots`` (the DRAM slot protocol, prefetch) and ``types``."""

from tiered_cache.hierarchy.pins import PinRefused
from tiered_cache.hierarchy.slots import MISSED_S
from tiered_cache.hierarchy.store import TieredStore
from tiered_cache.hierarchy.types import Hit, PeerFetch, TierSlot, WriteMode, header_info

__all__ = [
    "MISSED_S",
    "Hit",
    "PeerFetch",
    "PinRefused",
    "TierSlot",
    "TieredStore",
    "WriteMode",
    "header_info",
]
