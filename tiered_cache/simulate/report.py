"""The CLI's report: every policy plus the references (``run``), and its table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiered_cache.simulate.engine import belady, simulate, unbounded
from tiered_cache.simulate.specs import TierSpec
from tiered_cache.simulate.stubs import BLOCK_TOKENS, DEFAULT_BLOCK_BYTES, Record


def run(
    records: Sequence[Record],
    tiers: Sequence[TierSpec],
    policies: Sequence[str],
    admission: str = "always",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    block_tokens: int = BLOCK_TOKENS,
    capacity_hints: bool = False,
    demand_belady: bool = False,
) -> dict[str, Any]:
    """Every policy plus the references, as the JSON report the CLI prints.
    ``demand_belady`` adds demand-paging MIN (another O(n log n) pass), the only
    reference with a write volume."""
    total = sum(t.capacity_blocks for t in tiers)
    ref = belady(records, total, True, block_bytes, block_tokens)
    unb = unbounded(records, block_bytes, block_tokens)
    out: dict[str, Any] = {"policies": {}}
    for p in policies:
        r = simulate(records, tiers, p, admission, block_bytes, block_tokens, capacity_hints)
        d = r.to_dict()
        d["ratio_to_belady"] = (
            r.prefix_hit_ratio / ref.prefix_hit_ratio if ref.prefix_hit_ratio else None
        )
        out["policies"][p] = d
    out.update(
        {
            "belady_prefix_hit_ratio": ref.prefix_hit_ratio,
            "unbounded_prefix_hit_ratio": unb.prefix_hit_ratio,
            "belady": ref.to_dict(),
            "unbounded": unb.to_dict(),
            "requests": len(records),
            "blocks": ref.blocks,
            "capacity_blocks": total,
            "tiers": [
                {
                    "name": t.name,
                    "capacity_blocks": t.capacity_blocks,
                    "eviction": t.eviction,  # None: the run's policy
                    "admission": t.admission or admission,
                }
                for t in tiers
            ],
            "block_bytes": block_bytes,
            "admission": admission,
        }
    )
    if demand_belady:
        dem = belady(records, total, False, block_bytes, block_tokens)
        out["belady_demand_prefix_hit_ratio"] = dem.prefix_hit_ratio
        out["belady_demand"] = dem.to_dict()
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def format_report(rep: dict[str, Any]) -> str:
    """Human-readable table of a ``run`` report."""
    tiers = [t["name"] for t in rep["tiers"]]
    caps = ", ".join(
        f"{t['name']}={t['capacity_blocks']}"
        + (
            f" ({t['eviction'] or '*'}/{t['admission']})"
            if t["eviction"] or t["admission"] != rep["admission"]
            else ""
        )
        for t in rep["tiers"]
    )
    lines = [
        f"{rep['requests']} requests, {rep['blocks']} blocks; capacity {caps} blocks "
        f"({rep['block_bytes'] / 2**20:g} MiB each)",
        "",
    ]
    head = f"{'policy':<14}{'prefix hit':>11}{'/belady':>9}{'tok saved':>12}{'attn saved':>11}"
    head += "".join(f"{t + ' hit':>10}" for t in tiers)
    head += "".join(f"{t + ' written':>18}" for t in tiers)
    lines.append(head)
    for name, d in rep["policies"].items():
        row = f"{name:<14}{d['prefix_hit_ratio']:>11.3f}"
        ratio = d.get("ratio_to_belady")
        row += f"{ratio:>9.3f}" if ratio is not None else f"{'-':>9}"
        row += f"{d['prefill_tokens_saved']:>12,}{d['attention_saved_ratio']:>11.3f}"
        row += "".join(f"{d['tiers'][t]['hit_ratio']:>10.3f}" for t in tiers)
        row += "".join(f"{_gib(d['tiers'][t]['bytes_written']):>18}" for t in tiers)
        lines.append(row)
    for ref in ("belady", "belady_demand", "unbounded"):
        if ref not in rep:
            continue
        d = rep[ref]
        row = f"{ref:<14}{d['prefix_hit_ratio']:>11.3f}{'':>9}{d['prefill_tokens_saved']:>12,}"
        row += f"{d['attention_saved_ratio']:>11.3f}"
        row += (
            "   (unbounded"
            if ref == "unbounded"
            else f"   (one tier of {rep['capacity_blocks']} blocks"
        )
        if d["bytes_written"] is not None:
            row += f", {_gib(d['bytes_written'])} written"
        row += ")"
        lines.append(row)
    return "\n".join(lines)
