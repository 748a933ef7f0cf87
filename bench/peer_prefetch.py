"""A peer hit's agent part, without vLLM: node B's agent copies nine ~3 MiB chunks that
node A's agent holds in DRAM into its own DRAM, as bench/e2e_ttft.py's peer hit does
(node A in the root namespace, node B in its own, a veth between; B restarted before each
run). Timed from B's client: lookup, prefetch, then the shared DRAM index until every
chunk is there; against one TCP connection moving the same bytes over the same link.

    python bench/peer_prefetch.py [--runs 8]      (root and iproute2: network namespaces)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_ttft import raw_socket_s  # bench/ is on the path: scripts run from it

from tiered_cache import codec
from tiered_cache.agent import spawn_agent
from tiered_cache.client import AgentClient
from tiered_cache.keys import ModelFingerprint, chunk_keys
from tiered_cache.netns import NetNodes
from tiered_cache.tools.vllm_launch import free_port

FP = ModelFingerprint("peer-prefetch-bench", chunk_size=256, block_size=16)
CHUNKS = 9
PAYLOAD = 3 * 2**20 - 4096  # e2e_ttft's chunks: 24 MiB of KV in nine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=8)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tc-peer-prefetch-"))
    net = NetNodes(["b"])
    procs: list[subprocess.Popen[Any]] = []
    shms: list[str] = []
    try:
        port = free_port()
        procs.append(subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
             net.host_ip, "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL,
        ))  # fmt: skip

        def config(node: str) -> Path:
            shms.append(f"tcpp_{uuid.uuid4().hex[:8]}")
            cfg = {
                "node_id": node, "redis_url": f"redis://{net.host_ip}:{port}/0",
                "dram": {"capacity": "256MiB", "shm_name": shms[-1], "keep_on_stop": False},
                "agent": {"socket": str(tmp / f"{node}.sock"), "peer_port": free_port(),
                          "peer_host": "0.0.0.0"},
            }  # fmt: skip
            path = tmp / f"{node}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            return path

        log = (tmp / "agents.log").open("w")
        procs.append(spawn_agent(config("node-a"), stdout=log, stderr=subprocess.STDOUT))
        b_cfg = config("node-b")
        a = AgentClient(str(tmp / "node-a.sock"))
        rng = np.random.default_rng(0)
        alls, firsts = [], []
        for run in range(args.runs + 1):  # the first one is a warm-up
            b_proc = spawn_agent(b_cfg, prefix=net.prefix("b"), stdout=log,
                                 stderr=subprocess.STDOUT)  # fmt: skip
            procs.append(b_proc)
            keys = chunk_keys(rng.integers(0, 500, 256 * CHUNKS).tolist(), FP)
            a.put_many([
                (codec.ChunkMeta(k, FP.digest, 256, "uint8", (PAYLOAD,),
                                 parent=keys[i - 1] if i else "", position=i),
                 rng.integers(0, 255, PAYLOAD, dtype=np.uint8).tobytes())
                for i, k in enumerate(keys)
            ], wait=True)  # fmt: skip
            b = AgentClient(str(tmp / "node-b.sock"))
            t0 = time.perf_counter()
            found = b.lookup(keys)
            assert found == ["peer"] * CHUNKS, found
            b.prefetch(keys, FP.digest)
            first = None
            while not all(here := b.in_dram(keys) or [False]):
                if first is None and any(here):
                    first = time.perf_counter() - t0
                time.sleep(0.0005)
            dt = time.perf_counter() - t0
            b.close()
            b_proc.terminate()
            b_proc.wait(30)
            procs.remove(b_proc)
            if run:
                alls.append(dt)
                firsts.append(first or dt)
                print(f"run {run}: first chunk {ms(first or dt)}, all {ms(dt)}")
        a.close()
        raw = raw_socket_s(net.host_ip, net.prefix("b"), CHUNKS * (PAYLOAD + 256), args.runs)
        print(
            f"median: first chunk {ms(statistics.median(firsts))}, all "
            f"{ms(statistics.median(alls))}; raw socket {ms(statistics.median(raw))}"
        )
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        net.close()
        for name in shms:
            for seg in (name, f"{name}_ix"):
                Path("/dev/shm", seg).unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)


def ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


if __name__ == "__main__":
    main()
