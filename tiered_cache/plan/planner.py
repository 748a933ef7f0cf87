"""The planner: deployments of one piece of hardware, replayed through ``sim`` at each
rate, reduced to the serving bench's figures, and a verdict.

Deployments (the serving bench's names):

- ``mono``: one vLLM on all the units of a node, its own prefix cache only;
- ``ours``: the same with the tiers (kv_both);
- ``replicas``: a vLLM per ``tp`` units behind the prefix- and load-aware router, tiers
  shared;
- ``replicas-rr``: the same servers, no connector, round robin;
- ``pd`` / ``pd-split``: prefill and decode pools (``P:D`` servers, ``pd-P:D`` when
  several ratios are asked) through the tiers, the router's ``auto`` or ``split``.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_cache.plan.hardware import Hardware
from tiered_cache.plan.model import ModelSpec, PlanError
from tiered_cache.plan.sim import Layout, Outcome, ServerLayout, SimRequest, replay
from tiered_cache.plan.workloads import Request, block_keys

DEPLOYMENTS = ("mono", "ours", "replicas", "replicas-rr", "pd", "pd-split")
FIGURES = ("goodput", "ttft_p50")  # what --validate scores


@dataclass
class Workload:
    """Prompts as chained block keys (arrivals are drawn per rate)."""

    name: str
    prompts: list[tuple[int, int, list[int], str]]  # (tokens, output tokens, keys, kind)
    block_tokens: int
    times: list[float] | None = None  # arrivals recorded by a run (a replay of it)

    def at(self, rate: float, seed: int) -> list[SimRequest]:
        ts = self.times if self.times is not None else arrivals(len(self.prompts), rate, seed)
        return [SimRequest(t, n, o, k, kind) for t, (n, o, k, kind)
                in zip(ts, self.prompts, strict=True)]  # fmt: skip


def from_requests(name: str, reqs: Sequence[Request], block_tokens: int) -> Workload:
    return Workload(name, [(len(r.prompt), r.output_len, block_keys(r.prompt, block_tokens),
                            r.kind) for r in reqs], block_tokens)  # fmt: skip


def from_mooncake(path: str | Path, block_tokens: int, limit: int | None = None,
                  max_output: int | None = None) -> tuple[Workload, float | None]:  # fmt: skip
    """A Mooncake trace (``hash_ids`` of 512-token blocks, ``input_length``,
    ``output_length``, ``timestamp`` in ms): each id split into ``512 // block_tokens``
    block keys. Returns the workload and the trace's own rate (req/s) if it has times."""
    prompts: list[tuple[int, int, list[int], str]] = []
    times: list[float] = []
    per = max(1, 512 // block_tokens)
    try:
        with open(path) as f:
            for i, line in enumerate(f):
                if limit is not None and len(prompts) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    n = int(rec["input_length"])
                    out = max(1, int(rec["output_length"]))
                    ids = list(rec["hash_ids"])
                except (ValueError, KeyError, TypeError) as e:
                    raise PlanError(f"--trace {path}:{i + 1}: not a Mooncake record ({e})"
                                    ) from None  # fmt: skip
                if max_output is not None:
                    out = min(out, max_output)
                # chained: a block's key names its whole prefix
                chained, acc = [], 0
                for k in [hash((h, j)) for h in ids for j in range(per)][: n // block_tokens]:
                    acc = hash((acc, k))
                    chained.append(acc)
                prompts.append((n, out, chained, ""))
                if "timestamp" in rec:
                    times.append(float(rec["timestamp"]) / 1e3)
    except OSError as e:
        raise PlanError(f"--trace: {e}") from None
    if not prompts:
        raise PlanError(f"--trace {path}: no requests")
    span = (max(times) - min(times)) if len(times) > 1 else 0.0
    return Workload(Path(path).stem, prompts, block_tokens), (len(times) / span if span else None)


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """vLLM's benchmark arrivals: exponential gaps (Poisson at ``rate``), rescaled so the
    last request leaves at ``n / rate`` (``get_request`` without ramp-up)."""
    if rate <= 0 or math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, ts = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        ts.append(t)
    return [x * (n / rate) / ts[-1] for x in ts]


def parse_ratios(spec: str) -> list[tuple[int, int]]:
    out = []
    for item in spec.split(","):
        p, _, d = item.partition(":")
        try:
            pr, dr = int(p), int(d)
        except ValueError:
            raise PlanError(f"--ratios: {item!r} is not P:D") from None
        if pr <= 0 or dr <= 0:
            raise PlanError(f"--ratios: {item!r}: both sides must be > 0")
        out.append((pr, dr))
    return out


def layouts(hw: Hardware, names: Sequence[str], ratios: str = "1:1") -> list[Layout]:
    """Each deployment on the same ``hw.units``: servers of ``hw.tp`` units (mono: all a
    node's). A P:D ratio that does not fit is skipped (scaled to fill the units)."""
    tp = hw.tp
    n = hw.units // tp
    per_node = max(1, hw.units_per_node // tp)
    out: list[Layout] = []
    rs = parse_ratios(ratios)

    def srv(name: str, pool: str, i: int, cache: bool) -> ServerLayout:
        return ServerLayout(name, pool, tp, node=i // per_node, cache=cache)

    for name in names:
        if name not in DEPLOYMENTS:
            raise PlanError(f"unknown deployment {name!r} ({', '.join(DEPLOYMENTS)})")
        if name in ("mono", "ours"):
            u = min(hw.units, hw.units_per_node)
            if u not in hw.engines:
                continue
            out.append(Layout(name, [ServerLayout(name, "whole", u, 0, name == "ours")],
                              "none"))  # fmt: skip
        elif name in ("replicas", "replicas-rr"):
            if n < 2:
                continue
            rr = name == "replicas-rr"
            out.append(Layout(name, [srv(f"{name}-{i}", "whole", i, not rr) for i in range(n)],
                              "round_robin" if rr else "whole"))  # fmt: skip
        else:
            for p, d in rs:
                k = n // (p + d)
                if k < 1:
                    continue
                pn, dn = p * k, d * k
                # prefill servers first: on two nodes, prefill on one, decode on the other
                servers = [srv(f"prefill-{i}", "prefill", i, True) for i in range(pn)]
                servers += [srv(f"decode-{i}", "decode", pn + i, True) for i in range(dn)]
                label = name if len(rs) == 1 else f"{name}-{p}:{d}"
                out.append(Layout(label, servers, "auto" if name == "pd" else "split"))
    return out


# ------------------------------------------------------------------------------ figures


def percentile(xs: Sequence[float], p: float) -> float | None:
    """numpy's default (linear) percentile, as vLLM's benchmark reports."""
    s = sorted(xs)
    if not s:
        return None
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Slo:
    ttft_ms: float = 3000.0
    tpot_ms: float = 250.0


def figures(outs: Sequence[Outcome], slo: Slo) -> dict[str, Any]:
    dur = max(o.done for o in outs) if outs else 0.0
    ttft = [o.ttft for o in outs]
    tpot = [o.tpot for o in outs if o.tpot is not None]
    good = sum(1 for o in outs if 1e3 * o.ttft <= slo.ttft_ms
               and (o.tpot is None or 1e3 * o.tpot <= slo.tpot_ms))  # fmt: skip
    prompt = sum(o.prompt for o in outs) or 1
    tiers: dict[str, float] = {}
    for o in outs:
        for t, v in o.tier_hit.items():
            tiers[t] = tiers.get(t, 0) + v
    n = len(outs) or 1

    def ms(x: float | None) -> float | None:
        return None if x is None else 1e3 * x

    return {
        "requests": len(outs),
        "duration_s": dur,
        "throughput": len(outs) / dur if dur else 0.0,
        "goodput": good / dur if dur else 0.0,
        "slo_attainment": good / len(outs) if outs else 0.0,  # share within both SLOs
        "ttft_p50": ms(percentile(ttft, 50)), "ttft_p90": ms(percentile(ttft, 90)),
        "ttft_p99": ms(percentile(ttft, 99)),
        "tpot_p50": ms(percentile(tpot, 50)), "tpot_p90": ms(percentile(tpot, 90)),
        "tpot_p99": ms(percentile(tpot, 99)),
        "hit_rate": {"vllm": sum(o.local_hit for o in outs) / prompt,
                     **{t: v / prompt for t, v in sorted(tiers.items())}},
        "split_share": sum(o.split for o in outs) / n,
        "kv_bytes_per_request": {"loaded": sum(o.load_bytes for o in outs) / n,
                                 "saved": sum(o.save_bytes for o in outs) / n},
        "load_ms_per_request": 1e3 * sum(o.load_s for o in outs) / n,
        "load_ms_per_request_by_link": {
            k: 1e3 * sum(o.link_s.get(k, 0.0) for o in outs) / n
            for k in sorted({k for o in outs for k in o.link_s})},
    }  # fmt: skip


def _mean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in runs[0].items():
        if isinstance(v, dict):
            out[k] = _mean([r[k] for r in runs])
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            vals = [r[k] for r in runs if r.get(k) is not None]
            out[k] = statistics.fmean(vals) if vals else None
        else:
            out[k] = v
    return out


def label(w: Workload, rate: float) -> str:
    """``workload@rate``, as the serving bench labels its results (``chat@1.0``)."""
    return f"{w.name}@{float(rate)}"


def predict(
    hw: Hardware, model: ModelSpec, points: Sequence[tuple[Workload, float]],
    names: Sequence[str] = DEPLOYMENTS, ratios: str = "1:1", slo: Slo | None = None,
    seeds: int = 3,
) -> dict[str, dict[str, dict[str, Any]]]:  # fmt: skip
    """{deployment: {"workload@rate": figures}} for each (workload, rate) point, each the
    mean over ``seeds`` draws of the arrivals (one replay of a workload's recorded
    ``times``)."""
    slo = slo or Slo()
    res: dict[str, dict[str, dict[str, Any]]] = {}
    for w, _ in points:
        if w.block_tokens != hw.block_tokens:
            raise PlanError(f"workload {w.name} has {w.block_tokens}-token blocks, "
                            f"the hardware {hw.block_tokens}")  # fmt: skip
    for lay in layouts(hw, names, ratios):
        per: dict[str, dict[str, Any]] = {}
        for w, rate in points:
            draws = 1 if w.times is not None else seeds  # recorded arrivals: one replay
            runs = [figures(replay(lay, hw, w.at(rate, s), model.kv_bytes_per_token), slo)
                    for s in range(draws)]  # fmt: skip
            per[label(w, rate)] = _mean(runs)
        res[lay.name] = per
    return res


def default_rates(hw: Hardware, works: Sequence[Workload]) -> list[float]:
    """Rates around what the hardware can prefill with no cache at all: every server's
    prefill tokens/s at the mean prompt, over the mean prompt, x 0.25 ... 2."""
    prompts = [n for w in works for n, *_ in w.prompts]
    mean = max(1, round(statistics.fmean(prompts))) if prompts else 1024
    servers = max(1, hw.units // hw.tp)
    cap = servers * hw.engine(hw.tp).prefill_tps(mean) / mean
    return [float(f"{cap * f:.2g}") for f in (0.25, 0.5, 1.0, 1.5, 2.0)]


def best(per_dep: dict[str, dict[str, Any]], tie: float = 0.03) -> str:
    """The deployment with the most goodput; within ``tie`` of it, the lowest TTFT p50
    ("none" when no deployment serves a request within the SLOs)."""
    top = max(f["goodput"] for f in per_dep.values())
    if top <= 0:
        return "none"
    close = {d: f for d, f in per_dep.items() if f["goodput"] >= top * (1 - tie)}
    return min(close, key=lambda d: close[d]["ttft_p50"] or math.inf)


def verdict(pred: dict[str, dict[str, dict[str, Any]]], rates: Sequence[float]
            ) -> dict[str, Any]:  # fmt: skip
    """Per workload: the best deployment at each rate, and the handbook-style line."""
    labels = sorted({lab for per in pred.values() for lab in per},
                    key=lambda s: (s.split("@")[0], float(s.split("@")[1])))  # fmt: skip
    by_w: dict[str, list[tuple[float, str]]] = {}
    for lab in labels:
        w, r = lab.split("@")
        per = {d: pred[d][lab] for d in pred if lab in pred[d]}
        by_w.setdefault(w, []).append((float(r), best(per)))
    lines: dict[str, Any] = {}
    for w, picks in by_w.items():
        served = [(r, d) for r, d in picks if d != "none"]
        over = [r for r, d in picks if d == "none"]
        tail = (f" From {min(over):g} req/s no deployment meets the SLOs on this hardware."
                if over else "")  # fmt: skip
        pd_rates = [r for r, d in served if d.startswith("pd")]
        other = [d for _, d in served if not d.startswith("pd")]
        alt = max(set(other), key=other.count) if other else None
        if not served:
            text = f"{w}: no deployment meets the SLOs at {_span(picks)} req/s."
            tail = ""
        elif not pd_rates:
            text = f"{w}: P/D does not pay at {_span(served)} req/s; run {alt}."
        elif len(pd_rates) == len(served):
            text = f"{w}: P/D pays at every rate served ({_span(served)} req/s)."
        else:
            lo = min(pd_rates)
            below = [d for r, d in served if r < lo and not d.startswith("pd")]
            above = [d for r, d in served if r > lo and not d.startswith("pd")]
            text = (f"{w}: P/D pays off from {lo:g} req/s at this prompt mix; below that, "
                    f"run {below[-1] if below else alt}.")  # fmt: skip
            if above:
                text += f" (Not at every rate above: {', '.join(sorted(set(above)))} too.)"
        lines[w] = {"best": {f"{r:g}": d for r, d in picks}, "verdict": text + tail}
    return lines


def _span(picks: list[tuple[float, str]]) -> str:
    rs = [r for r, _ in picks]
    return f"{min(rs):g}-{max(rs):g}" if len(rs) > 1 else f"{rs[0]:g}"


def table(pred: dict[str, dict[str, dict[str, Any]]]) -> str:
    dw = max([10, *(len(d) for d in pred)]) + 2
    lw = max([4, *(len(lab) for per in pred.values() for lab in per)]) + 2
    rows = [f"{'deployment':<{dw}}{'load':<{lw}}{'goodput':>8}{'TTFT p50':>10}{'p99':>9}"
            f"{'TPOT p50':>10}{'p99':>8}{'split':>7}  hit rate (vllm/tiers)"]  # fmt: skip
    for d, per in pred.items():
        for lab, f in per.items():
            hits = "/".join(f"{k} {v:.0%}" for k, v in f["hit_rate"].items())
            g = {k: "-" if f[k] is None else f"{f[k]:.0f}" for k in
                 ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")}  # fmt: skip
            rows.append(f"{d:<{dw}}{lab:<{lw}}{f['goodput']:>8.2f}{g['ttft_p50']:>10}"
                        f"{g['ttft_p99']:>9}{g['tpot_p50']:>10}{g['tpot_p99']:>8}"
                        f"{f['split_share']:>7.0%}  {hits}")  # fmt: skip
    return "\n".join(rows)


def plot(pred: dict[str, dict[str, dict[str, Any]]], dest: Path) -> list[Path]:
    """Goodput against rate, one chart per workload, a line per deployment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = sorted({lab.split("@")[0] for per in pred.values() for lab in per})
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for w in works:
        fig, ax = plt.subplots(figsize=(6, 4))
        for d, per in pred.items():
            pts = sorted((float(lab.split("@")[1]), f["goodput"]) for lab, f in per.items()
                         if lab.split("@")[0] == w)  # fmt: skip
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=d)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("goodput (req/s within SLO)")
        ax.set_title(f"predicted goodput: {w}")
        ax.grid(alpha=0.3)
        ax.legend()
        p = dest / f"plan_goodput_{w}.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


@dataclass
class Plan:
    model: ModelSpec
    hardware: Hardware
    rates: list[float]
    prediction: dict[str, dict[str, dict[str, Any]]]
    verdicts: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "hardware": self.hardware.to_dict(),
                "rates": self.rates, "prediction": self.prediction,
                "verdict": self.verdicts}  # fmt: skip
