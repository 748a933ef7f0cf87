"""``tiered-cache`` command line: the node agent and the admin commands.

Errors are one line on stderr with a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from tiered_cache.api import TIERS
from tiered_cache.config import CacheConfig, ConfigError, load_config, parse_duration
from tiered_cache.keys import ModelFingerprint

if TYPE_CHECKING:
    from tiered_cache.directory import ModelRegistration

F = TypeVar("F", bound=Callable[..., Any])


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


# Long-running commands log at INFO; admin commands only print their result or a one-line
# error (library warnings, e.g. "Redis unavailable", would add lines), unless -v.
_SERVICES = ("agent", "router", "dashboard", "simulate")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """tiered-cache: a tiered KV cache (DRAM -> NVMe -> S3) for vLLM."""
    quiet = ctx.invoked_subcommand not in _SERVICES
    logging.basicConfig(
        level=logging.DEBUG if verbose else (logging.CRITICAL if quiet else logging.INFO),
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


def _tier_list(tiers: str, what: str = "tier") -> list[str]:
    tier_list = [t.strip() for t in tiers.split(",") if t.strip()]
    bad = [t for t in tier_list if t not in TIERS]
    if bad or not tier_list:
        raise CliError(f"unknown {what} {', '.join(bad) or '(none)'}; valid: {', '.join(TIERS)}")
    return list(dict.fromkeys(tier_list))


def _agent_op(cfg: CacheConfig, op: str, *, hint: str = "", **kw: Any) -> dict[str, Any]:
    """One request to this node's agent over its socket (no shared-memory attach)."""
    from tiered_cache.protocol import AgentUnreachable, agent_call, request

    try:
        return asyncio.run(agent_call(cfg.socket_path, request(op, **kw)))
    except AgentUnreachable:
        raise CliError(
            f"no node agent at {cfg.socket_path}; start `tiered-cache agent`{hint}"
        ) from None


def _redis(cfg: CacheConfig, fn: Callable[[Any], Any], *, check: bool = True) -> Any:
    """Run ``fn(directory)`` against Redis. Reads check reachability first, since the
    directory answers reads from its last known state when Redis is down."""
    from tiered_cache.directory import RedisDirectory

    async def go() -> Any:
        d = RedisDirectory.from_url(cfg.redis_url or "")
        try:
            if check:
                await d.check()
            return await fn(d)
        finally:
            await d.close()

    return asyncio.run(go())


def _registered_models(cfg: CacheConfig) -> list[ModelRegistration]:
    """Fingerprints vLLM connectors registered: from Redis, else from this node's agent."""
    from tiered_cache.directory import ModelRegistration

    if cfg.redis_url:
        return list(_redis(cfg, lambda d: d.models()))
    docs = _agent_op(cfg, "models", hint=" or set redis_url")["models"]
    return [ModelRegistration.model_validate(d) for d in docs]


def _canon(name: str) -> str:
    return os.path.realpath(name) if os.path.exists(name) else name


def _registrations_for(
    cfg: CacheConfig, model: str, chunk_size: int | None
) -> list[ModelRegistration]:
    """Every registered fingerprint of ``model`` (its id, a served name or its directory)."""
    regs = _registered_models(cfg)
    want = _canon(model)
    mine = [r for r in regs if want in {_canon(n) for n in r.names()}]
    if not mine:
        known = sorted({r.model_id for r in regs})
        raise CliError(
            f"no vLLM instance has registered model {model!r} yet"
            + (f" (registered: {', '.join(known)})" if known else "")
            + "; start it with the TieredCacheConnector (it registers its KV fingerprint "
            "with the node agent), or pass --fingerprint, or --kv-layout/--block-size/"
            "--dtype/--tp-size to build the fingerprint by hand"
        )
    if chunk_size:
        sized = [r for r in mine if r.chunk_size == chunk_size]
        if not sized:
            have = ", ".join(str(c) for c in sorted({r.chunk_size for r in mine}))
            raise CliError(
                f"model {model!r} is registered with chunk size {have}, not --chunk-size "
                f"{chunk_size}"
            )
        mine = sized
    return mine


@dataclasses.dataclass(frozen=True)
class _GivenFingerprint(ModelFingerprint):
    """A fingerprint known only by its digest (as the vLLM connector logs it)."""

    given: bytes = b""

    @property
    def digest(self) -> bytes:
        return self.given


class _Admin:
    """Pin-list access: Redis directly when configured, else the node agent's socket."""

    def __init__(self, cfg: CacheConfig, token: str | None) -> None:
        self.cfg = cfg
        self.token = token

    def _need_token(self, what: str) -> None:
        if self.cfg.agent.auth_token and self.token != self.cfg.agent.auth_token:
            raise CliError(f"{what} needs the admin token (--token or TIERED_CACHE_TOKEN)")

    def _op(self, op: str, **kw: Any) -> dict[str, Any]:
        hint = "" if self.cfg.redis_url else " or set redis_url"
        return _agent_op(self.cfg, op, hint=hint, **kw)

    def add(self, pin: Any, chunk_bytes: int) -> str:
        if self.cfg.redis_url:
            self._need_token("pin add")
            _redis(self.cfg, lambda d: d.add_pin(pin), check=False)
            return str(pin.id)
        return str(
            self._op("pin_add", pin=pin.model_dump(), chunk_bytes=chunk_bytes, token=self.token)[
                "id"
            ]
        )

    def remove(self, pin_id: str) -> bool:
        if self.cfg.redis_url:
            self._need_token("pin rm")
            return bool(_redis(self.cfg, lambda d: d.remove_pin(pin_id), check=False))
        return bool(self._op("pin_rm", id=pin_id, token=self.token)["removed"])

    def list(
        self, *, fleet: bool = False
    ) -> tuple[list[Any], dict[str, dict[str, str]], dict[str, dict[str, list[str]]]]:
        """Pins, their residency on this node (when its agent runs) and, with Redis and
        ``fleet``, the nodes holding each pin per tier."""
        from tiered_cache.dashboard import Collector
        from tiered_cache.directory import Pin
        from tiered_cache.protocol import AgentUnreachable, PinLs, agent_call

        pins: list[Any] = []
        res: dict[str, dict[str, str]] = {}
        try:
            r = asyncio.run(agent_call(self.cfg.socket_path, PinLs()))
            pins = [Pin.model_validate(p) for p in r["pins"]]
            res = r["residency"]
            have_agent = True
        except AgentUnreachable:
            if not self.cfg.redis_url:
                raise CliError(
                    f"no node agent at {self.cfg.socket_path} and no redis_url configured; "
                    "start `tiered-cache agent` or set redis_url"
                ) from None
            have_agent = False
        where: dict[str, dict[str, list[str]]] = {}
        if self.cfg.redis_url and (fleet or not have_agent):

            async def read(d: Any) -> tuple[list[Any], dict[str, dict[str, list[str]]]]:
                ps = pins if have_agent else await d.list_pins()
                f = await Collector._fleet(d, [p.model_dump() for p in ps]) if fleet else {}
                return ps, f

            pins, where = _redis(self.cfg, read)
        return pins, res, where

    def get(self, pin_id: str) -> Any:
        pins, _, _ = self.list()
        for p in pins:
            if p.id == pin_id:
                return p
        raise CliError(f"no pin with id {pin_id}")


def _check_budget(cfg: CacheConfig, tiers: list[str], need: int) -> None:
    from tiered_cache.pinfile import pin_budget_error

    err = pin_budget_error(cfg, tiers, need)
    if err:
        raise CliError(err)


@main.group()
def pin() -> None:
    """Pin hot prefixes (system prompts) so they are never evicted from named tiers."""


_cfg_opt = click.option("-c", "--config", type=click.Path(dir_okay=False), help="YAML config.")
_token_opt = click.option(
    "--token", envvar="TIERED_CACHE_TOKEN", help="Admin token (env TIERED_CACHE_TOKEN)."
)
_json_opt = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


@pin.command("add")
@_cfg_opt
@_token_opt
@click.option("--text", help="Prefix text, tokenized with --model's tokenizer.")
@click.option("--file", "file", type=click.Path(exists=True, dir_okay=False), help="Text file.")
@click.option("--tokens", help="Token ids: '1,2,3' or @file.")
@click.option(
    "--model",
    help="Model id, served name or directory: pins under every fingerprint the vLLM "
    "instances serving it registered (see `tiered-cache models`); tokenizes --text/--file.",
)
@click.option(
    "--dtype", default="float32", show_default=True,
    help="With --kv-layout/--block-size/--tp-size: build the fingerprint by hand "
    "instead of using the registered ones.",
)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--kv-layout", default="LBHNC", show_default=True)
@click.option("--tp-size", type=int, default=1, show_default=True)
@click.option(
    "--fingerprint",
    "fingerprints",
    multiple=True,
    help="The connector's fingerprint (hex, from its startup log), one per TP rank; "
    "replaces --model/--dtype/--kv-layout/--tp-size for the keys.",
)
@click.option("--chunk-size", type=int, help="Tokens per chunk (default: the config's).")
@click.option("--tiers", default="dram", show_default=True, help="Comma list of dram,nvme,s3.")
@click.option("--ttl", default="none", show_default=True, help="e.g. 24h, 30m; none = hard pin.")
@click.option("--salt", help="cache_salt of the tenant.")
@click.option("--note", default="", help="Free text shown by `pin ls`.")
@click.option("--owner", default=lambda: os.environ.get("USER", "admin"))
@_json_opt
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
    fingerprints: tuple[str, ...],
    chunk_size: int | None,
    tiers: str,
    ttl: str,
    salt: str | None,
    note: str,
    owner: str,
    as_json: bool,
) -> None:
    """Pin a prefix: print its id, chunks and bytes."""
    from tiered_cache.directory import Pin
    from tiered_cache.keys import chunk_keys

    cfg = _load(config)
    tier_list = _tier_list(tiers)
    ttl_s = parse_duration(ttl)
    ctx = click.get_current_context()
    by_hand = any(
        ctx.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT
        for p in ("dtype", "block_size", "kv_layout", "tp_size")
    )
    # The connector's KV layout and block size are only known inside vLLM, so by default
    # --model means "the fingerprints its vLLM instances registered".
    regs = (
        _registrations_for(cfg, model, chunk_size)
        if model is not None and not fingerprints and not by_hand
        else []
    )
    tok_src = model
    if regs and model is not None and not os.path.exists(model):
        tok_src = regs[0].tokenizer or regs[0].model_id  # --model named a served name
    toks = _tokens(text, file, tokens, tok_src)
    keys_all: list[str] = []
    fp_hex = ""
    csize = chunk_size or cfg.chunk_size
    if not regs and csize % block_size:
        raise CliError(f"--chunk-size {csize} must be a multiple of --block-size {block_size}")
    fps: list[ModelFingerprint] = []
    cb = 0
    if regs:
        fps = [r.fingerprint() for r in regs]
        csize = min(r.chunk_size for r in regs)
        for r in regs:  # per-rank share of a chunk's KV; the largest when they differ
            path = model if model and os.path.exists(model) else r.model_id
            cb = max(cb, _chunk_bytes(path, r.dtype, r.chunk_size) // r.tp_world_size)
    elif fingerprints:
        for h in fingerprints:  # one per TP rank, as the connector logs them
            try:
                digest = bytes.fromhex(h)
            except ValueError:
                digest = b""
            if len(digest) != 16:
                raise CliError(f"--fingerprint takes 32 hex characters, got {h!r}")
            fps.append(
                _GivenFingerprint("given", block_size=block_size, chunk_size=csize, given=digest)
            )
    else:
        fps = [
            ModelFingerprint(
                model_id=model or "default",
                dtype=dtype,
                kv_layout=kv_layout,
                block_size=block_size,
                tp_rank=rank,
                tp_world_size=tp_size,
                chunk_size=csize,
            )
            for rank in range(tp_size)
        ]
    for fp in fps:
        keys_all.extend(chunk_keys(toks, fp, cache_salt=salt))
        fp_hex = fp_hex or fp.hex
    if not keys_all:
        raise CliError(
            f"prefix has {len(toks)} tokens, fewer than one chunk ({csize}); "
            "only whole chunks are pinned"
        )
    if not regs:
        cb = _chunk_bytes(model, dtype, csize) // max(1, len(fps))
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
        tokens=toks,
    )
    pin_id = _Admin(cfg, token).add(p, cb)
    info = {
        "id": pin_id,
        "chunks": len(keys_all),
        "tokens": len(toks),
        "bytes": cb * len(keys_all),
        "tiers": tier_list,
        "ttl_s": ttl_s,
        "fingerprints": [fp.hex for fp in fps],
    }
    if as_json:
        click.echo(json.dumps(info))
    else:
        click.echo(
            f"pinned {pin_id}: {len(keys_all)} chunks, {len(toks)} tokens, "
            f"{_fmt_bytes(cb * len(keys_all)) if cb else 'size unknown (no --model config)'}"
            f" in {','.join(tier_list)}" + (f", ttl {ttl}" if ttl_s else ", no ttl (hard pin)")
            + (f", {len(fps)} registered fingerprints" if len(regs) > 1 else "")
        )


@main.command("models")
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


def _fmt_bytes(n: float | None) -> str:
    if not n:
        return "?" if n is None else "0B"
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{f:.0f}{unit}" if unit == "B" else f"{f:.1f}{unit}"
        f /= 1024
    return str(n)


def _fmt_age(s: float | None) -> str:
    if s is None:
        return "none"
    s = max(0.0, float(s))
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _table(rows: list[list[str]], right: Collection[int] = ()) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


@pin.command("ls")
@_cfg_opt
@click.option("--fleet/--no-fleet", default=True, help="With Redis: which nodes hold each pin.")
@_json_opt
@friendly
def pin_ls(config: str | None, fleet: bool, as_json: bool) -> None:
    """List pins: owner, age, TTL left, bytes, residency per tier (resident/pending/missing)."""
    from tiered_cache.dashboard import pin_rows

    cfg = _load(config)
    pins, res, where = _Admin(cfg, None).list(fleet=fleet)
    rows = pin_rows([p.model_dump() for p in pins], res, where)
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no pins")
        return
    table = [["ID", "OWNER", "AGE", "TTL LEFT", "CHUNKS", "BYTES", "RESIDENCY", "NOTE"]]
    if where:
        table[0].insert(7, "FLEET")
    for r in rows:
        resid = " ".join(f"{t}={r['residency'].get(t, '?')}" for t in r["tiers"])
        line = [
            r["id"],
            r["owner"][:12],
            _fmt_age(r["age_s"]),
            "hard pin" if r["ttl_left_s"] is None else _fmt_age(r["ttl_left_s"]),
            str(r["chunks"]),
            _fmt_bytes(r["bytes"]) if r["bytes"] else "?",
            resid,
            r["note"],
        ]
        if where:
            line.insert(7, " ".join(f"{t}={len(n)}" for t, n in r["fleet"].items()))
        table.append(line)
    click.echo(_table(table, right={2, 3, 4, 5}))


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


_EXPORT_FIELDS = (
    "id",
    "name",
    "note",
    "owner",
    "tiers",
    "ttl_s",
    "fingerprint",
    "num_tokens",
    "bytes_per_chunk",
    "keys",
    "tokens",
)


def _export_doc(pins: list[Any]) -> dict[str, Any]:
    out = []
    for p in pins:
        d = p.model_dump()
        out.append({k: d[k] for k in _EXPORT_FIELDS if d.get(k) not in (None, "")})
    return {"version": 1, "pins": out}


@pin.command("export")
@_cfg_opt
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="File (default: stdout).")
@friendly
def pin_export(config: str | None, output: str | None) -> None:
    """Write the pin list as YAML (keep it in git; restore with `pin import`)."""
    import yaml

    cfg = _load(config)
    pins, _, _ = _Admin(cfg, None).list()
    text = (
        "# tiered-cache pins: `tiered-cache pin import FILE` restores them.\n"
        "# A TTL pin's TTL starts again when it is imported.\n"
        + yaml.safe_dump(_export_doc(pins), sort_keys=False, default_flow_style=None, width=100)
    )
    if output:
        Path(output).write_text(text)
        click.echo(f"wrote {len(pins)} pins to {output}", err=True)
    else:
        click.echo(text, nl=False)


@pin.command("import")
@_cfg_opt
@_token_opt
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--prune", is_flag=True, help="Also remove pins that are not in FILE.")
@click.option("--dry-run", is_flag=True, help="Print what would change, change nothing.")
@friendly
def pin_import(
    config: str | None, token: str | None, file: str, prune: bool, dry_run: bool
) -> None:
    """Add or update the pins of a YAML file written by `pin export`.

    The node agent imports its `agent.pin_file` the same way at start-up."""
    from tiered_cache.pinfile import plan_pin_import, read_pin_file

    cfg = _load(config)
    wanted = read_pin_file(file, cfg)  # the whole file is checked before anything changes
    admin = _Admin(cfg, token)
    plan = plan_pin_import(wanted, admin.list()[0], prune=prune)
    would = "would be " if dry_run else ""
    for what, p in plan.changes:
        click.echo(f"{would}{what}: {p.id} {p.note}".rstrip())
        if not dry_run:
            admin.add(p, p.bytes_per_chunk or 0)
    for pid in plan.removed:
        click.echo(f"{would}removed: {pid}")
        if not dry_run:
            admin.remove(pid)
    click.echo(("dry run: " if dry_run else "") + plan.summary())


def _prefill(
    server: str, model: str | None, tokens: list[int], salt: str | None, timeout: float
) -> str:
    """Send the prefix to a vLLM server (OpenAI API) with max_tokens=1, so its connector
    stores the chunks. Returns the model name used."""
    import urllib.error
    import urllib.request

    base = server.rstrip("/").removesuffix("/v1")
    if not base.startswith(("http://", "https://")):
        raise CliError(f"--server must be an http:// or https:// URL, got {server!r}")

    def call(path: str, body: dict[str, Any] | None) -> Any:
        req = urllib.request.Request(
            base + path,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            detail = e.read()[:200].decode(errors="replace").replace("\n", " ")
            raise CliError(f"vLLM at {base} answered {e.code} to {path}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise CliError(f"cannot reach vLLM at {base}: {reason}") from None

    if model is None:
        models = call("/v1/models", None)
        try:
            model = str(models["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise CliError(f"vLLM at {base} lists no model; pass --model") from None
    body: dict[str, Any] = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    call("/v1/completions", body)
    return model


@pin.command("warm")
@_cfg_opt
@_token_opt
@click.argument("pin_id")
@click.option(
    "--server",
    help="vLLM base URL (http://host:8000) to prefill through when no tier has the prefix.",
)
@click.option("--model", help="Served model name for --server (default: its first model).")
@click.option("--salt", help="The cache_salt the pin was made with (sent to --server).")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds.")
@_json_opt
@friendly
def pin_warm(
    config: str | None,
    token: str | None,
    pin_id: str,
    server: str | None,
    model: str | None,
    salt: str | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Make a pinned prefix resident in its tiers on this node.

    Chunks held by some tier (here, a peer or S3) are copied into the pinned tiers; chunks
    held nowhere are prefilled through --server, whose connector stores them.
    """
    cfg = _load(config)
    admin = _Admin(cfg, token)
    r = admin._op("warm", id=pin_id, token=token)
    copied = int(r["copied"])
    prefilled = None
    if r["missing"]:
        n = len(r["missing"])
        if not server:
            raise CliError(
                f"{n} chunks of pin {pin_id} are in no tier; pass --server URL to prefill "
                "them through vLLM"
            )
        p = admin.get(pin_id)
        if not p.tokens:
            raise CliError(f"pin {pin_id} has no stored tokens to prefill; add it again")
        prefilled = _prefill(server, model, p.tokens, salt, timeout)
        deadline = time.monotonic() + min(timeout, 60.0)
        while True:  # the connector stores asynchronously: wait for the chunks to land
            r = admin._op("warm", id=pin_id, token=token)
            copied += int(r["copied"])
            if not r["missing"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if r["missing"]:
            raise CliError(
                f"after prefilling through {server}, {len(r['missing'])} chunks of pin "
                f"{pin_id} are still in no tier (does that server use this node's cache, "
                "with the pin's model, dtype, block size and salt?)"
            )
    out = {"id": pin_id, "copied": copied, "prefilled_via": prefilled, "residency": r["residency"]}
    if as_json:
        click.echo(json.dumps(out))
        return
    resid = " ".join(f"{t}={s}" for t, s in r["residency"].items())
    via = f", prefilled through {server} ({prefilled})" if prefilled else ""
    click.echo(f"warmed {pin_id}: copied {copied} chunk copies{via}; {resid}")


# ------------------------------------------------------------------- cache admin


@main.command("ls")
@_cfg_opt
@click.option("--prefix", default="", help="Key prefix (hex); empty lists everything.")
@click.option("--limit", type=int, default=100, show_default=True)
@_json_opt
@friendly
def ls_cmd(config: str | None, prefix: str, limit: int, as_json: bool) -> None:
    """List chunk keys on this node with a prefix, across tiers."""
    prefix = prefix.lower()
    if not re.fullmatch(r"[0-9a-f]{0,32}", prefix):
        raise CliError("--prefix must be hex (chunk keys are 32 hex characters)")
    cfg = _load(config)
    r = _agent_op(cfg, "ls", prefix=prefix, limit=limit)
    if as_json:
        click.echo(json.dumps({"entries": r["entries"], "total": r["total"]}))
        return
    if not r["entries"]:
        click.echo(f"no chunks with prefix {prefix!r}")
        return
    rows = [["KEY", "TIER", "BYTES", "PINNED"]]
    for e in r["entries"]:
        rows.append([e["key"], e["tier"], _fmt_bytes(e["bytes"]), "yes" if e["pinned"] else ""])
    click.echo(_table(rows, right={2}))
    if r["total"] > len(r["entries"]):
        click.echo(f"... {r['total'] - len(r['entries'])} more (raise --limit)")


@main.command()
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


@main.command()
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


@main.command()
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


def _stats_text(s: dict[str, Any]) -> str:
    lines = []
    head = f"node {s['node_id']}" if s["node_id"] else f"no local agent ({s['agent_error']})"
    lines.append(
        f"{head} · directory {s['directory']}" + ("" if s["directory_ok"] else " (degraded)")
    )
    if s["tiers"]:
        rows = [["TIER", "HIT RATE", "HITS", "HIT TOKENS", "USED", "CAPACITY", "USE", "CHUNKS",
                 "PINNED", "EVICTIONS"]]  # fmt: skip
        for t, v in s["tiers"].items():
            cap = v["capacity_bytes"]
            used = v["used_bytes"]
            rows.append(
                [
                    t,
                    _pct(v["hit_rate"]),
                    f"{v['hits']:.0f}",
                    f"{v['hit_tokens']:.0f}",
                    "-" if used is None else _fmt_bytes(used),
                    "-" if used is None else (_fmt_bytes(cap) if cap else "unbounded"),
                    _pct(used / cap) if cap and used is not None else "-",
                    "-" if v["chunks"] is None else str(v["chunks"]),
                    "-" if v["pinned_bytes"] is None else _fmt_bytes(v["pinned_bytes"]),
                    f"{v['evictions']:.0f}",
                ]
            )
        lines.append(_table(rows, right=set(range(1, 10))))
        lines.append(f"hit rate {_pct(s['hit_rate'])}, misses {s['misses']:.0f}")
        e = s["errors"]
        lines.append(
            "errors: "
            + ", ".join(f"{k.replace('_', ' ')} {v:.0f}" for k, v in e.items())
            + f"; admission rejects {s['admission_rejects']:.0f}"
        )
    c = s["cluster"]
    if c["hits"] or c["misses"]:
        by = ", ".join(f"{t} {_pct(v)}" for t, v in c["hit_rate_by_tier"].items())
        lines.append(f"cluster: hit rate {_pct(c['hit_rate'])} ({by}), misses {c['misses']:.0f}")
    if s["nodes"]:
        rows = [["NODE", "HEARTBEAT", "HIT RATE", "TIER", "USED", "CAPACITY", "USE"]]
        for n in s["nodes"]:
            age = "gone" if not n["live"] else f"{n['heartbeat_age_s'] or 0:.1f}s ago"
            first = True
            for t, u in (n["tiers"] or {"-": {}}).items():
                cap, used = u.get("capacity_bytes"), u.get("used_bytes")
                rows.append(
                    [
                        n["node"] if first else "",
                        age if first else "",
                        _pct(n["hit_rate"]) if first and (n["hits"] or n["misses"]) else "",
                        t,
                        _fmt_bytes(used) if used is not None else "-",
                        (_fmt_bytes(cap) if cap else "unbounded") if u else "-",
                        _pct(used / cap) if cap and used is not None else "-",
                    ]
                )
                first = False
        lines.append(_table(rows, right={2, 4, 5, 6}))
    return "\n".join(lines)


@main.command()
@_cfg_opt
@_json_opt
@click.option("--watch", type=float, metavar="SECONDS", help="Refresh every SECONDS.")
@click.option("--count", type=int, help="With --watch: stop after this many readings.")
@click.option("--scrape", multiple=True, metavar="URL", help="Also read an agent's /metrics.")
@friendly
def stats(
    config: str | None,
    as_json: bool,
    watch: float | None,
    count: int | None,
    scrape: tuple[str, ...],
) -> None:
    """Hit rate per tier, usage and capacity per tier and node, evictions, errors."""
    from tiered_cache.dashboard import Collector, summarize

    cfg = _load(config)
    if watch is not None and watch <= 0:
        raise CliError("--watch takes a positive number of seconds")
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


@main.command()
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

        cache = connect(_load(config), embedded="never", attach_pool=False)
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


if __name__ == "__main__":
    sys.exit(main())
