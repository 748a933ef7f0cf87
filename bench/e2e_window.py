"""Models with several KV cache groups under real vLLM CPU (issue 27): a hit with vLLM's
hybrid allocator on (the connector's ``SupportsHMA``) against a hit with it off (every
layer in one full-attention group, as vLLM runs a connector without ``SupportsHMA``),
and each against recomputing, in the same run; and what each allocator holds.

The model: the benchmark Llama (``make_tiny_model.py --preset bench-window``, bfloat16,
12 layers, 4 KV heads) with its layers alternately sliding-window (512 tokens) and full
attention, as Gemma 2/3 and gpt-oss interleave them. A 2,000-token prompt per run.
Servers: ``hma`` (hybrid allocator on) on core 0 and ``onegroup``
(``--disable-hybrid-kv-cache-manager``) on core 1, both ``kv_both`` over one embedded
agent (DRAM). Every measured prompt is new: each case writes it on the writer (one
token, as a prefill), pauses ``--gap-s`` (vLLM CPU's workers poll for about a second
after a request), then times one token on the reader (TTFT). ``recompute`` is the reader
on a prompt nobody wrote. Capacity: vLLM's own "maximum concurrency" line for 4,096-token
requests at each server's start (the same ``VLLM_CPU_KVCACHE_SPACE``).

    python bench/e2e_window.py [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_ttft import timed

from tiered_cache import client as tc_client
from tiered_cache.tools.vllm_launch import (
    REPO,
    VllmServer,
    free_port,
    kv_transfer_config,
    pinned_core,
    server_env,
    start_servers,
)

PROMPT_LEN = 2000
CHUNK = 256
MAX_LEN = 4096
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def say(msg: str) -> None:
    print(f"[window] {msg}", file=sys.stderr, flush=True)


def concurrency(server: VllmServer) -> float | None:
    """vLLM's "maximum concurrency" for ``MAX_LEN``-token requests, from its log."""
    m = _CONCURRENCY.search(server.log_text())
    return float(m.group(2)) if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=5, help="prompts per case (default 5)")
    ap.add_argument("--gap-s", type=float, default=2.0,
                    help="pause between a case's write and its timed read (default 2)")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.gap_s < 0:
        ap.error("--gap-s must not be negative")
    work = Path(tempfile.mkdtemp(prefix="tc-window-"))
    model = str(REPO / ".models" / "bench-window-bf16")
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", model,
         "--preset", "bench-window"],
        check=True, env=server_env(), stdout=subprocess.DEVNULL,
    )  # fmt: skip
    store_cfg = {"store_dir": str(work / "store")}
    store = tc_client.open_store(store_cfg)  # hosts the agent both servers use
    kv = kv_transfer_config("kv_both", store_cfg, policy="recompute", chunk_size=CHUNK)

    def srv(name: str, core: int, *extra: str) -> VllmServer:
        return VllmServer(
            name, model, free_port(), work / f"{name}.log", kv_config=kv, dtype="bfloat16",
            extra_args=list(extra), env={"VLLM_CPU_OMP_THREADS_BIND": pinned_core(core)},
            max_model_len=MAX_LEN,
        )  # fmt: skip

    servers = {"hma": srv("hma", 0),
               "onegroup": srv("onegroup", 1, "--disable-hybrid-kv-cache-manager")}  # fmt: skip
    rng = random.Random(0)
    cases = [("hma", "hma"), (None, "hma"), ("onegroup", "hma"),
             ("onegroup", "onegroup"), (None, "onegroup")]  # fmt: skip
    out: dict[str, Any] = {"prompt_tokens": PROMPT_LEN, "runs": args.runs,
                           "gap_s": args.gap_s, "cases": {}}  # fmt: skip
    try:
        say("starting servers (hybrid allocator on and off)")
        start_servers(list(servers.values()))
        out["max_concurrency"] = {n: concurrency(s) for n, s in servers.items()}
        out["max_concurrency_tokens"] = MAX_LEN
        for writer, reader in cases:
            name = f"{writer}->{reader}" if writer else f"recompute@{reader}"
            times, cached = [], []
            for i in range(args.runs + 1):  # the first run warms the path up, not counted
                prompt = [rng.randrange(6, 512) for _ in range(PROMPT_LEN)]
                if writer:
                    timed(servers[writer], prompt)
                time.sleep(args.gap_s)
                dt, c = timed(servers[reader], prompt)
                if i:
                    times.append(dt)
                    cached.append(c)
            out["cases"][name] = {"ttft_s": statistics.median(times), "runs_s": times,
                                  "cached_tokens": cached}  # fmt: skip
            say(f"{name}: TTFT {statistics.median(times) * 1e3:.0f} ms, "
                f"cached {statistics.median(cached):.0f} of {PROMPT_LEN}")  # fmt: skip
    finally:
        for s in servers.values():
            s.stop()
        store.close()
        tc_client.shutdown_embedded()
    t = {k: v["ttft_s"] for k, v in out["cases"].items()}
    mc = out["max_concurrency"]
    out["ratios"] = {
        "hma_hit_vs_onegroup_hit": t["hma->hma"] / t["onegroup->onegroup"],
        "hma_hit_vs_recompute": t["hma->hma"] / t["recompute@hma"],
        "onegroup_hit_vs_recompute": t["onegroup->onegroup"] / t["recompute@onegroup"],
        "onegroup_chunk_on_hma_vs_hma_hit": t["onegroup->hma"] / t["hma->hma"],
        "hma_vs_onegroup_concurrency": (mc["hma"] / mc["onegroup"]
                                        if mc.get("hma") and mc.get("onegroup") else None),
    }  # fmt: skip
    for k, v in out["ratios"].items():
        say(f"{k}: {v:.2f}x" if v is not None else f"{k}: n/a")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
