"""Storage tiers: DRAM (shared-memory slot pool), NVMe (files), S3 (object store)."""

from tiered_cache.tiers.base import Tier, TierError, TierFull, TierUsage

__all__ = ["Tier", "TierError", "TierFull", "TierUsage"]
