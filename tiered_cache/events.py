"""What the tiered store reports as it works, as calls on an observer.

``TieredStore`` says *what happened* (a hit from NVMe, an eviction for capacity, a write
refused by admission); the observer decides what to do with it. ``StoreEvents`` does
nothing, which is what the trace simulator wants; ``MetricsEvents`` turns each event into
the agent's Prometheus series (``tiered_cache.metrics``). Source and tier names are those
of ``tiered_cache.api`` (``dram``, ``nvme``, ``peer``, ``s3``).
"""

from __future__ import annotations

from tiered_cache.metrics import Metrics


class StoreEvents:
    """The events, as no-ops: subclass and override the ones you want."""

    def looked_up(self, source: str) -> None:
        """A lookup found a key's nearest copy in ``source``."""

    def hit(self, source: str, tokens: int, nbytes: int, seconds: float | None = None) -> None:
        """A chunk was read from ``source`` (``seconds``: how long, when timed here)."""

    def miss(self) -> None:
        """A read found the chunk nowhere."""

    def stored(self, tier: str, nbytes: int, seconds: float | None = None) -> None:
        """A chunk landed in ``tier``."""

    def evicted(self, tier: str, reason: str) -> None:
        """A chunk left ``tier`` (reason: capacity, delete)."""

    def refused(self, tier: str) -> None:
        """``tier``'s admission policy declined a chunk."""

    def write_failed(self, tier: str, reason: str) -> None:
        """A write to ``tier`` failed (reason: too_large, full, io)."""

    def read_failed(self, tier: str) -> None:
        """A read from ``tier`` raised."""

    def verify_failed(self, source: str) -> None:
        """A chunk from ``source`` failed verification (it is a miss, never data)."""

    def forged(self, source: str) -> None:
        """A chunk from ``source`` failed its MAC check (a miss, never data)."""

    def dropped(self, reason: str) -> None:
        """A chunk was stored in no tier at all (reason: the most telling refusal)."""

    def estimate(self, source: str, latency_s: float, bandwidth_bps: float) -> None:
        """The expected cost of reading from ``source`` changed."""

    def peer_transfer(self, direction: str) -> None:
        """A chunk crossed between nodes (direction: in, out)."""

    def peer_skipped(self) -> None:
        """A read or lookup passed over a peer whose breaker is open."""

    def absent_skipped(self, n: int) -> None:
        """A lookup answered ``n`` keys missing from a recent miss (no remote query)."""

    def s3_probe_late(self) -> None:
        """A lookup stopped waiting for S3 on a chunk the directory does not list."""

    def usage(self, tier: str, used_bytes: int, capacity_bytes: int | None) -> None:
        """``tier``'s occupancy, as last measured."""

    def tenant_usage(self, tier: str, tenant: str, used_bytes: int, quota: int | None) -> None:
        """Bytes of ``tenant``'s chunks in ``tier`` (``tenancy``), and its quota there."""

    def pinned(self, tier: str, nbytes: int) -> None:
        """Bytes pinned in ``tier``."""

    def background_bytes(self, nbytes: int) -> None:
        """Bytes now held by queued background copies (write-through, promotions)."""

    def background_dropped(self, kind: str, tier: str) -> None:
        """A background copy of ``kind`` (write_through, promotion) to ``tier`` was
        skipped: the byte budget of queued copies was spent."""


class MetricsEvents(StoreEvents):
    """Events as the ``tiered_cache_*`` Prometheus series."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def looked_up(self, source: str) -> None:
        self.m.lookups.labels(source).inc()

    def hit(self, source: str, tokens: int, nbytes: int, seconds: float | None = None) -> None:
        m = self.m
        m.hits.labels(source).inc()
        m.hit_tokens.labels(source).inc(tokens)
        m.bytes_read.labels(source).inc(nbytes)
        if seconds is not None:
            m.load_seconds.labels(source).observe(seconds)

    def miss(self) -> None:
        self.m.misses.labels("all").inc()

    def stored(self, tier: str, nbytes: int, seconds: float | None = None) -> None:
        if seconds is not None:
            self.m.store_seconds.labels(tier).observe(seconds)
        self.m.bytes_written.labels(tier).inc(nbytes)

    def evicted(self, tier: str, reason: str) -> None:
        self.m.evictions.labels(tier, reason).inc()

    def refused(self, tier: str) -> None:
        self.m.admission_rejects.labels(tier).inc()

    def write_failed(self, tier: str, reason: str) -> None:
        self.m.write_errors.labels(tier, reason).inc()

    def read_failed(self, tier: str) -> None:
        self.m.read_errors.labels(tier).inc()

    def verify_failed(self, source: str) -> None:
        self.m.verification_failures.labels(source).inc()

    def forged(self, source: str) -> None:
        self.m.forged_chunks.labels(source).inc()

    def dropped(self, reason: str) -> None:
        self.m.chunks_dropped.labels(reason).inc()

    def estimate(self, source: str, latency_s: float, bandwidth_bps: float) -> None:
        self.m.source_latency.labels(source).set(latency_s)
        self.m.source_bandwidth.labels(source).set(bandwidth_bps)

    def peer_transfer(self, direction: str) -> None:
        self.m.peer_transfers.labels(direction).inc()

    def peer_skipped(self) -> None:
        self.m.peer_fetches_skipped.inc()

    def absent_skipped(self, n: int) -> None:
        self.m.absent_skipped.inc(n)

    def s3_probe_late(self) -> None:
        self.m.s3_probes_late.inc()

    def usage(self, tier: str, used_bytes: int, capacity_bytes: int | None) -> None:
        self.m.used_bytes.labels(tier).set(used_bytes)
        if capacity_bytes is not None:
            self.m.capacity_bytes.labels(tier).set(capacity_bytes)

    def tenant_usage(self, tier: str, tenant: str, used_bytes: int, quota: int | None) -> None:
        self.m.tenant_used_bytes.labels(tier, tenant).set(used_bytes)
        if quota is not None:
            self.m.tenant_quota_bytes.labels(tier, tenant).set(quota)

    def pinned(self, tier: str, nbytes: int) -> None:
        self.m.pinned_bytes.labels(tier).set(nbytes)

    def background_bytes(self, nbytes: int) -> None:
        self.m.background_bytes.set(nbytes)

    def background_dropped(self, kind: str, tier: str) -> None:
        self.m.background_dropped.labels(kind, tier).inc()
