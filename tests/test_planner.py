"""The planner (``tiered-cache plan``, tiered_cache.plan): model sizes from a config, the
calibration fit, the replay's behaviour, the verdict and the CLI's errors.

The replay runs the production store and policies; the engines here are a made-up
calibration, so the assertions are orderings and exact counts, not figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from tiered_cache.cli import main
from tiered_cache.plan import planner as pl
from tiered_cache.plan.calibrate import fit_prefill, parse_targets
from tiered_cache.plan.hardware import Engine, gpu_hardware, host_hardware, load_calibration
from tiered_cache.plan.model import PlanError, from_hf_config, load_model
from tiered_cache.plan.workloads import Request, bench_workload, tokens
from tiered_cache.tools.plan_validate import DEMO, score

REPO = Path(__file__).resolve().parents[1]
LLAMA70 = REPO / "configs" / "models" / "llama-3-70b.json"

# A vLLM CPU-like engine: ~0.5 ms a prefill token, 16 ms a decode step.
ENGINE_1 = {"step_s": 0.015, "per_seq_s": 0.001, "per_ctx_s": 1e-6, "per_token_s": 5e-4,
            "per_pair_s": 2e-7, "overhead_s": 0.02, "overlap": False}  # fmt: skip
ENGINE_2 = {**ENGINE_1, "per_token_s": 3e-4, "per_pair_s": 1.2e-7}
CALIBRATION: dict[str, Any] = {"engines": {"1": ENGINE_1, "2": ENGINE_2},
                               "links": {"dram": {"bytes_per_s": 4e9, "latency_s": 2e-4}}}  # fmt: skip


def _host(**kw: Any) -> Any:
    return host_hardware(CALIBRATION, **kw)


def _figs(name: str, work: str, rate: float, n: int = 36, seeds: int = 2,
          hw: Any = None) -> dict[str, Any]:  # fmt: skip
    w = pl.from_requests(work, bench_workload(work, n, 0), 32)
    pred = pl.predict(hw or _host(), DEMO, [(w, rate)], [name], seeds=seeds)
    return pred[name][pl.label(w, rate)]


# ------------------------------------------------------------------------------ model


def test_llama_3_70b_config_gives_its_kv_bytes_weights_and_params(tmp_path: Path) -> None:
    m = load_model(str(LLAMA70))
    assert m.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2  # layers, K+V, KV heads, dim, bf16
    assert 69e9 < m.params < 72e9  # "70B"
    assert 138e9 < m.weight_bytes < 144e9
    assert load_model(str(LLAMA70), "fp8").kv_bytes_per_token == 80 * 2 * 8 * 128
    (tmp_path / "config.json").write_text(LLAMA70.read_text())
    assert load_model(str(tmp_path)) == m  # a directory holding config.json


def test_mla_keeps_one_latent_and_moe_counts_active_experts() -> None:
    cfg = {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
           "num_experts_per_tok": 8, "n_shared_experts": 1, "vocab_size": 129280,
           "torch_dtype": "bfloat16"}  # fmt: skip
    m = from_hf_config(cfg, "dsv3")
    assert m.mla and m.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert m.params * 10 < m.weight_bytes / 2  # ~37B active of ~670B
    dense = from_hf_config({**cfg, "n_routed_experts": None, "num_experts_per_tok": None})
    assert dense.params == dense.weight_bytes / 2


@pytest.mark.parametrize(
    ("spec", "msg"),
    [
        ("kv_bytes_per_token=abc,params=1", "is not KEY=NUMBER"),
        ("kv_bytes_per_token=100", "kv_bytes_per_token=N,params=N"),
        ("kv_bytes_per_token=0,params=5", "must be > 0"),
        ("colour=1,params=2,kv_bytes_per_token=3", "kv_bytes_per_token=N,params=N"),
        ("/nowhere/config.json", "no config.json"),
    ],
)
def test_bad_model_specs_are_one_clear_error(spec: str, msg: str) -> None:
    with pytest.raises(PlanError, match=msg):
        load_model(spec)


def test_numbers_and_bad_configs(tmp_path: Path) -> None:
    m = load_model("kv_bytes_per_token=131072,params=8e9,layers=32")
    assert (m.kv_bytes_per_token, m.params, m.weight_bytes, m.layers) == (131072, 8e9, 16e9, 32)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PlanError, match="is not JSON"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(PlanError, match="not a config object"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(PlanError, match="num_hidden_layers"):
        load_model(str(tmp_path))
    with pytest.raises(PlanError, match="unknown dtype"):
        load_model(str(LLAMA70), "float13")


# ------------------------------------------------------------------------------ hardware


def test_fit_prefill_recovers_its_coefficients_and_never_goes_negative() -> None:
    a, b, c = 0.05, 4e-4, 3e-7
    pts = [(n, a + b * n + c * n * n / 2) for n in (32, 256, 512, 1024, 2048)]
    fa, fb, fc = fit_prefill(pts)
    assert fa == pytest.approx(a, rel=1e-6)
    assert fb == pytest.approx(b, rel=1e-6)
    assert fc == pytest.approx(c, rel=1e-6)
    # Concave times (a negative quadratic fits best): the fit keeps every term >= 0.
    bent = [(n, 0.01 + 1e-3 * n - 2e-7 * n * n) for n in (32, 256, 512, 1024, 2048)]
    assert min(fit_prefill(bent)) >= 0
    with pytest.raises(PlanError, match="3 lengths"):
        fit_prefill(pts[:2])


def test_engine_prices_a_prefill_and_overlaps_on_a_gpu() -> None:
    e = Engine(step_s=0.01, per_token_s=1e-4, per_pair_s=0.0)
    assert e.prefill_s(1000) == pytest.approx(0.01 + 0.1)
    g = Engine(step_s=0.01, per_token_s=1e-4, overlap=True)
    assert g.step(8, 0, 1000, 0) == pytest.approx(0.1)  # compute hides the memory time
    assert g.step(8, 0, 10, 0) == pytest.approx(0.01)


def test_presets_need_the_model_to_fit_and_tp_to_divide_a_node() -> None:
    m = load_model(str(LLAMA70))
    with pytest.raises(PlanError, match="does not fit 1xH100"):
        gpu_hardware(m, "h100x8", 1)
    with pytest.raises(PlanError, match="does not divide"):
        gpu_hardware(m, "h100x8", 3)
    with pytest.raises(PlanError, match="unknown preset"):
        gpu_hardware(m, "tpu-v9", 4)
    hw = gpu_hardware(m, "h100x16-rdma400", 4)
    assert sorted(hw.engines) == [4, 8] and hw.net is not None
    # a TP-4 server holds what 4 x 80 GB x 0.9 leaves after the weights
    assert hw.kv_tokens[4] == int((4 * 80e9 * 0.9 - m.weight_bytes) / m.kv_bytes_per_token)


def test_a_calibration_file_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "cal.json"
    good.write_text(json.dumps(CALIBRATION))
    assert load_calibration(good)["engines"]["1"] == ENGINE_1
    for body, msg in (("{}", "no engines"), ('{"engines": {"1": {"speed": 3}}}', "bad engine"),
                      ("nope", "cannot read")):  # fmt: skip
        (tmp_path / "bad.json").write_text(body)
        with pytest.raises(PlanError, match=msg):
            load_calibration(tmp_path / "bad.json")
    assert parse_targets(["http://a:1", "2=http://b:2"]) == {1: "http://a:1", 2: "http://b:2"}
    with pytest.raises(PlanError, match="UNITS=URL"):
        parse_targets(["x=http://a"])


# ------------------------------------------------------------------------------ replay


def test_arrivals_end_at_n_over_rate_as_vllms_benchmark() -> None:
    ts = pl.arrivals(40, 2.0, seed=3)
    assert ts == sorted(ts) and ts[-1] == pytest.approx(20.0)
    assert ts == pl.arrivals(40, 2.0, seed=3) and ts != pl.arrivals(40, 2.0, seed=4)
    assert pl.arrivals(5, float("inf"), 0) == [0.0] * 5


def test_tiers_serve_what_vllms_own_cache_evicted() -> None:
    # A 2k-token KV space cannot keep six 1000-token system prompts; the tiers can.
    hw = _host(kv_tokens=2048)
    mono = _figs("mono", "chat", 0.5, hw=hw)
    ours = _figs("ours", "chat", 0.5, hw=hw)
    assert set(mono["hit_rate"]) == {"vllm"}
    assert ours["hit_rate"]["dram"] > 0.2
    assert ours["hit_rate"]["vllm"] + ours["hit_rate"]["dram"] > mono["hit_rate"]["vllm"] + 0.2
    assert ours["ttft_p50"] < mono["ttft_p50"]
    assert ours["kv_bytes_per_request"]["loaded"] > 0 == mono["kv_bytes_per_request"]["loaded"]


def test_more_load_queues_longer() -> None:
    lo, hi = _figs("mono", "mixed", 0.5), _figs("mono", "mixed", 4.0)
    assert hi["ttft_p50"] > 2 * lo["ttft_p50"]
    assert hi["goodput"] < 4.0 * 0.8  # past capacity, goodput falls behind the rate


def test_replicas_sharing_the_tiers_beat_round_robin_without_them() -> None:
    # A conversation's next turn lands on either replica; with the shared tiers either
    # one finds its prefix, without them only the one that served it before.
    aware, rr = _figs("replicas", "chat", 1.0), _figs("replicas-rr", "chat", 1.0)
    assert sum(aware["hit_rate"].values()) > rr["hit_rate"]["vllm"] + 0.2
    assert aware["ttft_p50"] < rr["ttft_p50"]


def test_pd_split_hands_off_every_prompt_the_cache_does_not_cover() -> None:
    reqs = [Request(tokens(__import__("random").Random(i), 900), 8) for i in range(12)]
    w = pl.from_requests("unique", reqs, 32)
    pred = pl.predict(_host(), DEMO, [(w, 0.5)], ["pd-split", "replicas"], seeds=1)
    split, whole = pred["pd-split"]["unique@0.5"], pred["replicas"]["unique@0.5"]
    assert split["split_share"] == 1.0 and whole["split_share"] == 0.0
    assert split["kv_bytes_per_request"]["loaded"] > 0  # the decode loads the handoff
    assert split["ttft_p50"] > whole["ttft_p50"]  # the hop and the load cost a little


def _shared_prefix(n: int, prompt: int, shared: int, seed: int = 0) -> list[Request]:
    import random

    rng = random.Random(seed)
    head = tokens(random.Random(-1), shared)
    return [Request(head + tokens(rng, prompt - shared), 16) for _ in range(n)]


def test_running_requests_keep_their_shared_prefix_cached() -> None:
    # Three 1100-token requests fill most of a 4096-token KV space; the 1000-token
    # prefix they share is theirs while they run, so vLLM keeps it cached for the next.
    w = pl.from_requests("shared", _shared_prefix(24, 1100, 1000), 32)
    f = pl.predict(_host(kv_tokens=4096), DEMO, [(w, 4.0)], ["mono"], seeds=1)
    assert f["mono"]["shared@4.0"]["hit_rate"]["vllm"] > 0.6


def test_recorded_arrivals_are_replayed_once() -> None:
    w = pl.from_requests("chat", bench_workload("chat", 12, 0), 32)
    w.times = [0.5 * i for i in range(12)]
    a = pl.predict(_host(), DEMO, [(w, 9.0)], ["mono"], seeds=3)["mono"]["chat@9.0"]
    b = pl.predict(_host(), DEMO, [(w, 0.1)], ["mono"], seeds=1)["mono"]["chat@0.1"]
    assert a["duration_s"] == b["duration_s"] > 5.5  # the times, not a draw at the rate
    assert a["ttft_p50"] == b["ttft_p50"]


def test_a_busy_neighbour_and_the_router_cost_what_was_calibrated() -> None:
    quiet = _figs("replicas", "mixed", 2.0, seeds=1)
    noisy = _figs("replicas", "mixed", 2.0, seeds=1, hw=host_hardware(
        {**CALIBRATION, "neighbour": {"prefill": 0.5, "decode": 0.5}}))  # fmt: skip
    assert noisy["tpot_p50"] > 1.2 * quiet["tpot_p50"]
    mono = _figs("mono", "mixed", 0.5, seeds=1)
    routed_hw = host_hardware({**CALIBRATION, "router_s": 0.25})
    assert _figs("mono", "mixed", 0.5, seeds=1, hw=routed_hw)["ttft_p50"] == mono["ttft_p50"]
    slow = _figs("replicas", "mixed", 0.5, seeds=1, hw=routed_hw)
    fast = _figs("replicas", "mixed", 0.5, seeds=1)
    assert slow["ttft_p50"] == pytest.approx(fast["ttft_p50"] + 250, abs=30)


def test_block_size_mismatch_is_refused() -> None:
    w = pl.from_requests("chat", bench_workload("chat", 12, 0), 16)
    with pytest.raises(PlanError, match="16-token blocks"):
        pl.predict(_host(), DEMO, [(w, 1.0)], ["mono"])


def test_mooncake_trace_parses_and_bad_lines_name_their_line(tmp_path: Path) -> None:
    t = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
            {"timestamp": 2000, "input_length": 600, "output_length": 0, "hash_ids": [1, 3]}]  # fmt: skip
    t.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w, rate = pl.from_mooncake(t, 32)
    (n0, o0, k0, _), (n1, o1, k1, _) = w.prompts
    assert (n0, o0, len(k0), n1, o1, len(k1)) == (1024, 4, 32, 600, 1, 18)
    assert k0[:16] == k1[:16] and k0[16] != k1[16]  # hash id 1 shared, then they differ
    assert rate == pytest.approx(1.0)  # 2 requests over 2 s
    t.write_text(json.dumps(rows[0]) + "\n" + '{"input_length": 5}\n')
    with pytest.raises(PlanError, match=r"trace.jsonl:2: not a Mooncake record"):
        pl.from_mooncake(t, 32)


# ------------------------------------------------------------------------------ verdict


def test_best_and_the_verdict() -> None:
    f = {"goodput": 1.0, "ttft_p50": 100.0}
    assert pl.best({"a": f, "b": {**f, "goodput": 0.99, "ttft_p50": 50.0}}) == "b"  # tie: TTFT
    assert pl.best({"a": f, "b": {**f, "goodput": 0.5, "ttft_p50": 1.0}}) == "a"
    assert pl.best({"a": {**f, "goodput": 0.0}, "b": {**f, "goodput": 0.0}}) == "none"

    def at(**goodputs: float) -> dict[str, dict[str, dict[str, Any]]]:
        return {d: {f"chat@{float(r)}": {"goodput": g, "ttft_p50": 10.0}
                    for r, g in zip((1, 2, 4), gs, strict=True)}
                for d, gs in {"replicas": (1.0, 1.8, 0.0), "pd": (0.9, 1.95, 0.0)}.items()}  # fmt: skip

    v = pl.verdict(at(), [1, 2, 4])["chat"]
    assert v["best"] == {"1": "replicas", "2": "pd", "4": "none"}
    assert v["verdict"].startswith("chat: P/D pays off from 2 req/s")
    assert "below that, run replicas" in v["verdict"]
    assert "From 4 req/s no deployment meets the SLOs" in v["verdict"]


def test_default_rates_scale_with_the_servers() -> None:
    m = load_model(str(LLAMA70))
    w = [pl.from_requests("chat", bench_workload("chat", 12, 0), 16)]
    r8 = pl.default_rates(gpu_hardware(m, "h100x8", 4), w)
    r16 = pl.default_rates(gpu_hardware(m, "h100x16-rdma400", 4), w)
    assert len(r8) == 5 and r8 == sorted(r8)
    assert r16[2] == pytest.approx(2 * r8[2], rel=0.06)


def test_validation_scores_relative_errors_and_agreement() -> None:
    pred = {"mono": {"chat@1.0": {"goodput": 1.1, "ttft_p50": 100.0, "tpot_p50": 20.0},
                     "chat@3.0": {"goodput": 1.0, "ttft_p50": 900.0, "tpot_p50": 20.0}},
            "pd": {"chat@1.0": {"goodput": 1.0, "ttft_p50": 300.0, "tpot_p50": 20.0},
                   "chat@3.0": {"goodput": 2.0, "ttft_p50": 500.0, "tpot_p50": 20.0}}}  # fmt: skip
    meas: dict[str, dict[str, dict[str, float | None]]] = {
        "mono": {"chat@1.0": {"goodput": 1.0, "ttft_p50": 100.0, "tpot_p50": 25.0},
                 "chat@3.0": {"goodput": 1.0, "ttft_p50": 1000.0, "tpot_p50": 20.0}},
        "pd": {"chat@1.0": {"goodput": 1.0, "ttft_p50": 200.0, "tpot_p50": 20.0},
               "chat@3.0": {"goodput": 1.5, "ttft_p50": 500.0, "tpot_p50": 20.0}},
    }  # fmt: skip
    s = score(pred, meas)
    assert s["prediction_error"]["mono"]["goodput"]["per_load"] == {"chat@1.0": 0.1,
                                                                   "chat@3.0": 0.0}  # fmt: skip
    assert s["prediction_error"]["pd"]["ttft_p50"]["max_abs"] == 0.5
    assert s["within_25pct"] == pytest.approx(6 / 8)  # pd's TTFT at 1 and goodput at 3 miss
    assert s["best_choice"]["chat@1.0"] == {"measured": "mono", "predicted": "mono",
                                            "measured_ties": ["mono"]}  # fmt: skip
    assert s["best_choice"]["chat@3.0"] == {"measured": "pd", "predicted": "pd",
                                            "measured_ties": ["pd"]}  # fmt: skip
    assert s["best_choice_agreement"] == 1.0
    # pd predicted best at 1 req/s: an error while pd's TTFT is twice mono's, none once
    # the two are as good within the bench's noise (a measured tie)
    p2 = {**pred, "pd": {**pred["pd"], "chat@1.0": {**pred["pd"]["chat@1.0"], "goodput": 1.2}}}
    wrong = score(p2, meas)
    assert (wrong["best_choice_agreement"], wrong["best_choice_agreement_up_to_ties"]) == (0.5, 0.5)
    m2 = {**meas, "pd": {**meas["pd"], "chat@1.0": {**meas["pd"]["chat@1.0"], "ttft_p50": 110.0}}}
    tied = score(p2, m2)
    assert tied["best_choice"]["chat@1.0"]["measured_ties"] == ["mono", "pd"]
    assert (tied["best_choice_agreement"], tied["best_choice_agreement_up_to_ties"]) == (0.5, 1.0)
    assert s["goals"] == {"within_25pct_all": False, "best_choice_agreement_80pct": True}


# ------------------------------------------------------------------------------ CLI


def _plan(*args: str) -> Result:
    return CliRunner().invoke(main, ["plan", *args], catch_exceptions=False)


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        ([], "--model is required"),
        (["--model", "/nowhere"], "no config.json"),
        (["--model", str(LLAMA70), "--tp", "1"], "does not fit 1xH100: raise --tp"),
        (["--model", str(LLAMA70), "--rates", "1,x"], "is not a list of numbers"),
        (["--model", str(LLAMA70), "--rates", "0"], "must be > 0"),
        (["--model", str(LLAMA70), "--slo", "ttft:fast"], "--slo takes"),
        (["--model", str(LLAMA70), "--ratios", "0:1"], "both sides must be > 0"),
        (["--model", str(LLAMA70), "--deployments", "mono,magic"], "unknown deployment"),
        (["--model", str(LLAMA70), "--preset", "cpu-here"], "needs --calibration"),
        (["--model", str(LLAMA70), "--calibrate", "ftp://x"], "UNITS=URL"),
    ],
)
def test_cli_errors_are_one_line(args: list[str], msg: str) -> None:
    r = _plan(*args)
    assert r.exit_code != 0
    assert msg in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_cli_json_on_this_machines_calibration(tmp_path: Path) -> None:
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CALIBRATION))
    r = _plan("--model", "kv_bytes_per_token=16384,params=3.3e7", "--preset", "cpu-here",
              "--calibration", str(cal), "--workload", "chat", "--num-requests", "12",
              "--rates", "0.5,2", "--seeds", "1", "--deployments", "mono,replicas,pd",
              "--json", "--plot", str(tmp_path / "plots"))  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert set(out["prediction"]) == {"mono", "replicas", "pd"}
    assert set(out["prediction"]["pd"]) == {"chat@0.5", "chat@2.0"}
    assert out["verdict"]["chat"]["verdict"].startswith("chat: ")
    assert out["hardware"]["name"] == "cpu-here" and out["rates"] == [0.5, 2.0]
    assert [Path(p).name for p in out["plots"]] == ["plan_goodput_chat.png"]
    assert (tmp_path / "plots" / "plan_goodput_chat.png").stat().st_size > 1000


def test_cli_table_for_a_gpu_preset() -> None:
    r = _plan("--model", str(LLAMA70), "--preset", "h100x16-tcp25", "--workload", "mixed",
              "--num-requests", "16", "--rates", "1", "--seeds", "1", "--ratios", "1:1")  # fmt: skip
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()  # the progress lines go to stderr
    assert lines[0].startswith("deployment") and any(ln.startswith("pd ") for ln in lines)
    assert lines[-1].startswith("mixed: ")
