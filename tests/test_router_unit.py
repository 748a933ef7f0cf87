"""The router's handoff breaker, against two small HTTP servers that answer as vLLM with
our connector does (real sockets, real router app; no vLLM needed).

A prefill whose connector reports its cache unavailable saved nothing, so a handoff
would make the decode recompute the prompt. The router decodes that request on the
prefill server (its own prefix cache holds the prompt) and serves the next ones whole,
on either pool, until a probe prefill saves its chunks again.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from helpers_router import FakeVllm, serve

from tiered_cache.router import Router


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Rig:
    p: FakeVllm
    d: FakeVllm
    router: Router
    clock: Clock
    url: str
    http: aiohttp.ClientSession

    async def complete(self, prompt: str) -> str:
        body = {"model": "m", "prompt": prompt, "max_tokens": 4}
        async with self.http.post(self.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return str(json.loads(await r.read())["choices"][0]["text"])


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    p, d = FakeVllm("prefill"), FakeVllm("decode")
    runners = []
    for srv in (p, d):
        runner, srv.url = await serve(srv.app())
        runners.append(runner)
    clock = Clock()
    router = Router([p.url], [d.url], handoff_retry_s=5.0, clock=clock)
    runner, url = await serve(router.app())
    runners.append(runner)
    async with aiohttp.ClientSession() as http:
        yield Rig(p, d, router, clock, url, http)
    for r in reversed(runners):
        await r.cleanup()


async def test_requests_are_not_split_while_the_prefills_cache_is_down(rig: Rig) -> None:
    # Up: the usual handoff.
    assert await rig.complete("a") == "from decode"
    assert rig.p.stages() == ["prefill"] and rig.d.stages() == ["decode"]

    # The prefill's cache goes down: that request is decoded where its prompt was just
    # computed, not recomputed by the decode server.
    rig.p.cache_down = True
    assert await rig.complete("b") == "from prefill"
    assert rig.p.stages()[1:] == ["prefill", "whole"] and rig.d.stages() == ["decode"]

    # Until the retry time, no request is split: each goes whole to one server of either
    # pool (ties rotate, so both pools serve).
    got = {await rig.complete(f"c{i}") for i in range(4)}
    assert got == {"from prefill", "from decode"}
    assert "prefill" not in rig.p.stages()[3:]
    assert set(rig.d.stages()[1:]) == {"whole"}

    # A probe at the retry time still finds the cache down: served on the prefill
    # server, and the breaker backs off further.
    rig.clock.t += 5.0
    n_p = len(rig.p.seen)
    assert await rig.complete("d") == "from prefill"
    assert rig.p.stages()[n_p:] == ["prefill", "whole"]

    # The cache is back: the next probe's prefill saves its chunks and the handoff resumes.
    rig.p.cache_down = False
    rig.clock.t += 10.0
    for prompt in ("e", "f"):
        n_p, n_d = len(rig.p.seen), len(rig.d.seen)
        assert await rig.complete(prompt) == "from decode"
        assert rig.p.stages()[n_p:] == ["prefill"] and rig.d.stages()[n_d:] == ["decode"]
    st = rig.router.stats
    assert st.fallbacks == {"cache_down": 6} and st.errors == 0, st
