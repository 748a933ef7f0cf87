"""At-rest codecs and encryption under real vLLM CPU: bytes stored, NVMe- and S3-hit TTFT
per codec, and what the lossy ``fp8`` costs in output (issue 28). The harness is
``bench/e2e_ttft.py``'s (its agents, servers and clean-up), with one vLLM and one agent.

One vLLM (``kv_both``, prefix cache off, one worker thread) stays up; the agent behind it
restarts for every case with that case's tier (DRAM plus NVMe, or DRAM plus S3, written
through) and codec, on a fresh directory or bucket prefix. Per case:

1. **Bytes.** A prompt of English text (``docs/architecture.md``) and the serving bench's
   ``chat`` requests are computed and stored; the agent's
   ``at_rest_bytes_total{form=raw|stored}`` says what the codec kept.
2. **TTFT.** The text prompt again, ``max_tokens=1``, each run after the agent drops its
   DRAM copies (``clear dram``), so the load comes from the case's tier: NVMe (page cache
   warm) or S3.
3. **Output.** After one more ``clear dram``, each ``chat`` request again with 16 greedy tokens,
   loaded from the tier, against the same request loaded in the ``none`` case (the codec's
   own effect) and against its computation in this case (that plus what loading instead
   of computing changes, which a random-weight model's near-flat logits turn into greedy
   flips): whole-output match rate, and the largest difference in a generated token's
   log-probability before the outputs part (log-softmax: the logits' difference less one
   constant per position).

The model is the project's random-weight Llama: its KV compresses unlike a trained
model's (the package indexes here ship no small trained weights), so the bytes-saved
figures say how the codecs behave on vLLM's KV, not what a trained model saves.

    python bench/e2e_at_rest.py [--quick] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_ttft import (
    S3_ENV,
    Agent,
    clean_up,
    make_model,
    on_sigterm,
    say,
    start_redis_moto,
    timed,
    uninterrupted,
)

from tiered_cache import at_rest
from tiered_cache.plan.workloads import chat_workload
from tiered_cache.tools.vllm_launch import (
    REPO,
    VllmServer,
    free_port,
    kv_transfer_config,
    mp_shm,
    start_servers,
)

TEXT_TOKENS = 2050
OUTPUT_TOKENS = 16
#: (tier, codec, encrypt): every codec on each tier, and encryption against plaintext.
_CODECS: tuple[tuple[at_rest.CodecName, bool], ...] = (
    ("none", False), ("none", True), ("zstd", False), ("zstd-planes", False),
    ("fp8", False), ("fp8", True),
)  # fmt: skip
CASES = tuple((tier, name, enc) for tier in ("nvme", "s3") for name, enc in _CODECS)


def paced_proxy(upstream_port: int, mbps: float) -> int:
    """A TCP proxy on a free loopback port in front of ``upstream_port`` that sends
    replies at most ``mbps`` MB/s a connection, as one S3 connection moves (about 100 MB/s
    from an EC2 instance in the bucket's region); requests pass unpaced. Runs on a daemon
    thread for the life of the bench. Returns its port."""
    import asyncio
    import threading

    port = free_port()
    rate = mbps * 1e6
    ready = threading.Event()

    async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, paced: bool) -> None:
        t0, sent = time.monotonic(), 0
        try:
            while data := await r.read(256 * 1024):
                w.write(data)
                await w.drain()
                if paced:
                    sent += len(data)
                    ahead = sent / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(pump(cr, uw, False), pump(ur, cw, True))

    def serve() -> None:
        async def main() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", port)
            ready.set()
            async with server:
                await server.serve_forever()

        asyncio.run(main())

    threading.Thread(target=serve, daemon=True, name="paced-s3").start()
    ready.wait(10)
    return port


def case_name(tier: str, name: str, enc: bool) -> str:
    return f"{tier}/{name}{'+aes' if enc else ''}"


def text_prompt(model: Path) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = (REPO / "docs" / "architecture.md").read_text()
    ids = tok.encode(text).ids
    while len(ids) < TEXT_TOKENS:
        ids += ids
    return [int(x) for x in ids[:TEXT_TOKENS]]


def generate(server: VllmServer, prompt: list[int]) -> dict[str, Any]:
    r = server.completion(prompt, max_tokens=OUTPUT_TOKENS, logprobs=2, timeout=600)
    r.raise_for_status()
    ch = r.json()["choices"][0]
    tops = [sorted(d.values(), reverse=True) for d in ch["logprobs"]["top_logprobs"]]
    return {"tokens": list(ch["token_ids"]),
            "logprobs": [float(x) for x in ch["logprobs"]["token_logprobs"]],
            "top2_gaps": [t[0] - t[1] for t in tops if len(t) > 1]}  # fmt: skip


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> dict[str, Any]:
    """Whole-output match rate, and the largest |logprob difference| of the tokens both
    generated before they part."""
    same, diffs, agree = 0, [], []
    for a, b in zip(ref, got, strict=True):
        same += a["tokens"] == b["tokens"]
        n = 0
        while n < len(a["tokens"]) and n < len(b["tokens"]) and a["tokens"][n] == b["tokens"][n]:
            diffs.append(abs(a["logprobs"][n] - b["logprobs"][n]))
            n += 1
        agree.append(n / max(1, len(a["tokens"])))
    gaps = [g for a in ref for g in a["top2_gaps"]]
    return {"requests": len(ref), "greedy_match_rate": same / max(1, len(ref)),
            # how close the reference's greedy choices were: a random-weight model's
            # logits are nearly flat, so small changes flip them
            "ref_top2_gap_median": statistics.median(gaps) if gaps else None,
            "token_agreement": statistics.mean(agree) if agree else None,
            "max_logprob_diff": max(diffs) if diffs else None}  # fmt: skip


def run(work: Path, runs: int, n_chat: int, s3_mbps: float | None,
        procs: list[subprocess.Popen[bytes]], servers: list[VllmServer],
        agents: list[Agent]) -> dict[str, Any]:  # fmt: skip
    model = make_model()
    redis_url, s3_url = start_redis_moto(work, procs, "127.0.0.1")
    if s3_mbps:
        s3_url = f"http://127.0.0.1:{paced_proxy(int(s3_url.rsplit(':', 1)[1]), s3_mbps)}"
        say(f"S3 through a proxy that sends {s3_mbps:g} MB/s a connection")
    os.environ[at_rest.ENV_KEYS] = "1 " + os.urandom(32).hex()  # the agents inherit it
    prompt = text_prompt(model)
    chats = [r.prompt for r in chat_workload(n_chat, seed=5, users=n_chat, systems=2,
                                             system_tokens=600)]  # fmt: skip
    sock = str(work / "node.sock")

    def cfg(tier: str, name: str, enc: bool, i: int) -> dict[str, Any]:
        # A directory of its own (a Redis database a case): the directory remembers S3
        # copies cluster-wide, and a case's agent would skip writing what an earlier
        # case's bucket prefix holds.
        c: dict[str, Any] = {"node_id": "node", "redis_url": f"{redis_url[:-1]}{i}",
                             "chunk_size": 256,
                             "dram": {"capacity": "128MiB"}, "agent": {"socket": sock}}  # fmt: skip
        if tier == "nvme":
            c["nvme"] = {"enabled": True, "path": str(work / f"nvme-{i}"), "capacity": "4GiB",
                         "write_mode": "write_through", "codec": name, "encrypt": enc}  # fmt: skip
        else:
            c["s3"] = {"enabled": True, "url": f"s3://bench/c{i}", "endpoint_url": s3_url,
                       "region": "us-east-1", "write_mode": "write_through", "codec": name,
                       "encrypt": enc}  # fmt: skip
        return c

    ag = Agent("node", work, cfg(*CASES[0], 0))
    agents.append(ag.start())
    store = {"config_file": str(ag.path), "embedded": "never", "agent_socket": sock}
    srv = VllmServer("kv-both", str(model), free_port(), work / "kv-both.log",
                     kv_config=kv_transfer_config("kv_both", store, policy="recompute"),
                     env=S3_ENV, dtype="bfloat16", max_model_len=4096, served_name="bench",
                     max_num_seqs=1)  # fmt: skip
    servers.append(srv)
    say("starting vLLM (kv_both)")
    start_servers([srv], 900)
    warm = [7, 8, 9] * 20

    def restart(c: dict[str, Any]) -> None:
        ag.stop()
        ag.cfg = c
        ag.start(fresh_dram=True)
        # untimed: the connector reconnects to the new agent here
        srv.completion(warm, max_tokens=1, logprobs=0, timeout=600).raise_for_status()

    def empty_dram() -> None:
        """Drop every DRAM copy, so the next load comes from the case's tier: cheaper than
        an agent restart, and the pool (and the connector's mapping of it) stays."""
        from tiered_cache.client import AgentClient

        c = AgentClient(sock, attach_pool=False)
        try:
            c.admin("clear", tier="dram")
        finally:
            c.close()

    out: dict[str, Any] = {
        "model": "random Llama: hidden 1024, 12 layers, 16 heads, 4 KV heads, bf16",
        "text_tokens": TEXT_TOKENS, "chat_requests": n_chat, "cases": {},
        "s3_link": f"{s3_mbps:g} MB/s a connection (paced proxy)" if s3_mbps else "loopback",
    }  # fmt: skip
    cases: dict[str, Any] = out["cases"]
    reference: list[dict[str, Any]] = []
    for i, (tier, name, enc) in enumerate(CASES):
        label = case_name(tier, name, enc)
        say(f"case {i + 1}/{len(CASES)}: {label}")
        restart(cfg(tier, name, enc, i))
        miss_s, _ = timed(srv, prompt)  # computed, and stored through the agent
        ag.flush()
        st = ag.stats()
        raw = st.get(f"tiered_cache_at_rest_bytes_total{{form=raw,tier={tier}}}")
        stored = st.get(f"tiered_cache_at_rest_bytes_total{{form=stored,tier={tier}}}")
        written = st.get(f"tiered_cache_written_bytes_total{{tier={tier}}}", 0.0)
        computed = [generate(srv, p) for p in chats]
        ag.flush()
        hits_s, cached = [], []
        for _ in range(runs):
            empty_dram()
            dt, c = timed(srv, prompt)
            hits_s.append(dt)
            cached.append(c)
        tier_hits = ag.stats().get(f"tiered_cache_hits_total{{tier={tier}}}", 0.0)
        empty_dram()
        loaded = [generate(srv, p) for p in chats]
        if name == "none" and not enc and not reference:
            reference = loaded
        cases[label] = {
            "miss_s": miss_s, "hit_s": statistics.median(hits_s), "hit_runs_s": hits_s,
            "cached_tokens": cached, "tier_hits_last_run": tier_hits,
            "stored_ratio_text": (stored / raw) if raw and stored else 1.0,
            "bytes_written_text": written,
            "vs_computed_here": compare(computed, loaded),
            "vs_none": compare(reference, loaded) if reference else None,
        }  # fmt: skip
        c = cases[label]
        say(f"  stored {c['stored_ratio_text']:.3f} of the text prompt's KV; hit "
            f"{c['hit_s'] * 1000:.0f} ms (miss {miss_s * 1000:.0f} ms), cached {cached}; "
            f"outputs vs none: {c['vs_none']}")  # fmt: skip
    with uninterrupted():
        srv.stop()

    def ratio(tier: str, label: str) -> float | None:
        a, b = cases.get(f"{tier}/{label}"), cases.get(f"{tier}/none")
        return a["hit_s"] / b["hit_s"] if a and b else None

    out["ratios"] = {
        f"{tier}_{label}_hit_vs_none": ratio(tier, label)
        for tier in ("nvme", "s3") for label in ("none+aes", "zstd", "zstd-planes", "fp8", "fp8+aes")
    }  # fmt: skip
    return out


def main() -> None:
    signal.signal(signal.SIGTERM, on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 timed hits a case, 4 chat requests")
    ap.add_argument("--runs", type=int, default=3, help="timed hits a case")
    ap.add_argument("--chat", type=int, default=8, help="chat requests a case")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--s3-mbps",
        type=float,
        default=None,
        help="pace S3 replies to this many MB/s a connection (default: loopback)",
    )
    ap.add_argument("--tiers", default="nvme,s3", help="comma list of nvme, s3")
    a = ap.parse_args()
    global CASES
    tiers = a.tiers.split(",")
    if not tiers or set(tiers) - {"nvme", "s3"}:
        ap.error("--tiers takes nvme, s3 or both")
    CASES = tuple(c for c in CASES if c[0] in tiers)
    runs, n_chat = (2, 4) if a.quick else (a.runs, a.chat)
    if runs < 1 or n_chat < 1:
        ap.error("--runs and --chat must be at least 1")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="tc-atrest-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    servers: list[VllmServer] = []
    agents: list[Agent] = []
    shm_before = mp_shm()
    t0 = time.monotonic()
    try:
        res = run(work, runs, n_chat, a.s3_mbps, procs, servers, agents)
    finally:
        clean_up(servers, agents, procs, shm_before)
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = round(time.monotonic() - t0)
    print(json.dumps(res) if a.json else json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
