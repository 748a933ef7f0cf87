"""Figures from readings: ``summarize`` (what ``tiered-cache stats`` prints), the
``History`` of rates over a sliding window, and ``build_state`` (the page's JSON)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from tiered_cache.dashboard.sources import ERROR_KINDS, Reading, _sum_by, _tier_sort, _total


def cumulative(rd: Reading) -> dict[str, Any]:
    """Counters (monotonic) of one reading, for rates between two readings."""
    hits: dict[str, float] = {}
    misses = 0.0
    if rd.counters_ok:
        for c in rd.counters.values():
            for name, v in c.items():
                tier, _, fam = name.partition(":")
                if fam == "hits":
                    hits[tier] = hits.get(tier, 0.0) + v
                elif fam == "misses":
                    misses += v
        hit_scope = "cluster"
    else:
        hits = _sum_by(rd.samples, "tiered_cache_hits_total", "tier")
        misses = _total(rd.samples, "tiered_cache_misses_total")
        hit_scope = "node"
    return {
        "hits": hits,
        "misses": misses,
        "hit_scope": hit_scope,
        "hit_tokens": _sum_by(rd.samples, "tiered_cache_hit_tokens_total", "tier"),
        "evictions": _sum_by(rd.samples, "tiered_cache_evictions_total", "tier"),
        "errors": {k: _total(rd.samples, f"tiered_cache_{k}_total") for k in ERROR_KINDS},
        # A scraped router's (``--scrape ROUTER/metrics``): split, whole, skip.
        "decisions": _sum_by(rd.samples, "tiered_cache_router_decisions_total", "kind"),
        # Per kind of client (vllm, lmcache_mp, lmcache_plugin): chunks asked for, and
        # those whose load failed.
        "client_loads": _sum_by(rd.samples, "tiered_cache_client_loads_total", "client"),
        "client_load_failures": _sum_by(
            rd.samples, "tiered_cache_client_load_failures_total", "client"
        ),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def hit_rates(hits: Mapping[str, float], misses: float) -> tuple[dict[str, float | None], float]:
    reads = sum(hits.values()) + misses
    rates = {t: _ratio(v, reads) for t, v in hits.items()}
    return rates, (_ratio(sum(hits.values()), reads) or 0.0)


def node_rows(rd: Reading) -> list[dict[str, Any]]:
    nodes = dict(rd.nodes)
    if rd.node_id and rd.usage:
        # This node's own usage is fresher from its agent than from its last heartbeat.
        nodes[rd.node_id] = {**nodes.get(rd.node_id, {"last_seen": rd.t}), "tiers": rd.usage}
    rows = []
    for node in sorted(set(nodes) | set(rd.counters)):
        info = nodes.get(node, {})
        c = rd.counters.get(node, {})
        hits = {k.split(":")[0]: float(v) for k, v in c.items() if k.endswith(":hits")}
        misses = float(sum(v for k, v in c.items() if k.endswith(":misses")))
        per, total = hit_rates(hits, misses)
        seen = info.get("last_seen")
        rows.append(
            {
                "node": node,
                "live": node in nodes,
                "heartbeat_age_s": None if seen is None else max(0.0, rd.t - float(seen)),
                "tiers": info.get("tiers", {}),
                "peer": info.get("peer"),
                "hits": hits,
                "misses": misses,
                "hit_rate": total,
                "hit_rate_by_tier": per,
            }
        )
    return rows


def pin_rows(
    pins: Iterable[Mapping[str, Any]],
    residency: Mapping[str, Mapping[str, str]],
    fleet: Mapping[str, Mapping[str, list[str]]] | None = None,
    now: float | None = None,
) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    rows = []
    for p in pins:
        exp = p.get("expires_at")
        rows.append(
            {
                "id": p["id"],
                "owner": p.get("owner", ""),
                "age_s": round(now - float(p.get("created_at", now))),
                "ttl_left_s": None if exp is None else max(0, round(float(exp) - now)),
                "chunks": len(p["keys"]),
                "tokens": p.get("num_tokens", 0),
                "bytes": (p.get("bytes_per_chunk") or 0) * len(p["keys"]),
                "tiers": list(p["tiers"]),
                "residency": dict(residency.get(p["id"], {})),
                "fleet": dict((fleet or {}).get(p["id"], {})),
                "note": p.get("note", ""),
            }
        )
    return rows


def summarize(rd: Reading) -> dict[str, Any]:
    """What ``tiered-cache stats`` prints (and ``--json`` emits)."""
    cum = cumulative(rd)
    node_hits = _sum_by(rd.samples, "tiered_cache_hits_total", "tier")
    node_misses = _total(rd.samples, "tiered_cache_misses_total")
    per, total = hit_rates(node_hits, node_misses)
    tiers: dict[str, dict[str, Any]] = {}
    names = _tier_sort([*rd.usage, *node_hits])
    ev = _sum_by(rd.samples, "tiered_cache_evictions_total", "tier")
    for t in names:
        u = rd.usage.get(t, {})
        tiers[t] = {
            "hits": node_hits.get(t, 0.0),
            "hit_rate": per.get(t),
            "hit_tokens": cum["hit_tokens"].get(t, 0.0),
            "lookups": _sum_by(rd.samples, "tiered_cache_lookups_total", "tier").get(t, 0.0),
            "read_bytes": _sum_by(rd.samples, "tiered_cache_read_bytes_total", "tier").get(t, 0.0),
            "written_bytes": _sum_by(rd.samples, "tiered_cache_written_bytes_total", "tier").get(
                t, 0.0
            ),
            "evictions": ev.get(t, 0.0),
            "used_bytes": u.get("used_bytes"),
            "capacity_bytes": u.get("capacity_bytes"),
            "chunks": u.get("chunks"),
            "pinned_bytes": u.get("pinned_bytes"),
        }
    c_per, c_total = hit_rates(cum["hits"], cum["misses"]) if rd.counters else ({}, 0.0)
    return {
        "time": rd.t,
        "node_id": rd.node_id,
        "agent_error": rd.agent_error,
        "directory": rd.directory,
        "directory_ok": rd.directory_ok,
        "metric_sources": rd.metric_sources,
        "scrape_errors": rd.scrape_errors,
        "tiers": tiers,
        "misses": node_misses,
        "hit_rate": total,
        "evictions_by_reason": _sum_by(rd.samples, "tiered_cache_evictions_total", "reason"),
        "admission_rejects": _total(rd.samples, "tiered_cache_admission_rejects_total"),
        "errors": cum["errors"],
        "clients": {
            c: {
                "loads": n,
                "load_failures": cum["client_load_failures"].get(c, 0.0),
                "load_failure_rate": _ratio(cum["client_load_failures"].get(c, 0.0), n),
            }
            for c, n in sorted(cum["client_loads"].items())
        },
        "cluster": {
            "hit_rate": c_total,
            "hit_rate_by_tier": c_per,
            "hits": cum["hits"] if rd.counters else {},
            "misses": cum["misses"] if rd.counters else 0.0,
        },
        "nodes": node_rows(rd),
    }


# --------------------------------------------------------------------------- history


class History:
    """Ring buffer of cumulative counters; rates over a sliding window (PromQL-style)."""

    def __init__(self, maxlen: int = 900, window_s: float = 30.0) -> None:
        self.points: deque[tuple[float, dict[str, Any]]] = deque(maxlen=maxlen)
        self.window_s = window_s
        # Series, aligned with self.points (recomputed as points are added).
        self.series: deque[dict[str, Any]] = deque(maxlen=maxlen)

    @staticmethod
    def _delta(new: Mapping[str, float], old: Mapping[str, float]) -> dict[str, float]:
        out = {}
        for k, v in new.items():
            d = v - old.get(k, 0.0)
            out[k] = v if d < 0 else d  # a counter reset (agent restart) restarts at 0
        return out

    def add(self, t: float, cum: dict[str, Any]) -> dict[str, Any]:
        base: dict[str, Any] | None = None
        base_t = t
        for pt, pc in self.points:
            if pt >= t - self.window_s:
                base, base_t = pc, pt
                break
        if base is None and self.points:
            base_t, base = self.points[-1]
        if base is None:  # first reading: counters start at zero with their agent
            base = {"hits": {}, "misses": 0.0, "hit_tokens": {}, "evictions": {}, "errors": {}}
            base_t = t - self.window_s
        self.points.append((t, cum))
        dt = max(1e-9, t - base_t)
        dh = self._delta(cum["hits"], base["hits"])
        dm = cum["misses"] - base["misses"]
        dm = cum["misses"] if dm < 0 else dm
        per, total = hit_rates(dh, dm)
        reads = sum(dh.values()) + dm
        pt_series = {
            "t": t,
            "hit_rate": per,
            "hit_rate_total": total if reads > 0 else None,
            "reads_per_s": reads / dt,
            "evictions_per_s": {
                k: v / dt for k, v in self._delta(cum["evictions"], base["evictions"]).items()
            },
            "errors_per_s": {
                k: v / dt for k, v in self._delta(cum["errors"], base["errors"]).items()
            },
            "decisions_per_s": {
                k: v / dt
                for k, v in self._delta(cum.get("decisions", {}), base.get("decisions", {})).items()
            },
            "load_failure_rate": _failure_rates(cum, base),
        }
        self.series.append(pt_series)
        return pt_series

    def export(self) -> dict[str, Any]:
        pts = list(self.series)
        tiers = _tier_sort({k for p in pts for k in p["hit_rate"]})
        ev_tiers = _tier_sort({k for p in pts for k in p["evictions_per_s"]})
        return {
            "window_s": self.window_s,
            "t": [p["t"] for p in pts],
            "hit_rate": {t: [p["hit_rate"].get(t) for p in pts] for t in tiers},
            "hit_rate_total": [p["hit_rate_total"] for p in pts],
            "reads_per_s": [p["reads_per_s"] for p in pts],
            "evictions_per_s": {
                t: [p["evictions_per_s"].get(t, 0.0) for p in pts] for t in ev_tiers
            },
            "errors_per_s": [sum(p["errors_per_s"].values()) for p in pts],
            "errors_per_s_by_kind": {
                k: [p["errors_per_s"].get(k, 0.0) for p in pts] for k in ERROR_KINDS
            },
            "decisions_per_s": {
                k: [p["decisions_per_s"].get(k, 0.0) for p in pts]
                for k in sorted({k for p in pts for k in p["decisions_per_s"]})
            },
            # Share of each client's chunk loads that failed over the window (None: no
            # loads in it).
            "load_failure_rate": {
                c: [p["load_failure_rate"].get(c) for p in pts]
                for c in sorted({c for p in pts for c in p["load_failure_rate"]})
            },
        }


def _failure_rates(cum: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, float | None]:
    """Per client: failed chunk loads over chunk loads between two readings."""
    loads = History._delta(cum.get("client_loads", {}), base.get("client_loads", {}))
    fails = History._delta(
        cum.get("client_load_failures", {}), base.get("client_load_failures", {})
    )
    return {c: _ratio(fails.get(c, 0.0), n) for c, n in loads.items()}


def build_state(rd: Reading, hist: History, *, started: float) -> dict[str, Any]:
    """The JSON the dashboard page renders."""
    s = summarize(rd)
    cum = cumulative(rd)
    tok = cum["hit_tokens"]
    tok_total = sum(tok.values())
    usage = []
    for row in s["nodes"]:
        for tier in _tier_sort(row["tiers"]):
            u = row["tiers"][tier]
            usage.append(
                {
                    "node": row["node"],
                    "tier": tier,
                    "used_bytes": u.get("used_bytes") or 0,
                    "capacity_bytes": u.get("capacity_bytes"),
                    "pinned_bytes": u.get("pinned_bytes") or 0,
                    "chunks": u.get("chunks") or 0,
                }
            )
    return {
        "updated": rd.t,
        "started": started,
        "node_id": rd.node_id,
        "agent_error": rd.agent_error,
        "directory": rd.directory,
        "directory_ok": rd.directory_ok,
        "hit_scope": cum["hit_scope"],
        "metric_sources": rd.metric_sources,
        "scrape_errors": rd.scrape_errors,
        "series": hist.export(),
        "hit_tokens": {t: tok[t] for t in _tier_sort(tok)},
        "hit_tokens_share": {t: tok[t] / tok_total for t in _tier_sort(tok)} if tok_total else {},
        "usage": usage,
        "pins": pin_rows(rd.pins, rd.residency, rd.fleet, now=rd.t),
        "nodes": s["nodes"],
        "summary": s,
    }
