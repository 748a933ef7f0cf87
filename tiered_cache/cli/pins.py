"""The ``pin`` group and the pin-list commands (ls, rm, export, import); ``add`` and
``warm`` live in :mod:`tiered_cache.cli.pin_prefix`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from tiered_cache.cli.common import (
    CliError,
    _Admin,
    _cfg_opt,
    _json_opt,
    _load,
    _token_opt,
    friendly,
)
from tiered_cache.cli.fmt import _fmt_age, _fmt_bytes, _table
from tiered_cache.cli.pin_prefix import pin_add, pin_warm


@click.group()
def pin() -> None:
    """Pin hot prefixes (system prompts) so they are never evicted from named tiers."""


@pin.command("ls")
@_cfg_opt
@click.option("--fleet/--no-fleet", default=True, help="With Redis: which nodes hold each pin.")
@click.option("--tenant", help="Only this tenant's pins (made with `pin add --tenant`).")
@_json_opt
@friendly
def pin_ls(config: str | None, fleet: bool, tenant: str | None, as_json: bool) -> None:
    """List pins: owner, age, TTL left, bytes, residency per tier (resident/pending/missing)."""
    from tiered_cache.dashboard import pin_rows

    cfg = _load(config)
    pins, res, where = _Admin(cfg, None).list(fleet=fleet)
    if tenant is not None:
        pins = [p for p in pins if p.tenant == tenant]
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


pin.add_command(pin_add)
pin.add_command(pin_warm)
