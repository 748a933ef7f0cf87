"""The router's skip-prefill rule: a prompt whose whole chunks are all cached skips the
prefill server only when the decode is left at most ``max_local_prefill_tokens`` tokens to
compute itself (a real agent holds the chunks; stand-in vLLM servers record the stages)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers_agent import FP, meta, payload, socket_of
from helpers_router import router_rig

from tiered_cache.client import AgentClient
from tiered_cache.config import ConfigError, load_config
from tiered_cache.keys import chunk_keys
from tiered_cache.router import Router

# Two whole 32-token chunks, then 20 tokens a decode would compute itself.
PROMPT = list(range(2000, 2084))
REST = len(PROMPT) - 2 * FP.chunk_size


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
    async with router_rig(cfg, max_local_prefill_tokens=max_local) as rig:
        assert (await rig.complete([1, 2, 3]))[0] == 200  # teaches the router the fingerprint
        _cache_whole_chunks(cfg)
        n_p = len(rig.p.seen)
        assert (await rig.complete(PROMPT))[0] == 200
        assert rig.router.stats.prefill_skipped == (1 if skips else 0)
        assert len(rig.p.seen) == n_p + (0 if skips else 1)


async def test_a_missing_whole_chunk_never_skips(
    agent: tuple[Path, subprocess.Popen[str]],
) -> None:
    async with router_rig(agent[0]) as rig:
        await rig.complete([1, 2, 3])
        await rig.complete(PROMPT)  # nothing cached
        assert rig.router.stats.prefill_skipped == 0 and len(rig.p.seen) == 2


def test_config_refuses_a_negative_cap() -> None:
    assert (
        load_config({"router": {"max_local_prefill_tokens": 0}}).router.max_local_prefill_tokens
        == 0
    )
    with pytest.raises(ConfigError, match="max_local_prefill_tokens"):
        load_config({"router": {"max_local_prefill_tokens": -1}})
    with pytest.raises(ValueError, match="max_local_prefill_tokens"):
        Router(["http://p"], ["http://d"], max_local_prefill_tokens=-5)
