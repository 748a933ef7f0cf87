"""The serving benchmark's workloads (tiered_cache.plan.workloads, bench/serve.py's): deterministic, shaped as promised."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import serve

from tiered_cache.plan import workloads as wl


def test_trace_blocks_are_deterministic_and_shared_by_equal_hash_ids(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1536, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 1024, "output_length": 99, "hash_ids": [1, 2]},
        {"timestamp": 2, "input_length": 700, "output_length": 2, "hash_ids": [7, 8]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = wl.trace_workload(trace, 3, block_tokens=32, max_output=16, max_len=4000)
    b = wl.trace_workload(trace, 3, block_tokens=32, max_output=16, max_len=4000)
    assert [r.prompt for r in a] == [r.prompt for r in b]  # no salted hash(): same every run
    assert [len(r.prompt) for r in a] == [96, 64, 44]  # 512-token blocks scaled to 32
    assert a[1].prompt == a[0].prompt[:64]  # equal ids, equal prefix
    assert a[2].prompt[:32] != a[0].prompt[:32]
    assert [r.output_len for r in a] == [5, 16, 2]
    short = wl.trace_workload(trace, 1, block_tokens=32, max_output=16, max_len=60)
    assert len(short[0].prompt) == 60 - 5 - 16  # cut to what the model takes


def test_chat_conversations_grow_and_share_system_prompts() -> None:
    reqs = wl.chat_workload(40, seed=3, users=8, systems=4, system_tokens=100)
    assert reqs == wl.chat_workload(40, seed=3, users=8, systems=4, system_tokens=100)
    by_prefix: dict[tuple[int, ...], list[int]] = {}
    for r in reqs:
        by_prefix.setdefault(tuple(r.prompt[:100]), []).append(len(r.prompt))
    assert len(by_prefix) == 4  # four system prompts
    # Later turns extend earlier ones: some prompt is a prefix of a longer one.
    prompts = [r.prompt for r in reqs]
    assert any(q[: len(p)] == p and len(q) > len(p) for p in prompts for q in prompts)
    assert wl.unique_prefix_tokens(reqs) < sum(len(p) for p in prompts)


def test_mixed_has_one_long_prompt_for_two_short() -> None:
    reqs = wl.mixed_workload(9, seed=1)
    assert [r.kind for r in reqs] == ["long", "short", "short"] * 3
    assert all(len(r.prompt) > 1000 for r in reqs if r.kind == "long")


def test_a_bad_prompts_file_names_the_line(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": [1, 2, 3], "output_len": 4}\n{"oops": 1}\n')
    with pytest.raises(SystemExit, match=r"p.jsonl:2: not a prompt line"):
        wl.jsonl_workload(f, 10, tokenizer=None)
    got = wl.jsonl_workload(f, 1, tokenizer=None)
    assert got[0].prompt == [1, 2, 3] and got[0].output_len == 4


def test_pd_goals_compare_pd_with_its_same_hardware_baselines() -> None:
    def r(goodput: float, tpot_p99: float = 10.0, itl: tuple[float, float] = (5.0, 6.0),
          decisions: dict[str, float] | None = None) -> dict[str, object]:  # fmt: skip
        return {"request_goodput": goodput, "tpot_ms": {"p99": tpot_p99},
                "itl_ms": {"median": itl[0], "p99": itl[1]},
                "router_decisions": decisions or {}}  # fmt: skip

    res = {
        "mono": {"chat@1.0": r(1.0), "chat@2.0": r(1.5), "mixed@1.0": r(1.0),
                 "mixed@2.0": r(1.0)},
        "replicas": {"chat@1.0": r(1.0), "chat@2.0": r(2.0), "mixed@1.0": r(1.0, 20.0),
                     "mixed@2.0": r(1.0, 40.0, (5.0, 50.0))},
        "replicas-rr": {"chat@2.0": r(1.0)},
        "pd": {"chat@1.0": r(1.0), "chat@2.0": r(1.8), "mixed@1.0": r(1.0, 21.0),
               "mixed@2.0": r(1.0, 20.0, decisions={"split": 3.0, "whole": 6.0})},
    }  # fmt: skip
    g = serve.pd_goals(res, [(1.0, "chat@1.0"), (2.0, "chat@2.0")], "chat@1.0",
                       {"pd": 3, "ideal": 1})  # fmt: skip
    assert g["goodput_pd_vs_replicas_min"] == 0.9  # at chat@2.0
    assert g["goodput_pd_vs_monolithic_min"] == 1.0
    assert g["goodput_pd_vs_replicas_rr_at_highest_rate"] == 1.8
    # Only mixed@2.0 shows long prefills between decode steps (ITL p99 10x its median).
    assert g["mixed_overlap_by_load"] == {"mixed@1.0": False, "mixed@2.0": True}
    assert g["tpot_p99_pd_vs_replicas_mixed_overlap"] == 0.5
    assert g["tpot_p99_pd_vs_replicas_mixed_no_overlap"] == 1.05
    assert g["stalls_pd_minus_ideal"] == 2
    assert g["pd_decisions_by_load"]["mixed@2.0"] == {"split": 3.0, "whole": 6.0}
    assert g["demo_cached_gain_median"] is None
