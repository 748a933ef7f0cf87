"""Prometheus metrics of the vLLM connector, exported on vLLM's own ``/metrics``.

vLLM runs the connector twice (scheduler side in the engine core, worker side in each
worker), usually in processes other than the API server that serves ``/metrics``, and
without ``PROMETHEUS_MULTIPROC_DIR`` (vLLM sets it only for ``--api-server-count > 1``), so
a collector registered inside the connector would never be scraped. vLLM's connector
stats path carries them instead: each side accumulates a ``TieredCacheConnectorStats``,
vLLM collects it every engine step (``get_kv_connector_stats``: workers' through the model
runner output, then the scheduler's), aggregates and ships it to the API server, where
``TieredCachePromMetrics`` (from ``build_prom_metrics``) records it under vLLM's
``model_name`` and ``engine`` labels. Needs stats logging on (vLLM's default; not with
``--disable-log-stats``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from tiered_cache.api import SOURCES
from tiered_cache.metrics import CONNECTOR_METRICS, CONNECTOR_PREFIX, LATENCY_BUCKETS

PREFIX = CONNECTOR_PREFIX
METRICS = CONNECTOR_METRICS

# Nearest first: a request's load latency is attributed to the farthest tier it touched.


def farthest(tiers: set[str]) -> str:
    known = [t for t in SOURCES if t in tiers]
    return known[-1] if known else (sorted(tiers)[-1] if tiers else "none")


@dataclass
class TieredCacheConnectorStats(KVConnectorStats):
    """One interval's observations, as plain dicts (vLLM serialises them between
    processes): ``{"counters": {name: {label: value}}, "observations": {name: {label:
    [seconds, ...]}}}``; unlabelled metrics use the label ``""``."""

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("observations", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "observations": {}}

    def inc(self, name: str, label: str = "", n: float = 1) -> None:
        c = self.data["counters"].setdefault(name, {})
        c[label] = c.get(label, 0) + n

    def observe(self, name: str, label: str, value: float) -> None:
        self.data["observations"].setdefault(name, {}).setdefault(label, []).append(value)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, by in (other.data.get("counters") or {}).items():
            for label, n in by.items():
                self.inc(name, label, n)
        for name, by in (other.data.get("observations") or {}).items():
            for label, vals in by.items():
                self.data["observations"].setdefault(name, {}).setdefault(label, []).extend(vals)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Flat summary for vLLM's periodic "KV Transfer metrics" log line."""
        out: dict[str, int | float] = {}
        for name, by in self.data["counters"].items():
            for label, n in by.items():
                out[f"{name}[{label}]" if label else name] = n
        for name, by in self.data["observations"].items():
            for label, vals in by.items():
                if vals:
                    key = f"{name}[{label}]" if label else name
                    out[f"{key}_avg_ms"] = round(1000 * sum(vals) / len(vals), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not any(
            self.data["observations"].values()
        )


class StatsRecorder:
    """Thread-safe accumulator (loads run on a loader thread) that hands vLLM one
    ``TieredCacheConnectorStats`` per interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cur = TieredCacheConnectorStats()

    def inc(self, name: str, label: str = "", n: float = 1) -> None:
        if n:
            with self._lock:
                self._cur.inc(name, label, n)

    def observe(self, name: str, label: str, value: float) -> None:
        with self._lock:
            self._cur.observe(name, label, value)

    def take(self) -> TieredCacheConnectorStats | None:
        with self._lock:
            cur, self._cur = self._cur, TieredCacheConnectorStats()
        return None if cur.is_empty() else cur


def _unregister_ours() -> None:
    """Drop our collectors from the default registry: vLLM builds its stat loggers again
    in one process (tests, engine restarts) and only unregisters its own ``vllm:`` ones."""
    from prometheus_client import REGISTRY

    names = getattr(REGISTRY, "_collector_to_names", {})
    for collector, cnames in list(names.items()):
        if any(n.startswith(PREFIX) for n in cnames):
            REGISTRY.unregister(collector)


class TieredCachePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_ours()
        self._metrics: dict[str, Any] = {}
        hist_cls: Any = self._histogram_cls  # typed as the union of metric classes
        for name, (kind, label, doc) in METRICS.items():
            names = self._labelnames + ([label] if label else [])
            if kind == "counter":
                m: Any = self._counter_cls(
                    name=PREFIX + name, documentation=doc, labelnames=names
                )
            else:
                m = hist_cls(
                    name=PREFIX + name, documentation=doc, labelnames=names,
                    buckets=list(LATENCY_BUCKETS),
                )
            self._metrics[name] = m

    def _child(self, name: str, engine_idx: int, label: str) -> Any:
        base = list(self.per_engine_labelvalues.get(engine_idx, []))
        has_label = bool(METRICS[name][1])
        return self._metrics[name].labels(*base, *([label] if has_label else []))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, by in (transfer_stats_data.get("counters") or {}).items():
            if name in METRICS:
                for label, n in by.items():
                    self._child(name, engine_idx, label).inc(n)
        for name, by in (transfer_stats_data.get("observations") or {}).items():
            if name in METRICS:
                for label, vals in by.items():
                    child = self._child(name, engine_idx, label)
                    for v in vals:
                        child.observe(v)
