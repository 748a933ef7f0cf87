"""Simulator inputs: ``--tier`` and ``--policy`` specs, and Mooncake-format traces."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from policies import ADMISSION_POLICIES, EVICTION_POLICIES
from tiered_cache.api import TIERS
from tiered_cache.config import parse_size
from tiered_cache.simulate.stubs import BLOCK_TOKENS, DEFAULT_BLOCK_BYTES, Record, SimError


@dataclass(frozen=True)
class TierSpec:
    name: str
    capacity_blocks: int
    eviction: str | None = None  # None: the run's policy
    admission: str | None = None  # None: the run's admission


_TIER_RE = re.compile(r"^\s*([A-Za-z0-9_]+)\s*=\s*([^:]+?)\s*(?::([^:]*))?(?::([^:]*))?\s*$")


def parse_tier(spec: str, block_bytes: int = DEFAULT_BLOCK_BYTES) -> TierSpec:
    """``NAME=SIZE[:EVICTION[:ADMISSION]]``. A bare SIZE counts blocks; with a unit
    (``64GiB``) it is bytes, turned into whole blocks of ``block_bytes``."""
    m = _TIER_RE.match(spec)
    if not m:
        raise SimError(f"bad --tier {spec!r}: use NAME=SIZE[:EVICTION[:ADMISSION]], e.g. dram=8000")
    name, size, ev, adm = m.group(1).lower(), m.group(2), m.group(3), m.group(4)
    if name not in TIERS:
        raise SimError(f"bad --tier {spec!r}: tier must be one of {', '.join(TIERS)}")
    if size.isdigit():
        blocks = int(size)
    else:
        try:
            blocks = parse_size(size) // block_bytes
        except ValueError as e:
            raise SimError(f"bad --tier {spec!r}: {e}") from None
    if blocks < 1:
        raise SimError(f"bad --tier {spec!r}: capacity must be at least one block")
    if ev:
        check_policy(ev)
    if adm:
        check_admission(adm)
    return TierSpec(name, blocks, ev.lower() if ev else None, adm.lower() if adm else None)


def check_policy(name: str) -> str:
    if name.lower() not in EVICTION_POLICIES:
        raise SimError(
            f"unknown policy {name!r}; valid: all, {', '.join(sorted(EVICTION_POLICIES))}"
        )
    return name.lower()


def check_admission(name: str) -> str:
    if name.lower() not in ADMISSION_POLICIES:
        raise SimError(
            f"unknown admission policy {name!r}; valid: {', '.join(sorted(ADMISSION_POLICIES))}"
        )
    return name.lower()


def parse_policies(spec: str) -> list[str]:
    """``all``, one name, or a comma-separated list."""
    if spec.strip().lower() == "all":
        return sorted(EVICTION_POLICIES)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise SimError("empty --policy")
    return [check_policy(n) for n in names]


def load_trace(path: str | Path, limit: int | None = None) -> list[Record]:
    """Read a Mooncake-format JSONL trace (``hash_ids`` and ``input_length`` needed)."""
    if limit is not None and limit < 1:
        raise SimError("--limit must be at least 1")
    p = Path(path)
    if not p.is_file():
        raise SimError(f"trace not found: {path}")
    out: list[Record] = []
    with open(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = rec["hash_ids"]
                if not isinstance(ids, list) or not all(
                    isinstance(x, int) and 0 <= x < 1 << 128 for x in ids
                ):
                    raise TypeError("hash_ids must be a list of integers in [0, 2**128)")
                rec.setdefault("input_length", len(ids) * BLOCK_TOKENS)
            except (ValueError, KeyError, TypeError) as e:
                raise SimError(f"{path}:{lineno}: not a Mooncake trace record ({e})") from None
            out.append(rec)
            if limit is not None and len(out) >= limit:
                break
    return out
