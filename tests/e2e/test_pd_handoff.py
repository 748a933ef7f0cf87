"""Prefill/decode handoff through the tiered cache with real ``vllm serve`` processes.

One module-scoped set of CPU servers (started together, ~1 min) serves every test:

* ``mono``: no connector, the reference;
* ``prefill``: ``kv_producer``, run with ``max_tokens=1`` like a P/D proxy does;
* ``decode``: ``kv_consumer`` with ``kv_load_failure_policy="recompute"``;
* ``decode_fail``: ``kv_consumer`` with ``kv_load_failure_policy="fail"``.

All connector servers share one store (``vllm_harness.SharedStore``).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.vllm_harness import (
    SharedStore,
    VllmServer,
    free_port,
    kv_transfer_config,
    pinned_core,
    start_servers,
)

CHUNK = 256
PROMPT_LEN = 600
GEN_TOKENS = 8
WAIT_S = 4.0
NEAR_TIE = 1e-4  # top-2 logprobs this close: either token is a correct greedy pick
LOGPROB_TOL = 1e-4  # same token: loaded vs recomputed KV (measured: bit-identical on CPU)


def make_prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 512) for _ in range(n)]  # ids < 6 are special tokens


@dataclass
class Gen:
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[float]]  # top-k logprobs per position, best first
    cached_tokens: int | None
    body: dict[str, Any]


def parse(resp: httpx.Response) -> Gen:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    ch = body["choices"][0]
    lp = ch["logprobs"]
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return Gen(
        token_ids=list(ch["token_ids"]),
        logprobs=[float(x) for x in lp["token_logprobs"]],
        top=[sorted((float(v) for v in d.values()), reverse=True) for d in lp["top_logprobs"]],
        cached_tokens=details.get("cached_tokens"),
        body=body,
    )


def assert_same_generation(ref: Gen, got: Gen) -> None:
    """Token-for-token equality; at a near tie in the reference, the logprobs decide."""
    assert len(got.token_ids) == len(ref.token_ids)
    pairs = zip(ref.token_ids, got.token_ids, strict=True)
    same = [i for i, (a, b) in enumerate(pairs) if a == b]
    worst = max((abs(ref.logprobs[i] - got.logprobs[i]) for i in same), default=0.0)
    print(f"[e2e] {len(same)}/{len(ref.token_ids)} tokens equal, max |dlogprob| {worst:.2e}")
    for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)):
        if a == b:
            assert abs(ref.logprobs[i] - got.logprobs[i]) <= LOGPROB_TOL, (
                f"token {i}: logprob {got.logprobs[i]} vs reference {ref.logprobs[i]}"
            )
            continue
        top = ref.top[i]
        assert len(top) >= 2 and top[0] - top[1] <= NEAR_TIE, (
            f"token {i} differs ({b} vs reference {a}) and is no near tie: top-2 {top[:2]}"
        )
        assert abs(got.logprobs[i] - ref.logprobs[i]) <= NEAR_TIE + LOGPROB_TOL
        return  # the sequences legitimately diverge after a tie


@dataclass
class Cluster:
    mono: VllmServer
    prefill: VllmServer
    decode: VllmServer
    decode_fail: VllmServer
    store: SharedStore


@pytest.fixture(scope="module")
def cluster(tiny_model: str, shared_store: SharedStore, log_dir: Path) -> Iterator[Cluster]:
    store_cfg = shared_store.config

    def srv(name: str, kv: dict[str, Any] | None) -> VllmServer:
        # Prefill and decode on different cores (see vllm_harness.pinned_core).
        core = pinned_core(0 if name in ("mono", "prefill") else 1)
        return VllmServer(
            name, tiny_model, free_port(), log_dir / f"{name}.log", kv_config=kv,
            env={"VLLM_CPU_OMP_THREADS_BIND": core},
        )

    servers = Cluster(
        mono=srv("mono", None),
        prefill=srv("prefill", kv_transfer_config("kv_producer", store_cfg, chunk_size=CHUNK)),
        decode=srv(
            "decode",
            kv_transfer_config(
                "kv_consumer", store_cfg, policy="recompute", chunk_size=CHUNK,
                load_wait_timeout_s=WAIT_S,
            ),
        ),
        decode_fail=srv(
            "decode_fail",
            kv_transfer_config(
                "kv_consumer", store_cfg, policy="fail", chunk_size=CHUNK,
                load_wait_timeout_s=WAIT_S,
            ),
        ),
        store=shared_store,
    )
    all_servers = [servers.mono, servers.prefill, servers.decode, servers.decode_fail]
    t0 = time.monotonic()
    start_servers(all_servers)
    print(
        f"\n[e2e] 4 servers ready in {time.monotonic() - t0:.1f}s "
        + " ".join(f"{s.name}={s.startup_s:.0f}s" for s in all_servers)
    )
    try:
        yield servers
    finally:
        for s in all_servers:
            s.stop()


_refs: dict[int, Gen] = {}


def reference(c: Cluster, seed: int) -> Gen:
    if seed not in _refs:
        _refs[seed] = parse(c.mono.completion(make_prompt(seed), max_tokens=GEN_TOKENS))
    return _refs[seed]


def prefill(c: Cluster, seed: int) -> dict[str, Any]:
    """Run the prompt on the prefill server (max_tokens=1) like a P/D proxy; returns the
    response's ``kv_transfer_params`` (our connector lists the chunks it stored)."""
    g = parse(c.prefill.completion(make_prompt(seed), max_tokens=1))
    # The prefill computed the same first token as the monolithic run.
    assert g.token_ids[0] == reference(c, seed).token_ids[0]
    params = dict(g.body.get("kv_transfer_params") or {})
    tc = params.get("tiered_cache") or {}
    n_chunks = -(-PROMPT_LEN // CHUNK)  # full chunks and the partial tail
    assert tc.get("chunks") == n_chunks and len(tc.get("keys", [])) == n_chunks, params
    # Saves commit on a helper thread after the forward pass: they land moments after.
    deadline = time.monotonic() + 5
    while c.store.present(tc["keys"]) < n_chunks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert c.store.present(tc["keys"]) == n_chunks
    return params


def external_hits(s: VllmServer) -> float:
    return s.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


def series_sum(s: VllmServer, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples on ``s``'s /metrics carrying all of ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v for k, v in s.metrics().items()
        if k.startswith(name + "{") and all(w in k for w in want)
    )  # fmt: skip


def wait_metric(s: VllmServer, name: str, at_least: float, **labels: str) -> float:
    """Connector stats reach the API server's /metrics with the engine's next stats
    update: poll briefly."""
    deadline = time.monotonic() + 10
    while (v := series_sum(s, name, **labels)) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return v


def test_monolithic_reference(cluster: Cluster) -> None:
    ref = reference(cluster, 1)
    assert len(ref.token_ids) == GEN_TOKENS
    assert all(len(t) == 2 for t in ref.top)
    assert ref.cached_tokens in (None, 0)
    again = parse(cluster.mono.completion(make_prompt(1), max_tokens=GEN_TOKENS))
    assert again.token_ids == ref.token_ids  # greedy on CPU is deterministic


def test_prefill_then_decode_matches_monolithic(cluster: Cluster) -> None:
    ref = reference(cluster, 1)
    hit_tokens = "tiered_cache_connector_hit_tokens_total"
    dram0 = series_sum(cluster.decode, hit_tokens, tier="dram", model_name="tiny")
    params = prefill(cluster, 1)
    assert params.get("tiered_cache", {}).get("chunks") == 3, params
    # The connector's own metrics, on vLLM's /metrics (see connectors/vllm_metrics.py).
    assert wait_metric(cluster.prefill, "tiered_cache_connector_stored_chunks_total", 3) >= 3
    hits0 = external_hits(cluster.decode)
    got = parse(
        cluster.decode.completion(
            make_prompt(1), max_tokens=GEN_TOKENS, extra={"kv_transfer_params": params}
        )
    )
    assert_same_generation(ref, got)
    # All of the prompt but the last token came from the cache (>= chunk-aligned length).
    assert got.cached_tokens is not None and got.cached_tokens >= PROMPT_LEN // CHUNK * CHUNK
    assert got.cached_tokens == PROMPT_LEN - 1
    assert external_hits(cluster.decode) - hits0 == PROMPT_LEN - 1
    # vLLM attributes the hit to the tier our lookup reported (DRAM -> "host").
    by_source = {
        k: v for k, v in cluster.decode.metrics().items()
        if k.startswith("vllm:prompt_tokens_cached_by_source") and "{" in k
    }
    assert any('source="host"' in k and v >= PROMPT_LEN - 1 for k, v in by_source.items()), (
        by_source
    )
    # Our metric names the tier that served the chunks (the agent's reply), as does the log.
    dram = wait_metric(cluster.decode, hit_tokens, dram0 + PROMPT_LEN - 1, tier="dram")
    assert dram - dram0 == PROMPT_LEN - 1
    assert wait_metric(cluster.decode, "tiered_cache_connector_lookups_total", 1, result="hit")
    assert f"loaded 3/3 chunks ({PROMPT_LEN - 1} tokens planned) from dram in" in (
        cluster.decode.log_text()
    )


def test_pin_by_model_names_the_keys_the_connector_wrote(cluster: Cluster) -> None:
    """The servers' connectors registered their fingerprint (KV layout and block size of
    vLLM's CPU backend, which the CLI cannot guess): `pin add --model <served name>`
    pins exactly the chunks the prefill stored."""
    import yaml
    from click.testing import CliRunner

    from tiered_cache.cli import main
    from tiered_cache.client import config_from_extra

    keys = prefill(cluster, 6)["tiered_cache"]["keys"]
    cfg = cluster.store.root / "cli.yaml"
    sock = config_from_extra(cluster.store.config).socket_path
    cfg.write_text(yaml.safe_dump({"agent": {"socket": sock}}))

    def cli(*args: str) -> str:
        r = CliRunner().invoke(main, list(args), catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return r.output

    models = json.loads(cli("models", "-c", str(cfg), "--json"))
    assert len(models) == 1 and "tiny" in models[0]["aliases"], models
    assert "@cpu/FullAttentionSpec" in models[0]["kv_layout"]
    toks = ",".join(map(str, make_prompt(6)))
    info = json.loads(
        cli("pin", "add", "-c", str(cfg), "--model", "tiny", "--tokens", toks, "--json")
    )
    pins = yaml.safe_load(cli("pin", "export", "-c", str(cfg)))["pins"]
    assert next(p for p in pins if p["id"] == info["id"])["keys"] == keys[: PROMPT_LEN // CHUNK]
    cli("pin", "rm", "-c", str(cfg), info["id"])


def test_corrupted_chunks_are_recomputed(cluster: Cluster) -> None:
    ref = reference(cluster, 2)
    params = prefill(cluster, 2)
    cluster.store.corrupt(params["tiered_cache"]["keys"])
    t0 = time.monotonic()
    got = parse(cluster.decode.completion(make_prompt(2), max_tokens=GEN_TOKENS))
    assert_same_generation(ref, got)
    # Recomputed at once: no second wait for chunks after the failed load.
    assert time.monotonic() - t0 < WAIT_S
    log = cluster.decode.log_text()
    assert "not loaded" in log and "vLLM recomputes it" in log
    assert "Recovered from KV load failure" in log


def test_corrupted_chunks_fail_policy_errors_cleanly(cluster: Cluster) -> None:
    params = prefill(cluster, 3)
    cluster.store.corrupt(params["tiered_cache"]["keys"])
    resp = cluster.decode_fail.completion(make_prompt(3), max_tokens=GEN_TOKENS)
    # vLLM 0.32 finishes the request with FINISHED_ERROR (finish_reason "error"): no token
    # is sampled from the bad KV, and the OpenAI server answers 500 (GenerationError).
    assert resp.status_code == 500, resp.text
    assert "choices" not in resp.json()
    assert "Failing 1 request(s) due to KV load failure" in cluster.decode_fail.log_text()
    # The server is still healthy and serves the next request.
    ref = reference(cluster, 1)
    got = parse(cluster.decode_fail.completion(make_prompt(1), max_tokens=GEN_TOKENS))
    assert_same_generation(ref, got)


def test_decode_without_prefill_recomputes_without_waiting(cluster: Cluster) -> None:
    """A request that carries no prefill's list of saved chunks has nothing on its way:
    the decode recomputes at once (the old rule waited out the whole deadline)."""
    ref = reference(cluster, 5)
    before = series_sum(cluster.decode, "tiered_cache_connector_recompute_fallbacks_total",
                        reason="deadline")  # fmt: skip
    got = parse(cluster.decode.completion(make_prompt(5), max_tokens=GEN_TOKENS))
    assert_same_generation(ref, got)
    assert got.cached_tokens in (None, 0)
    assert wait_metric(cluster.decode, "tiered_cache_connector_lookups_total", 1, result="miss")
    assert series_sum(cluster.decode, "tiered_cache_connector_recompute_fallbacks_total",
                      reason="deadline") == before  # fmt: skip
    assert "did not arrive" not in cluster.decode.log_text()


def test_chat_completion_works(cluster: Cluster) -> None:
    r = httpx.post(
        cluster.mono.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello cache"}],
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None
