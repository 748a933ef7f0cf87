"""The long-running commands: agent, dashboard, router, simulate."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import click

from tiered_cache.cli.common import CliError, _cfg_opt, _load, friendly
from tiered_cache.cli.events import _reachable


@click.command()
@click.option("-c", "--config", type=click.Path(dir_okay=False), help="YAML config file.")
@click.option("--node-id", help="Override node_id.")
@click.option("--socket", "socket_path", help="Override the local unix socket path.")
@click.option("--peer-port", type=int, help="Serve chunks to peers on this TCP port (0=any).")
@click.option("--metrics-port", type=int, help="Serve Prometheus /metrics on this port.")
@click.option(
    "--metrics-host",
    help="Address /metrics binds (default agent.metrics_host: 127.0.0.1; 0.0.0.0 exposes it).",
)
@click.option(
    "--drop-dram",
    is_flag=True,
    help="Remove the DRAM pool on a clean stop (default: keep it for a warm restart).",
)
@friendly
def agent(
    config: str | None,
    node_id: str | None,
    socket_path: str | None,
    peer_port: int | None,
    metrics_port: int | None,
    metrics_host: str | None,
    drop_dram: bool,
) -> None:
    """Run the node agent (owns DRAM pool, NVMe dir, S3 client; serves local vLLM)."""
    cfg = _load(config)
    upd: dict[str, Any] = {}
    if node_id:
        upd["node_id"] = node_id
    if drop_dram:
        upd["dram"] = cfg.dram.model_copy(update={"keep_on_stop": False})
    a: dict[str, Any] = {}
    if socket_path:
        a["socket"] = socket_path
    if peer_port is not None:
        a["peer_port"] = peer_port
    if metrics_port is not None:
        a["metrics_port"] = metrics_port
    if metrics_host:
        a["metrics_host"] = metrics_host
    if a:
        upd["agent"] = cfg.agent.model_copy(update=a)
    cfg = cfg.model_copy(update=upd)
    from tiered_cache.agent import NodeAgent
    from tiered_cache.tiers.base import TierError

    try:
        asyncio.run(NodeAgent(cfg).run_forever())
    except TierError as e:  # a tier that cannot open (NVMe directory in use, unreadable)
        raise CliError(str(e)) from None


@click.command()
@_cfg_opt
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8790, show_default=True)
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds per reading.")
@click.option("--window", type=float, default=30.0, show_default=True, help="Rate window, seconds.")
@click.option("--history", type=int, default=900, show_default=True, help="Readings kept.")
@click.option("--scrape", multiple=True, metavar="URL", help="Also read an agent's /metrics.")
@friendly
def dashboard(
    config: str | None,
    host: str,
    port: int,
    interval: float,
    window: float,
    history: int,
    scrape: tuple[str, ...],
) -> None:
    """Serve a live web dashboard of the cluster (hit rates, tokens, usage, pins, errors)."""
    from tiered_cache.dashboard import Collector, Dashboard, serve

    cfg = _load(config)
    if interval <= 0 or window <= 0 or history < 2:
        raise CliError("--interval and --window must be > 0 and --history at least 2")

    async def check() -> None:
        col = Collector(cfg, use_agent=False)
        try:
            await col.check_directory()
        finally:
            await col.close()

    asyncio.run(check())
    dash = Dashboard(
        Collector(cfg, scrape=scrape), interval_s=interval, history=history, window_s=window
    )
    click.echo(f"dashboard on http://{host}:{port}/ (Ctrl-C to stop)", err=True)
    serve(dash, host, port)


@click.command()
@click.option("--prefill", "prefill", multiple=True, help="Prefill server URL (repeat).")
@click.option("--decode", "decode", multiple=True, help="Decode server URL (repeat).")
@click.option(
    "--replica",
    "replica",
    multiple=True,
    help="A whole vLLM (repeat): a replica router, each request served whole on one, picked"
    " by cached prefix and load (instead of --prefill/--decode).",
)
@click.option(
    "--round-robin",
    is_flag=True,
    help="Whole requests in strict rotation, blind to cache and load (a plain load balancer,"
    " for comparison).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "-c",
    "--config",
    type=click.Path(dir_okay=False),
    help="Cache config: makes routing cache-aware through the node agent; its"
    " router.tenants make every request need a tenant's API key, router.split chooses"
    " split, whole or auto.",
)
@friendly
def router(
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    replica: tuple[str, ...],
    round_robin: bool,
    host: str,
    port: int,
    config: str | None,
) -> None:
    """OpenAI-compatible P/D router (prefill max_tokens=1, then decode through the cache),
    or a replica router (--replica)."""
    from tiered_cache.router import run_router

    if replica and (prefill or decode):
        raise CliError("--replica excludes --prefill and --decode")
    if not replica and not (prefill and decode):
        raise CliError("give --prefill and --decode servers (or --replica servers)")
    for u in prefill + decode + replica:
        if not u.startswith(("http://", "https://")):
            raise CliError(f"backend URL must start with http:// or https://: {u!r}")
    cache = None
    tenants = []
    kw: dict[str, Any] = {}
    sources: list[tuple[str, str | None]] = []
    if config:
        from tiered_cache.client import connect

        cfg = _load(config)
        tenants = cfg.router.tenants
        if tenants:
            names = ", ".join(t.name for t in tenants)
            click.echo(f"tenants: {names} (API keys required)", err=True)
        if cfg.router.lookup == "events":  # the cached prefix from KV event streams
            srcs = [(x.endpoint, x.replay_endpoint) for x in cfg.router.kv_event_sources]
            if not srcs:  # this node's agent's own stream
                if not cfg.kv_events.enabled:
                    raise CliError(
                        "router.lookup: events needs router.kv_event_sources, or"
                        " kv_events.enabled in this config (its agent's stream)"
                    )
                ev = cfg.kv_events
                srcs = [
                    (_reachable(ev.endpoint), ev.replay_endpoint and _reachable(ev.replay_endpoint))
                ]
            sources = srcs
        try:
            cache = connect(cfg, embedded="never", attach_pool=False)
        except OSError as e:
            raise CliError(
                f"no node agent answers at {cfg.socket_path} ({e.strerror or e}): start"
                f" `tiered-cache agent -c {config}` first, or leave out -c"
            ) from None
        rc = cfg.router
        kw = {
            "max_local_prefill_tokens": rc.max_local_prefill_tokens, "split": rc.split,
            "prefill_tokens_per_s": rc.prefill_tokens_per_s, "handoff_s": rc.handoff_s,
            "decode_step_s": rc.decode_step_s,
        }  # fmt: skip
        if sources:
            kw["kv_event_sources"] = sources
    if replica:
        prefill, decode = (), replica
        kw["split"] = "whole"
    run_router(
        prefill, decode, host, port, cache=cache, tenants=tenants, round_robin=round_robin,
        **kw,
    )  # fmt: skip


@click.command()
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option(
    "--tier",
    "tier_specs",
    multiple=True,
    required=True,
    metavar="NAME=SIZE[:EVICTION[:ADMISSION]]",
    help="A tier, top first (repeat): dram=8000 (blocks) or nvme=2TiB (bytes, see --block-bytes).",
)
@click.option("--policy", default="all", show_default=True, help="Eviction policy, a,b,c or all.")
@click.option("--admission", default="always", show_default=True, help="Admission policy.")
@click.option(
    "--block-bytes",
    default="64MiB",
    show_default=True,
    help="Bytes per 512-token block (default: Llama-3.1-8B bf16 KV).",
)
@click.option("--limit", type=int, default=None, help="Replay only the first N requests.")
@click.option(
    "--demand-belady", is_flag=True, help="Also demand-paging Belady (with its write volume)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (last line).")
@friendly
def simulate(
    trace: str,
    tier_specs: tuple[str, ...],
    policy: str,
    admission: str,
    block_bytes: str,
    limit: int | None,
    demand_belady: bool,
    as_json: bool,
) -> None:
    """Replay a Mooncake-format TRACE through the real hierarchy and policies."""
    from tiered_cache import simulate as sim
    from tiered_cache.config import parse_size

    nbytes = parse_size(block_bytes)
    if nbytes < 1:
        raise CliError("--block-bytes must be at least 1 byte")
    tiers = [sim.parse_tier(s, nbytes) for s in tier_specs]
    policies = sim.parse_policies(policy)
    sim.check_admission(admission)
    records = sim.load_trace(trace, limit)
    rep = sim.run(records, tiers, policies, admission, nbytes, demand_belady=demand_belady)
    click.echo(json.dumps(rep) if as_json else sim.format_report(rep))
