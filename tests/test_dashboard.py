"""The dashboard: rate maths, the shipped Grafana/Prometheus configs, and the live page in a
real headless Chromium (driven over the Chrome DevTools Protocol) against two agents with
traffic, a Redis directory and a pin. Saves ``artifacts/dashboard.png``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import RedisServer, free_port, wait_port

from tiered_cache import codec
from tiered_cache.agent import wait_for_socket
from tiered_cache.client import AgentClient
from tiered_cache.dashboard import History, Reading, build_state, cumulative, parse_flat
from tiered_cache.keys import ModelFingerprint, chunk_keys
from tiered_cache.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
CHUNK = 32
N = 16 * 1024
FP = ModelFingerprint("default", chunk_size=CHUNK, block_size=16)


# --------------------------------------------------------------------------- unit


def reading(t: float, hits: dict[str, float], misses: float, tokens: dict[str, float]) -> Reading:
    s: list[tuple[str, dict[str, str], float]] = []
    s += [("tiered_cache_hits_total", {"tier": k}, v) for k, v in hits.items()]
    s += [("tiered_cache_hit_tokens_total", {"tier": k}, v) for k, v in tokens.items()]
    s.append(("tiered_cache_misses_total", {"tier": "all"}, misses))
    s.append(("tiered_cache_evictions_total", {"tier": "dram", "reason": "capacity"}, t))
    return Reading(t=t, node_id="n1", samples=s, usage={"dram": {"used_bytes": 5}})


def test_history_rates_over_a_window() -> None:
    h = History(maxlen=100, window_s=10)
    h.add(0, cumulative(reading(0, {"dram": 30, "nvme": 10}, 10, {"nvme": 100})))
    h.add(5, cumulative(reading(5, {"dram": 30, "nvme": 10}, 10, {})))  # idle: no rate
    h.add(10, cumulative(reading(10, {"dram": 60, "nvme": 10}, 20, {})))
    # Agent restarted: counters went back to zero, the new values count from zero.
    h.add(20, cumulative(reading(20, {"dram": 8, "nvme": 0}, 2, {})))
    s = h.export()
    assert s["hit_rate"]["dram"][0] == pytest.approx(0.6)  # first reading: since agent start
    assert s["hit_rate_total"][1] is None
    assert s["hit_rate"]["dram"][2] == pytest.approx(30 / 40)
    assert s["hit_rate"]["nvme"][2] == 0.0
    assert s["hit_rate"]["dram"][3] == pytest.approx(0.8)
    assert s["evictions_per_s"]["dram"][2] == pytest.approx(1.0)  # 10 over 10 s
    assert parse_flat("tiered_cache_hits_total{tier=dram}") == (
        "tiered_cache_hits_total",
        {"tier": "dram"},
    )
    st = build_state(reading(1, {"dram": 3}, 1, {"dram": 30, "nvme": 90}), h, started=0)
    assert st["hit_tokens_share"] == {"dram": 0.25, "nvme": 0.75}
    assert st["usage"][0]["node"] == "n1" and st["usage"][0]["used_bytes"] == 5


# --------------------------------------------------------------------------- configs


def _metric_names() -> set[str]:
    from tiered_cache.metrics import CONNECTOR_METRICS, CONNECTOR_PREFIX

    bases = [fam.name for fam in Metrics().registry.collect()]
    bases += [CONNECTOR_PREFIX + n for n in CONNECTOR_METRICS]  # exported through vLLM
    names = set()
    for base in bases:
        names |= {base, f"{base}_total", f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return names


def _referenced(expr: str) -> set[str]:
    return set(re.findall(r"\btiered_cache_[a-z_]+\b", expr))


def _grafana_exprs() -> list[str]:
    d = json.loads((ROOT / "configs" / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def test_grafana_dashboard_is_valid() -> None:
    d = json.loads((ROOT / "configs" / "grafana-dashboard.json").read_text())
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"].lower() for p in d["panels"])
    for want in ["hit ratio per tier", "ttft-saving tokens", "usage against capacity",
                 "evictions", "verification failures", "directory errors", "recompute",
                 "peer transfers", "load latency"]:  # fmt: skip
        assert want in titles, want
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0
    known = _metric_names()
    exprs = _grafana_exprs()
    assert exprs
    for e in exprs:
        assert _referenced(e) and _referenced(e) <= known, e
    assert any("histogram_quantile(0.99" in e and "load_seconds_bucket" in e for e in exprs)


def test_prometheus_rules_are_valid(tmp_path: Path) -> None:
    rules = yaml.safe_load((ROOT / "configs" / "prometheus-rules.yml").read_text())
    known = _metric_names()
    alerts, records = [], []
    for g in rules["groups"]:
        for r in g["rules"]:
            assert ("alert" in r) != ("record" in r) and r["expr"].strip()
            (alerts if "alert" in r else records).append(r.get("alert") or r["record"])
            assert _referenced(r["expr"]) <= known, r["expr"]
            if "alert" in r:
                assert r["annotations"]["summary"] and r["labels"]["severity"]
    for want in ["TieredCacheAgentDown", "TieredCacheVerificationFailures",
                 "TieredCacheDirectoryErrors", "TieredCacheDramNearFullWithPins",
                 "TieredCacheHitRateDrop"]:  # fmt: skip
        assert want in alerts
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # structure checked above; `apt-get install prometheus` adds promtool
    r = subprocess.run(
        [promtool, "check", "rules", str(ROOT / "configs" / "prometheus-rules.yml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # The Grafana queries parse as PromQL too (Grafana's variables substituted).
    sub = {"$__rate_interval": "5m", "$__range": "1h", "$vllm_job": ".*", "$job": ".*",
           "$instance": ".*"}  # fmt: skip
    exprs = []
    for e in _grafana_exprs():
        for k, v in sub.items():
            e = e.replace(k, v)
        exprs.append(e)
    g = {"groups": [{"name": "grafana", "rules": [
        {"record": f"grafana:panel{i}", "expr": e} for i, e in enumerate(exprs)]}]}  # fmt: skip
    (tmp_path / "grafana.yml").write_text(yaml.safe_dump(g))
    r = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "grafana.yml")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # Unit test: alerts fire on the series they are meant for (annotations left out: the
    # test compares them verbatim).
    for g in rules["groups"]:
        for rule in g["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": 'up{job="tiered-cache",instance="n1"}', "values": "1 1 0 0 0 0"},
                    {"series": 'tiered_cache_verification_failures_total{instance="n1",tier="nvme"}', "values": "0 0 3 3 3 3"},
                    {"series": 'tiered_cache_used_bytes{job="tiered-cache",instance="n1",tier="dram"}', "values": "99x30"},
                    {"series": 'tiered_cache_pinned_bytes{job="tiered-cache",instance="n1",tier="dram"}', "values": "60x30"},
                    {"series": 'tiered_cache_capacity_bytes{job="tiered-cache",instance="n1",tier="dram"}', "values": "100x30"},
                ],
                "alert_rule_test": [
                    {"eval_time": "5m", "alertname": "TieredCacheAgentDown", "exp_alerts": [
                        {"exp_labels": {"severity": "page", "job": "tiered-cache", "instance": "n1"}}]},
                    {"eval_time": "5m", "alertname": "TieredCacheVerificationFailures", "exp_alerts": [
                        {"exp_labels": {"severity": "warning", "instance": "n1", "tier": "nvme"}}]},
                    {"eval_time": "20m", "alertname": "TieredCacheDramNearFullWithPins", "exp_alerts": [
                        {"exp_labels": {"severity": "warning", "job": "tiered-cache", "instance": "n1", "tier": "dram"}}]},
                ],
            }
        ],
    }  # fmt: skip
    (tmp_path / "rules_test.yml").write_text(yaml.safe_dump(test))
    r = subprocess.run(
        [promtool, "test", "rules", "rules_test.yml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------- live page


def _cfg(tmp: Path, name: str, redis_url: str) -> Path:
    doc = {
        "node_id": f"{name}-{uuid.uuid4().hex[:6]}",
        "chunk_size": CHUNK,
        "redis_url": redis_url,
        "heartbeat_ttl_s": 6,
        "dram": {"capacity": "1MiB", "slot_bytes": "64KiB"},
        "nvme": {"enabled": True, "path": str(tmp / name / "nvme"), "capacity": "16MiB"},
        "agent": {"socket": str(tmp / f"{name}.sock"), "pin_sync_interval_s": 0.5},
    }
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tiered_cache.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _put(sock: str, keys: list[str], seed: int) -> None:
    c = AgentClient(sock)
    try:
        items = []
        for i, k in enumerate(keys):
            data = np.random.default_rng(seed + i).integers(0, 255, N, dtype=np.uint8).tobytes()
            meta = codec.ChunkMeta(
                key=k, fingerprint=FP.digest, num_tokens=CHUNK, dtype="uint8", shape=(N,),
                kv_layout="LBHNC", block_size=16,
            )  # fmt: skip
            items.append((meta, data))
        c.put_many(items, wait=True)
    finally:
        c.close()


class Traffic:
    """Steady load on an agent: chunks that overflow DRAM into NVMe, read back in small
    batches (hits in both tiers) plus some misses."""

    def __init__(self, sock: str, base: int) -> None:
        self.sock = sock
        self.keys = chunk_keys(np.arange(base, base + 24 * CHUNK), FP)
        _put(sock, self.keys, base)
        self._stop = threading.Event()
        self.rounds = 0
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, daemon=True)

    def round(self, c: AgentClient) -> None:
        rng = np.random.default_rng(self.rounds)
        pick = [self.keys[i] for i in rng.choice(len(self.keys), 4, replace=False)]
        c.get_many(pick, FP.digest)
        c.get_many(chunk_keys(np.arange(self.rounds, self.rounds + CHUNK) + 10**6, FP), FP.digest)
        self.rounds += 1

    def _run(self) -> None:
        c = AgentClient(self.sock)
        try:
            while not self._stop.is_set():
                self.round(c)
                self._stop.wait(0.2)
        except BaseException as e:
            self.error = e
        finally:
            c.close()

    def start(self) -> Traffic:
        c = AgentClient(self.sock)
        try:
            for _ in range(6):
                self.round(c)
        finally:
            c.close()
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)


def find_chromium() -> str:
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return str(shutil.which(name))
    pytest.fail(
        "headless Chromium is needed for the dashboard test and was not found: "
        "install Debian's `chromium` package (apt-get install -y chromium) or set CHROMIUM"
    )


class CDP:
    """A minimal Chrome DevTools Protocol client over one page's websocket (aiohttp)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.n = 0
        self.events: list[dict[str, Any]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.n += 1
        my = self.n
        await self.ws.send_json({"id": my, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 60)
            if msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
            if "method" in msg:
                self.events.append(msg)

    async def js(self, expr: str) -> Any:
        r = await self.call(
            "Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")


@contextlib.contextmanager
def chromium(tmp: Path) -> Iterator[int]:
    """Headless Chromium with remote debugging on a free loopback port; yields the port."""
    exe = find_chromium()
    profile = tmp / "chromium-profile"
    profile.mkdir()
    args = [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--no-default-browser-check", "--disable-extensions",
        "--disable-domain-reliability", "--disable-client-side-phishing-detection",
        "--metrics-recording-only", "--mute-audio", "--hide-scrollbars",
        # Resolve nothing but loopback: the page must not need (or reach) the network.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0", "--window-size=1440,1000", "about:blank",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                err = proc.communicate()[1][-2000:]
                pytest.fail(f"chromium did not start (exit {proc.returncode}): {err}")
            time.sleep(0.1)
        yield int(port_file.read_text().split()[0])
    finally:
        proc.kill()
        proc.wait(10)


async def drive_page(devtools_port: int, url: str, shot: Path) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{devtools_port}/json/list") as r:
            targets = await r.json(content_type=None)
        page = next(t for t in targets if t["type"] == "page")
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            cdp = CDP(ws)
            await cdp.call("Runtime.enable")
            await cdp.call("Page.enable")
            await cdp.call(
                "Emulation.setDeviceMetricsOverride",
                width=1440, height=1000, deviceScaleFactor=1, mobile=False,
            )  # fmt: skip
            await cdp.call("Page.navigate", url=url)
            want = """(() => {
              const c = window.__tcCharts || {}, s = window.__tcState || {};
              const hr = (c.hitRate || {}).series || {};
              const nz = ys => (ys || []).some(v => v !== null && v > 0);
              return {
                dram: nz(hr.dram), nvme: nz(hr.nvme), total: nz(hr.total),
                tokens: Object.values(c.tokenShare || {}).some(v => v > 0),
                nodes: new Set((c.usage || []).map(u => u.node)).size,
                usage: (c.usage || []).some(u => u.used_bytes > 0 && u.capacity_bytes > 0),
                resident: (s.pins || []).some(p => Object.values(p.residency).includes("resident")),
                renders: window.__tcRenders || 0,
              };
            })()"""
            deadline = time.monotonic() + 90
            got: dict[str, Any] = {}
            while time.monotonic() < deadline:
                got = await cdp.js(want) or {}
                if (
                    all(
                        got.get(k) for k in ("dram", "nvme", "total", "tokens", "usage", "resident")
                    )
                    and got.get("nodes", 0) >= 2
                    and got.get("renders", 0) >= 3
                ):
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(1.6)  # one more refresh so the screenshot shows a settled page
            drawn = await cdp.js(
                """({
                  hitPaths: document.querySelectorAll('#c-hit path[data-series]').length,
                  tokenBars: document.querySelectorAll('#c-tok rect[data-tier]').length,
                  usageBars: document.querySelectorAll('#c-usage .bar').length,
                  ratePaths: document.querySelectorAll('#c-rates path[data-series]').length,
                  pinRows: document.querySelectorAll('#t-pins tr').length - 1,
                  nodeRows: document.querySelectorAll('#t-nodes tr').length - 1,
                  hitKpi: document.getElementById('k-hit').textContent,
                  state: window.__tcState,
                })"""
            )
            shot.parent.mkdir(parents=True, exist_ok=True)
            size = (await cdp.call("Page.getLayoutMetrics"))["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
            png = await cdp.call(
                "Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip
            )
            shot.write_bytes(base64.b64decode(png["data"]))
            errors = [e for e in cdp.events if e["method"] == "Runtime.exceptionThrown"]
            return {"ready": got, "drawn": drawn, "js_errors": errors}


def test_dashboard_in_headless_chromium(redis_server: RedisServer) -> None:
    find_chromium()  # fail fast, before starting anything
    tmp = Path(tempfile.mkdtemp(prefix="tc-dash-"))
    procs: list[subprocess.Popen[str]] = []
    traffic: list[Traffic] = []
    try:
        cfg_a, cfg_b = _cfg(tmp, "node-a", redis_server.url), _cfg(tmp, "node-b", redis_server.url)
        mport_b = free_port()
        procs.append(_spawn("agent", "-c", str(cfg_a)))
        procs.append(_spawn("agent", "-c", str(cfg_b), "--metrics-port", str(mport_b)))
        sock_a, sock_b = (
            str(yaml.safe_load(c.read_text())["agent"]["socket"]) for c in (cfg_a, cfg_b)
        )
        for s in (sock_a, sock_b):
            wait_for_socket(s, 60)
        # A pinned system prompt, resident on node A.
        toks = ",".join(str(t) for t in range(500_000, 500_000 + 2 * CHUNK))
        r = subprocess.run(
            [sys.executable, "-m", "tiered_cache.cli", "pin", "add", "-c", str(cfg_a), "--tokens",
             toks, "--tiers", "dram,nvme", "--ttl", "24h", "--note", "system prompt", "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        _put(sock_a, chunk_keys(np.arange(500_000, 500_000 + 2 * CHUNK), FP), 9)
        traffic = [Traffic(sock_a, 0).start(), Traffic(sock_b, 100_000).start()]
        port = free_port()
        dash = _spawn(
            "dashboard", "-c", str(cfg_a), "--port", str(port), "--interval", "0.5",
            "--scrape", f"http://127.0.0.1:{mport_b}/metrics",
        )  # fmt: skip
        procs.append(dash)
        wait_port(port, 60)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
            html = resp.read().decode()
        assert "<svg" in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
        with chromium(tmp) as devtools:
            out = asyncio.run(
                drive_page(devtools, f"http://127.0.0.1:{port}/", ARTIFACTS / "dashboard.png")
            )
        ready, drawn = out["ready"], out["drawn"]
        assert not out["js_errors"], out["js_errors"]
        assert ready["dram"] and ready["nvme"] and ready["total"], ready
        assert ready["tokens"] and ready["usage"] and ready["resident"], ready
        assert ready["nodes"] >= 2, ready  # both agents: one page shows the cluster
        st = drawn["state"]
        assert {u["node"] for u in st["usage"]} >= {
            yaml.safe_load(c.read_text())["node_id"] for c in (cfg_a, cfg_b)
        }
        assert st["hit_scope"] == "cluster" and st["directory_ok"]
        assert len(st["metric_sources"]) == 2 and not st["scrape_errors"]
        assert drawn["hitPaths"] >= 3 and drawn["tokenBars"] >= 1 and drawn["usageBars"] >= 4
        assert drawn["ratePaths"] >= 1 and drawn["pinRows"] == 1 and drawn["nodeRows"] == 2
        assert drawn["hitKpi"].endswith("%")
        png = (ARTIFACTS / "dashboard.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
        for t in traffic:
            assert t.error is None, t.error
    finally:
        for t in traffic:
            t.stop()
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
