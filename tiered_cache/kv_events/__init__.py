"""KV events in vLLM's format for this node's tiers (issue 25): ``wire`` (the structs),
``book`` (chunk -> vLLM blocks, chunk -> tiers), ``publisher`` (ZMQ PUB + replay) and
``service`` (the agent's part, joining them)."""

from tiered_cache.kv_events.book import BlockBook, Blocks, DescriptionError, tier_media
from tiered_cache.kv_events.publisher import EventPublisher
from tiered_cache.kv_events.service import KVEvents

__all__ = ["BlockBook", "Blocks", "DescriptionError", "EventPublisher", "KVEvents", "tier_media"]
