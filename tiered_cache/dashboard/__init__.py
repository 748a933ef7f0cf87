"""Cluster view for ``tiered-cache stats`` and ``tiered-cache dashboard``.

One ``Collector`` reads everything an operator looks at:

- this node's agent over its unix socket: usage per tier, its Prometheus metrics, pins with
  their residency on this node;
- the directory (Redis when ``redis_url`` is set, else the agent's local one): live nodes
  with their usage per tier, and the hit/miss counters every agent pushes, so hit rates
  cover the whole cluster;
- optionally other agents' ``/metrics`` endpoints (``--scrape URL``), so token, eviction
  and error figures cover them too.

``summarize`` turns one reading into the figures ``stats`` prints. The dashboard keeps a
ring buffer of readings, so its charts show rates over time (like PromQL ``rate()`` over a
short window), and serves them as JSON at ``/api/state`` to a self-contained page (inline
JS and SVG, no external assets).

Hit rate of a tier = chunk reads served by that tier / all chunk reads (hits + misses), so
the per-tier rates add up to the overall hit rate.
"""

from tiered_cache.dashboard.app import PAGE, Dashboard, serve
from tiered_cache.dashboard.figures import (
    History,
    build_state,
    cumulative,
    hit_rates,
    node_rows,
    pin_rows,
    summarize,
)
from tiered_cache.dashboard.sources import (
    ERROR_KINDS,
    Collector,
    Reading,
    parse_exposition,
    parse_flat,
)

__all__ = [
    "ERROR_KINDS",
    "PAGE",
    "Collector",
    "Dashboard",
    "History",
    "Reading",
    "build_state",
    "cumulative",
    "hit_rates",
    "node_rows",
    "parse_exposition",
    "parse_flat",
    "pin_rows",
    "serve",
    "summarize",
]
