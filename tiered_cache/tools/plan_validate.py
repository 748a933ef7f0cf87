"""``tiered-cache plan --validate``: the planner against measured runs on this machine.

1. Calibrate: a vLLM on one core and one on both (the serving bench's settings, no
   connector), each through ``plan.calibrate`` (a separate, short run).
2. Measure: ``bench/serve.py`` runs its deployments at its rates (``--measured FILE``
   reuses a results file instead).
3. Predict the same workloads (the same prompts: ``plan.workloads``) at the same rates
   from the calibration alone, and score: the relative error per deployment and figure
   (goodput, TTFT p50; TPOT p50 reported), and how often the predicted best deployment is
   the measured best.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiered_cache.plan.calibrate import Calibrator, calibrate, neighbour_slowdown
from tiered_cache.plan.hardware import Engine, host_hardware
from tiered_cache.plan.model import ModelSpec
from tiered_cache.plan.planner import Slo, best, from_requests, label, predict
from tiered_cache.plan.workloads import bench_workload
from tiered_cache.tools.vllm_launch import (
    REPO,
    VllmServer,
    free_port,
    server_env,
    spawn,
    start_servers,
    stop_group,
    wait_http,
)  # fmt: skip

BLOCK = 32
KV_BLOCKS = 128  # bench/serve.py's --kv-blocks default
MAX_LEN = (KV_BLOCKS - 2) * BLOCK
DEMO_KV_BPT = 8 * 2 * 4 * 64 * 4  # the demo preset in float32 (bench/serve.py's)
DEMO = ModelSpec("demo (random Llama, float32)", DEMO_KV_BPT, 3.3e7, 1.3e8, 8, 512)
FULL: dict[str, Any] = {
    "rates": [0.5, 1.0, 2.0, 3.0],
    "num_requests": 36,
    "workloads": ["chat", "mixed"],
}
QUICK: dict[str, Any] = {"rates": [1.0, 3.0], "num_requests": 36, "workloads": ["chat", "mixed"]}
DEPLOYMENTS = ["mono", "ours", "replicas", "replicas-rr", "pd"]
REPEAT = ["mono", "pd"]  # measured twice: the bench's own repeatability
GOAL = 0.25  # the issue's: goodput and TTFT p50 within 25 %
GOAL_AGREEMENT = 0.8


def _model(work: Path) -> Path:
    out = REPO / ".models" / "demo-float32"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(out),
         "--preset", "demo", "--dtype", "float32"],
        check=True, env=server_env(), stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return out


def _server(name: str, model: Path, cores: str, work: Path) -> VllmServer:
    return VllmServer(
        name, str(model), free_port(), work / f"{name}.log",
        extra_args=["--enable-prefix-caching", "--block-size", str(BLOCK),
                    "--num-gpu-blocks-override", str(KV_BLOCKS)],
        env={"VLLM_CPU_OMP_THREADS_BIND": cores}, dtype="float32",
        max_model_len=MAX_LEN, served_name="calib", max_num_seqs=8,
    )  # fmt: skip


def router_overhead(direct: str, routed: str, n: int = 9) -> float:
    """Seconds the router adds to a short request (median through it minus direct)."""
    c = Calibrator(direct)
    r = Calibrator(routed)
    c._complete(64, 2)
    r._complete(64, 2)
    d = statistics.median(c._complete(64, 2) for _ in range(n))
    t = statistics.median(r._complete(64, 2) for _ in range(n))
    return max(0.0, t - d)


def run_calibration(work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Two 1-core vLLMs (cores 0 and 1, as the bench's replicas and P/D): the first
    calibrated while the second idles, then the slowdown a busy neighbour causes, and
    the router's own cost in front of them; then one vLLM on both cores."""
    model = _model(work)
    cal: dict[str, Any] = {"engines": {}, "raw": {}}
    a, b = _server("calib-1a", model, "0", work), _server("calib-1b", model, "1", work)
    say("calibrating a 1-core vLLM (and its neighbour on the other core)")
    router = None
    try:
        start_servers([a, b], 600)
        one = calibrate({1: a.url}, say=say)
        cal["neighbour"] = neighbour_slowdown(Engine(**one["engines"]["1"]), [a.url, b.url],
                                              say=say)  # fmt: skip
        port = free_port()
        router = spawn([sys.executable, "-m", "tiered_cache.cli", "router", "--replica", a.url,
                        "--replica", b.url, "--port", str(port), "--round-robin"],
                       work / "calib-router.log")  # fmt: skip
        wait_http(f"http://127.0.0.1:{port}/health", 60, router, work / "calib-router.log")
        cal["router_s"] = router_overhead(a.url, f"http://127.0.0.1:{port}")
        say(f"the router adds {1e3 * cal['router_s']:.0f} ms to a request")
    finally:
        stop_group(router)
        a.stop()
        b.stop()
    cal["engines"].update(one["engines"])
    cal["raw"].update(one["raw"])
    s = _server("calib-2", model, "0-1", work)
    say("calibrating a 2-core vLLM")
    try:
        start_servers([s], 600)
        two = calibrate({2: s.url}, say=say)
    finally:
        s.stop()
    cal["engines"].update(two["engines"])
    cal["raw"].update(two["raw"])
    cal["links"], cal["when"] = two["links"], two["when"]
    return cal


def run_bench(work: Path, grid: dict[str, Any], say: Callable[[str], None],
              deployments: Sequence[str] = DEPLOYMENTS, out: str = "serve") -> dict[str, Any]:  # fmt: skip
    cmd = [
        sys.executable, str(REPO / "bench" / "serve.py"), "--json", "--no-kill-agent",
        "--deployments", ",".join(deployments), "--workloads", ",".join(grid["workloads"]),
        "--rates", ",".join(str(r) for r in grid["rates"]),
        "--num-requests", str(grid["num_requests"]), "--out", str(work / out),
    ]  # fmt: skip
    say("measuring: " + " ".join(cmd[1:]))
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, env=server_env())
    if p.returncode != 0:
        raise RuntimeError(f"bench/serve.py exited {p.returncode}")
    # the saved file: it keeps the per-request lists (arrival times among them)
    return dict(json.loads((work / out / "results.json").read_text()))


def repeat_error(res: dict[str, Any]) -> dict[str, Any]:
    """The bench against itself: the deployments measured a second time (``repeat``, the
    same prompts and arrivals), as relative differences from the first measurement, the
    floor under any prediction's error on this machine."""
    first, again = measured_figures(res), measured_figures({"results": res.get("repeat", {})})
    errs: dict[str, Any] = {}
    within, total = 0, 0
    for dep, per in again.items():
        for fig in ("goodput", "ttft_p50"):
            pts = {}
            for lab, m in per.items():
                a, b = m.get(fig), first.get(dep, {}).get(lab, {}).get(fig)
                if a is None or not b:
                    continue
                pts[lab] = round((a - b) / b, 3)
                total += 1
                within += abs(pts[lab]) <= GOAL
            if pts:
                errs.setdefault(dep, {})[fig] = {"max_abs": max(abs(v) for v in pts.values()),
                                                 "per_load": pts}  # fmt: skip
    return {"repeat_error": errs, "repeat_within_25pct": round(within / total, 3) if total else None}


def recorded_arrivals(res: dict[str, Any], dep: str, lab: str, n: int, rate: float
                      ) -> list[float] | None:  # fmt: skip
    """The send times the bench recorded for this load (vLLM's arrivals end at n/rate):
    the prediction replays the very arrivals it is compared with."""
    st = res.get("results", {}).get(dep, {}).get(lab, {}).get("start_times")
    if not st or len(st) != n:
        return None
    return [t - st[-1] + n / rate for t in st]


def measured_figures(res: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for dep, per in res.get("results", {}).items():
        if not isinstance(per, dict) or "error" in per:
            continue
        for lab, r in per.items():
            if not isinstance(r, dict) or "ttft_ms" not in r or "@" not in lab:
                continue
            if not lab.split("@")[1].replace(".", "").isdigit():
                continue  # chat@kill, chat@alive
            out.setdefault(dep, {})[lab] = {
                "goodput": r.get("request_goodput"), "ttft_p50": r["ttft_ms"].get("median"),
                "tpot_p50": r["tpot_ms"].get("median"), "ttft_p90": r["ttft_ms"].get("p90"),
            }  # fmt: skip
    return out


def score(pred: dict[str, dict[str, dict[str, Any]]],
          meas: dict[str, dict[str, dict[str, float | None]]]) -> dict[str, Any]:  # fmt: skip
    errors: dict[str, dict[str, Any]] = {}
    within, total = 0, 0
    for dep, per in meas.items():
        if dep not in pred:
            continue
        for fig in ("goodput", "ttft_p50", "tpot_p50"):
            pts = {}
            for lab, m in per.items():
                p = pred[dep].get(lab, {}).get(fig)
                mv = m.get(fig)
                if p is None or not mv:
                    continue
                pts[lab] = round((p - mv) / mv, 3)
                if fig in ("goodput", "ttft_p50"):
                    total += 1
                    within += abs(pts[lab]) <= GOAL
            if pts:
                errs = [abs(v) for v in pts.values()]
                errors.setdefault(dep, {})[fig] = {
                    "mean_abs": round(sum(errs) / len(errs), 3), "max_abs": round(max(errs), 3),
                    "per_load": pts,
                }  # fmt: skip
    labels = sorted({lab for per in meas.values() for lab in per})
    picks: dict[str, dict[str, Any]] = {}
    agree = agree_ties = 0
    for lab in labels:
        deps = [d for d in meas if d in pred and lab in meas[d] and lab in pred[d]
                and meas[d][lab].get("goodput") is not None]  # fmt: skip
        if not deps:
            continue
        mb = best({d: {"goodput": meas[d][lab]["goodput"], "ttft_p50": meas[d][lab]["ttft_p50"]}
                   for d in deps})  # fmt: skip
        pb = best({d: pred[d][lab] for d in deps})
        # measured ties: deployments as good as the best within the bench's own noise
        # (goodput within 3 %, TTFT p50 within 25 %); picking any of them is no error
        top = meas[mb][lab]
        ties = sorted(d for d in deps if (meas[d][lab]["goodput"] or 0) >= 0.97 * (top["goodput"] or 0)
                      and (meas[d][lab]["ttft_p50"] or math.inf) <= 1.25 * (top["ttft_p50"] or 0))  # fmt: skip
        picks[lab] = {"measured": mb, "predicted": pb, "measured_ties": ties}
        agree += mb == pb
        agree_ties += pb in ties or pb == mb
    agreement = agree / len(picks) if picks else 0.0
    return {
        "prediction_error": errors,
        "within_25pct": round(within / total, 3) if total else None,
        "best_choice_agreement": round(agreement, 3),
        "best_choice_agreement_up_to_ties": round(agree_ties / len(picks), 3) if picks else 0.0,
        "best_choice": picks,
        "goals": {"within_25pct_all": within == total and total > 0,
                  "best_choice_agreement_80pct": agreement >= GOAL_AGREEMENT},
    }  # fmt: skip


def validate(
    quick: bool, measured: Path | None, calibration: dict[str, Any] | None,
    say: Callable[[str], None], workdir: Path | None = None, seeds: int = 5,
    deployments: Sequence[str] = DEPLOYMENTS, repeat: Sequence[str] = REPEAT,
) -> dict[str, Any]:  # fmt: skip
    work = workdir or Path(tempfile.mkdtemp(prefix="tc-plan-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    grid: dict[str, Any] = dict(QUICK if quick else FULL)
    if calibration is None:
        calibration = run_calibration(work, say)
        (work / "calibration.json").write_text(json.dumps(calibration, indent=1))
        say(f"calibration in {work / 'calibration.json'}")
    if measured is not None:
        res = json.loads(measured.read_text())
        rates = res.get("arrivals", {}).get("rates") or grid["rates"]
        n = max(v["requests"] for k, v in res.get("workloads", {}).items() if k == "chat") \
            if "chat" in res.get("workloads", {}) else grid["num_requests"]  # fmt: skip
        grid = {"rates": rates, "num_requests": n,
                "workloads": [w for w in res.get("workloads", {}) if w in ("chat", "mixed")]}  # fmt: skip
    else:
        res = run_bench(work, grid, say)
        if repeat:
            res["repeat"] = run_bench(work, grid, say, repeat, "serve-repeat")["results"]
        (work / "measured.json").write_text(json.dumps(res))
    slo_ms = res.get("goodput_slo_ms", {})
    slo = Slo(slo_ms.get("ttft", 3000.0), slo_ms.get("tpot", 250.0))
    hw = host_hardware(calibration, kv_tokens=res.get("vllm_kv_space_tokens", KV_BLOCKS * BLOCK),
                       dram_mib=int(res.get("our_dram_bytes", 2**30) // 2**20),
                       disk_mib=int(res.get("our_disk_bytes", 2**32) // 2**20))  # fmt: skip
    say(f"predicting {len(grid['workloads']) * len(grid['rates'])} loads x "
        f"{len(deployments)} deployments")  # fmt: skip
    pred: dict[str, dict[str, dict[str, Any]]] = {}
    for dep in [d for d in deployments if d != "ideal"]:
        points = []
        for w in grid["workloads"]:
            for i, r in enumerate(grid["rates"]):
                wl = from_requests(w, bench_workload(w, grid["num_requests"], i,
                                                     max_len=MAX_LEN), BLOCK)  # fmt: skip
                wl.times = recorded_arrivals(res, dep, label(wl, r), len(wl.prompts), r)
                points.append((wl, float(r)))
        pred.update(predict(hw, DEMO, points, names=[dep], slo=slo, seeds=seeds))
    out = score(pred, measured_figures(res))
    out.update(repeat_error(res))
    out.update({
        "rates": grid["rates"], "workloads": grid["workloads"], "slo_ms": slo.__dict__,
        "engines": calibration["engines"], "measured": measured_figures(res),
        "predicted": {d: {lab: {k: f[k] for k in ("goodput", "ttft_p50", "tpot_p50",
                                                   "ttft_p90", "split_share")}
                          for lab, f in per.items()} for d, per in pred.items()},
        "workdir": str(work),
    })  # fmt: skip
    return out
