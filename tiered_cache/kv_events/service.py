"""The agent's KV events: its ``BlockBook`` (which vLLM blocks each chunk holds, which tier
holds each chunk) fed by the store's residency changes and the connectors' descriptions,
and its ``EventPublisher``. Descriptions of resident chunks are saved at stop and taken
back at start, so the start's snapshot names what a warm restart kept."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgpack

from tiered_cache.kv_events.book import BlockBook, Blocks, DescriptionError, tier_media
from tiered_cache.kv_events.publisher import EventPublisher
from tiered_cache.kv_events.wire import KVEvent
from tiered_cache.metrics import Metrics

if TYPE_CHECKING:
    from tiered_cache.config import KVEventsConfig
    from tiered_cache.hierarchy import TieredStore
    from tiered_cache.protocol import Describe

log = logging.getLogger("tiered_cache.kv_events")


class KVEvents:
    """Implements the store's ``Residency``; ``describe`` takes a connector's message."""

    def __init__(
        self,
        cfg: KVEventsConfig,
        node_id: str,
        store: TieredStore,
        state_path: str,
        metrics: Metrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.metrics = metrics or Metrics()
        self.state_path = state_path
        slots = store.slots
        self.book = BlockBook(
            tier_media(node_id, [s.name for s in slots]),
            lambda key: [s.name for s in slots if s.tier.size_of(key) is not None],
            self._emit,
            max_pending=cfg.max_pending_descriptions,
        )
        self.publisher = EventPublisher(
            cfg.endpoint,
            cfg.replay_endpoint,
            lambda: self.book.snapshot([self.topic("")]),
            metrics=self.metrics,
            buffer_steps=cfg.buffer_steps,
            hwm=cfg.hwm,
            batch_events=cfg.batch_events,
            flush_s=cfg.flush_s,
            bind=cfg.bind,
        )

    def topic(self, model: str) -> str:
        return self.cfg.topic.format(node_id=self.node_id, model=model)

    def _emit(self, topic: str, event: KVEvent) -> None:
        self.publisher.emit(topic, event)

    # ------------------------------------------------------------ the store's Residency

    def added(self, tier: str, keys: list[str]) -> None:
        for k in keys:
            self.book.added(tier, k)

    def removed(self, tier: str, keys: list[str]) -> None:
        for k in keys:
            self.book.removed(tier, k)

    def forgot(self, tier: str, key: str) -> None:
        self.book.forgot(tier, key)

    # ------------------------------------------------------------ connectors

    def describe(self, req: Describe) -> int:
        """Record each chunk's blocks; returns how many were refused as inconsistent."""
        n = len(req.keys)
        if not (len(req.hashes) == len(req.parents) == len(req.tokens) == n) or (
            req.extra_keys is not None and len(req.extra_keys) != n
        ):
            raise ValueError("describe: one hashes, parent and tokens entry per key")
        topic = self.topic(req.model)
        refused = 0
        for i, key in enumerate(req.keys):
            extra = req.extra_keys[i] if req.extra_keys is not None else None
            b = Blocks(
                list(req.hashes[i]), req.parents[i], bytes(req.tokens[i]), req.block_size,
                req.lora_id, req.lora_name, extra, topic,
            )  # fmt: skip
            try:
                self.book.describe(key, b)
            except DescriptionError as e:
                refused += 1
                log.debug("refused the description of %s: %s", key, e)
        if refused:
            self.metrics.kv_event_descriptions_refused.inc(refused)
        return refused

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Take the descriptions a previous run saved, then bind and publish the snapshot."""
        saved = _read(self.state_path)
        if saved:
            n = self.book.restore(saved)
            log.info("KV events: %d chunk descriptions kept from the last run", n)
        await self.publisher.start()

    async def close(self) -> None:
        await self.publisher.close()
        _write(self.state_path, self.book.dump())

    @property
    def endpoints(self) -> Sequence[str | None]:
        return (self.publisher.endpoint, self.publisher.replay_address)


def _read(path: str) -> dict[str, list[object]] | None:
    try:
        with open(path, "rb") as f:
            data = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, msgpack.UnpackException) as e:
        log.warning("KV events: ignored unreadable state %s (%s)", path, e)
        return None
    return data if isinstance(data, dict) else None


def _write(path: str, data: dict[str, list[object]]) -> None:
    tmp = f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgpack.packb(data, use_bin_type=True))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("KV events: could not save chunk descriptions to %s (%s)", path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
