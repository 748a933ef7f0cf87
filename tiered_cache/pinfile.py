"""Pin files: the YAML that ``tiered-cache pin export`` writes and that ``pin import FILE``
and the node agent's ``agent.pin_file`` read.

One reader and one diff for both, so a file means the same thing to each:

- ``read_pin_file`` parses and validates the whole file before anything changes. A TTL
  pin's TTL starts at import; an entry without ``id`` gets one derived from its
  fingerprint and chunk keys, so importing the same file again (another agent, a restart)
  updates that pin instead of adding a copy.
- ``plan_pin_import`` compares the file with the current pin list by id: pins that are new
  are added, pins whose content differs are updated, the rest are left alone (so an
  unchanged TTL pin keeps its expiry); with ``prune``, pins absent from the file are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tiered_cache.config import ConfigError

if TYPE_CHECKING:
    from tiered_cache.config import CacheConfig
    from tiered_cache.directory import Pin


class PinFileError(ConfigError):
    """A pin file that cannot be read or validated; the message names the file."""


# Fields that make two pins with the same id the same pin (created_at/expires_at are not:
# they are set at import).
_SAME_FIELDS = ("note", "name", "owner", "tiers", "ttl_s", "keys", "tokens", "fingerprint")


def derived_pin_id(fingerprint: str, keys: Iterable[str]) -> str:
    """A stable id for a file entry without one: the same prefix always gets the same id."""
    blob = json.dumps({"fingerprint": fingerprint.lower(), "keys": list(keys)})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def pin_budget_error(cfg: CacheConfig, tiers: Iterable[str], need: int) -> str | None:
    """Why ``need`` bytes of pinned chunks do not fit a tier's pin budget, or None."""
    caps = {
        "dram": (cfg.dram.enabled, cfg.dram.capacity, cfg.dram.pin_budget_fraction),
        "nvme": (cfg.nvme.enabled, cfg.nvme.capacity, cfg.nvme.pin_budget_fraction),
        "s3": (cfg.s3.enabled, cfg.s3.capacity, cfg.s3.pin_budget_fraction),
    }
    for t in tiers:
        enabled, cap, frac = caps[t]
        if enabled and cap and need > cap * frac:
            return (
                f"pin of {need} B does not fit the {t} pin budget of {int(cap * frac)} B "
                f"({frac:.0%} of {cap} B)"
            )
    return None


def read_pin_file(
    path: str | os.PathLike[str], cfg: CacheConfig | None = None, *, now: float | None = None
) -> list[Pin]:
    """The pins of ``path``, validated (and checked against ``cfg``'s pin budgets when
    given). Raises PinFileError naming the file and, for a bad entry, its position."""
    import yaml
    from pydantic import ValidationError

    from tiered_cache.config import format_validation_error
    from tiered_cache.directory import Pin

    file = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise PinFileError(f"pin file not found: {file}") from None
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise PinFileError(f"{file}: cannot read pin file: {why}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PinFileError(f"{file}: invalid YAML: {str(e).splitlines()[0]}") from None
    if isinstance(doc, list):
        doc = {"pins": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("pins"), list):
        raise PinFileError(f"{file}: expected a mapping with a `pins:` list")
    now = time.time() if now is None else now
    pins: list[Pin] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(doc["pins"], 1):
        if not isinstance(entry, Mapping):
            raise PinFileError(f"{file}: pin #{i} is not a mapping")
        given = {k: v for k, v in entry.items() if not (k == "id" and v is None)}
        try:
            p = Pin.model_validate({**given, "created_at": now, "expires_at": None})
        except ValidationError as e:
            raise PinFileError(f"{file}: pin #{i}: {format_validation_error(e)}") from None
        if "id" not in given:
            p = p.model_copy(update={"id": derived_pin_id(p.fingerprint, p.keys)})
        if cfg is not None:
            err = pin_budget_error(cfg, p.tiers, (p.bytes_per_chunk or 0) * len(p.keys))
            if err:
                raise PinFileError(f"{file}: pin #{i} ({p.id}): {err}")
        if p.id in seen:
            raise PinFileError(
                f"{file}: duplicate pin ids: pins #{seen[p.id]} and #{i} are both {p.id}"
                + ("" if "id" in given else " (an entry without id gets one from its keys)")
            )
        seen[p.id] = i
        pins.append(p)
    return pins


def same_pin(a: Pin, b: Pin) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _SAME_FIELDS)


@dataclass
class PinImport:
    """What importing a pin file changes: ``actions`` in file order, then ``removed``."""

    actions: list[tuple[str, Pin]] = field(default_factory=list)  # added/updated/unchanged
    removed: list[str] = field(default_factory=list)

    @property
    def changes(self) -> list[tuple[str, Pin]]:
        return [(what, p) for what, p in self.actions if what != "unchanged"]

    def counts(self) -> dict[str, int]:
        out = {"added": 0, "updated": 0, "unchanged": 0, "removed": len(self.removed)}
        for what, _ in self.actions:
            out[what] += 1
        return out

    def summary(self) -> str:
        """``2 added, 0 updated, 1 unchanged`` (``, N removed`` when some were)."""
        return ", ".join(f"{n} {k}" for k, n in self.counts().items() if n or k != "removed")


def plan_pin_import(
    wanted: Iterable[Pin], current: Iterable[Pin], *, prune: bool = False
) -> PinImport:
    """Diff a file's pins against the current pin list (by id)."""
    have = {p.id: p for p in current}
    plan = PinImport()
    ids: set[str] = set()
    for p in wanted:
        ids.add(p.id)
        old = have.get(p.id)
        what = "unchanged" if old and same_pin(old, p) else ("updated" if old else "added")
        plan.actions.append((what, p))
    if prune:
        plan.removed = sorted(set(have) - ids)
    return plan
