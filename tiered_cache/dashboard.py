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

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tiered_cache.api import SOURCES
from tiered_cache.config import CacheConfig
from tiered_cache.ipc import IPCError
from tiered_cache.protocol import Counters, Nodes, PinLs, Stats, agent_call

log = logging.getLogger(__name__)

ERROR_KINDS = (
    "verification_failures",
    "read_errors",
    "write_errors",
    "directory_errors",
    "recompute_fallbacks",
)
_FLAT_RE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?$")


# --------------------------------------------------------------------------- sources


def parse_flat(key: str) -> tuple[str, dict[str, str]]:
    """``name{a=x,b=y}`` (the agent's ``stats`` summary keys) -> (name, labels)."""
    m = _FLAT_RE.match(key)
    if not m:
        return key, {}
    labels: dict[str, str] = {}
    for part in (m.group(2) or "").split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            labels[k] = v.strip('"')
    return m.group(1), labels


def parse_exposition(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition (buckets and ``_created`` dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: list[tuple[str, dict[str, str], float]] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            out.append((s.name, dict(s.labels), float(s.value)))
    return out


def _sum_by(
    samples: Iterable[tuple[str, dict[str, str], float]], name: str, label: str | None
) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, labels, v in samples:
        if n != name:
            continue
        k = labels.get(label, "") if label else ""
        out[k] = out.get(k, 0.0) + v
    return out


def _total(samples: Iterable[tuple[str, dict[str, str], float]], name: str) -> float:
    return sum(_sum_by(samples, name, None).values())


def _tier_sort(names: Iterable[str]) -> list[str]:
    return sorted(set(names), key=lambda t: (SOURCES.index(t) if t in SOURCES else 99, t))


@dataclass
class Reading:
    """One look at the cluster."""

    t: float
    node_id: str | None = None
    agent_error: str | None = None
    usage: dict[str, dict[str, Any]] = field(default_factory=dict)  # this node, per tier
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)
    metric_sources: list[str] = field(default_factory=list)
    scrape_errors: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    # The directory's counters were read (even if still empty): hit rates then come from
    # them alone, so a chart never mixes them with one agent's own metrics.
    counters_ok: bool = False
    pins: list[dict[str, Any]] = field(default_factory=list)
    residency: dict[str, dict[str, str]] = field(default_factory=dict)
    fleet: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    directory: str = "local"
    directory_ok: bool = True


class Collector:
    """Reads the agent, the directory and scraped agents; see the module docstring."""

    def __init__(
        self,
        cfg: CacheConfig,
        *,
        scrape: Iterable[str] = (),
        use_agent: bool = True,
        fleet_residency: bool = True,
    ) -> None:
        self.cfg = cfg
        self.scrape = list(scrape)
        self.use_agent = use_agent
        self.fleet_residency = fleet_residency
        self._dir: Any = None
        self._http: Any = None

    async def _directory(self) -> Any:
        if self._dir is None and self.cfg.redis_url:
            from tiered_cache.directory import RedisDirectory

            self._dir = RedisDirectory.from_url(self.cfg.redis_url)
        return self._dir

    async def check_directory(self) -> None:
        """Raise ``DirectoryUnavailable`` (URL without password) when Redis is down."""
        d = await self._directory()
        if d is not None:
            await d.check()

    async def _scrape(self, url: str) -> list[tuple[str, dict[str, str], float]]:
        import aiohttp

        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3))
        async with self._http.get(url) as resp:
            resp.raise_for_status()
            return parse_exposition(await resp.text())

    async def read(self) -> Reading:
        rd = Reading(t=time.time())
        if self.use_agent:
            sock = self.cfg.socket_path
            try:
                st = await agent_call(sock, Stats())
                rd.node_id = st["node_id"]
                rd.usage = st["usage"]
                for k, v in st["metrics"].items():
                    name, labels = parse_flat(k)
                    rd.samples.append((name, labels, float(v)))
                rd.metric_sources.append(f"agent {rd.node_id} ({sock})")
                pl = await agent_call(sock, PinLs())
                rd.pins = list(pl["pins"])
                rd.residency = dict(pl["residency"])
            except IPCError as e:
                rd.agent_error = str(e)
        for url in self.scrape:
            try:
                rd.samples.extend(await self._scrape(url))
                rd.metric_sources.append(url)
            except Exception as e:
                rd.scrape_errors[url] = f"{type(e).__name__}: {e}"
        d = await self._directory()
        if d is not None:
            rd.directory = d.url
            rd.nodes = await d.nodes()
            rd.counters = await d.counters()
            rd.counters_ok = True
            if not rd.pins and rd.agent_error is not None:
                rd.pins = [p.model_dump() for p in await d.list_pins()]
            if self.fleet_residency and rd.pins:
                rd.fleet = await self._fleet(d, rd.pins)
            rd.directory_ok = not d.degraded
        elif rd.agent_error is None:
            try:
                rd.nodes = (await agent_call(self.cfg.socket_path, Nodes()))["nodes"]
                rd.counters = (await agent_call(self.cfg.socket_path, Counters()))[
                    "counters"
                ]
                rd.counters_ok = True
            except IPCError as e:  # an agent older than these ops: no cluster view
                log.debug("agent has no nodes/counters ops: %s", e)
        return rd

    @staticmethod
    async def _fleet(d: Any, pins: list[dict[str, Any]]) -> dict[str, dict[str, list[str]]]:
        """Per pin and tier: the nodes holding every chunk of the pin there."""
        out: dict[str, dict[str, list[str]]] = {}
        for p in pins:
            keys = p["keys"]
            locs = await d.locate(keys)
            per: dict[str, list[str]] = {}
            for tier in p["tiers"]:
                holders: set[str] | None = None
                for ls in locs:
                    here = {x.node_id for x in ls if x.tier == tier}
                    if tier == "s3" and here:
                        here = {"shared"}  # S3 is one store for the fleet
                    holders = here if holders is None else holders & here
                per[tier] = sorted(holders or ())
            out[p["id"]] = per
        return out

    async def close(self) -> None:
        if self._dir is not None:
            await self._dir.close()
            self._dir = None
        if self._http is not None:
            await self._http.close()
            self._http = None


# --------------------------------------------------------------------------- figures


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
        }


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


# --------------------------------------------------------------------------- server


class Dashboard:
    def __init__(
        self,
        collector: Collector,
        *,
        interval_s: float = 1.0,
        history: int = 900,
        window_s: float = 30.0,
    ) -> None:
        self.collector = collector
        self.interval_s = interval_s
        self.hist = History(history, window_s)
        self.started = time.time()
        self.state: dict[str, Any] = {"updated": None, "error": "no reading yet"}
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> None:
        rd = await self.collector.read()
        self.hist.add(rd.t, cumulative(rd))
        self.state = build_state(rd, self.hist, started=self.started)

    async def _loop(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception as e:
                log.exception("dashboard reading failed")
                self.state = {**self.state, "error": f"{type(e).__name__}: {e}"}
            await asyncio.sleep(self.interval_s)

    def app(self) -> Any:
        from aiohttp import web

        async def index(_: web.Request) -> web.Response:
            return web.Response(text=PAGE, content_type="text/html", charset="utf-8")

        async def state(_: web.Request) -> web.Response:
            return web.Response(
                text=json.dumps(self.state, default=str),
                content_type="application/json",
                headers={"Cache-Control": "no-store"},
            )

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok\n")

        async def on_startup(_: web.Application) -> None:
            self._task = asyncio.ensure_future(self._loop())

        async def on_cleanup(_: web.Application) -> None:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            await self.collector.close()

        app = web.Application()
        app.router.add_get("/", index)
        app.router.add_get("/api/state", state)
        app.router.add_get("/healthz", healthz)
        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app


def serve(dash: Dashboard, host: str, port: int) -> None:
    from aiohttp import web

    web.run_app(dash.app(), host=host, port=port, print=None, handle_signals=True)


# --------------------------------------------------------------------------- page

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tiered-cache</title>
<style>
:root { --bg:#f6f7f9; --card:#fff; --ink:#1d2330; --mute:#6b7385; --line:#e3e6ec;
  --dram:#2563eb; --nvme:#16a34a; --s3:#d97706; --peer:#9333ea; --all:#111827; --err:#dc2626; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  background:var(--bg); color:var(--ink); }
header { display:flex; align-items:baseline; gap:16px; padding:14px 20px; background:#111827;
  color:#f9fafb; }
header h1 { font-size:18px; margin:0; }
header .meta { color:#cbd5e1; font-size:12px; }
.pill { display:inline-block; padding:1px 8px; border-radius:10px; font-size:12px;
  background:#334155; color:#e2e8f0; margin-left:6px; }
.pill.ok { background:#166534; } .pill.bad { background:#991b1b; }
main { display:grid; grid-template-columns:repeat(12, 1fr); gap:14px; padding:14px 20px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:12px 14px; min-width:0; }
.card h2 { font-size:13px; margin:0 0 8px; color:var(--mute); font-weight:600;
  text-transform:uppercase; letter-spacing:.04em; }
.w3 { grid-column:span 3; } .w4 { grid-column:span 4; } .w5 { grid-column:span 5; }
.w6 { grid-column:span 6; } .w7 { grid-column:span 7; } .w8 { grid-column:span 8; }
.w12 { grid-column:span 12; }
.kpi .v { font-size:26px; font-weight:600; } .kpi .s { color:var(--mute); font-size:12px; }
svg text { font-size:11px; fill:var(--mute); }
.legend { display:flex; gap:12px; flex-wrap:wrap; font-size:12px; margin-top:4px; }
.legend i { display:inline-block; width:10px; height:10px; border-radius:2px;
  margin-right:4px; vertical-align:-1px; }
table { width:100%; border-collapse:collapse; font-size:13px; }
th, td { text-align:left; padding:5px 6px; border-bottom:1px solid var(--line);
  white-space:nowrap; }
th { color:var(--mute); font-weight:600; font-size:12px; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; }
.badge { display:inline-block; padding:0 6px; border-radius:4px; font-size:12px;
  margin-right:4px; }
.badge.resident { background:#dcfce7; color:#166534; }
.badge.pending { background:#fef9c3; color:#854d0e; }
.badge.missing { background:#fee2e2; color:#991b1b; }
.badge.na { background:#e5e7eb; color:#374151; }
.bar { position:relative; height:16px; background:#eef0f4; border-radius:3px;
  overflow:hidden; }
.bar .u { position:absolute; left:0; top:0; bottom:0; }
.bar .p { position:absolute; left:0; top:0; bottom:0; background:repeating-linear-gradient(
  45deg, rgba(0,0,0,.35) 0 3px, transparent 3px 6px); }
.empty { color:var(--mute); font-style:italic; }
.err { color:var(--err); }
</style>
</head>
<body>
<header>
  <h1>tiered-cache</h1>
  <span class="meta" id="meta">loading…</span>
  <span id="pills"></span>
</header>
<main>
  <div class="card kpi w3"><h2>Hit rate (window)</h2><div class="v" id="k-hit">–</div>
    <div class="s" id="k-hit-s"></div></div>
  <div class="card kpi w3"><h2>TTFT-saving tokens</h2><div class="v" id="k-tok">–</div>
    <div class="s" id="k-tok-s"></div></div>
  <div class="card kpi w3"><h2>Evictions / s</h2><div class="v" id="k-ev">–</div>
    <div class="s" id="k-ev-s"></div></div>
  <div class="card kpi w3"><h2>Errors / s</h2><div class="v" id="k-err">–</div>
    <div class="s" id="k-err-s"></div></div>

  <div class="card w8"><h2>Hit rate per tier over time</h2>
    <svg id="c-hit" width="100%" height="240"></svg><div class="legend" id="l-hit"></div></div>
  <div class="card w4"><h2>Share of TTFT-saving tokens by tier</h2>
    <svg id="c-tok" width="100%" height="240"></svg></div>

  <div class="card w6"><h2>Usage against capacity, per node and tier</h2>
    <div id="c-usage"></div></div>
  <div class="card w6"><h2>Eviction and error rates</h2>
    <svg id="c-rates" width="100%" height="200"></svg><div class="legend" id="l-rates"></div></div>

  <div class="card w12"><h2>Pinned prefixes and their residency</h2><div id="t-pins"></div></div>
  <div class="card w12"><h2>Nodes</h2><div id="t-nodes"></div></div>
</main>
<script>
"use strict";
const COLORS = {dram:"#2563eb", nvme:"#16a34a", s3:"#d97706", peer:"#9333ea", total:"#111827",
  evictions:"#2563eb", errors:"#dc2626"};
const color = (k, i) => COLORS[k] || COLORS[String(k).split(" ").pop()] ||
  ["#0891b2","#be185d","#4d7c0f","#7c3aed"][i % 4];
// Round an axis maximum up to 1, 2 or 5 times a power of ten.
function niceMax(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v))), f = v / p;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
}
const NS = "http://www.w3.org/2000/svg";
window.__tcCharts = {};

function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}
function esc(s) { return String(s ?? "").replace(/[&<>"']/g,
  c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}[c])); }
function fmtBytes(n) {
  if (n === null || n === undefined) return "∞";
  const u = ["B","KiB","MiB","GiB","TiB","PiB"]; let i = 0; n = +n;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n.toFixed(0)) + " " + u[i];
}
function fmtNum(n) {
  n = +n; if (n >= 1e9) return (n/1e9).toFixed(1)+"G"; if (n >= 1e6) return (n/1e6).toFixed(1)+"M";
  if (n >= 1e4) return (n/1e3).toFixed(1)+"k"; return Number.isInteger(n) ? String(n) : n.toFixed(2);
}
function fmtDur(s) {
  if (s === null || s === undefined) return "none"; s = Math.round(s);
  if (s < 120) return s + "s"; if (s < 7200) return Math.round(s/60) + "m";
  if (s < 172800) return (s/3600).toFixed(1) + "h"; return (s/86400).toFixed(1) + "d";
}
const pct = v => v === null || v === undefined ? "–" : (100*v).toFixed(1) + "%";

// A line chart: series = {name: [y|null,...]}, xs = epoch seconds.
function lineChart(svg, xs, series, opt) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = svg.clientWidth || 600, H = svg.clientHeight || 220;
  const m = {l: 48, r: 10, t: 8, b: 22}, w = W - m.l - m.r, h = H - m.t - m.b;
  const vals = Object.values(series).flat().filter(v => v !== null && v !== undefined);
  let ymax = opt.ymax !== undefined ? opt.ymax : niceMax(Math.max(1e-9, ...vals) * 1.05);
  if (!isFinite(ymax) || ymax <= 1e-6) ymax = 1;
  const x0 = xs.length ? xs[0] : 0, x1 = xs.length ? xs[xs.length-1] : 1;
  const X = t => m.l + (x1 > x0 ? (t - x0) / (x1 - x0) : 1) * w;
  const Y = v => m.t + h - (v / ymax) * h;
  for (let i = 0; i <= 4; i++) {
    const v = ymax * i / 4, y = Y(v);
    el("line", {x1: m.l, x2: m.l + w, y1: y, y2: y, stroke: "#e5e7eb"}, svg);
    el("text", {x: m.l - 6, y: y + 4, "text-anchor": "end"}, svg).textContent = opt.fmt(v);
  }
  if (xs.length) {
    const span = x1 - x0;
    for (const f of [0, 0.5, 1]) {
      const t = x0 + span * f;
      const lab = el("text", {x: X(t), y: H - 6, "text-anchor": f === 0 ? "start" : f === 1 ? "end" : "middle"}, svg);
      lab.textContent = f === 1 ? "now" : "-" + fmtDur(x1 - t);
    }
  }
  let i = 0; const drawn = {};
  for (const [name, ys] of Object.entries(series)) {
    let d = "", pen = false, n = 0;
    ys.forEach((v, k) => {
      if (v === null || v === undefined) { pen = false; return; }
      d += (pen ? "L" : "M") + X(xs[k]).toFixed(1) + "," + Y(v).toFixed(1); pen = true; n++;
    });
    const c = color(name, i++);
    if (d) el("path", {d, fill: "none", stroke: c, "stroke-width": name === "total" ? 2.5 : 2,
      "stroke-dasharray": name === "total" ? "5 3" : "", "data-series": name}, svg);
    // Single points are invisible as paths: mark the last value.
    const last = ys.map((v, k) => [v, k]).filter(p => p[0] !== null && p[0] !== undefined).pop();
    if (last) el("circle", {cx: X(xs[last[1]]), cy: Y(last[0]), r: 3, fill: c}, svg);
    drawn[name] = n;
  }
  return drawn;
}

function legend(div, names, fmtv) {
  div.innerHTML = names.map((n, i) => `<span><i style="background:${color(n, i)}"></i>${esc(n)}` +
    (fmtv ? ` <b>${fmtv(n)}</b>` : "") + `</span>`).join("");
}

function barChart(svg, data) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = svg.clientWidth || 300, H = svg.clientHeight || 220;
  const names = Object.keys(data);
  if (!names.length) {
    el("text", {x: W/2, y: H/2, "text-anchor": "middle"}, svg).textContent = "no hits yet";
    return;
  }
  const m = {l: 44, r: 10, t: 20, b: 22}, w = W - m.l - m.r, h = H - m.t - m.b;
  const bw = w / names.length;
  for (let i = 0; i <= 4; i++) {
    const y = m.t + h - h * i / 4;
    el("line", {x1: m.l, x2: m.l + w, y1: y, y2: y, stroke: "#e5e7eb"}, svg);
    el("text", {x: m.l - 6, y: y + 4, "text-anchor": "end"}, svg).textContent = (25*i) + "%";
  }
  names.forEach((n, i) => {
    const v = data[n], bh = h * v, x = m.l + i * bw + bw * 0.2;
    el("rect", {x, y: m.t + h - bh, width: bw * 0.6, height: Math.max(0, bh), fill: color(n, i),
      rx: 2, "data-tier": n}, svg);
    el("text", {x: x + bw * 0.3, y: m.t + h - bh - 4, "text-anchor": "middle"}, svg).textContent = pct(v);
    el("text", {x: x + bw * 0.3, y: H - 6, "text-anchor": "middle"}, svg).textContent = n;
  });
}

function usageBars(div, rows) {
  if (!rows.length) { div.innerHTML = '<div class="empty">no nodes reporting</div>'; return; }
  let html = '<table><tr><th>node</th><th>tier</th><th style="width:45%">used / capacity ' +
    '(hatched: pinned)</th><th class="num">used</th><th class="num">capacity</th>' +
    '<th class="num">chunks</th></tr>';
  rows.forEach((r, i) => {
    const cap = r.capacity_bytes;
    const f = cap ? Math.min(1, r.used_bytes / cap) : 0, pf = cap ? Math.min(1, r.pinned_bytes / cap) : 0;
    html += `<tr><td>${esc(r.node)}</td><td>${esc(r.tier)}</td><td><div class="bar" title="${pct(f)}">` +
      `<div class="u" style="width:${(100*f).toFixed(1)}%;background:${color(r.tier, i)}"></div>` +
      `<div class="p" style="width:${(100*pf).toFixed(1)}%"></div></div></td>` +
      `<td class="num">${fmtBytes(r.used_bytes)}${cap ? " (" + pct(f) + ")" : ""}</td>` +
      `<td class="num">${cap ? fmtBytes(cap) : "unbounded"}</td><td class="num">${fmtNum(r.chunks)}</td></tr>`;
  });
  div.innerHTML = html + "</table>";
}

function pinsTable(div, pins) {
  if (!pins.length) { div.innerHTML = '<div class="empty">no pins</div>'; return; }
  let html = '<table><tr><th>id</th><th>owner</th><th>note</th><th class="num">age</th>' +
    '<th class="num">TTL left</th><th class="num">chunks</th><th class="num">bytes</th>' +
    '<th>residency (this node)</th><th>fleet</th></tr>';
  for (const p of pins) {
    const res = p.tiers.map(t => {
      const s = p.residency[t] || "na";
      return `<span class="badge ${esc(s.replace("/", ""))}">${esc(t)}: ${esc(s)}</span>`;
    }).join("");
    const fleet = Object.entries(p.fleet || {}).map(([t, ns]) => `${esc(t)}: ${ns.length ? esc(ns.join(",")) : "–"}`).join("; ");
    html += `<tr><td><code>${esc(p.id)}</code></td><td>${esc(p.owner)}</td><td>${esc(p.note)}</td>` +
      `<td class="num">${fmtDur(p.age_s)}</td><td class="num">${p.ttl_left_s === null ? "hard pin" : fmtDur(p.ttl_left_s)}</td>` +
      `<td class="num">${p.chunks}</td><td class="num">${p.bytes ? fmtBytes(p.bytes) : "?"}</td>` +
      `<td>${res}</td><td>${fleet || "–"}</td></tr>`;
  }
  div.innerHTML = html + "</table>";
}

function nodesTable(div, nodes) {
  if (!nodes.length) { div.innerHTML = '<div class="empty">no live agents</div>'; return; }
  let html = '<table><tr><th>node</th><th>state</th><th>tiers</th><th class="num">heartbeat age</th>' +
    '<th class="num">hit rate</th><th>by tier</th><th class="num">misses</th></tr>';
  for (const n of nodes) {
    const by = Object.entries(n.hit_rate_by_tier || {}).map(([t, v]) => `${esc(t)} ${pct(v)}`).join(", ");
    html += `<tr><td>${esc(n.node)}</td><td>${n.live ? '<span class="badge resident">live</span>' : '<span class="badge missing">gone</span>'}</td>` +
      `<td>${esc(Object.keys(n.tiers || {}).join(", "))}</td>` +
      `<td class="num">${n.heartbeat_age_s === null ? "–" : n.heartbeat_age_s.toFixed(1) + "s"}</td>` +
      `<td class="num">${pct(n.hit_rate)}</td><td>${by || "–"}</td><td class="num">${fmtNum(n.misses)}</td></tr>`;
  }
  div.innerHTML = html + "</table>";
}

function render(st) {
  window.__tcState = st;
  const s = st.series || {t: [], hit_rate: {}, hit_rate_total: []};
  const when = st.updated ? new Date(st.updated * 1000).toLocaleTimeString() : "–";
  document.getElementById("meta").textContent =
    `node ${st.node_id || "–"} · directory ${st.directory} · hit rates: ${st.hit_scope} · ` +
    `window ${s.window_s || "?"}s · updated ${when}`;
  const pills = [];
  pills.push(st.agent_error ? `<span class="pill bad" title="${esc(st.agent_error)}">agent down</span>` : '<span class="pill ok">agent</span>');
  pills.push(st.directory_ok ? '<span class="pill ok">directory</span>' : '<span class="pill bad">directory degraded</span>');
  for (const u of Object.keys(st.scrape_errors || {})) pills.push(`<span class="pill bad" title="${esc(st.scrape_errors[u])}">scrape ${esc(u)}</span>`);
  if (st.error) pills.push(`<span class="pill bad">${esc(st.error)}</span>`);
  document.getElementById("pills").innerHTML = pills.join("");

  // Hit rate per tier over time.
  const hs = {};
  for (const [t, ys] of Object.entries(s.hit_rate || {})) hs[t] = ys;
  hs.total = s.hit_rate_total || [];
  const drawn = lineChart(document.getElementById("c-hit"), s.t || [], hs, {ymax: 1, fmt: v => (100*v).toFixed(0) + "%"});
  const lastOf = ys => { for (let i = ys.length - 1; i >= 0; i--) if (ys[i] !== null && ys[i] !== undefined) return ys[i]; return null; };
  legend(document.getElementById("l-hit"), Object.keys(hs), n => pct(lastOf(hs[n])));
  const tot = lastOf(hs.total);
  document.getElementById("k-hit").textContent = pct(tot);
  document.getElementById("k-hit-s").textContent = Object.keys(s.hit_rate || {}).map(t => `${t} ${pct(lastOf(s.hit_rate[t]))}`).join(" · ");

  // Token share.
  barChart(document.getElementById("c-tok"), st.hit_tokens_share || {});
  const tokTotal = Object.values(st.hit_tokens || {}).reduce((a, b) => a + b, 0);
  document.getElementById("k-tok").textContent = fmtNum(tokTotal);
  document.getElementById("k-tok-s").textContent = Object.entries(st.hit_tokens || {}).map(([t, v]) => `${t} ${fmtNum(v)}`).join(" · ") || "no hits yet";

  // Usage.
  usageBars(document.getElementById("c-usage"), st.usage || []);

  // Eviction and error rates.
  const rs = {};
  for (const [t, ys] of Object.entries(s.evictions_per_s || {})) rs["evictions " + t] = ys;
  rs.errors = s.errors_per_s || [];
  lineChart(document.getElementById("c-rates"), s.t || [], rs, {fmt: v => +v.toFixed(2) + "/s"});
  legend(document.getElementById("l-rates"), Object.keys(rs), n => (lastOf(rs[n]) || 0).toFixed(2) + "/s");
  const evNow = Object.values(s.evictions_per_s || {}).reduce((a, ys) => a + (lastOf(ys) || 0), 0);
  document.getElementById("k-ev").textContent = evNow.toFixed(2);
  const evTotal = Object.values(st.summary?.tiers || {}).reduce((a, t) => a + (t.evictions || 0), 0);
  document.getElementById("k-ev-s").textContent = `${fmtNum(evTotal)} total on this node`;
  const errNow = lastOf(s.errors_per_s || []) || 0;
  const errs = st.summary?.errors || {};
  document.getElementById("k-err").textContent = errNow.toFixed(2);
  document.getElementById("k-err").className = "v" + (errNow > 0 ? " err" : "");
  document.getElementById("k-err-s").textContent = Object.entries(errs).filter(([, v]) => v).map(([k, v]) => `${k.replace(/_/g, " ")} ${fmtNum(v)}`).join(" · ") || "none so far";

  pinsTable(document.getElementById("t-pins"), st.pins || []);
  nodesTable(document.getElementById("t-nodes"), st.nodes || []);

  window.__tcCharts = {
    hitRate: {series: hs, points: drawn},
    tokenShare: st.hit_tokens_share || {},
    usage: st.usage || [],
    rates: rs,
    pins: (st.pins || []).length,
  };
  window.__tcRenders = (window.__tcRenders || 0) + 1;
}

async function tick() {
  try {
    const r = await fetch("api/state", {cache: "no-store"});
    render(await r.json());
  } catch (e) {
    document.getElementById("pills").innerHTML = `<span class="pill bad">dashboard unreachable: ${esc(e)}</span>`;
  }
}
tick();
setInterval(tick, 1500);
</script>
</body>
</html>
"""
