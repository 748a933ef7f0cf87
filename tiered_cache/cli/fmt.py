"""Text output of the admin commands: sizes, ages, percentages, tables, the stats view."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


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
