"""Trace simulator: references (Belady, unbounded), the store-driven replay, the CLI, and
the policies added for it (W-TinyLFU)."""

from __future__ import annotations

import asyncio
import functools
import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import EVICTION_POLICIES, EntryInfo, WTinyLFU
from tiered_cache import codec
from tiered_cache.cli import main
from tiered_cache.events import MetricsEvents, StoreEvents
from tiered_cache.hierarchy import TieredStore, TierSlot
from tiered_cache.simulate import (
    DEFAULT_BLOCK_BYTES,
    SimError,
    SimTier,
    StubEncoder,
    TierSpec,
    belady,
    block_key,
    build_store,
    load_trace,
    parse_policies,
    parse_tier,
    run,
    simulate,
    stub_chunk,
    unbounded,
)
from tiered_cache.tools.tracegen import generate_trace, write_jsonl

Rec = dict[str, object]


def recs(*requests: list[int]) -> list[Rec]:
    return [{"hash_ids": list(r), "input_length": 512 * len(r)} for r in requests]


# ----------------------------------------------------------------- brute force


def brute_force_prefix_hits(requests: list[list[int]], cap: int, bypass: bool) -> int:
    """Max prefix hits (leading cached blocks per request) over every caching decision:
    on each miss, which resident to evict (and, with ``bypass``, whether to cache)."""
    seq: list[int] = []
    starts: set[int] = set()
    for r in requests:
        starts.add(len(seq))
        seq.extend(r)

    @functools.cache
    def best(i: int, cache: frozenset[int], leading: bool) -> int:
        if i == len(seq):
            return 0
        leading = leading or i in starts
        x = seq[i]
        if x in cache:
            return int(leading) + best(i + 1, cache, leading)
        options = []
        if bypass or cap == 0:
            options.append(best(i + 1, cache, False))
        if cap > 0:
            if len(cache) < cap:
                options.append(best(i + 1, cache | {x}, False))
            else:
                options.extend(best(i + 1, (cache - {v}) | {x}, False) for v in cache)
        return max(options)

    return best(0, frozenset(), True)


@st.composite
def prefix_traces(draw: st.DrawFn) -> list[list[int]]:
    """Requests that are root-to-node paths of a small random forest: a block id always
    has the same parent, as in Mooncake traces."""
    n = draw(st.integers(1, 6))
    parent: list[int | None] = [None]
    for i in range(1, n):
        parent.append(draw(st.sampled_from([None, *range(i)])))

    def path(v: int | None) -> list[int]:
        out = []
        while v is not None:
            out.append(v)
            v = parent[v]
        return out[::-1]

    ends = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6))
    return [path(v) for v in ends]


@settings(max_examples=400, deadline=None)
@given(requests=prefix_traces(), cap=st.integers(1, 3))
def test_belady_figure_is_the_brute_force_prefix_optimum(
    requests: list[list[int]], cap: int
) -> None:
    got = belady(recs(*requests), cap)
    assert got.hit_blocks == brute_force_prefix_hits(requests, cap, bypass=True)
    # and no demand-paging schedule beats it either
    assert got.hit_blocks >= brute_force_prefix_hits(requests, cap, bypass=False)


@settings(max_examples=200, deadline=None)
@given(requests=prefix_traces(), cap=st.integers(1, 3))
def test_demand_belady_never_beats_the_optimum(requests: list[list[int]], cap: int) -> None:
    demand = belady(recs(*requests), cap, bypass=False)
    assert demand.hit_blocks <= brute_force_prefix_hits(requests, cap, bypass=False)
    assert demand.hit_blocks <= belady(recs(*requests), cap).hit_blocks


def test_demand_belady_can_miss_the_prefix_optimum() -> None:
    # A request longer than the cache: demand paging must cache the tail and evicts the
    # head; the optimum keeps the head.
    requests = [[0, 1, 2], [0, 1, 2], [0, 1], [0]]
    assert belady(recs(*requests), 2, bypass=False).hit_blocks == 2
    assert belady(recs(*requests), 2).hit_blocks == brute_force_prefix_hits(requests, 2, True) == 5
    assert brute_force_prefix_hits(requests, 2, False) == 3


def test_unbounded_and_belady_basics() -> None:
    r = recs([1, 2, 3], [1, 2, 4], [1, 2, 3], [5])
    u = unbounded(r)
    assert u.hit_blocks == 2 + 3
    assert u.blocks == 10
    assert u.attention_saved_ratio == pytest.approx((2**2 + 3**2) / (9 + 9 + 9 + 1))
    assert belady(r, 100).hit_blocks == u.hit_blocks
    assert belady(r, 0).hit_blocks == 0
    # Belady at 2 blocks keeps the shared 1, 2
    assert belady(r, 2).hit_blocks == 4


# ----------------------------------------------------------------- the replay


def test_lru_known_answer() -> None:
    # cap 2, LRU: [1,2] miss; [1,2] hit 2 (order 1,2); [3] evicts 1 -> {2,3};
    # [1,2]: 1 missing -> no hit; put 1 evicts 2, put 2 evicts 3 -> {1,2}.
    r = recs([1, 2], [1, 2], [3], [1, 2])
    res = simulate(r, [TierSpec("dram", 2)], "lru")
    assert res.hit_blocks == 2
    assert res.prefix_hit_ratio == pytest.approx(2 / 7)
    assert res.tokens_saved == 1024
    # attention work: a request of n blocks costs n**2, a hit of h saves h**2
    assert (res.attention_saved, res.attention_total) == (4, 4 + 4 + 1 + 4)
    assert res.to_dict()["attention_saved_ratio"] == pytest.approx(4 / 13)
    (t,) = res.tiers
    assert t.writes == 5
    assert t.bytes_written == 5 * DEFAULT_BLOCK_BYTES


def test_two_tiers_demote_and_promote() -> None:
    # dram=1, nvme=2, write-back: [1] -> dram{1}; [2] evicts 1 to nvme; [1] hits in nvme,
    # is promoted, and evicting 2 from dram demotes it.
    r = recs([1], [2], [1])
    res = simulate(r, [TierSpec("dram", 1), TierSpec("nvme", 2)], "lru", block_bytes=10)
    dram, nvme = res.tiers
    assert res.hit_blocks == 1
    assert (dram.hit_blocks, nvme.hit_blocks) == (0, 1)
    assert nvme.hit_ratio == pytest.approx(1 / 3)
    assert (dram.writes, nvme.writes) == (3, 2)
    assert (dram.bytes_written, nvme.bytes_written) == (30, 20)


def test_prefix_break_counts_only_leading_blocks() -> None:
    # cap 3: after [1,3] the LRU order is 2,1,3, so [4] evicts 2; the last request then
    # finds 1 and 3 cached but its prefix hit is 1 block.
    r = recs([1, 2, 3], [1, 3], [4], [1, 2, 3])
    res = simulate(r, [TierSpec("dram", 3)], "lru")
    assert res.hit_blocks == 2 + 1


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_big_cache_reaches_the_unbounded_ratio(name: str) -> None:
    r = generate_trace("multiturn", 300, seed=5)
    u = unbounded(r)
    res = simulate(r, [TierSpec("dram", u.blocks + 1)], name)
    assert res.hit_blocks == u.hit_blocks
    assert res.tiers[0].writes == len({h for rec in r for h in rec["hash_ids"]})


@pytest.mark.parametrize("kind", ["zipf", "multiturn", "scan"])
@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_no_policy_beats_belady(kind: str, name: str) -> None:
    r = generate_trace(kind, 400, seed=9)
    cap = 300
    res = simulate(r, [TierSpec("dram", cap)], name)
    assert res.hit_blocks <= belady(r, cap).hit_blocks
    # split over tiers the same total capacity: still bounded by one tier's optimum
    res2 = simulate(r, [TierSpec("dram", cap // 3), TierSpec("nvme", cap - cap // 3)], name)
    assert res2.hit_blocks <= belady(r, cap).hit_blocks
    assert sum(t.hit_blocks for t in res2.tiers) == res2.hit_blocks


def test_s3prefix_keeps_a_reread_prefix_through_a_scan() -> None:
    hot = [1, 2, 3]
    scan = [list(range(100 + 5 * i, 105 + 5 * i)) for i in range(10)]  # 50 fresh blocks
    r = recs(hot, hot, hot, *scan, hot)
    tier = [TierSpec("dram", 20)]
    assert simulate(r, tier, "s3prefix").hit_blocks == 2 * 3 + 3
    assert simulate(r, tier, "lru").hit_blocks == 2 * 3  # the scan flushed it


def test_the_simulated_store_reports_to_no_metrics() -> None:
    """Its events go to a plain StoreEvents (no Prometheus bookkeeping in the replay);
    the agent's store turns the same events into its series."""
    store = build_store([TierSpec("dram", 4)], "lru")
    assert type(store.events) is StoreEvents
    asyncio.run(store.put(block_key(1), stub_chunk(block_key(1))))
    assert store.metrics.value("tiered_cache_written_bytes_total", tier="dram") == 0
    assert TieredStore([TierSlot(SimTier("dram", 1024, 64))]).events.__class__ is MetricsEvents


def test_admission_keeps_one_hit_wonders_out() -> None:
    r = generate_trace("scan", 400, seed=2)
    plain = simulate(r, [TierSpec("dram", 200)], "lru")
    gated = simulate(r, [TierSpec("dram", 200)], "lru", admission="frequency")
    assert gated.tiers[0].writes < plain.tiers[0].writes


def test_replay_is_deterministic() -> None:
    r = generate_trace("zipf", 300, seed=1)
    a = run(r, [TierSpec("dram", 100), TierSpec("nvme", 200)], ["arc", "wtinylfu", "s3fifo"])
    b = run(r, [TierSpec("dram", 100), TierSpec("nvme", 200)], ["arc", "wtinylfu", "s3fifo"])
    for p in a["policies"]:
        a["policies"][p].pop("seconds")
        a["policies"][p].pop("requests_per_s")
        b["policies"][p].pop("seconds")
        b["policies"][p].pop("requests_per_s")
    assert a["policies"] == b["policies"]


def test_stub_encoder_matches_codec() -> None:
    enc = StubEncoder()
    for h in (0, 1, 2**64 + 7, 2**128 - 1):
        key = block_key(h)
        assert enc(key) == stub_chunk(key)
        meta, payload = codec.decode(enc(key), expect_key=key)
        assert meta.num_tokens == 512 and payload.nbytes == 0


# ----------------------------------------------------------------- parsing


def test_parse_tier() -> None:
    assert parse_tier("dram=8000") == TierSpec("dram", 8000)
    assert parse_tier("nvme=64GiB", block_bytes=2**30) == TierSpec("nvme", 64)
    assert parse_tier("nvme=1GiB").capacity_blocks == 2**30 // DEFAULT_BLOCK_BYTES
    assert parse_tier("DRAM=10:arc:frequency") == TierSpec("dram", 10, "arc", "frequency")
    for bad in ("dram", "dram=", "gpu=10", "dram=0", "dram=ten", "dram=10:nope", "dram=1:lru:x"):
        with pytest.raises(SimError):
            parse_tier(bad)


def test_parse_policies() -> None:
    assert parse_policies("all") == sorted(EVICTION_POLICIES)
    assert parse_policies("LRU, arc") == ["lru", "arc"]
    with pytest.raises(SimError, match="valid: all, arc"):
        parse_policies("bogus")


def test_load_trace_errors(tmp_path: Path) -> None:
    with pytest.raises(SimError, match="not found"):
        load_trace(tmp_path / "missing.jsonl")
    p = tmp_path / "bad.jsonl"
    p.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": "x"}\n')
    with pytest.raises(SimError, match=":2:"):
        load_trace(p)
    p.write_text('{"hash_ids": [1, 2]}\n\n{"hash_ids": [3]}\n')
    assert [r["input_length"] for r in load_trace(p)] == [1024, 512]
    assert len(load_trace(p, limit=1)) == 1


# ----------------------------------------------------------------- CLI


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    p = tmp_path / "t.jsonl"
    write_jsonl(generate_trace("zipf", 200, seed=4), p)
    return p


def test_cli_json_last_line(trace_file: Path) -> None:
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            str(trace_file),
            "--tier",
            "dram=100",
            "--tier",
            "nvme=300",
            "--policy",
            "all",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert set(out["policies"]) == set(EVICTION_POLICIES)
    for d in out["policies"].values():
        assert 0.0 <= d["prefix_hit_ratio"] <= out["belady_prefix_hit_ratio"] + 1e-12
        assert set(d["tiers"]) == {"dram", "nvme"}
        assert {"hit_ratio", "bytes_written"} <= set(d["tiers"]["dram"])
        assert "prefill_tokens_saved" in d
    assert out["belady_prefix_hit_ratio"] <= out["unbounded_prefix_hit_ratio"]
    assert out["capacity_blocks"] == 400


def test_cli_demand_belady(trace_file: Path) -> None:
    args = ["simulate", str(trace_file), "--tier", "dram=50", "--policy", "lru", "--json"]
    out = json.loads(CliRunner().invoke(main, [*args, "--demand-belady"]).output.splitlines()[-1])
    assert out["belady_demand_prefix_hit_ratio"] <= out["belady_prefix_hit_ratio"]
    assert out["belady_demand"]["bytes_written"] > 0
    plain = json.loads(CliRunner().invoke(main, args).output.splitlines()[-1])
    assert "belady_demand" not in plain


def test_cli_table_and_units(trace_file: Path) -> None:
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            str(trace_file),
            "--tier",
            "dram=1GiB",
            "--block-bytes",
            "8MiB",
            "--policy",
            "lru,arc",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "dram=128 blocks" in res.output
    assert "belady" in res.output and "arc" in res.output


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--tier", "dram"], "bad --tier"),
        (["--tier", "dram=10", "--policy", "nope"], "unknown policy 'nope'; valid: all, arc"),
        (["--tier", "dram=10", "--admission", "nope"], "unknown admission policy"),
        (["--tier", "dram=10", "--tier", "dram=20"], "duplicate tiers"),
        (["--tier", "dram=10", "--block-bytes", "lots"], "not a size"),
        (["--tier", "dram=10", "--limit", "0"], "--limit must be at least 1"),
    ],
)
def test_cli_errors_are_one_line(trace_file: Path, args: list[str], msg: str) -> None:
    res = CliRunner().invoke(main, ["simulate", str(trace_file), *args])
    assert res.exit_code != 0
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], res.output


def test_cli_missing_trace(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["simulate", str(tmp_path / "no.jsonl"), "--tier", "dram=1"])
    assert res.exit_code != 0
    assert res.output.strip() == f"error: trace not found: {tmp_path / 'no.jsonl'}"


# ----------------------------------------------------------------- W-TinyLFU


def test_wtinylfu_frequent_entry_survives_a_scan() -> None:
    p = WTinyLFU(capacity_hint=10, adaptive=False)
    resident: set[str] = set()

    def put(k: str) -> None:
        if k in resident:
            p.on_access(k)
            return
        while len(resident) >= 10:
            v = p.victim()
            assert v is not None and v in resident
            p.on_remove(v)
            resident.discard(v)
        p.on_insert(k, 1)
        resident.add(k)

    for _ in range(5):
        for k in ("h1", "h2", "h3"):
            put(k)
    for i in range(200):
        put(f"scan{i}")
    assert {"h1", "h2", "h3"} <= resident


def test_wtinylfu_queues_and_pins() -> None:
    p = WTinyLFU(capacity_hint=4, adaptive=False)
    for k in "abcd":
        p.on_insert(k, 1, EntryInfo())
    assert p.queue_of("a") == "window"
    v = p.victim()  # the window overflow moves to probation first
    assert v is not None
    assert {p.queue_of(k) for k in "abcd"} <= {"window", "probation"}
    p.on_remove("b")  # pinned: not an eviction, keeps its queue on return
    q = p.queue_of("c")
    p.on_access("c")
    if q == "probation":
        assert p.queue_of("c") == "protected"
    p.on_insert("b", 1)
    assert "b" in p and len(p) == 4


def test_wtinylfu_window_adapts() -> None:
    # A recency-friendly trace (every key re-read soon after its first use, never
    # again) grows the window from its 1% start.
    p = WTinyLFU(capacity_hint=100)
    resident: list[str] = []
    rng = random.Random(0)
    for i in range(20_000):
        k = f"k{i}" if rng.random() < 0.5 or i < 10 else f"k{i - rng.randint(1, 40)}"
        if k in p:
            p.on_access(k)
            continue
        while len(p) >= 100:
            v = p.victim()
            assert v is not None
            p.on_remove(v)
            resident.remove(v)
        p.on_insert(k, 1)
        resident.append(k)
    assert p.window_ratio > 0.01
