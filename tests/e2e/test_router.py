"""``tiered-cache router`` in front of real prefill/decode ``vllm serve`` processes.

One module-scoped set of processes serves every test:

* a node agent (``tiered-cache agent -c``, DRAM + NVMe) shared by
* ``prefill`` (kv_producer) and ``decode`` (kv_consumer, ``recompute`` policy) servers,
* the router (``tiered-cache router --prefill P --decode D -c cfg``, cache-aware through
  the agent), and the session's ``mono_server`` as the reference.

Checked through the router: completions (plain and SSE) and chat completions (plain and
SSE) equal the monolithic reference with the prompt's KV loaded from the cache; /health;
a prompt whose chunks are all cached skips prefill; a dead decode backend is taken out of
rotation while requests succeed on the live one; with only dead (or broken) prefill
backends the decode server computes the prompt itself, and with only dead decode backends
a prefill server decodes: no request fails; with a live one beside it, a prefill or decode
backend that drops the request is retried on the live one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.test_pd_handoff import Gen, assert_same_generation, parse
from e2e.vllm_harness import (
    REPO,
    VllmServer,
    free_port,
    kv_transfer_config,
    pinned_core,
    start_pd_agent,
)

CHUNK = 256
GEN_TOKENS = 8
WAIT_S = 4.0
WORDS = [
    "cache", "tier", "chunk", "prefix", "decode", "prefill", "token", "block", "node", "page",
    "hit", "miss", "policy", "evict", "admit", "pin", "warm", "cold", "hot", "latency",
    "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "sphinx", "quartz",
]


def text_prompt(seed: int, words: int = 260) -> str:
    """~650 tokens of the tiny model's tokenizer: two full chunks and a tail."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def completion_body(prompt: str | list[int], **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": GEN_TOKENS,
        "temperature": 0.0,
        "logprobs": 2,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    body.update(extra)
    return body


def chat_body(seed: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text_prompt(seed)}],
        "max_tokens": GEN_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    body.update(extra)
    return body


class RouterProc:
    """``tiered-cache router`` as its own process."""

    def __init__(self, name: str, prefill: Sequence[str], decode: Sequence[str],
                 log_dir: Path, config: Path | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.log_path = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "tiered_cache.cli", "router", "--port", str(self.port)]
        for u in prefill:
            cmd += ["--prefill", u]
        for u in decode:
            cmd += ["--decode", u]
        if config is not None:
            cmd += ["-c", str(config)]
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            cmd, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1"),
        )
        log.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_up(self, timeout: float = 60.0) -> RouterProc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router {self.name} exited:\n{self.log_text()}")
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(self.url + "/health", timeout=2)
                return self  # answering (200, or 503 when no decode is up)
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"router {self.name} did not come up:\n{self.log_text()}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stats(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/router/stats", timeout=10)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def backend(self, url: str) -> dict[str, Any]:
        return next(b for b in self.stats()["backends"] if b["url"] == url)

    def wait_backend(self, url: str, healthy: bool, timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            b = self.backend(url)
            if b["healthy"] is healthy or time.monotonic() > deadline:
                return b
            time.sleep(0.1)

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@dataclass
class PD:
    agent: Any  # AgentProc (tests/e2e/conftest.py)
    prefill: VllmServer
    decode: VllmServer
    mono: VllmServer
    router: RouterProc
    log_dir: Path


@pytest.fixture(scope="module")
def pd(
    request: pytest.FixtureRequest,
    tiny_model: str,
    agent_procs: Callable[[str, dict[str, Any]], Any],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PD]:
    root = tmp_path_factory.mktemp("pd")
    agent, store = start_pd_agent(agent_procs, root, "pd", CHUNK)
    prefill = VllmServer(
        "rt-prefill", tiny_model, free_port(), log_dir / "rt-prefill.log",
        kv_config=kv_transfer_config("kv_producer", store, chunk_size=CHUNK),
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(0)},
    )
    decode = VllmServer(
        "rt-decode", tiny_model, free_port(), log_dir / "rt-decode.log",
        kv_config=kv_transfer_config(
            "kv_consumer", store, policy="recompute", chunk_size=CHUNK,
            load_wait_timeout_s=WAIT_S,
        ),
        env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(1)},
    )
    servers = [prefill, decode]
    t0 = time.monotonic()
    for s in servers:
        s.start()
    router = None
    try:
        mono = request.getfixturevalue("mono_server")  # starts alongside, if not up yet
        for s in servers:
            s.wait_ready(300)
        for s in servers:
            s.completion([7], max_tokens=1, logprobs=0).raise_for_status()
        router = RouterProc("router", [prefill.url], [decode.url], log_dir,
                            config=agent.cfg_path).wait_up()
        print(f"\n[router] servers and router ready in {time.monotonic() - t0:.1f}s")
        yield PD(agent, prefill, decode, mono, router, log_dir)
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()


# ----------------------------------------------------------------------- references

_refs: dict[Any, Any] = {}


def ref_completion(pd: PD, seed: int) -> Gen:
    if ("cmpl", seed) not in _refs:
        _refs["cmpl", seed] = parse(pd.mono.completion(text_prompt(seed), max_tokens=GEN_TOKENS))
    ref: Gen = _refs["cmpl", seed]
    return ref


def ref_chat(pd: PD, seed: int) -> str:
    if ("chat", seed) not in _refs:
        r = httpx.post(pd.mono.url + "/v1/chat/completions", json=chat_body(seed), timeout=120)
        assert r.status_code == 200, r.text
        _refs["chat", seed] = r.json()["choices"][0]["message"]["content"]
    text: str = _refs["chat", seed]
    return text


def sse_events(resp: httpx.Response) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events: list[dict[str, Any]] = []
    done = False
    for block in resp.text.split("\n\n"):
        line = block.strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            done = True
            continue
        events.append(json.loads(line[len("data: "):]))
    assert done, "stream did not end with [DONE]"
    return events


def min_cached(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // CHUNK * CHUNK


# ------------------------------------------------------------------------------ tests


def test_health_and_models(pd: PD) -> None:
    r = httpx.get(pd.router.url + "/health", timeout=10)
    assert r.status_code == 200, r.text
    assert r.json() == {"prefill": [pd.prefill.url], "decode": [pd.decode.url]}
    m = httpx.get(pd.router.url + "/v1/models", timeout=10)
    assert m.status_code == 200 and m.json()["data"][0]["id"] == "tiny"


def test_completion_matches_monolithic(pd: PD) -> None:
    ref = ref_completion(pd, 1)
    before = pd.router.stats()
    got = parse(pd.router.post("/v1/completions", completion_body(text_prompt(1))))
    assert_same_generation(ref, got)
    n_prompt = got.body["usage"]["prompt_tokens"]
    assert n_prompt > 2 * CHUNK
    # The decode server loaded all of the prompt but its last token from the cache.
    assert got.cached_tokens == n_prompt - 1, got.body["usage"]
    assert got.cached_tokens >= min_cached(n_prompt)
    after = pd.router.stats()
    assert after["per_backend"].get(pd.prefill.url, 0) == before["per_backend"].get(
        pd.prefill.url, 0) + 1
    assert after["prefill_skipped"] == before["prefill_skipped"]
    # The router learned the prefill node from the producer's kv_transfer_params.
    assert pd.router.backend(pd.prefill.url)["node_id"] == pd.agent.node_id
    print(f"[router] completion: prompt {n_prompt} tokens, cached {got.cached_tokens}")


def test_same_prompt_again_skips_prefill(pd: PD) -> None:
    ref = ref_completion(pd, 1)
    before = pd.router.stats()
    got = parse(pd.router.post("/v1/completions", completion_body(text_prompt(1))))
    assert_same_generation(ref, got)
    n_prompt = got.body["usage"]["prompt_tokens"]
    assert got.cached_tokens is not None and got.cached_tokens >= min_cached(n_prompt)
    after = pd.router.stats()
    assert after["prefill_skipped"] == before["prefill_skipped"] + 1, after
    assert after["per_backend"].get(pd.prefill.url) == before["per_backend"].get(pd.prefill.url)
    assert after["per_backend"][pd.decode.url] == before["per_backend"][pd.decode.url] + 1
    print(f"[router] repeat: prefill skipped, cached {got.cached_tokens}/{n_prompt}")


def test_token_id_prompt_is_routed_by_the_cache_too(pd: PD) -> None:
    """A prompt given as token ids needs no tokenizing: the router computes its keys
    directly, and the second time skips the prefill."""
    toks = [(i * 7919) % 500 + 6 for i in range(700)]
    ref = parse(pd.mono.completion(toks, max_tokens=GEN_TOKENS))
    first = parse(pd.router.post("/v1/completions", completion_body(toks)))
    assert_same_generation(ref, first)
    before = pd.router.stats()
    got = parse(pd.router.post("/v1/completions", completion_body(toks)))
    assert_same_generation(ref, got)
    assert pd.router.stats()["prefill_skipped"] == before["prefill_skipped"] + 1
    assert got.cached_tokens is not None and got.cached_tokens >= 512


def test_streaming_completion_yields_the_same_tokens(pd: PD) -> None:
    ref = ref_completion(pd, 2)
    body = completion_body(
        text_prompt(2), stream=True, stream_options={"include_usage": True}
    )
    before = pd.router.stats()
    events = sse_events(pd.router.post("/v1/completions", body))
    choices = [e["choices"][0] for e in events if e.get("choices")]
    assert len(choices) >= 2  # streamed, not one blob
    tokens = [t for c in choices for t in (c.get("token_ids") or [])]
    text = "".join(c.get("text") or "" for c in choices)
    assert tokens == ref.token_ids
    assert text == ref.body["choices"][0]["text"]
    usage = events[-1]["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached == usage["prompt_tokens"] - 1, usage
    after = pd.router.stats()
    assert after["per_backend"][pd.prefill.url] == before["per_backend"][pd.prefill.url] + 1
    print(f"[router] stream: {len(choices)} events, cached {cached}/{usage['prompt_tokens']}")


def test_chat_completions(pd: PD) -> None:
    want = ref_chat(pd, 3)
    r = pd.router.post("/v1/chat/completions", chat_body(3))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == want
    usage = body["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage

    want4 = ref_chat(pd, 4)
    events = sse_events(pd.router.post(
        "/v1/chat/completions",
        chat_body(4, stream=True, stream_options={"include_usage": True}),
    ))
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == want4
    usage = events[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage
    print(f"[router] chat: cached {usage['prompt_tokens_details']['cached_tokens']}"
          f"/{usage['prompt_tokens']} (stream)")


def test_dead_decode_backend_is_taken_out_of_rotation(pd: PD) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = RouterProc("router-dead-decode", [pd.prefill.url], [pd.decode.url, dead],
                        pd.log_dir).wait_up()
    try:
        assert router.wait_backend(dead, healthy=False)["healthy"] is False
        ref = ref_completion(pd, 1)
        for _ in range(3):
            got = parse(router.post("/v1/completions", completion_body(text_prompt(1))))
            assert_same_generation(ref, got)
        st = router.stats()
        assert st["per_backend"].get(dead, 0) == 0 and st["per_backend"][pd.decode.url] == 3
        assert st["errors"] == 0
        assert router.backend(dead)["healthy"] is False
        assert router.backend(pd.decode.url)["healthy"] is True
        h = httpx.get(router.url + "/health", timeout=10)
        assert h.status_code == 200 and h.json()["decode"] == [pd.decode.url]
    finally:
        router.stop()


def test_a_dead_prefill_pool_fails_no_request(pd: PD) -> None:
    """Only dead prefill backends: every request is served by the decode server alone
    (it computes the prompt), counted as a fallback; nothing fails or hangs."""
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    router = RouterProc("router-dead-prefill", dead, [pd.decode.url], pd.log_dir).wait_up()
    try:
        ref = ref_completion(pd, 5)
        for body in (completion_body(text_prompt(5)), completion_body(text_prompt(5))):
            t0 = time.monotonic()
            got = parse(router.post("/v1/completions", body, timeout=60))
            assert time.monotonic() - t0 < 30  # answered, not hung on the dead backends
            assert_same_generation(ref, got)
        r = router.post("/v1/completions", completion_body(text_prompt(5), stream=True))
        assert r.status_code == 200 and "data: [DONE]" in r.text
        r = router.post("/v1/chat/completions", chat_body(5))
        assert r.status_code == 200, r.text
        for u in dead:
            assert router.wait_backend(u, healthy=False)["healthy"] is False
        st = router.stats()
        assert st["errors"] == 0 and st["fallbacks"]["no_prefill"] == 4, st
        assert httpx.get(router.url + "/health", timeout=10).status_code == 200
        assert router.proc.poll() is None
        assert "Traceback" not in router.log_text()
    finally:
        router.stop()


class _HealthyButBroken(BaseHTTPRequestHandler):
    """Answers /health, drops every POST without a response (a backend dying mid-request)."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.close_connection = True  # closed with no status line

    def log_message(self, *args: Any) -> None:
        return


def test_a_prefill_failing_mid_request_leaves_it_to_the_decode(pd: PD) -> None:
    """The only prefill backend passes its probes but drops requests: the decode server
    computes the prompt itself; the client sees a normal answer."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _HealthyButBroken)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    broken = f"http://127.0.0.1:{srv.server_address[1]}"
    router = RouterProc("router-broken-prefill", [broken], [pd.decode.url], pd.log_dir).wait_up()
    try:
        assert router.wait_backend(broken, healthy=True)["healthy"] is True  # probes pass
        ref = ref_completion(pd, 6)
        got = parse(router.post("/v1/completions", completion_body(text_prompt(6)), timeout=60))
        assert_same_generation(ref, got)
        st = router.stats()
        assert st["errors"] == 0 and st["fallbacks"] == {"no_prefill": 1}, st
        assert st["per_backend"][broken] == 1
        assert router.proc.poll() is None
        assert "Traceback" not in router.log_text()
    finally:
        router.stop()
        srv.shutdown()
        srv.server_close()


def test_a_dead_decode_pool_fails_no_request(pd: PD) -> None:
    """Only dead (or broken) decode backends: the prefill server decodes the request
    itself, streaming too."""
    srv, broken = _broken_server()
    dead = f"http://127.0.0.1:{free_port()}"
    router = RouterProc("router-dead-decode", [pd.prefill.url], [dead, broken],
                        pd.log_dir).wait_up()  # fmt: skip
    try:
        ref = ref_completion(pd, 8)
        got = parse(router.post("/v1/completions", completion_body(text_prompt(8)), timeout=60))
        assert_same_generation(ref, got)
        r = router.post("/v1/completions", completion_body(text_prompt(8), stream=True))
        assert r.status_code == 200 and "data: [DONE]" in r.text
        st = router.stats()
        assert st["errors"] == 0 and st["fallbacks"]["no_decode"] == 2, st
        assert router.proc.poll() is None
        assert "Traceback" not in router.log_text()
    finally:
        router.stop()
        srv.shutdown()
        srv.server_close()


def _broken_server() -> tuple[ThreadingHTTPServer, str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _HealthyButBroken)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_a_backend_failing_mid_request_is_retried_on_a_live_one(pd: PD, stage: str) -> None:
    """A backend that passes health probes but drops requests: the request moves to the next
    live backend and succeeds. For decode this is the point of a cache-mediated handoff: the
    KV sits in the tiers, so any decode server can pull it."""
    srv, broken = _broken_server()
    pre = [broken, pd.prefill.url] if stage == "prefill" else [pd.prefill.url]
    dec = [broken, pd.decode.url] if stage == "decode" else [pd.decode.url]
    router = RouterProc(f"router-retry-{stage}", pre, dec, pd.log_dir).wait_up()
    try:
        ref = ref_completion(pd, 7)
        tried_broken = False
        for _ in range(6):  # backends are picked by load, then round-robin
            assert router.wait_backend(broken, healthy=True)["healthy"] is True
            got = parse(router.post("/v1/completions", completion_body(text_prompt(7))))
            assert_same_generation(ref, got)
            if router.stats()["per_backend"].get(broken, 0) > 0:
                tried_broken = True
                break
        assert tried_broken, "the broken backend was never picked"
        st = router.stats()
        assert st["errors"] == 0 and st["retries"] >= 1, st
        assert "Traceback" not in router.log_text()
        print(f"[router] {stage} retry: retries={st['retries']} per_backend={st['per_backend']}")
    finally:
        router.stop()
        srv.shutdown()
        srv.server_close()
