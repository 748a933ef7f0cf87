"""Where the dashboard's figures come from: the agent, the directory and scraped agents.

``Collector.read`` takes one ``Reading`` of them all; ``parse_flat`` and ``parse_exposition``
turn the agent's ``stats`` keys and Prometheus text into samples.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
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
