"""Admin commands on the cache itself: models, ls, evict, flush, nodes, stats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
from typing import Any

import click

from tiered_cache.cli.common import (
    CliError,
    _agent_op,
    _cfg_opt,
    _json_opt,
    _load,
    _redis,
    _registered_models,
    _tier_list,
    _token_opt,
    friendly,
)
from tiered_cache.cli.fmt import _fmt_age, _fmt_bytes, _stats_text, _table
from tiered_cache.config import CacheConfig


@click.command("models")
@_cfg_opt
@_json_opt
@friendly
def models_cmd(config: str | None, as_json: bool) -> None:
    """KV fingerprints vLLM instances registered (what `pin add --model` pins under)."""
    regs = _registered_models(_load(config))
    now = time.time()
    rows: list[dict[str, Any]] = [
        {
            "model": r.model_id,
            "aliases": r.aliases,
            "dtype": r.dtype,
            "kv_layout": r.kv_layout,
            "block_size": r.block_size,
            "chunk_size": r.chunk_size,
            "tp": f"{r.tp_rank}/{r.tp_world_size}",
            "fingerprint": r.hex,
            "node": r.node_id,
            "last_seen_age_s": round(now - r.last_seen, 1),
        }
        for r in regs
    ]
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no registered models (vLLM with the TieredCacheConnector registers them)")
        return
    table = [["MODEL", "DTYPE", "LAYOUT", "BLOCK", "CHUNK", "TP", "FINGERPRINT", "NODE", "SEEN"]]
    for x in rows:
        name = x["model"] + (f" ({', '.join(x['aliases'])})" if x["aliases"] else "")
        table.append(
            [name, x["dtype"], x["kv_layout"], str(x["block_size"]), str(x["chunk_size"]),
             x["tp"], x["fingerprint"], x["node"], f"{_fmt_age(x['last_seen_age_s'])} ago"]
        )  # fmt: skip
    click.echo(_table(table, right=(3, 4)))


@click.command("ls")
@_cfg_opt
@click.option("--prefix", default="", help="Key prefix (hex); empty lists everything.")
@click.option("--limit", type=int, default=100, show_default=True)
@click.option("--tenant", default="", help="Only this tenant's chunks.")
@_json_opt
@friendly
def ls_cmd(config: str | None, prefix: str, limit: int, tenant: str, as_json: bool) -> None:
    """List chunk keys on this node with a prefix, across tiers."""
    prefix = prefix.lower()
    if not re.fullmatch(r"[0-9a-f]{0,32}", prefix):
        raise CliError("--prefix must be hex (chunk keys are 32 hex characters)")
    cfg = _load(config)
    # Sent only when given: an agent older than tenancy refuses the field.
    r = _agent_op(cfg, "ls", prefix=prefix, limit=limit, **({"tenant": tenant} if tenant else {}))
    if as_json:
        click.echo(json.dumps({"entries": r["entries"], "total": r["total"]}))
        return
    if not r["entries"]:
        click.echo(f"no chunks with prefix {prefix!r}")
        return
    rows = [["KEY", "TIER", "BYTES", "PINNED", "TENANT"]]
    for e in r["entries"]:
        rows.append(
            [e["key"], e["tier"], _fmt_bytes(e["bytes"]), "yes" if e["pinned"] else "",
             e.get("tenant", "")]
        )  # fmt: skip
    click.echo(_table(rows, right={2}))
    if r["total"] > len(r["entries"]):
        click.echo(f"... {r['total'] - len(r['entries'])} more (raise --limit)")


@click.command()
@_cfg_opt
@_token_opt
@click.argument("key")
@click.option("--tier", "tiers", help="Comma list of tiers (default: every tier).")
@friendly
def evict(config: str | None, token: str | None, key: str, tiers: str | None) -> None:
    """Remove one chunk from this node's tiers (pinned or not)."""
    from tiered_cache.keys import is_valid_key

    key = key.lower()
    if not is_valid_key(key):
        raise CliError(f"not a chunk key: {key!r} (32 hex characters)")
    tier_list = _tier_list(tiers) if tiers else None
    cfg = _load(config)
    where = [
        e["tier"]
        for e in _agent_op(cfg, "ls", prefix=key, limit=10)["entries"]
        if tier_list is None or e["tier"] in tier_list
    ]
    if not where:
        scope = f" in {','.join(tier_list)}" if tier_list else ""
        raise CliError(f"no chunk {key} on this node{scope}")
    _agent_op(cfg, "evict", key=key, tiers=where, token=token)
    click.echo(f"evicted {key} from {','.join(where)}")


@click.command()
@_cfg_opt
@_token_opt
@click.option("--tier", "tiers", help="Comma list of tiers to empty.")
@click.option("--include-pinned", is_flag=True, help="Drop pinned chunks too.")
@click.option(
    "--write-back",
    is_flag=True,
    help="Instead: finish pending writes and copy "
    "DRAM-only chunks down (drops nothing, no confirmation).",
)
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@friendly
def flush(
    config: str | None,
    token: str | None,
    tiers: str | None,
    include_pinned: bool,
    write_back: bool,
    yes: bool,
) -> None:
    """Drop every chunk of a tier on this node (asks for confirmation)."""
    cfg = _load(config)
    if write_back:
        r = _agent_op(cfg, "flush", token=token)
        click.echo(f"flushed: wrote back {r['written_back']} DRAM chunks")
        return
    if not tiers:
        raise CliError("give --tier (e.g. --tier dram), or --write-back")
    tier_list = _tier_list(tiers)
    what = "chunk" if include_pinned else "unpinned chunk"
    if not yes:
        click.confirm(
            f"Drop every {what} from {', '.join(tier_list)} on node {cfg.node_id}?", abort=True
        )
    for t in tier_list:
        r = _agent_op(cfg, "clear", tier=t, include_pinned=include_pinned, token=token)
        kept = f", kept {r['kept_pinned']} pinned" if r["kept_pinned"] else ""
        click.echo(f"flushed {t}: removed {r['removed']} chunks{kept}")


@click.command()
@_cfg_opt
@_json_opt
@friendly
def nodes(config: str | None, as_json: bool) -> None:
    """Live agents, their tiers and heartbeat age."""
    cfg = _load(config)
    if cfg.redis_url:
        live = _redis(cfg, lambda d: d.nodes())
    else:
        live = _agent_op(cfg, "nodes", hint=" or set redis_url")["nodes"]
    now = time.time()
    rows_j = []
    for n in sorted(live):
        info = live[n]
        rows_j.append(
            {
                "node": n,
                "heartbeat_age_s": round(now - float(info.get("last_seen", now)), 1),
                "expires_in_s": round(float(info.get("expires_at", now)) - now, 1),
                "tiers": info.get("tiers", {}),
                "peer": info.get("peer"),
                "pid": info.get("pid"),
            }
        )
    if as_json:
        click.echo(json.dumps(rows_j))
        return
    if not rows_j:
        click.echo("no live agents")
        return
    table = [["NODE", "HEARTBEAT", "PEER", "TIERS (used/capacity)"]]
    for r in rows_j:
        tiers = "  ".join(
            f"{t} {_fmt_bytes(u.get('used_bytes'))}/"
            f"{_fmt_bytes(u['capacity_bytes']) if u.get('capacity_bytes') else 'unbounded'}"
            for t, u in r["tiers"].items()
        )
        peer = ":".join(str(x) for x in r["peer"]) if r["peer"] else "-"
        table.append([r["node"], f"{r['heartbeat_age_s']:.1f}s ago", peer, tiers])
    click.echo(_table(table))


@click.command()
@_cfg_opt
@_json_opt
@click.option("--watch", type=float, metavar="SECONDS", help="Refresh every SECONDS.")
@click.option("--count", type=int, help="With --watch: stop after this many readings.")
@click.option("--scrape", multiple=True, metavar="URL", help="Also read an agent's /metrics.")
@click.option("--tenant", help="Only this tenant's bytes, chunks and quota per tier.")
@friendly
def stats(
    config: str | None,
    as_json: bool,
    watch: float | None,
    count: int | None,
    scrape: tuple[str, ...],
    tenant: str | None,
) -> None:
    """Hit rate per tier, usage and capacity per tier and node, evictions, errors."""
    from tiered_cache.dashboard import Collector, summarize

    cfg = _load(config)
    if watch is not None and watch <= 0:
        raise CliError("--watch takes a positive number of seconds")
    if tenant is not None:
        _tenant_stats(cfg, tenant, as_json)
        return
    clear = watch is not None and not as_json and sys.stdout.isatty()

    async def go() -> None:
        col = Collector(cfg, scrape=scrape)
        try:
            await col.check_directory()
            n = 0
            while True:
                rd = await col.read()
                if rd.agent_error and not cfg.redis_url:
                    raise CliError(f"{rd.agent_error}; start `tiered-cache agent` or set redis_url")
                s = summarize(rd)
                if as_json:
                    click.echo(json.dumps(s))
                else:
                    if clear:
                        click.clear()
                    elif n:
                        click.echo()
                    click.echo(_stats_text(s))
                n += 1
                if watch is None or (count is not None and n >= count):
                    return
                await asyncio.sleep(watch)
        finally:
            await col.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(go())


def _tenant_stats(cfg: CacheConfig, tenant: str, as_json: bool) -> None:
    """``stats --tenant``: that tenant's bytes, chunks and quota per tier on this node's
    agent, and nothing of the node's or other tenants'."""
    r = _agent_op(cfg, "stats", tenant=tenant)
    if as_json:
        click.echo(json.dumps({"node_id": r["node_id"], "tenant": tenant, "tiers": r["usage"]}))
        return
    rows = [["TIER", "USED", "CHUNKS", "QUOTA"]]
    for tier, u in r["usage"].items():
        quota = u["quota_bytes"]
        rows.append([tier, _fmt_bytes(u["used_bytes"]), str(u["chunks"]),
                     "-" if quota is None else _fmt_bytes(quota)])  # fmt: skip
    click.echo(f"tenant {tenant} on {r['node_id']}")
    click.echo(_table(rows, right={1, 2, 3}))
