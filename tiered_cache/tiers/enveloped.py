"""A tier that keeps each chunk in an at-rest envelope (``tiered_cache.at_rest``):
compressed, sealed, or both (S3 and NVMe). It wraps another tier (composition: the inner tier stores,
indexes, evicts and accounts the envelope's bytes as it would any chunk's).

Reads give back the chunk's encoded bytes, which the hierarchy verifies as for any tier.
A copy this reader cannot open is never handed on as data:

- sealed under a key it does not hold or has retired, plaintext where it seals every
  chunk, or failing its AES-GCM tag: a miss (``None``), the copy left in place. Damage
  fails the stored bytes' checksum first, so a tag that fails on intact bytes means
  another master key under the same id (a misconfigured node) or a forgery; deleting
  would let one misconfigured reader empty a shared bucket of good copies;
- damaged: the stored bytes are returned as they are, so the hierarchy's own
  verification fails on them and removes the copy, as for any damaged chunk.

A copy of an envelope version or codec this release does not know is a miss too
("unknown"), so a rolling upgrade deletes nothing from a shared bucket. On a node's own
disk (NVMe) a copy it cannot open is handed on unopened and so removed: nobody else reads
that disk, and a copy left there would keep the key from ever being stored again.

Either way the reason is counted in ``unopened`` ("key", "plain", "unknown", "tag",
"damaged") and
in ``tiered_cache_at_rest_unopened_total{tier, reason}``; ``at_rest_bytes_total{form}``
counts the bytes written before and after the envelope (the codec's ratio). Wrapping and unwrapping run in a
thread: zstd and AES-GCM take milliseconds per chunk, too long for the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence, Set
from typing import Any

from tiered_cache import codec
from tiered_cache.at_rest import (
    HEADER_SIZE,
    TAG_SIZE,
    AtRest,
    EnvelopeUnknown,
    KeyUnavailable,
    PlainRefused,
)
from tiered_cache.logthrottle import LogThrottle
from tiered_cache.metrics import Metrics
from tiered_cache.tiers.base import Tier, TierUsage

log = logging.getLogger(__name__)
_THROTTLE = LogThrottle(log)
#: Below this many bytes a chunk is (un)wrapped inline: a thread hop costs more.
_INLINE_BYTES = 64 * 1024


class EnvelopedTier(Tier):
    stores_chunks_as_is = False  # envelopes: sizes and bytes are not the chunk's

    def __init__(self, inner: Tier, at_rest: AtRest, metrics: Metrics | None = None,
                 *, shared: bool | None = None) -> None:  # fmt: skip
        if not at_rest.active:
            raise ValueError("an EnvelopedTier needs a codec or keys (else use the tier)")
        self.inner = inner
        self.at_rest = at_rest
        self.name = inner.name
        self.counts_write_errors = inner.counts_write_errors
        #: reason -> copies read but not opened (also ``at_rest_unopened_total``)
        self.unopened: Counter[str] = Counter()
        self._metrics = metrics
        #: Whether other nodes read the inner tier (S3): then a copy this node cannot open
        #: stays for one that can. A node's own disk drops it, or the key could never be
        #: stored there again (the tier would keep answering "held").
        self.shared = inner.name == "s3" if shared is None else shared

    def __repr__(self) -> str:
        sealed = self.at_rest.keys is not None
        return f"EnvelopedTier({self.inner!r}, codec={self.at_rest.codec}, sealed={sealed})"

    # the store sets this on the tier it holds: it belongs to the inner one
    @property
    def on_forget(self) -> Callable[[str], None] | None:
        return self.inner.on_forget

    @on_forget.setter
    def on_forget(self, fn: Callable[[str], None] | None) -> None:
        self.inner.on_forget = fn

    def __getattr__(self, attr: str) -> Any:  # the inner tier's own (S3's counters, ...)
        return getattr(self.inner, attr)

    async def _run(self, fn: Callable[[Any], Any], buf: Any) -> Any:
        if memoryview(buf).nbytes < _INLINE_BYTES:
            return fn(buf)
        return await asyncio.to_thread(fn, buf)

    async def get(self, key: str) -> bytes | bytearray | None:
        stored = await self.inner.get(key)
        if stored is None:
            return None
        try:
            plain = await self._run(self.at_rest.unwrap, stored)
        except (KeyUnavailable, PlainRefused, EnvelopeUnknown, codec.ChunkForged) as e:
            reason = ("key" if isinstance(e, KeyUnavailable)
                      else "plain" if isinstance(e, PlainRefused)
                      else "unknown" if isinstance(e, EnvelopeUnknown) else "tag")  # fmt: skip
            self._unopened(reason)
            _THROTTLE.log((self.name, reason), logging.WARNING,
                          "%s copy of %s not opened here: %s", self.name, key, e)  # fmt: skip
            # on this node's own disk: handed on unopened, so the hierarchy removes it
            return None if self.shared else stored
        except Exception as e:  # whatever the stored bytes do: a miss, never an error
            self._unopened("damaged")
            _THROTTLE.log((self.name, "damaged"), logging.WARNING,
                          "%s envelope of %s: %s", self.name, key, e)  # fmt: skip
            return stored  # fails the hierarchy's verification, which removes the copy
        return plain if isinstance(plain, bytes | bytearray) else bytes(plain)

    def _unopened(self, reason: str) -> None:
        self.unopened[reason] += 1
        if self._metrics is not None:
            self._metrics.at_rest_unopened.labels(tier=self.name, reason=reason).inc()

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        stored = await self._run(self.at_rest.wrap, data)
        await self.inner.put(key, stored)
        if self._metrics is not None:
            raw = memoryview(data).nbytes
            self._metrics.at_rest_bytes.labels(tier=self.name, form="raw").inc(raw)
            self._metrics.at_rest_bytes.labels(tier=self.name, form="stored").inc(len(stored))

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.contains_many(keys)

    async def longest_prefix(self, keys: Sequence[str]) -> int:
        return await self.inner.longest_prefix(keys)

    async def delete(self, key: str) -> bool:
        return await self.inner.delete(key)

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def entries(self) -> Iterator[tuple[str, int]]:
        return self.inner.entries()

    def size_of(self, key: str) -> int | None:
        return self.inner.size_of(key)

    @staticmethod
    def stored_bound(nbytes: int) -> int:
        """The most a chunk of ``nbytes`` may take stored: the envelope, the tag, and what
        zstd adds to bytes it cannot compress (under 1/128)."""
        return nbytes + HEADER_SIZE + TAG_SIZE + (nbytes >> 7) + 64

    def fits(self, nbytes: int) -> bool:
        return self.inner.fits(self.stored_bound(nbytes))

    def has_room(self, nbytes: int) -> bool:
        return self.inner.has_room(self.stored_bound(nbytes))

    async def put_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """Defined, so ``__getattr__`` never hands the inner tier's (which stores plain
        bytes) to a caller."""
        await self.put(key, b"".join(parts))

    def take_recovered(self) -> dict[str, tuple[str, int, str]]:
        return self.inner.take_recovered()

    def leased(self) -> Set[str]:
        return self.inner.leased()

    async def open(self) -> None:
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()
