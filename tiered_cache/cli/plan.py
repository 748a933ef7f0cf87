"""``tiered-cache plan``: predict each deployment of one piece of hardware for a model
and a workload, and say which pays (``tiered_cache.plan``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from tiered_cache.cli.common import CliError, friendly

_HOST_RATES = "0.5,1,2,3"


def _say(msg: str) -> None:
    click.echo(f"[plan] {msg}", err=True)


def _floats(spec: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{what}: {spec!r} is not a list of numbers") from None
    if not out or any(x <= 0 for x in out):
        raise CliError(f"{what}: every value must be > 0")
    return out


def _slo(items: tuple[str, ...]) -> Any:
    from tiered_cache.plan.planner import Slo

    slo = Slo()
    for item in items:
        k, _, v = item.partition(":")
        try:
            ms = float(v)
        except ValueError:
            ms = -1.0
        if k not in ("ttft", "tpot") or ms <= 0:
            raise CliError(f"--slo takes ttft:MS and tpot:MS, got {item!r}")
        setattr(slo, f"{k}_ms", ms)
    return slo


@click.command()
@click.option("--model", "model_spec", metavar="CONFIG|NUMBERS",
              help="A Hugging Face config.json (or its directory), or "
                   "kv_bytes_per_token=N,params=N[,weight_bytes=N,layers=N].")  # fmt: skip
@click.option("--dtype", default=None, help="KV dtype, if not the config's (bfloat16, fp8, ...).")
@click.option("--preset", default="h100x8", show_default=True,
              help="h100x8, h100x16-rdma400, h100x16-tcp100, h100x16-tcp25, h200x8, or "
                   "cpu-here (this machine; needs --calibration or --calibrate).")  # fmt: skip
@click.option(
    "--calibration",
    type=click.Path(dir_okay=False),
    help="Engines measured earlier (the JSON --calibrate writes with --save-calibration).",
)
@click.option(
    "--calibrate",
    "calibrate_urls",
    multiple=True,
    metavar="[UNITS=]URL",
    help="Measure a running vLLM of UNITS units (default 1) now; repeatable.",
)
@click.option(
    "--save-calibration",
    type=click.Path(dir_okay=False),
    help="Write what --calibrate measured here.",
)
@click.option("--tp", type=int, default=None, help="Units a server (GPU presets: default 1 "
              "if the weights fit, else the least that fits).")  # fmt: skip
@click.option("--dram-gib", type=float, default=None, help="Host DRAM for the cache, a node.")
@click.option("--nvme-gib", type=float, default=None, help="NVMe for the cache, a node.")
@click.option("--s3-gib", type=float, default=None, help="S3 for the cache (0: none).")
@click.option(
    "--net-gbps",
    type=float,
    default=None,
    help="Link between nodes, Gb/s (overrides the preset's).",
)
@click.option(
    "--gpu-kv-tokens",
    type=int,
    default=None,
    help="KV space of one server in tokens (default: from HBM and weights).",
)
@click.option(
    "--trace",
    type=click.Path(dir_okay=False),
    help="A Mooncake-format trace (hash_ids of 512-token blocks).",
)
@click.option(
    "--limit", type=int, default=500, show_default=True, help="Requests of the trace replayed."
)
@click.option(
    "--workload",
    "workload_names",
    default=None,
    help="The serving bench's workloads instead: chat,mixed (default without --trace).",
)
@click.option(
    "--num-requests",
    type=int,
    default=36,
    show_default=True,
    help="Requests of each bench workload.",
)
@click.option(
    "--rates",
    default=None,
    help="Request rates, req/s (default: around what the servers prefill "
    f"without a cache; cpu-here {_HOST_RATES}).",
)
@click.option(
    "--slo",
    "slo_items",
    multiple=True,
    metavar="ttft:MS|tpot:MS",
    help="The goodput SLOs (default ttft:3000 tpot:250, as bench/serve.py).",
)
@click.option("--deployments", default="mono,ours,replicas,replicas-rr,pd,pd-split",
              show_default=True)  # fmt: skip
@click.option("--ratios", default=None,
              help="P:D server ratios to try, e.g. 1:1,1:3,3:1 (default 1:1; GPU presets "
                   "1:1,1:3,3:1).")  # fmt: skip
@click.option(
    "--seeds", type=int, default=2, show_default=True, help="Arrival draws averaged per rate."
)
@click.option(
    "--plot",
    "plot_dir",
    type=click.Path(file_okay=False),
    help="Draw goodput against rate here (a PNG per workload).",
)
@click.option("--validate", is_flag=True,
              help="Check the planner on this machine: calibrate, run bench/serve.py, predict "
                   "its loads, report the errors (needs vLLM CPU; minutes).")  # fmt: skip
@click.option("--quick", is_flag=True, help="--validate at 2 rates instead of 4.")
@click.option(
    "--measured",
    type=click.Path(dir_okay=False, exists=True),
    help="--validate against this bench/serve.py results file instead of a new run.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object as the last line.")
@friendly
def plan(
    model_spec: str | None, dtype: str | None, preset: str, calibration: str | None,
    calibrate_urls: tuple[str, ...], save_calibration: str | None, tp: int | None,
    dram_gib: float | None, nvme_gib: float | None, s3_gib: float | None,
    net_gbps: float | None, gpu_kv_tokens: int | None, trace: str | None, limit: int,
    workload_names: str | None, num_requests: int, rates: str | None,
    slo_items: tuple[str, ...], deployments: str, ratios: str | None, seeds: int,
    plot_dir: str | None, validate: bool, quick: bool, measured: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Is P/D worth it for this model, these links and this traffic? Predicts goodput,
    TTFT and TPOT, hit rates per tier and KV bytes moved for each deployment at each
    rate, and prints a verdict (docs/planning.md)."""
    from tiered_cache.plan import hardware as hwm
    from tiered_cache.plan import planner as pl
    from tiered_cache.plan.calibrate import calibrate, parse_targets
    from tiered_cache.plan.model import PlanError, load_model
    from tiered_cache.plan.workloads import bench_workload

    try:
        if seeds <= 0 or num_requests <= 0 or limit <= 0:
            raise CliError("--seeds, --num-requests and --limit must be > 0")
        # every input checked before anything is measured or replayed
        slo = _slo(slo_items)
        ratio = ratios or ("1:1" if preset == "cpu-here" else "1:1,1:3,3:1")
        pl.parse_ratios(ratio)
        unknown = [d for d in deployments.split(",") if d not in pl.DEPLOYMENTS]
        if unknown:
            raise CliError(f"unknown deployment {unknown[0]!r} ({', '.join(pl.DEPLOYMENTS)})")
        rate_list = _floats(rates, "--rates") if rates else None
        cal = hwm.load_calibration(calibration) if calibration else None
        if calibrate_urls:
            cal = calibrate(parse_targets(calibrate_urls), say=_say)
            if save_calibration:
                Path(save_calibration).write_text(json.dumps(cal, indent=1))
        if validate:
            from tiered_cache.tools.plan_validate import validate as run_validate

            out = run_validate(quick, Path(measured) if measured else None, cal, _say,
                               seeds=max(seeds, 5))  # fmt: skip
            if not as_json:
                click.echo(json.dumps({k: out[k] for k in ("prediction_error", "best_choice",
                                                           "goals")}, indent=1))  # fmt: skip
            click.echo(json.dumps({k: out[k] for k in (
                "best_choice_agreement", "best_choice_agreement_up_to_ties", "within_25pct",
                "goals", "prediction_error",
                "repeat_within_25pct", "repeat_error",
                "best_choice", "rates", "workloads", "slo_ms", "engines", "measured",
                "predicted", "workdir")}, separators=(",", ":")))  # fmt: skip
            return
        if not model_spec:
            raise CliError("--model is required (a config.json, or kv_bytes_per_token=N,params=N)")
        model = load_model(model_spec, dtype)
        if preset == "cpu-here":
            if cal is None:
                raise CliError("--preset cpu-here needs --calibration FILE or --calibrate URL")
            hw = hwm.host_hardware(cal)
        else:
            if tp is None:
                tp = 1
                while tp < 8 and model.weight_bytes > 0.8 * tp * hwm.GPUS[
                        hwm.PRESETS.get(preset, ("h100",))[0]].hbm_bytes:  # fmt: skip
                    tp *= 2
            hw = hwm.gpu_hardware(model, preset, tp, **{k: v for k, v in {
                "dram_gib": dram_gib, "nvme_gib": nvme_gib, "s3_gib": s3_gib,
                "net_gbps": net_gbps}.items() if v is not None})  # fmt: skip
            if cal is not None:  # measured engines replace the roofline's
                for u, e in cal["engines"].items():
                    hw = hwm.with_engine(hw, int(u), hwm.Engine(**e))
        if gpu_kv_tokens is not None:
            if gpu_kv_tokens <= 0:
                raise CliError("--gpu-kv-tokens must be > 0")
            hw.kv_tokens = {u: gpu_kv_tokens for u in hw.kv_tokens}
        if trace:
            w, own = pl.from_mooncake(trace, hw.block_tokens, limit)
            works = [w]
            if own:
                _say(f"{w.name}: {len(w.prompts)} requests; the trace's own rate {own:.2f} req/s")
        else:
            names = (workload_names or "chat,mixed").split(",")
            works = [pl.from_requests(n, bench_workload(n, num_requests, 0), hw.block_tokens)
                     for n in names]  # fmt: skip
        if rate_list is None and preset == "cpu-here":
            rate_list = _floats(_HOST_RATES, "--rates")
        elif rate_list is None:
            rate_list = pl.default_rates(hw, works)
            _say(f"rates {rate_list} req/s: 1/4 to 2x what the servers prefill with no cache")
        _say(f"{model.name}: {model.kv_bytes_per_token} KV bytes a token; {hw.name}, "
             f"{hw.units} {hw.unit_name}s, servers of {hw.tp}")  # fmt: skip
        points = [(w, r) for w in works for r in rate_list]
        pred = pl.predict(hw, model, points, deployments.split(","), ratio, slo, seeds)
        if not pred:
            raise CliError("no deployment fits this hardware (raise the units or lower --tp)")
        verdicts = pl.verdict(pred, rate_list)
        result = pl.Plan(model, hw, rate_list, pred, verdicts).to_dict()
        if plot_dir:
            result["plots"] = [str(p) for p in pl.plot(pred, Path(plot_dir))]
    except PlanError as e:
        raise CliError(str(e)) from None
    if as_json:
        click.echo(json.dumps(result, separators=(",", ":")))
        return
    click.echo(pl.table(pred))
    for v in verdicts.values():
        click.echo(v["verdict"])
    for p in result.get("plots", []):
        click.echo(f"plot: {p}")
