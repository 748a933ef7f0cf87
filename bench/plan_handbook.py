"""The handbook's rules of thumb for P/D, as outputs of the planner (``tiered-cache plan``).

Llama-3-70B (configs/models/llama-3-70b.json, bf16) on 16 H100s (TP 4: four servers, two
a node), the roofline engines of ``tiered_cache.plan.hardware``, and for each rule the
experiment that tests it:

1. "not below about 50 QPS": the rate from which P/D is the best deployment, on the
   Mooncake trace and the serving bench's ``mixed``, with RDMA and with TCP;
2. "not without RDMA": TTFT and TPOT of P/D against replicas as the link between the
   nodes goes from 10 to 800 Gb/s, with the GPU's asynchronous loads and with loads that
   stall the decode's step (a synchronous copy path);
3. "caution above a 70 % prefix hit rate": P/D against replicas as the shared share of
   each prompt goes from 0 to 95 %;
4. "long contexts depend": the same at 2k, 8k and 32k-token prompts.

Prints a table per rule while it runs; ``--json`` ends with one JSON object, ``--out DIR``
writes it with two plots. A few minutes on one core (``--quick``: about one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiered_cache.plan import planner as pl
from tiered_cache.plan.hardware import Hardware, gpu_hardware
from tiered_cache.plan.model import ModelSpec, load_model
from tiered_cache.plan.workloads import bench_workload

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "configs" / "models" / "llama-3-70b.json"
TRACE = REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
DEPS = ["replicas", "pd", "pd-split"]
RATIOS = "1:1,3:1"  # prefill:decode servers of P/D


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def synthetic(name: str, n: int, prompt: int, out: int, shared: float, groups: int,
              block: int, seed: int = 0) -> pl.Workload:  # fmt: skip
    """``n`` prompts of ``prompt`` tokens whose first ``shared`` share is one of
    ``groups`` common prefixes (a system prompt, a document), the rest their own."""
    rng = random.Random(seed)
    blocks = prompt // block
    common = round(shared * blocks)
    prompts = []
    for i in range(n):
        g = rng.randrange(groups)
        keys, acc = [], 0
        for b in range(blocks):
            acc = hash((acc, ("g", g, b) if b < common else ("u", seed, i, b)))
            keys.append(acc)
        prompts.append((prompt, out, keys, ""))
    return pl.Workload(name, prompts, block)


def capacity(hw: Hardware, prompt: int) -> float:
    """Requests/s the servers prefill with no cache (the planner's default rate scale)."""
    return (hw.units // hw.tp) * hw.engine(hw.tp).prefill_tps(prompt) / prompt


def run(hw: Hardware, model: ModelSpec, points: Sequence[tuple[pl.Workload, float]],
        deps: Sequence[str], seeds: int, ratios: str = "1:1") -> dict[str, Any]:  # fmt: skip
    return pl.predict(hw, model, points, deps, ratios, pl.Slo(args.ttft, args.tpot), seeds)


def rule_rate(model: ModelSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    limit = 120 if args.quick else 300
    trace, own = pl.from_mooncake(TRACE, 16, limit=limit)
    mixed = pl.from_requests("mixed", bench_workload("mixed", 96, 0), 16)
    for preset in ("h100x16-rdma400", "h100x16-tcp25"):
        hw = gpu_hardware(model, preset, 4)
        for w in (trace, mixed):
            rates = pl.default_rates(hw, [w])
            pred = run(hw, model, [(w, r) for r in rates], ["replicas", "replicas-rr", "pd",
                                                               "pd-split"], 1, "1:1,1:3,3:1")  # fmt: skip
            v = pl.verdict(pred, rates)[w.name]
            out[f"{preset}/{w.name}"] = {"rates": rates, **v,
                                         "goodput": {d: [f["goodput"] for f in per.values()]
                                                     for d, per in pred.items()}}  # fmt: skip
            say(f"  {preset:<16} {w.name:<26} {v['verdict']}")
    out["trace_own_rate"] = own
    return out


def rule_link(model: ModelSpec) -> dict[str, Any]:
    gbps = [10, 25, 50, 100, 200, 400, 800]
    rows: dict[str, Any] = {}
    base = gpu_hardware(model, "h100x16-rdma400", 4)
    rate = round(0.5 * capacity(base, 8192), 2)
    w = synthetic("unique-8k", sized(rate), 8192, 256, 0.0, 1, 16)
    for blocking in (False, True):
        for g in gbps:
            hw = dataclasses.replace(gpu_hardware(model, "h100x16-rdma400", 4, net_gbps=g),
                                     load_blocks=blocking)  # fmt: skip
            pred = run(hw, model, [(w, rate)], ["replicas", "pd-split"], 1)
            r, p = (pred[d][pl.label(w, rate)] for d in ("replicas", "pd-split"))
            key = f"{'blocking' if blocking else 'async'}@{g}"
            rows[key] = {
                "gbps": g, "blocking_loads": blocking, "rate": rate,
                "handoff_ms": p["load_ms_per_request"],
                **{f"{d}_{k}": f[k] for d, f in (("replicas", r), ("pd", p))
                   for k in ("ttft_p50", "tpot_p50", "tpot_p99", "goodput")},
            }  # fmt: skip
            say(f"  {key:<14} handoff {p['load_ms_per_request']:7.0f} ms  TTFT pd/replicas "
                f"{p['ttft_p50']:6.0f}/{r['ttft_p50']:6.0f} ms  TPOT p99 pd/replicas "
                f"{p['tpot_p99']:5.0f}/{r['tpot_p99']:5.0f} ms")  # fmt: skip
    kv = 8192 * model.kv_bytes_per_token
    pre = base.engine(4).prefill_s(8192)
    return {"rows": rows, "kv_bytes_8k": kv, "prefill_s_8k": pre,
            "gbps_handoff_equals_prefill": 8 * kv / pre / 1e9,
            "gbps_handoff_10pct_of_prefill": 8 * kv / (0.1 * pre) / 1e9}  # fmt: skip


def sized(rate: float) -> int:
    """Requests for a point: ``--span`` seconds of arrivals, so the drain of the last
    answers (seconds of decoding) does not decide the figures."""
    return int(min(3000, max(60, rate * args.span)))


def figs(f: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: f[k] for k in keys}


def rule_hits(model: ModelSpec) -> dict[str, Any]:
    """The same uncached prefill load at every share (0.8 of the servers' prefill
    capacity), so the rate, and the decode load with it, rises with the share."""
    hw = gpu_hardware(model, "h100x16-rdma400", 4)
    rows: dict[str, Any] = {}
    for shared in (0.0, 0.3, 0.5, 0.7, 0.9):
        rate = round(0.8 * capacity(hw, 4096) / (1 - shared), 2)
        w = synthetic(f"shared-{shared:.0%}", sized(rate), 4096, 256, shared, 8, 16, seed=1)
        pred = run(hw, model, [(w, rate)], DEPS, 1, RATIOS)
        f = {d: pred[d][pl.label(w, rate)] for d in pred}
        pick = pl.best(f)
        rows[f"{shared:.2f}"] = {
            "rate": rate, "requests": len(w.prompts), "best": pick,
            "hit_rate": sum(f["replicas"]["hit_rate"].values()),
            **{d: figs(f[d], "goodput", "slo_attainment", "ttft_p50", "tpot_p50", "tpot_p99",
                       "split_share") for d in f},
        }  # fmt: skip
        say(f"  shared {shared:4.0%} at {rate:6.2f} req/s: best {pick:<12} within SLO "
            + " ".join(f"{d} {f[d]['slo_attainment']:.0%}" for d in f)
            + "  TPOT p99 " + " ".join(f"{d} {f[d]['tpot_p99']:.0f}" for d in f))
    return rows


def rule_context(model: ModelSpec) -> dict[str, Any]:
    """Unique prompts of 2k to 32k tokens at 0.7 of the servers' prefill capacity."""
    hw = gpu_hardware(model, "h100x16-rdma400", 4)
    rows: dict[str, Any] = {}
    for prompt in (2048, 8192, 32768):
        rate = round(0.7 * capacity(hw, prompt), 3)
        w = synthetic(f"ctx-{prompt}", sized(rate), prompt, 256, 0.0, 1, 16, seed=2)
        pred = run(hw, model, [(w, rate)], DEPS, 1, RATIOS)
        f = {d: pred[d][pl.label(w, rate)] for d in pred}
        pick = pl.best(f)
        rows[str(prompt)] = {
            "rate": rate, "requests": len(w.prompts), "best": pick,
            **{d: figs(f[d], "goodput", "slo_attainment", "ttft_p50", "tpot_p50", "tpot_p99",
                       "split_share") for d in f},
        }  # fmt: skip
        say(f"  {prompt:>6}-token prompts at {rate:5.2f} req/s: best {pick:<12} within SLO "
            + " ".join(f"{d} {f[d]['slo_attainment']:.0%}" for d in f)
            + "  TTFT p50 " + " ".join(f"{d} {f[d]['ttft_p50']:.0f}" for d in f)
            + "  TPOT p99 " + " ".join(f"{d} {f[d]['tpot_p99']:.0f}" for d in f))
    return rows


def plots(res: dict[str, Any], dest: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    link = res["link"]["rows"]
    for blocking, ax in zip((False, True), axes, strict=True):
        rows = [r for r in link.values() if r["blocking_loads"] == blocking]
        g = [r["gbps"] for r in rows]
        ax.plot(g, [r["pd_tpot_p99"] for r in rows], marker="o", label="P/D TPOT p99")
        ax.plot(g, [r["replicas_tpot_p99"] for r in rows], marker="s", label="replicas TPOT p99")
        ax.plot(g, [r["pd_ttft_p50"] for r in rows], marker="^", ls="--", label="P/D TTFT p50")
        ax.plot(g, [r["replicas_ttft_p50"] for r in rows], marker="v", ls="--",
                label="replicas TTFT p50")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link between nodes (Gb/s)")
        ax.set_ylabel("ms")
        ax.set_title(("loads stall the step" if blocking else "asynchronous loads (GPU)")
                     + ", 8k prompts")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = dest / "handbook_link.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))
    fig, ax = plt.subplots(figsize=(6, 4))
    hits = res["hits"]
    xs = [float(k) for k in hits]
    deps = [d for d in next(iter(hits.values())) if isinstance(hits["0.00"][d], dict)]
    for d in deps:
        ax.plot(xs, [hits[k][d]["slo_attainment"] for k in hits], marker="o", label=d)
    ax.set_xlabel("shared share of each prompt")
    ax.set_ylabel("requests within both SLOs")
    ax.set_title("prefix sharing, 4k prompts, 70B on 16xH100")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p = dest / "handbook_hits.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))
    return paths


def main() -> None:
    t0 = time.perf_counter()
    model = load_model(str(MODEL))
    res: dict[str, Any] = {"model": model.to_dict(), "slo_ms": {"ttft": args.ttft,
                                                                "tpot": args.tpot}}  # fmt: skip
    for name, fn in (("rate", rule_rate), ("link", rule_link), ("hits", rule_hits),
                     ("context", rule_context)):  # fmt: skip
        say(f"rule: {name}")
        res[name] = fn(model)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    if args.out:
        dest = Path(args.out)
        dest.mkdir(parents=True, exist_ok=True)
        res["plots"] = plots(res, dest)
        (dest / "handbook.json").write_text(json.dumps(res, indent=1))
    say(f"done in {res['seconds']} s")
    if args.json:
        print(json.dumps(res, separators=(",", ":")))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write handbook.json and the plots here")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="fewer requests per point")
    ap.add_argument("--ttft", type=float, default=3000.0, help="TTFT SLO, ms")
    ap.add_argument("--tpot", type=float, default=100.0, help="TPOT SLO, ms")
    ap.add_argument("--span", type=float, default=None,
                    help="seconds of arrivals a point (default 30; --quick 8)")
    args = ap.parse_args()
    if args.span is None:
        args.span = 8.0 if args.quick else 30.0
    main()
