"""``pin add`` and ``pin warm``: a prompt prefix to chunk keys (tokenizer, model config,
registered fingerprints) and making those chunks resident (copy or prefill via vLLM)."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import click

from tiered_cache.cli.common import (
    CliError,
    _Admin,
    _cfg_opt,
    _GivenFingerprint,
    _json_opt,
    _load,
    _registrations_for,
    _tier_list,
    _token_opt,
    friendly,
)
from tiered_cache.cli.fmt import _fmt_bytes
from tiered_cache.config import CacheConfig, parse_duration
from tiered_cache.keys import ModelFingerprint


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
    per_layer = 2 * kvh * hd  # K and V of every KV head, a token
    if c.get("kv_lora_rank"):  # MLA: one latent plus the rope key
        per_layer = int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim") or 0)
    return int(c["num_hidden_layers"]) * per_layer * nbytes * chunk_size


def _check_budget(cfg: CacheConfig, tiers: list[str], need: int) -> None:
    from tiered_cache.pinfile import pin_budget_error

    err = pin_budget_error(cfg, tiers, need)
    if err:
        raise CliError(err)


@click.command("add")
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
    "--dtype",
    default="float32",
    show_default=True,
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
@click.option(
    "--tenant",
    help="A tenant of the config's router.tenants: pin with its secret salt, as its requests"
    " through the router are keyed.",
)
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
    tenant: str | None,
    note: str,
    owner: str,
    as_json: bool,
) -> None:
    """Pin a prefix: print its id, chunks and bytes."""
    from tiered_cache.directory import Pin
    from tiered_cache.keys import chunk_keys
    from tiered_cache.tenancy import tenant_of_salt, tenant_salt

    cfg = _load(config)
    if tenant:
        spec = next((t for t in cfg.router.tenants if t.name == tenant), None)
        if spec is None:
            raise CliError(f"--tenant {tenant!r} is not in the config's router.tenants")
        if salt:
            raise CliError("give --tenant or --salt, not both (a tenant's salt is its own)")
        salt = tenant_salt(spec.name, spec.salt.get_secret_value())
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
        # One per KV shard, as the connector logs them (MLA: every rank logs the same one).
        for h in dict.fromkeys(fingerprints):
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
        tenant=tenant_of_salt(salt),
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
            f" in {','.join(tier_list)}"
            + (f", ttl {ttl}" if ttl_s else ", no ttl (hard pin)")
            + (f", {len(fps)} registered fingerprints" if len(regs) > 1 else "")
        )


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


@click.command("warm")
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
