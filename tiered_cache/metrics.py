"""Prometheus metrics (``tiered_cache_*``, base units, ``_total`` counters).

Each store/agent/connector owns a ``Metrics`` with its own registry so tests and several
in-process components never collide; the agent exposes its registry on ``/metrics``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LATENCY_BUCKETS = _LAT_BUCKETS  # shared with the vLLM connector's histograms

# The vLLM connector's metrics, exported through vLLM (``connectors.vllm_metrics``):
# name without prefix (and counters without "_total") -> (kind, label or "", help).
CONNECTOR_PREFIX = "tiered_cache_connector_"
CONNECTOR_METRICS: dict[str, tuple[str, str, str]] = {
    "lookups": (
        "counter", "result",
        "Requests whose prompt prefix was looked up in the cache (result: hit, miss)",
    ),
    "hit_tokens": (
        "counter", "tier",
        "Prompt tokens loaded from the cache instead of prefilled, by the tier that served them",
    ),
    "loaded_chunks": ("counter", "tier", "Chunks loaded into vLLM's KV cache, by serving tier"),
    "loaded_bytes": ("counter", "tier", "Chunk payload bytes loaded, by serving tier"),
    "stored_chunks": ("counter", "", "Chunks copied out of vLLM's KV cache into the cache"),
    "stored_bytes": ("counter", "", "Chunk payload bytes stored"),
    "recompute_fallbacks": (
        "counter", "reason",
        "Requests that recompute KV they expected from the cache (reason: missing, "
        "verification, layout_mismatch, copy_error, load_error, deadline, fetch_deadline, "
        "unavailable)",
    ),
    "fetch_decisions": (
        "counter", "decision",
        "Fetch-or-recompute choices for requests with cached chunks (decision: load, all "
        "found chunks; prefix, a cheaper prefix; recompute, none)",
    ),
    "saves_skipped": (
        "counter", "reason",
        "Chunks not saved (reason: unavailable, the node agent was down; window, a sliding "
        "window had freed their blocks before they could be copied)",
    ),
    "layout_mismatches": (
        "counter", "",
        "Requests that found chunks of another KV layout, dtype, block size or fingerprint",
    ),
    "store_errors": ("counter", "op", "Cache calls that raised (op: lookup, load, save)"),
    "load_seconds": (
        "histogram", "tier",
        "Time to load one request's chunks, by the farthest tier that served any of them",
    ),
    "store_seconds": (
        "histogram", "", "Time an engine step spends handing its chunks to the cache",
    ),
}  # fmt: skip


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "tiered_cache_"
        self.lookups = Counter(p + "lookups", "Chunk lookups", ["tier"], registry=r)
        self.hits = Counter(p + "hits", "Chunk hits", ["tier"], registry=r)
        self.misses = Counter(p + "misses", "Chunk misses", ["tier"], registry=r)
        self.hit_tokens = Counter(
            p + "hit_tokens", "Tokens served from a tier", ["tier"], registry=r
        )
        self.bytes_read = Counter(p + "read_bytes", "Bytes read", ["tier"], registry=r)
        self.bytes_written = Counter(p + "written_bytes", "Bytes written", ["tier"], registry=r)
        self.load_seconds = Histogram(
            p + "load_seconds", "Chunk load latency", ["tier"], buckets=_LAT_BUCKETS, registry=r
        )
        self.store_seconds = Histogram(
            p + "store_seconds", "Chunk store latency", ["tier"], buckets=_LAT_BUCKETS, registry=r
        )
        self.evictions = Counter(p + "evictions", "Chunks evicted", ["tier", "reason"], registry=r)
        self.admission_rejects = Counter(
            p + "admission_rejects", "Writes refused by admission", ["tier"], registry=r
        )
        self.write_errors = Counter(
            p + "write_errors", "Writes that failed (full, I/O)", ["tier", "reason"], registry=r
        )
        self.chunks_dropped = Counter(
            p + "chunks_dropped",
            "Chunks a put could store in no tier (reason: io, full, too_large, refused)",
            ["reason"],
            registry=r,
        )
        self.background_bytes = Gauge(
            p + "background_bytes",
            "Bytes held by queued background copies (write-through, promotions)",
            registry=r,
        )
        self.background_dropped = Counter(
            p + "background_dropped",
            "Background copies skipped: their byte budget was spent (kind: write_through, "
            "promotion)",
            ["kind", "tier"],
            registry=r,
        )
        self.read_errors = Counter(
            p + "read_errors", "Reads that failed (I/O)", ["tier"], registry=r
        )
        self.absent_skipped = Counter(
            p + "absent_skipped",
            "Keys a lookup answered missing from a recent miss, without asking the "
            "directory or S3 again",
            registry=r,
        )
        self.s3_probes_late = Counter(
            p + "s3_probes_late",
            "Lookups that stopped waiting for S3 to confirm a chunk the directory does not "
            "list (counted as a miss)",
            registry=r,
        )
        self.verification_failures = Counter(
            p + "verification_failures", "Chunks that failed verification", ["tier"], registry=r
        )
        self.forged_chunks = Counter(
            p + "forged_chunks",
            "Chunks refused for a missing or wrong MAC (tier: nvme, s3, peer)",
            ["tier"],
            registry=r,
        )
        self.at_rest_unopened = Counter(
            p + "at_rest_unopened",
            "Enveloped copies read but not opened (reason: key, plain, tag, damaged)",
            ["tier", "reason"],
            registry=r,
        )
        self.at_rest_bytes = Counter(
            p + "at_rest_bytes",
            "Bytes of chunks enveloped for writes, before (form=raw) and after (form=stored)",
            ["tier", "form"],
            registry=r,
        )
        self.pinned_bytes = Gauge(p + "pinned_bytes", "Pinned bytes", ["tier"], registry=r)
        self.used_bytes = Gauge(p + "used_bytes", "Bytes used", ["tier"], registry=r)
        self.capacity_bytes = Gauge(p + "capacity_bytes", "Capacity", ["tier"], registry=r)
        self.tenant_used_bytes = Gauge(
            p + "tenant_used_bytes", "Bytes of a tenant's chunks", ["tier", "tenant"], registry=r
        )
        self.tenant_quota_bytes = Gauge(
            p + "tenant_quota_bytes", "A tenant's quota", ["tier", "tenant"], registry=r
        )
        self.directory_errors = Counter(
            p + "directory_errors", "Directory operations that failed", ["op"], registry=r
        )
        self.directory_dropped_updates = Counter(
            p + "directory_dropped_updates", "Directory updates dropped", registry=r
        )
        self.recompute_fallbacks = Counter(
            p + "recompute_fallbacks", "Loads that fell back to recompute", ["reason"], registry=r
        )
        self.peer_transfers = Counter(
            p + "peer_transfers", "Chunks moved between nodes", ["direction"], registry=r
        )
        self.peer_connections_closed = Counter(
            p + "peer_connections_closed",
            "Peer-port connections the agent closed (reason: auth_failed, handshake_timeout, "
            "over_cap, frame_too_large, bad_frame, idle_timeout)",
            ["reason"],
            registry=r,
        )
        self.peer_fetches_skipped = Counter(
            p + "peer_fetches_skipped",
            "Reads and lookups that skipped a peer whose breaker is open (it failed or hung)",
            registry=r,
        )
        self.s3_retries = Counter(p + "s3_retries", "S3 requests retried", registry=r)
        # What the read path believes each source costs (tiered_cache.estimates).
        self.source_latency = Gauge(
            p + "source_latency_seconds", "Estimated per-chunk latency of a source",
            ["source"], registry=r,
        )
        self.source_bandwidth = Gauge(
            p + "source_bandwidth_bytes_per_second", "Estimated bandwidth of a source",
            ["source"], registry=r,
        )
        # KV events (tiered_cache.kv_events): what routers learn of this node's tiers.
        self.kv_events = Counter(
            p + "kv_events", "KV events published (type: BlockStored, BlockRemoved, "
            "AllBlocksCleared)", ["type"], registry=r,
        )
        self.kv_event_batches = Counter(
            p + "kv_event_batches", "KV event batches published", registry=r
        )
        self.kv_event_replays = Counter(
            p + "kv_event_replays", "Replay requests (result: replayed, the buffered batches; "
            "snapshot, older than the buffer: the whole state; refused, malformed)",
            ["result"], registry=r,
        )
        self.kv_event_descriptions_refused = Counter(
            p + "kv_event_descriptions_refused",
            "Chunk descriptions refused as inconsistent (wrong token count, too many blocks)",
            registry=r,
        )

    def value(self, name: str, **labels: str) -> float:
        """Current sample value (for tests and the CLI); 0 when never set."""
        v = self.registry.get_sample_value(name, labels or None)
        return float(v) if v is not None else 0.0
