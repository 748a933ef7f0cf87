"""The router's modes against stand-in vLLM servers (real sockets, the real router app):
replicas (whole, by cache and load, or round robin), ``auto`` deciding whole or split per
request, its decisions and phase times on ``/metrics``, and the skip rule counting a
partial chunk the cache holds (a real agent)."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers_agent import FP, meta, payload, socket_of
from helpers_router import FakeVllm, router_rig, serve

from tiered_cache.client import AgentClient
from tiered_cache.keys import chunk_keys, partial_keys
from tiered_cache.router import Router

PROMPT = list(range(3000, 3084))  # two whole 32-token chunks, then 20 tokens


@asynccontextmanager
async def fakes(n: int) -> AsyncIterator[list[FakeVllm]]:
    servers = [FakeVllm(f"s{i}") for i in range(n)]
    runners = []
    for s in servers:
        runner, s.url = await serve(s.app())
        runners.append(runner)
    try:
        yield servers
    finally:
        for r in runners:
            await r.cleanup()


@asynccontextmanager
async def routed(router: Router) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    runner, url = await serve(router.app())
    try:
        async with aiohttp.ClientSession() as http:
            yield url, http
    finally:
        await runner.cleanup()


async def complete(http: aiohttp.ClientSession, url: str, prompt: Any) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["choices"][0]["text"])


async def test_round_robin_replicas_take_turns_whole() -> None:
    async with fakes(2) as (a, b):
        router = Router([], [a.url, b.url], split="whole", round_robin=True)
        async with routed(router) as (url, http):
            got = [await complete(http, url, f"p{i}") for i in range(4)]
            assert got in (["from s0", "from s1"] * 2, ["from s1", "from s0"] * 2)
            assert a.stages() == b.stages() == ["whole", "whole"]
            assert router.stats.decisions == {"whole": 4}


async def test_auto_splits_while_it_knows_nothing_of_the_prompt() -> None:
    # No cache: the router cannot price the prompt, so it splits as P/D always did (the
    # prefill's answer is where it learns the model's fingerprint).
    async with fakes(2) as (p, d):
        router = Router([p.url], [d.url], split="auto")
        async with routed(router) as (url, http):
            assert await complete(http, url, "x") == "from s1"
            assert p.stages() == ["prefill"] and d.stages() == ["decode"]
            async with http.get(url + "/metrics") as r:
                text = await r.text()
            assert 'tiered_cache_router_decisions_total{kind="split"} 1.0' in text
            assert 'tiered_cache_router_phase_seconds_count{phase="prefill"} 1.0' in text
            assert 'tiered_cache_router_phase_seconds_count{phase="decode_first_byte"} 1.0' in text


def test_modes_are_checked() -> None:
    with pytest.raises(ValueError, match="split must be one of"):
        Router(["http://p"], ["http://d"], split="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefill and one decode"):
        Router([], ["http://d"], split="auto")
    Router([], ["http://a", "http://b"], split="whole")  # replicas need no prefill pool


async def test_auto_serves_whole_once_it_can_price_the_prompt(
    agent: tuple[Path, subprocess.Popen[str]],
) -> None:
    async with router_rig(agent[0], split="auto") as rig:
        assert (await rig.complete([1, 2, 3]))[0] == 200  # split: teaches the fingerprint
        assert rig.p.stages() == ["prefill"]
        # Nothing runs anywhere: a handoff would only add its cost, so one server serves
        # the prompt whole (no prefill stage, no kv_transfer_params).
        assert (await rig.complete(PROMPT))[0] == 200
        stages = rig.p.stages()[1:] + rig.d.stages()[1:]
        assert stages == ["whole"], stages
        assert rig.router.stats.decisions == {"split": 1, "whole": 1}


def _put(cfg: Path, keys: list[str]) -> None:
    client = AgentClient(socket_of(cfg))
    try:
        client.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)])
    finally:
        client.close()


@pytest.mark.parametrize(
    ("what", "cap"),
    [("tail", 10), ("inside", 40)],
    ids=["partial-tail", "partial-inside-a-chunk"],
)
async def test_a_cached_partial_chunk_counts_toward_skipping_prefill(
    agent: tuple[Path, subprocess.Popen[str]], what: str, cap: int
) -> None:
    """partial-tail: both whole chunks and 16 of the 20 tail tokens cached (4 left, under
    the cap of 10; whole chunks alone leave 20). partial-inside-a-chunk: chunk 0 and the
    first 16 tokens of chunk 1 (36 left, under 40; the whole-chunk rule never skips with
    a whole chunk missing)."""
    cfg = agent[0]
    whole = chunk_keys(PROMPT[:-1], FP)
    if what == "tail":
        keys = [*whole, partial_keys(PROMPT, FP, None, whole[1], 64, [16])[0]]
    else:
        keys = [whole[0], partial_keys(PROMPT, FP, None, whole[0], 32, [16])[0]]
    async with router_rig(cfg, max_local_prefill_tokens=cap) as rig:
        assert (await rig.complete([1, 2, 3]))[0] == 200  # teaches the fingerprint
        _put(cfg, keys)
        n_p = len(rig.p.seen)
        assert (await rig.complete(PROMPT))[0] == 200
        assert rig.router.stats.prefill_skipped == 1
        assert len(rig.p.seen) == n_p


def test_config_router_split_settings() -> None:
    from tiered_cache.config import ConfigError, load_config

    rc = load_config({"router": {"split": "auto", "handoff_s": 0.05}}).router
    assert (rc.split, rc.handoff_s, rc.prefill_tokens_per_s) == ("auto", 0.05, 4000.0)
    with pytest.raises(ConfigError, match="split"):
        load_config({"router": {"split": "sometimes"}})
    with pytest.raises(ConfigError, match="prefill_tokens_per_s"):
        load_config({"router": {"prefill_tokens_per_s": 0}})
    with pytest.raises(ConfigError, match="splt"):
        load_config({"router": {"splt": "auto"}})  # unknown keys stay errors


def test_dashboard_charts_the_routers_decisions() -> None:
    from tiered_cache.dashboard.figures import History, cumulative
    from tiered_cache.dashboard.sources import Reading, parse_exposition

    def rd(t: float, split: float, whole: float) -> Reading:
        text = (f'tiered_cache_router_decisions_total{{kind="split"}} {split}\n'
                f'tiered_cache_router_decisions_total{{kind="whole"}} {whole}\n')  # fmt: skip
        return Reading(t=t, samples=parse_exposition(text))

    h = History(window_s=10)
    h.add(0, cumulative(rd(0, 0, 0)))
    h.add(10, cumulative(rd(10, 5, 20)))
    s = h.export()
    assert s["decisions_per_s"] == {"split": [0.0, 0.5], "whole": [0.0, 2.0]}


async def test_load_counters_return_to_zero_and_the_handoff_is_measured() -> None:
    # Requests split, then whole: every server's running decodes and queued prefill
    # tokens go back to zero, and each handoff is a sample of the handoff's cost.
    async with fakes(2) as (p, d):
        router = Router([p.url], [d.url], split="auto")
        async with routed(router) as (url, http):
            for i in range(3):
                await complete(http, url, f"x{i}")
            assert router.handoff_s.samples == 3
            router.split_mode = "whole"
            for i in range(3):
                await complete(http, url, f"y{i}")
        for b in (*router.prefill, *router.decode):
            assert (b.running, b.queued_tokens, b.inflight) == (0, 0, 0), b
        assert router.stats.decisions == {"split": 3, "whole": 3}
