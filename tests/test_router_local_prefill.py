"""The router's skip-prefill rule: a prompt whose whole chunks are all cached skips the
prefill server only when the decode is left at most ``max_local_prefill_tokens`` tokens to
compute itself (a real agent holds the chunks; stand-in vLLM servers record the stages)."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from helpers_agent import FP, meta, payload, socket_of
from helpers_router import FingerprintVllm, serve

from tiered_cache.client import AgentClient
from tiered_cache.config import ConfigError, load_config
from tiered_cache.keys import chunk_keys
from tiered_cache.router import Router

# Two whole 32-token chunks, then 20 tokens a decode would compute itself.
PROMPT = list(range(2000, 2084))
REST = len(PROMPT) - 2 * FP.chunk_size


@asynccontextmanager
async def _router(
    cfg: Path, max_local: int | None
) -> AsyncIterator[tuple[Callable[[], object], FingerprintVllm, Router]]:
    p, d = FingerprintVllm("prefill"), FingerprintVllm("decode")
    runners = []
    for srv in (p, d):
        runner, srv.url = await serve(srv.app())
        runners.append(runner)
    cache = AgentClient(socket_of(cfg), attach_pool=False)
    router = Router([p.url], [d.url], cache=cache, max_local_prefill_tokens=max_local)
    runner, url = await serve(router.app())
    runners.append(runner)
    try:
        async with aiohttp.ClientSession() as http:

            async def complete(prompt: list[int] = PROMPT) -> object:
                body = {"model": "m", "prompt": prompt, "max_tokens": 4}
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    return await r.json()

            yield complete, p, router
    finally:
        for r in reversed(runners):
            await r.cleanup()
        cache.close()


def _cache_whole_chunks(cfg: Path) -> None:
    client = AgentClient(socket_of(cfg))
    try:
        keys = chunk_keys(PROMPT[:-1], FP)
        assert len(keys) == 2
        client.put_many([(meta(k), payload(i)) for i, k in enumerate(keys)])
    finally:
        client.close()


@pytest.mark.parametrize(
    ("max_local", "skips"),
    [(None, True), (REST, True), (REST - 1, False), (0, False)],
    ids=["default-any-tail", "cap-equal", "cap-below", "never"],
)
async def test_skip_prefill_only_within_the_local_prefill_cap(
    agent: tuple[Path, subprocess.Popen[str]], max_local: int | None, skips: bool
) -> None:
    cfg = agent[0]
    async with _router(cfg, max_local) as (complete, p, router):
        await complete([1, 2, 3])  # teaches the router the model's fingerprint
        _cache_whole_chunks(cfg)
        n_p = len(p.seen)
        await complete()
        assert router.stats.prefill_skipped == (1 if skips else 0)
        assert len(p.seen) == n_p + (0 if skips else 1)


async def test_a_missing_whole_chunk_never_skips(
    agent: tuple[Path, subprocess.Popen[str]],
) -> None:
    async with _router(agent[0], None) as (complete, p, router):
        await complete([1, 2, 3])
        await complete()  # nothing cached
        assert router.stats.prefill_skipped == 0 and len(p.seen) == 2


def test_config_refuses_a_negative_cap() -> None:
    assert (
        load_config({"router": {"max_local_prefill_tokens": 0}}).router.max_local_prefill_tokens
        == 0
    )
    with pytest.raises(ConfigError, match="max_local_prefill_tokens"):
        load_config({"router": {"max_local_prefill_tokens": -1}})
    with pytest.raises(ValueError, match="max_local_prefill_tokens"):
        Router(["http://p"], ["http://d"], max_local_prefill_tokens=-5)
