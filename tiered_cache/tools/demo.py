"""The main job: a cache-mediated prefill -> decode demo on embedded defaults.

Starts Redis (the local one, or a spawned ``redis-server``), an S3-compatible endpoint
(moto), a node agent, one prefill and one decode ``vllm serve`` (CPU) and the router;
replays a small multi-turn workload with shared system prompts; prints per request the
TTFT, where each chunk came from and the cached tokens, then hit rates per tier. Every
process it started is stopped on the way out (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tiered_cache.api import SOURCES
from tiered_cache.tools.vllm_launch import (
    REPO,
    VllmServer,
    free_port,
    kv_transfer_config,
    server_env,
    spawn,
    stop_group,
    wait_http,
)


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


class Procs:
    """Every process the demo starts, stopped in reverse order."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []

    def add(self, name: str, obj: Any) -> Any:
        self.items.append((name, obj))
        return obj

    def stop_all(self) -> None:
        for _name, obj in reversed(self.items):
            with contextlib.suppress(Exception):
                if isinstance(obj, VllmServer):
                    obj.stop()
                else:
                    stop_group(obj)
        self.items.clear()


def _redis(procs: Procs, work: Path) -> str:
    """A private redis-server for this run: a shared one would hold the locations of
    earlier runs' chunks (and their S3 objects are gone with their moto server)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("no redis-server to start (make setup installs it)")
    port = free_port()
    procs.add(
        "redis",
        spawn(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            work / "redis.log",
        ),
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return f"redis://127.0.0.1:{port}/0"
        time.sleep(0.1)
    raise TimeoutError("redis-server did not start")


def _workload(n_requests: int, seed: int = 0) -> Iterator[tuple[str, str]]:
    """(conversation id, prompt): two shared system prompts, users with growing turns."""
    rng = random.Random(seed)
    words = [
        "cache",
        "tier",
        "chunk",
        "prefix",
        "decode",
        "prefill",
        "token",
        "block",
        "shard",
        "node",
        "page",
        "hit",
        "miss",
        "policy",
        "evict",
        "admit",
        "pin",
        "warm",
        "cold",
        "hot",
        "latency",
        "throughput",
        "bandwidth",
    ]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    systems = [f"System prompt {i}: you are a careful assistant. " + text(260) for i in range(2)]
    convs: dict[str, str] = {}
    users = [(f"s{i % 2}-u{i}", systems[i % 2]) for i in range(4)]
    k = 0
    while k < n_requests:
        for cid, sysp in users:
            if k >= n_requests:
                return
            hist = convs.get(cid, sysp)
            hist += f"\nUser: {text(15)}\nAssistant:"
            convs[cid] = hist + f" {text(20)}"
            yield cid, hist
            k += 1


def _stats(sock: str) -> dict[str, float]:
    from tiered_cache.client import AgentClient

    c = AgentClient(sock, attach_pool=False)
    try:
        return dict(c.admin("stats")["metrics"])
    finally:
        c.close()


def _hits(m: dict[str, float]) -> dict[str, float]:
    return {t: m.get(f"tiered_cache_hits_total{{tier={t}}}", 0.0) for t in SOURCES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12, help="requests to replay")
    ap.add_argument("--workdir", default=str(REPO / ".demo"), help="logs, model, NVMe dir")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--clients", type=int, default=1, help="requests in flight at a time (the recompute column is measured alone)")
    ap.add_argument("--json", metavar="PATH", help="also write the summary (gains) as JSON")
    ap.add_argument(
        "--prefix-caching",
        action="store_true",
        help="turn vLLM's own prefix cache on in both servers (off by default, so every "
        "reused token in the table comes from the tiered cache)",
    )
    a = ap.parse_args(argv)
    work = Path(a.workdir)
    if work.exists():  # a fresh run: no chunks or logs from the last one
        shutil.rmtree(work / "nvme", ignore_errors=True)
        for f in work.glob("*.log"):
            f.unlink()
    work.mkdir(parents=True, exist_ok=True)
    procs = Procs()

    def on_signal(signum: int, _: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        return _run(a, work, procs)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        say("stopping every process the demo started")
        procs.stop_all()


def _run(a: argparse.Namespace, work: Path, procs: Procs) -> int:
    t0 = time.monotonic()
    model = REPO / ".models" / "bench-bf16"
    say(
        f"[1/6] small random-weight Llama (12 layers, hidden 1024, bf16: a prefill costs "
        f"this CPU a noticeable fraction of a second) + tokenizer, offline -> {model}"
    )
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "make_tiny_model.py"),
            "--out",
            str(model),
            "--preset",
            "bench",
        ],
        check=True,
        env=server_env(),
        stdout=subprocess.DEVNULL,
    )

    say("[2/6] Redis and an S3-compatible endpoint (moto)")
    redis_url = _redis(procs, work)
    s3_port = free_port()
    moto = procs.add(
        "moto",
        spawn(
            # Niced: S3 runs on other machines in a deployment; here its uploads would
            # take the two cores from the requests behind them.
            ["nice", "-n", "15", sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
             "-p", str(s3_port)],
            work / "moto.log",
        ),
    )
    s3_url = f"http://127.0.0.1:{s3_port}"
    wait_http(s3_url, 30, moto, work / "moto.log", "moto")
    env_s3 = {
        "AWS_ACCESS_KEY_ID": "demo",
        "AWS_SECRET_ACCESS_KEY": "demo",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    os.environ.update(env_s3)
    import boto3

    boto3.client("s3", endpoint_url=s3_url).create_bucket(Bucket="tiered-cache-demo")

    node = f"demo-{uuid.uuid4().hex[:6]}"
    sock = str(work / "agent.sock")
    metrics_port = free_port()
    cfg: dict[str, Any] = {
        "node_id": node,
        "chunk_size": 256,
        "redis_url": redis_url,
        # Small DRAM on purpose (a chunk is 3 MiB): older prefixes get written back to
        # NVMe, so the table shows hits from more than one tier. Each run starts afresh,
        # so the pool is dropped on stop (an agent keeps it by default, for warm restarts).
        "dram": {"capacity": "48MiB", "keep_on_stop": False},
        "nvme": {
            "enabled": True,
            "path": str(work / "nvme"),
            "capacity": "256MiB",
            "write_mode": "write_back",
        },
        "s3": {
            "enabled": True,
            "url": "s3://tiered-cache-demo/kv",
            "endpoint_url": s3_url,
            "region": "us-east-1",
            "write_mode": "write_through",
        },
        "agent": {"socket": sock, "metrics_port": metrics_port},
    }
    cfg_path = work / "tiered-cache.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    say(
        f"[3/6] node agent {node}: DRAM 48MiB -> NVMe {work / 'nvme'} -> S3 (moto); "
        f"metrics on :{metrics_port}"
    )
    agent = procs.add(
        "agent",
        spawn(
            [sys.executable, "-m", "tiered_cache.cli", "agent", "-c", str(cfg_path)],
            work / "agent.log",
            extra_env=env_s3,
        ),
    )
    from tiered_cache.agent import wait_for_socket

    try:
        wait_for_socket(sock, 60)
    except TimeoutError:
        raise RuntimeError((work / "agent.log").read_text()[-3000:]) from None
    if agent.poll() is not None:
        raise RuntimeError((work / "agent.log").read_text()[-3000:])

    say(
        "[4/6] prefill + decode vLLM servers (CPU), vLLM's prefix cache "
        f"{'on' if a.prefix_caching else 'off'}; first start takes ~30-60 s"
    )
    pc_args = ["--enable-prefix-caching"] if a.prefix_caching else []
    store = {"config_file": str(cfg_path), "embedded": "never"}
    pre = procs.add(
        "prefill",
        VllmServer(
            "prefill",
            str(model),
            free_port(),
            work / "prefill.log",
            # kv_both: the prefill also reuses cached prefixes (a follow-up turn computes
            # only its new tokens) and saves the new chunks.
            kv_config=kv_transfer_config("kv_both", store, policy="recompute"),
            env={**env_s3, "VLLM_CPU_OMP_THREADS_BIND": "0"},  # one core each
            dtype="bfloat16",
            extra_args=pc_args,
        ),
    )
    dec = procs.add(
        "decode",
        VllmServer(
            "decode",
            str(model),
            free_port(),
            work / "decode.log",
            kv_config=kv_transfer_config("kv_consumer", store, policy="recompute"),
            env={**env_s3, "VLLM_CPU_OMP_THREADS_BIND": "1"},
            dtype="bfloat16",
            extra_args=pc_args,
        ),
    )
    pre.start()
    dec.start()
    t_start = time.monotonic()
    pending = [pre, dec]
    last = 0.0
    while pending:
        for s in list(pending):
            assert s.proc is not None
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} server exited:\n{s.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(s.url + "/health", timeout=1).status_code == 200:
                    pending.remove(s)
        waited = time.monotonic() - t_start
        if waited > 600:
            raise TimeoutError("vLLM servers did not start in 600 s")
        if pending and waited - last >= 10:
            last = waited
            say(f"      ... waiting for {', '.join(s.name for s in pending)} ({waited:.0f}s)")
        time.sleep(0.5)
    say(f"      servers up in {time.monotonic() - t_start:.0f}s")
    # A server's first prefills of a new length run slower (vLLM CPU's first-call costs).
    # The recompute column is measured after the replay, on warm servers; warm both here
    # too, so the first shared-prompt requests are not charged for them. Salted: nothing
    # the replay could load.
    for s in (pre, dec):
        for n in (150, 450):  # about 350 and 1,000 tokens: the demo's lengths
            _request(s.url, "warm " * n, 2, salt=f"demo-warmup-{uuid.uuid4().hex}")

    rport = free_port()
    say(f"[5/6] router on :{rport} (cache-aware: tokenizes, looks the prompt up in the cache)")
    router = procs.add(
        "router",
        spawn(
            [
                sys.executable,
                "-m",
                "tiered_cache.cli",
                "router",
                "--prefill",
                pre.url,
                "--decode",
                dec.url,
                "--port",
                str(rport),
                "-c",
                str(cfg_path),
            ],
            work / "router.log",
            extra_env=env_s3,
        ),
    )
    rurl = f"http://127.0.0.1:{rport}"
    wait_http(rurl + "/health", 60, router, work / "router.log", "router")

    say(
        f"[6/6] replaying {a.requests} requests (4 conversations, 2 shared system prompts, "
        f"{a.clients} client{'s' if a.clients > 1 else ''} at a time); each prompt also "
        "runs once on the decode server with a fresh cache_salt (nothing cached): its "
        "recompute TTFT"
    )
    before = _hits(_stats(sock))
    work_items = list(enumerate(_workload(a.requests)))
    rows: list[list[Any]] = []
    with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
        for wave in range(0, len(work_items), a.clients):
            batch = work_items[wave : wave + a.clients]
            results = list(pool.map(lambda it: _request(rurl, it[1][1], a.max_tokens), batch))
            for (i, (cid, _prompt)), (ttft, usage) in zip(batch, results, strict=True):
                details = usage.get("prompt_tokens_details") or {}
                rows.append([i, cid, usage.get("prompt_tokens", 0),
                             details.get("cached_tokens", 0), ttft, None, {}])  # fmt: skip
            after = _hits(_stats(sock))
            rows[-1][6] = {k: int(after[k] - before[k]) for k in SOURCES}  # per wave
            before = after
    # The same prompts with nothing cached, one at a time on the decode server.
    for row, (_i, (_cid, prompt)) in zip(rows, work_items, strict=True):
        row[5] = _request(dec.url, prompt, 1, salt=f"demo-recompute-{uuid.uuid4().hex}")[0]
    shared = _shared_prefixes(dec.url, [p for _, (_, p) in work_items])
    _report(rows, _stats(sock))
    summary = summarize(rows, shared, int(cfg["chunk_size"]))
    _print_summary(summary)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2) + "\n")
    say(f"done in {time.monotonic() - t0:.0f}s; logs in {work}")
    return 0


def _request(
    url: str, prompt: str, max_tokens: int, salt: str | None = None
) -> tuple[float, dict[str, Any]]:
    """One streamed completion: (TTFT seconds, usage)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if salt is not None:
        body["cache_salt"] = salt
    t = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"request failed: {r.status_code} {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ttft is None and ev.get("choices") and ev["choices"][0].get("text") is not None:
                ttft = time.perf_counter() - t
            if ev.get("usage"):
                usage = ev["usage"]
    return (ttft if ttft is not None else float("nan")), usage


def _shared_prefixes(url: str, prompts: list[str]) -> list[int]:
    """Tokens each prompt shares with the longest matching earlier prompt: what an
    earlier request computed (the cache can hold) before this one arrived."""
    seen: list[list[int]] = []
    out: list[int] = []
    for p in prompts:
        r = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": p}, timeout=60)
        r.raise_for_status()
        toks = list(r.json()["tokens"])
        best = 0
        for prev in seen:
            n = 0
            for a, b in zip(prev, toks, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        out.append(best)
        seen.append(toks)
    return out


def summarize(rows: list[list[Any]], shared: list[int], chunk: int) -> dict[str, Any]:
    """The demo's figures. A request counts as cached when it shares at least one chunk
    with an earlier prompt; ``demo_cached_gain_median`` is the median of recompute TTFT /
    TTFT through the cache over those (the first turn of a new system prompt gains
    nothing by design). ``ratio_90_worst``: the highest TTFT / recompute TTFT among
    requests with at least 90 % of their prompt shared (the goal: <= 0.35)."""
    per: list[dict[str, Any]] = []
    for (i, cid, ptok, cached, ttft, recompute, _), sh in zip(rows, shared, strict=True):
        per.append({
            "i": i, "conversation": cid, "prompt_tokens": ptok, "cached_tokens": cached,
            "shared_tokens": sh, "ttft_s": ttft, "recompute_s": recompute,
            "gain": recompute / ttft if ttft else None,
        })  # fmt: skip
    cached = [r for r in per if r["shared_tokens"] >= chunk and r["gain"]]
    gains = sorted(r["gain"] for r in cached)
    hot = [r for r in cached if r["shared_tokens"] >= 0.9 * r["prompt_tokens"]]
    ratios = [r["ttft_s"] / r["recompute_s"] for r in hot if r["recompute_s"]]
    all_gains = sorted(r["gain"] for r in per if r["gain"])
    return {
        "demo_cached_gain_median": _median(gains),
        "demo_gain_median": _median(all_gains),
        "cached_requests": len(cached),
        "ratio_90_worst": max(ratios) if ratios else None,
        "ratio_90_requests": len(hot),
        "requests": per,
    }


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _print_summary(s: dict[str, Any]) -> None:
    def fmt(x: float | None, unit: str = "x") -> str:
        return "-" if x is None else f"{x:.2f}{unit}"

    print(
        f"\ngain (recompute TTFT / TTFT): median {fmt(s['demo_cached_gain_median'])} over "
        f"the {s['cached_requests']} requests sharing a chunk with an earlier prompt "
        f"(demo_cached_gain_median), {fmt(s['demo_gain_median'])} over all; worst TTFT / "
        f"recompute of the {s['ratio_90_requests']} requests >= 90% shared: "
        f"{fmt(s['ratio_90_worst'])}"
    )


def _report(rows: list[list[Any]], m: dict[str, float]) -> None:
    print()
    print(
        f"{'#':>2} {'conversation':12} {'prompt':>6} {'cached':>6} {'TTFT ms':>8} "
        f"{'recompute':>9} {'saved':>6}  chunks by tier (per wave)"
    )
    for i, cid, ptok, cached, ttft, recompute, delta in rows:
        tiers = " ".join(f"{t}={n}" for t, n in delta.items() if n) or ""
        saved = f"{recompute / ttft:5.1f}x" if ttft and recompute else "    -"
        print(
            f"{i:>2} {cid:12} {ptok:>6} {cached:>6} {ttft * 1e3:>8.1f} "
            f"{recompute * 1e3:>9.1f} {saved:>6}  {tiers}"
        )
    ttfts = sorted(r[4] for r in rows)
    recs = sorted(r[5] for r in rows)
    print(
        f"\nTTFT median {ttfts[len(ttfts) // 2] * 1e3:.0f} ms through the cache vs "
        f"{recs[len(recs) // 2] * 1e3:.0f} ms recomputed; worst {ttfts[-1] * 1e3:.0f} ms"
    )
    hits = _hits(m)
    misses = m.get("tiered_cache_misses_total{tier=all}", 0.0)
    total = sum(hits.values()) + misses
    print()
    print("hit rate by tier (chunks served / chunk loads requested):")
    for t in SOURCES:
        share = hits[t] / total if total else 0.0
        print(f"  {t:5} {int(hits[t]):5d}  {share:6.1%}")
    print(f"  miss  {int(misses):5d}  {misses / total if total else 0.0:6.1%}")


if __name__ == "__main__":
    sys.exit(main())
