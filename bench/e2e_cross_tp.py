"""Hits across TP sizes under real vLLM CPU (issue 27): a cross-TP hit against a
same-TP hit and against recomputing, in the same run.

A TP 1 pool and a TP 2 pool share one cache; each reads chunks the other wrote and
chunks of its own size. ``--model mla``: the project's random DeepSeek-V2
(``make_tiny_model.py --preset mla``, bfloat16, 32-token blocks), whose keys name one KV
shard at any TP, so both pools read the same copy. ``--model llama``: the demo's Llama
(``--preset bench``, bfloat16, 12 layers, 4 KV heads, 12 KiB of KV a token), whose chunks
are per KV shard; each pool lists the other in ``peer_tp_sizes``, so a TP 2 rank loads a
head slice of a TP 1 chunk and a TP 1 reader joins the two ranks' chunks.

A 2,000-token prompt per run, so the prefill is worth saving. Servers: ``tp1`` on core
0 and ``tp2`` on cores 0 and 1 (2 cores here, so TP 2 shares core 0 with TP 1; nothing
else runs while one measures), both ``kv_both`` over one embedded agent (DRAM). Every
measured prompt is new: each case writes it on the writer (one token, as a prefill) then
times one token on the reader (TTFT). ``recompute`` is the reader on a prompt nobody
wrote (``fetch_policy`` left to ``auto``, which recomputes nothing here).

Between the write and the timed read every case pauses ``--gap-s`` (2 s): for about a
second after a request the TP 2 engine's workers keep the cores busy (vLLM CPU's workers
poll for work), and TP 1's core is one of them. Without the pause a read right after a
TP 2 write measured 0.5-1.0 s whatever it read (its load itself: 2 ms).

    python bench/e2e_cross_tp.py [--model mla|llama] [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
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
# --model: (make_tiny_model.py preset, directory under .models, extra vllm args). vLLM
# CPU's MLA kernels take blocks in multiples of 32; the Llama keeps its default (128).
MODELS: dict[str, tuple[str, str, list[str]]] = {
    "mla": ("mla", "mla-bf16", ["--block-size", "32"]),
    "llama": ("bench", "bench-bf16", []),
}


def say(msg: str) -> None:
    print(f"[cross-tp] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", choices=sorted(MODELS), default="mla",
                    help="mla (one shared copy) or llama (per-shard chunks; default mla)")
    ap.add_argument("--runs", type=int, default=5, help="prompts per case (default 5)")
    ap.add_argument("--gap-s", type=float, default=2.0,
                    help="pause between a case's write and its timed read (default 2)")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.gap_s < 0:
        ap.error("--gap-s must not be negative")
    work = Path(tempfile.mkdtemp(prefix="tc-cross-tp-"))
    preset, model_dir, blocks = MODELS[args.model]
    model = str(REPO / ".models" / model_dir)
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", model,
         "--preset", preset, "--dtype", "bfloat16"],
        check=True, env=server_env(), stdout=subprocess.DEVNULL,
    )  # fmt: skip
    store_cfg = {"store_dir": str(work / "store")}
    store = tc_client.open_store(store_cfg)  # hosts the agent both servers use

    def srv(name: str, tp: int, cores: str) -> VllmServer:
        # Each pool reads the other's chunks (MLA's are shared anyway: the setting is a
        # no-op there).
        kv = kv_transfer_config("kv_both", store_cfg, policy="recompute", chunk_size=CHUNK,
                                peer_tp_sizes=[3 - tp])  # fmt: skip
        return VllmServer(
            name, model, free_port(), work / f"{name}.log", kv_config=kv, dtype="bfloat16",
            extra_args=["--tensor-parallel-size", str(tp), *blocks],
            env={"VLLM_CPU_OMP_THREADS_BIND": cores}, max_model_len=4096,
        )  # fmt: skip

    servers = {"tp1": srv("tp1", 1, pinned_core(0)),
               "tp2": srv("tp2", 2, f"{pinned_core(0)}|{pinned_core(1)}")}  # fmt: skip
    rng = random.Random(0)
    cases = [("tp1", "tp1"), ("tp2", "tp1"), (None, "tp1"),
             ("tp2", "tp2"), ("tp1", "tp2"), (None, "tp2")]  # fmt: skip
    out: dict[str, Any] = {"model": args.model, "prompt_tokens": PROMPT_LEN,
                           "runs": args.runs, "gap_s": args.gap_s, "cases": {}}  # fmt: skip
    try:
        say("starting servers (TP 1 and TP 2)")
        start_servers(list(servers.values()))
        for writer, reader in cases:
            name = f"{writer}->{reader}" if writer else f"recompute@{reader}"
            times, cached = [], []
            for i in range(args.runs + 1):  # the first run warms the path up, not counted
                prompt = [rng.randrange(6, 512) for _ in range(PROMPT_LEN)]
                if writer:
                    timed(servers[writer], prompt)
                time.sleep(args.gap_s)  # the writer's engine idle again (see above)
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
    c = out["cases"]
    out["ratios"] = {
        r: {"cross_vs_same_tp": c[f"{o}->{r}"]["ttft_s"] / c[f"{r}->{r}"]["ttft_s"],
            "same_tp_vs_recompute": c[f"{r}->{r}"]["ttft_s"] / c[f"recompute@{r}"]["ttft_s"],
            "cross_tp_vs_recompute": c[f"{o}->{r}"]["ttft_s"] / c[f"recompute@{r}"]["ttft_s"]}
        for r, o in (("tp1", "tp2"), ("tp2", "tp1"))
    }  # fmt: skip
    for r, v in out["ratios"].items():
        say(f"reader {r}: cross-TP hit {v['cross_vs_same_tp']:.2f}x a same-TP hit; "
            f"hits {v['same_tp_vs_recompute']:.2f}x / {v['cross_tp_vs_recompute']:.2f}x "
            f"recompute")  # fmt: skip
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
