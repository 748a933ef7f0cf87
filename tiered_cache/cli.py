"""``tiered-cache`` command line: the node agent and the admin commands.

Errors are one line on stderr with a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from tiered_cache.config import CacheConfig, ConfigError, load_config, parse_duration

F = TypeVar("F", bound=Callable[..., Any])
TIERS = ("dram", "nvme", "s3")


class CliError(click.ClickException):
    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def friendly(fn: F) -> F:
    """Turn expected failures into one-line errors."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        from tiered_cache.directory import DirectoryUnavailable
        from tiered_cache.hierarchy import PinRefused
        from tiered_cache.ipc import IPCError

        try:
            return fn(*a, **kw)
        except (ConfigError, PinRefused, DirectoryUnavailable, IPCError, ValueError) as e:
            raise CliError(str(e)) from None
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise CliError(str(e)) from None

    return wrapper  # type: ignore[return-value]


def _load(config: str | None) -> CacheConfig:
    return load_config(config) if config else load_config(None)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """tiered-cache: a tiered KV cache (DRAM -> NVMe -> S3) for vLLM."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# ------------------------------------------------------------------- agent


@main.command()
@click.option("-c", "--config", type=click.Path(dir_okay=False), help="YAML config file.")
@click.option("--node-id", help="Override node_id.")
@click.option("--socket", "socket_path", help="Override the local unix socket path.")
@click.option("--peer-port", type=int, help="Serve chunks to peers on this TCP port (0=any).")
@click.option("--metrics-port", type=int, help="Serve Prometheus /metrics on this port.")
@friendly
def agent(
    config: str | None,
    node_id: str | None,
    socket_path: str | None,
    peer_port: int | None,
    metrics_port: int | None,
) -> None:
    """Run the node agent (owns DRAM pool, NVMe dir, S3 client; serves local vLLM)."""
    cfg = _load(config)
    upd: dict[str, Any] = {}
    if node_id:
        upd["node_id"] = node_id
    a: dict[str, Any] = {}
    if socket_path:
        a["socket"] = socket_path
    if peer_port is not None:
        a["peer_port"] = peer_port
    if metrics_port is not None:
        a["metrics_port"] = metrics_port
    if a:
        upd["agent"] = cfg.agent.model_copy(update=a)
    cfg = cfg.model_copy(update=upd)
    from tiered_cache.agent import NodeAgent

    asyncio.run(NodeAgent(cfg).run_forever())


# ------------------------------------------------------------------- pins


def _tokens(text: str | None, file: str | None, tokens: str | None, model: str | None) -> list[int]:
    given = [x for x in (text, file, tokens) if x is not None]
    if len(given) != 1:
        raise CliError("give exactly one of --text, --file or --tokens")
    if tokens is not None:
        src = Path(tokens[1:]).read_text() if tokens.startswith("@") else tokens
        try:
            return [int(t) for t in src.replace(",", " ").split()]
        except ValueError:
            raise CliError("--tokens takes integers separated by commas or spaces") from None
    if model is None:
        raise CliError("--text/--file need --model (a local model directory with a tokenizer)")
    body = text if text is not None else Path(file or "").read_text()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model)
    except Exception as e:
        raise CliError(f"cannot load a tokenizer from {model!r}: {e}") from None
    return list(tok(body, add_special_tokens=True)["input_ids"])


def _chunk_bytes(model: str | None, dtype: str, chunk_size: int) -> int:
    """KV bytes of one chunk from the model's config.json (0 when unknown)."""
    if not model or not (Path(model) / "config.json").exists():
        return 0
    c = json.loads((Path(model) / "config.json").read_text())
    heads = c.get("num_attention_heads", 1)
    kvh = c.get("num_key_value_heads", heads)
    hd = c.get("head_dim") or c["hidden_size"] // heads
    nbytes = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}.get(dtype, 2)
    return int(c["num_hidden_layers"]) * 2 * kvh * hd * nbytes * chunk_size


class _Admin:
    """Pin-list access: Redis directly when configured, else the node agent's socket."""

    def __init__(self, cfg: CacheConfig, token: str | None) -> None:
        self.cfg = cfg
        self.token = token

    def _agent(self) -> Any:
        from tiered_cache.client import AgentClient

        try:
            return AgentClient(self.cfg.socket_path)
        except OSError:
            raise CliError(
                f"no node agent at {self.cfg.socket_path} and no redis_url configured; "
                "start `tiered-cache agent` or set redis_url"
            ) from None

    def _run(self, fn: Callable[[Any], Any]) -> Any:
        from tiered_cache.directory import RedisDirectory

        async def go() -> Any:
            d = RedisDirectory.from_url(self.cfg.redis_url or "")
            try:
                return await fn(d)
            finally:
                await d.close()

        return asyncio.run(go())

    def add(self, pin: Any, chunk_bytes: int) -> str:
        if self.cfg.redis_url:
            if self.cfg.agent.auth_token and self.token != self.cfg.agent.auth_token:
                raise CliError("pin add needs the admin token (--token or TIERED_CACHE_TOKEN)")
            self._run(lambda d: d.add_pin(pin))
            return str(pin.id)
        c = self._agent()
        try:
            return str(
                c.admin("pin_add", pin=pin.model_dump(), chunk_bytes=chunk_bytes, token=self.token)[
                    "id"
                ]
            )
        finally:
            c.close()

    def remove(self, pin_id: str) -> bool:
        if self.cfg.redis_url:
            if self.cfg.agent.auth_token and self.token != self.cfg.agent.auth_token:
                raise CliError("pin rm needs the admin token (--token or TIERED_CACHE_TOKEN)")
            return bool(self._run(lambda d: d.remove_pin(pin_id)))
        c = self._agent()
        try:
            return bool(c.admin("pin_rm", id=pin_id, token=self.token)["removed"])
        finally:
            c.close()

    def list(self) -> tuple[list[Any], dict[str, dict[str, str]]]:
        from tiered_cache.directory import Pin

        try:
            c = self._agent()
        except CliError:
            if not self.cfg.redis_url:
                raise
            return list(self._run(lambda d: d.list_pins())), {}
        try:
            r = c.admin("pin_ls")
            return [Pin.model_validate(p) for p in r["pins"]], r["residency"]
        finally:
            c.close()


def _check_budget(cfg: CacheConfig, tiers: list[str], need: int) -> None:
    caps = {
        "dram": (cfg.dram.enabled, cfg.dram.capacity, cfg.dram.pin_budget_fraction),
        "nvme": (cfg.nvme.enabled, cfg.nvme.capacity, cfg.nvme.pin_budget_fraction),
        "s3": (cfg.s3.enabled, cfg.s3.capacity, cfg.s3.pin_budget_fraction),
    }
    for t in tiers:
        enabled, cap, frac = caps[t]
        if enabled and cap and need > cap * frac:
            raise CliError(
                f"pin of {need} B does not fit the {t} pin budget of {int(cap * frac)} B "
                f"({frac:.0%} of {cap} B)"
            )


@main.group()
def pin() -> None:
    """Pin hot prefixes (system prompts) so they are never evicted from named tiers."""


_cfg_opt = click.option("-c", "--config", type=click.Path(dir_okay=False), help="YAML config.")
_token_opt = click.option(
    "--token", envvar="TIERED_CACHE_TOKEN", help="Admin token (env TIERED_CACHE_TOKEN)."
)


@pin.command("add")
@_cfg_opt
@_token_opt
@click.option("--text", help="Prefix text, tokenized with --model's tokenizer.")
@click.option("--file", "file", type=click.Path(exists=True, dir_okay=False), help="Text file.")
@click.option("--tokens", help="Token ids: '1,2,3' or @file.")
@click.option("--model", help="Model directory or id (tokenizer + fingerprint).")
@click.option("--dtype", default="float32", show_default=True, help="KV dtype of the server.")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--kv-layout", default="LBHNC", show_default=True)
@click.option("--tp-size", type=int, default=1, show_default=True)
@click.option("--tiers", default="dram", show_default=True, help="Comma list of dram,nvme,s3.")
@click.option("--ttl", default="none", show_default=True, help="e.g. 24h, 30m; none = hard pin.")
@click.option("--salt", help="cache_salt of the tenant.")
@click.option("--note", default="", help="Free text shown by `pin ls`.")
@click.option("--owner", default=lambda: os.environ.get("USER", "admin"))
@click.option("--json", "as_json", is_flag=True)
@friendly
def pin_add(
    config: str | None,
    token: str | None,
    text: str | None,
    file: str | None,
    tokens: str | None,
    model: str | None,
    dtype: str,
    block_size: int,
    kv_layout: str,
    tp_size: int,
    tiers: str,
    ttl: str,
    salt: str | None,
    note: str,
    owner: str,
    as_json: bool,
) -> None:
    """Pin a prefix: print its id, chunks and bytes."""
    from tiered_cache.directory import Pin
    from tiered_cache.keys import ModelFingerprint, chunk_keys

    cfg = _load(config)
    tier_list = [t.strip() for t in tiers.split(",") if t.strip()]
    bad = [t for t in tier_list if t not in TIERS]
    if bad or not tier_list:
        raise CliError(f"unknown tier {', '.join(bad) or '(none)'}; valid: {', '.join(TIERS)}")
    ttl_s = parse_duration(ttl)
    toks = _tokens(text, file, tokens, model)
    keys_all: list[str] = []
    fp_hex = ""
    for rank in range(tp_size):
        fp = ModelFingerprint(
            model_id=model or "default",
            dtype=dtype,
            kv_layout=kv_layout,
            block_size=block_size,
            tp_rank=rank,
            tp_world_size=tp_size,
            chunk_size=cfg.chunk_size,
        )
        keys_all.extend(chunk_keys(toks, fp, cache_salt=salt))
        fp_hex = fp_hex or fp.hex
    if not keys_all:
        raise CliError(
            f"prefix has {len(toks)} tokens, fewer than one chunk ({cfg.chunk_size}); "
            "only whole chunks are pinned"
        )
    cb = _chunk_bytes(model, dtype, cfg.chunk_size) // max(1, tp_size)
    _check_budget(cfg, tier_list, cb * len(keys_all))
    now = time.time()
    p = Pin(
        id=uuid.uuid4().hex[:12],
        note=note,
        keys=keys_all,
        tiers=tier_list,
        ttl_s=ttl_s,
        owner=owner,
        created_at=now,
        expires_at=now + ttl_s if ttl_s else None,
        fingerprint=fp_hex,
        num_tokens=len(toks),
        bytes_per_chunk=cb or None,
    )
    pin_id = _Admin(cfg, token).add(p, cb)
    info = {
        "id": pin_id,
        "chunks": len(keys_all),
        "tokens": len(toks),
        "bytes": cb * len(keys_all),
        "tiers": tier_list,
        "ttl_s": ttl_s,
    }
    if as_json:
        click.echo(json.dumps(info))
    else:
        click.echo(
            f"pinned {pin_id}: {len(keys_all)} chunks, {len(toks)} tokens, "
            f"{_fmt_bytes(cb * len(keys_all))} in {','.join(tier_list)}"
            + (f", ttl {ttl}" if ttl_s else ", no ttl (hard pin)")
        )


def _fmt_bytes(n: int | None) -> str:
    if not n:
        return "?"
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{f:.0f}{unit}" if unit == "B" else f"{f:.1f}{unit}"
        f /= 1024
    return str(n)


@pin.command("ls")
@_cfg_opt
@click.option("--json", "as_json", is_flag=True)
@friendly
def pin_ls(config: str | None, as_json: bool) -> None:
    """List pins with owner, age, TTL left, bytes and residency per tier."""
    cfg = _load(config)
    pins, res = _Admin(cfg, None).list()
    now = time.time()
    rows = []
    for p in pins:
        rows.append(
            {
                "id": p.id,
                "owner": p.owner,
                "age_s": round(now - p.created_at),
                "ttl_left_s": None if p.expires_at is None else round(p.expires_at - now),
                "chunks": len(p.keys),
                "tokens": p.num_tokens,
                "bytes": (p.bytes_per_chunk or 0) * len(p.keys),
                "tiers": p.tiers,
                "residency": res.get(p.id, {}),
                "note": p.note,
            }
        )
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no pins")
        return
    click.echo(
        f"{'ID':12}  {'OWNER':10} {'AGE':>7} {'TTL':>8} {'CHUNKS':>6} {'BYTES':>9}  RESIDENCY"
    )
    for r in rows:
        ttl = "none" if r["ttl_left_s"] is None else f"{r['ttl_left_s']}s"
        resid = " ".join(f"{t}={r['residency'].get(t, '?')}" for t in r["tiers"])
        click.echo(
            f"{r['id']:12}  {r['owner'][:10]:10} {r['age_s']:>6}s {ttl:>8} {r['chunks']:>6} "
            f"{_fmt_bytes(r['bytes']):>9}  {resid}  {r['note']}"
        )


@pin.command("rm")
@_cfg_opt
@_token_opt
@click.argument("pin_id")
@friendly
def pin_rm(config: str | None, token: str | None, pin_id: str) -> None:
    """Remove a pin by id."""
    cfg = _load(config)
    if not _Admin(cfg, token).remove(pin_id):
        raise CliError(f"no pin with id {pin_id}")
    click.echo(f"removed {pin_id}")


@main.command()
@_cfg_opt
@click.option("--json", "as_json", is_flag=True)
@friendly
def stats(config: str | None, as_json: bool) -> None:
    """Usage and hit counters of this node's agent."""
    from tiered_cache.client import AgentClient

    cfg = _load(config)
    try:
        c = AgentClient(cfg.socket_path)
    except OSError:
        raise CliError(f"no node agent at {cfg.socket_path}") from None
    try:
        s = c.admin("stats")
    finally:
        c.close()
    s.pop("ok", None)
    if as_json:
        click.echo(json.dumps(s))
        return
    m = s["metrics"]
    click.echo(f"node {s['node_id']}")
    for tier, u in s["usage"].items():
        hits = m.get(f"tiered_cache_hits_total{{tier={tier}}}", 0)
        cap = u["capacity_bytes"]
        click.echo(
            f"  {tier:5} {_fmt_bytes(u['used_bytes'])}/{_fmt_bytes(cap) if cap else 'unbounded'}"
            f" {u['chunks']} chunks, pinned {_fmt_bytes(u['pinned_bytes'])}, hits {hits:.0f}"
        )


@main.command()
@click.option(
    "--prefill", "prefill", multiple=True, required=True, help="Prefill server URL (repeat)."
)
@click.option(
    "--decode", "decode", multiple=True, required=True, help="Decode server URL (repeat)."
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "-c",
    "--config",
    type=click.Path(dir_okay=False),
    help="Cache config: makes routing cache-aware through the node agent.",
)
@friendly
def router(
    prefill: tuple[str, ...], decode: tuple[str, ...], host: str, port: int, config: str | None
) -> None:
    """OpenAI-compatible P/D router (prefill max_tokens=1, then decode through the cache)."""
    from tiered_cache.router import run_router

    for u in prefill + decode:
        if not u.startswith(("http://", "https://")):
            raise CliError(f"backend URL must start with http:// or https://: {u!r}")
    cache = None
    if config:
        from tiered_cache.client import connect

        cache = connect(_load(config), embedded="never")
    run_router(prefill, decode, host, port, cache=cache)


# ------------------------------------------------------------------- simulate


@main.command()
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (last line).")
@friendly
def simulate(
    trace: str,
    tier_specs: tuple[str, ...],
    policy: str,
    admission: str,
    block_bytes: str,
    limit: int | None,
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
    rep = sim.run(records, tiers, policies, admission, nbytes)
    click.echo(json.dumps(rep) if as_json else sim.format_report(rep))


if __name__ == "__main__":
    sys.exit(main())
