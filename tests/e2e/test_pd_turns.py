"""A conversation through the router, turn after turn, under real vLLM: every turn loads
every token an earlier turn computed, to the token (all of the prompt but its last token
when its prefill ran), whether the router ran the prefill or skipped it, and whether the
decode's own prefix cache is on or off.

The turns grow inside a chunk and across a chunk boundary by less than a chunk (the router
skips the prefill: the decode loads what the cache holds and computes the rest itself,
then saves it), and by more than a chunk (the prefill runs). A decode that did not save
what it computed left the next turn to find only the turn before's chunks, and a probe
of whole blocks only lost up to a block of the turn before's tail (issue 23). The
generated tokens equal a recompute's.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.test_pd_handoff import Gen, assert_same_generation, parse
from e2e.test_router import RouterProc, completion_body
from e2e.vllm_harness import VllmServer, free_port, kv_transfer_config, pinned_core, start_pd_agent

CHUNK = 256


@dataclass
class Turns:
    prefill: VllmServer
    decodes: dict[str, VllmServer]  # "off" / "on": the decode's vLLM prefix cache
    routers: dict[str, RouterProc]


@pytest.fixture(scope="module")
def turns(
    tiny_model: str,
    agent_procs: Callable[[str, dict[str, Any]], Any],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Turns]:
    root = tmp_path_factory.mktemp("turns")
    agent, store = start_pd_agent(agent_procs, root, "turns", CHUNK)
    # kv_both as in the demo: the prefill loads what is cached and computes the rest.
    prefill = VllmServer(
        "turns-prefill", tiny_model, free_port(), log_dir / "turns-prefill.log",
        kv_config=kv_transfer_config("kv_both", store, policy="recompute", chunk_size=CHUNK),
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
    )
    decodes = {
        mode: VllmServer(
            f"turns-decode-{mode}", tiny_model, free_port(), log_dir / f"turns-decode-{mode}.log",
            kv_config=kv_transfer_config("kv_consumer", store, policy="recompute",
                                         chunk_size=CHUNK, load_wait_timeout_s=4.0),
            env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(i + 1)},
            extra_args=["--enable-prefix-caching"] if mode == "on" else [],
        )
        for i, mode in enumerate(("off", "on"))
    }  # fmt: skip
    servers = [prefill, *decodes.values()]
    routers: dict[str, RouterProc] = {}
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(400)
        for mode, d in decodes.items():
            routers[mode] = RouterProc(f"turns-router-{mode}", [prefill.url], [d.url], log_dir,
                                       config=agent.cfg_path).wait_up()  # fmt: skip
        yield Turns(prefill, decodes, routers)
    finally:
        for r in routers.values():
            r.stop()
        for s in servers:
            s.stop()


def _reference(server: VllmServer, toks: list[int]) -> Gen:
    """The same prompt computed from scratch (a fresh salt: nothing cached anywhere)."""
    body = completion_body(toks, cache_salt=f"ref-{uuid.uuid4().hex}")
    return parse(httpx.post(server.url + "/v1/completions", json=body, timeout=120))


@pytest.mark.parametrize("mode", ["off", "on"], ids=["prefix-cache-off", "prefix-cache-on"])
def test_every_turn_loads_every_cached_token(turns: Turns, mode: str) -> None:
    router, decode = turns.routers[mode], turns.decodes[mode]
    rng = random.Random(f"turns-{mode}")
    # 600 tokens: two whole chunks and an 88-token tail. Turns 2 and 3 grow inside the
    # third chunk, turn 4 crosses into a fourth one by less than a chunk (the router
    # skips the prefill: the decode computes what the cache lacks), and turn 5 grows by
    # more than a chunk (the prefill runs).
    convo = [rng.randrange(6, 500) for _ in range(600)]
    grow = [0, 60, 50, 100, 300]
    prev_len = 0
    for t, extra in enumerate(grow):
        convo = [*convo, *(rng.randrange(6, 500) for _ in range(extra))]
        n = len(convo)
        before = router.stats()
        t0 = time.monotonic()
        got = parse(router.post("/v1/completions", completion_body(convo)))
        dt = time.monotonic() - t0
        after = router.stats()
        skipped = after["prefill_skipped"] - before["prefill_skipped"]
        assert got.body["usage"]["prompt_tokens"] == n
        # Skipped: every token the turn before computed is in the cache (its prefill's or
        # its decode's chunks), to the token: not only its whole blocks. Else the prefill
        # computed and saved the rest: all but the last token.
        want = min(n - 1, prev_len) if skipped else n - 1
        print(f"[turns:{mode}] turn {t + 1}: {n} tokens, prefill "
              f"{'skipped' if skipped else 'ran'}, loaded {got.cached_tokens} "
              f"(want {want}) in {dt * 1e3:.0f} ms")  # fmt: skip
        assert got.cached_tokens == want, (t, n, skipped, got.body["usage"])
        if t in (1, 2, 3):  # less than a chunk uncached: the decode computes it
            assert skipped == 1, (t, after)
        if t == 4:
            assert skipped == 0, (t, after)
        assert_same_generation(_reference(decode, convo), got)
        prev_len = n
