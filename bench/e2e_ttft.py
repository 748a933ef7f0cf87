"""Decode-side TTFT of a cache-mediated handoff on vLLM CPU, against recompute and peers.

One request, ``max_tokens=1``, vLLM's prefix cache off, after an untimed warm-up on an
unrelated prompt. Every server runs with the same worker thread count
(``VLLM_CPU_NUM_OF_RESERVED_CPU=1``; vLLM otherwise reserves one more core whenever a
connector is configured). Cases:

- recompute: no connector;
- ours via DRAM (the prefill's node agent), via NVMe (same agent restarted with an empty
  DRAM pool; page cache warm, and cold when the machine lets us drop it), via a peer
  agent (another node's agent over TCP), via S3 (a node with only S3 in common);
- vLLM's ExampleConnector doing the same handoff (files in page cache);
- LMCache MP (L1 hit over shared memory; ``fs`` L2 hit after a server restart; our L2
  adapter hit after a server restart, on node-a's agent and on an NVMe-only agent with no
  DRAM tier) when lmcache is installed.

At most three vLLM servers run at once (all seven at once left ~1.6 GB of a 24 GiB machine
free and the run never ended): each starts when its phase comes and stops when its phase
is done. The agents, Redis and moto live for the whole run, so the chunks the
prefill stores through node-a stay there for every decode after it.

``--quick --json`` prints one JSON object as its last line, with ``"ratios"``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiered_cache.tools.vllm_launch import (
    REPO,
    VllmServer,
    drop_mp_shm,
    free_port,
    kv_transfer_config,
    mp_shm,
    server_env,
    spawn,
    start_servers,
    stop_group,
)

PROMPT_TOKENS = 2050
THREADS_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def say(msg: str) -> None:
    print(f"[e2e_ttft] {msg}", file=sys.stderr, flush=True)


_held = 0  # depth of ``uninterrupted()`` blocks
_sigterm = False  # a SIGTERM came inside one


def on_sigterm(*_: object) -> None:
    global _sigterm
    if _held:
        _sigterm = True
    else:
        sys.exit(143)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """SIGTERM waits until the block is done: a server's ``stop()`` forgets its process
    before it has killed it, so one cut short would leave it to outlive the bench."""
    global _held
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _sigterm:
            sys.exit(143)


class Agent:
    """A node agent process from a YAML config; ``restart(fresh_dram=True)`` empties DRAM."""

    def __init__(
        self, name: str, work: Path, cfg: dict[str, Any], prefix: Sequence[str] = ()
    ) -> None:
        self.name, self.work, self.cfg = name, work, cfg
        self.path = work / f"{name}.yaml"
        self.proc: subprocess.Popen[bytes] | None = None
        self.prefix = list(prefix)  # ``ip netns exec NS``: the node it runs on

    @property
    def sock(self) -> str:
        return str(self.cfg["agent"]["socket"])

    def start(self, fresh_dram: bool = True) -> Agent:
        from tiered_cache.agent import wait_for_socket

        if fresh_dram:
            dram = self.cfg.setdefault("dram", {})
            if dram.get("shm_name") and self.proc is None:
                # A stopped agent leaves its pool (and its index) for a successor to
                # recover: drop them.
                unlink_shm(dram["shm_name"])
            dram["shm_name"] = our_shm(f"tcb_{uuid.uuid4().hex[:10]}")
        self.path.write_text(yaml.safe_dump(self.cfg))
        self.proc = spawn(
            [*self.prefix, sys.executable, "-m", "tiered_cache.cli", "agent", "-c",
             str(self.path)],
            self.work / f"{self.name}.log",
            extra_env=S3_ENV,
        )  # fmt: skip
        wait_for_socket(self.sock, 120)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        t = time.monotonic()
        stop_group(self.proc, sig)
        self.proc = None
        if time.monotonic() - t > 5:
            say(f"agent {self.name} took {time.monotonic() - t:.0f}s to stop")

    def restart(self) -> None:
        self.stop()
        self.start(fresh_dram=True)

    def stats(self) -> dict[str, float]:
        from tiered_cache.client import AgentClient

        c = AgentClient(self.sock, attach_pool=False)
        try:
            return dict(c.admin("stats")["metrics"])
        finally:
            c.close()

    def flush(self) -> None:
        from tiered_cache.client import AgentClient

        c = AgentClient(self.sock, attach_pool=False)
        try:
            c.admin("flush")
        finally:
            c.close()


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    **THREADS_ENV,
}


_SHM_NAMES: list[str] = []  # unique /dev/shm names this run gave (see ``unlink_shm``)


def our_shm(name: str) -> str:
    """``name``, remembered so that main() removes what was made under it at the end."""
    _SHM_NAMES.append(name)
    return name


def unlink_shm(name: str) -> None:
    """Every /dev/shm file made under ``name``: an agent's pool and its ``_ix`` index, an
    LMCache server's ``lmcache_l1_pool_<name>`` (1 GB, left behind when it is killed)."""
    for f in Path("/dev/shm").glob(f"*{name}*"):
        f.unlink(missing_ok=True)


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(server: VllmServer, prompt: list[int]) -> tuple[float, int]:
    t = time.perf_counter()
    r = server.completion(prompt, max_tokens=1, logprobs=0, timeout=600)
    dt = time.perf_counter() - t
    r.raise_for_status()
    usage = r.json().get("usage") or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return dt, cached


def measure(
    server: VllmServer, prompt: list[int], runs: int, before: Callable[[], None] | None = None
) -> dict[str, Any]:
    times, cached = [], []
    for _ in range(runs):
        if before is not None:
            before()
        dt, c = timed(server, prompt)
        times.append(dt)
        cached.append(c)
    return {"ttft_s": statistics.median(times), "runs_s": times, "cached_tokens": cached}


_LMCACHE_SERVERS: list[Any] = []
_NETS: list[Any] = []  # network namespaces to remove at the end

_RAW_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("ready", flush=True)
c, _ = s.accept(); n = int(sys.argv[3]); buf = bytearray(n)
while c.recv(1):
    c.sendall(buf)
"""
_RAW_CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); n = int(sys.argv[3])
buf = bytearray(n); mv = memoryview(buf)
for _ in range(int(sys.argv[4])):
    t = time.perf_counter(); c.sendall(b"x"); got = 0
    while got < n:
        got += c.recv_into(mv[got:])
    print(time.perf_counter() - t, flush=True)
"""


def raw_socket_s(host: str, client_prefix: Sequence[str], nbytes: int, runs: int) -> list[float]:
    """Seconds to move ``nbytes`` over one TCP connection from ``host`` (node A's side)
    to a client run under ``client_prefix`` (node B): the link's floor for a peer hit."""
    port = free_port()
    srv = subprocess.Popen(
        [sys.executable, "-c", _RAW_SERVER, host, str(port), str(nbytes)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        out = subprocess.run(
            [*client_prefix, sys.executable, "-c", _RAW_CLIENT, host, str(port), str(nbytes),
             str(runs + 1)], capture_output=True, text=True, timeout=300, check=True,
        ).stdout  # fmt: skip
        return [float(x) for x in out.split()][1:]  # the first one sets the connection up
    finally:
        srv.kill()
        srv.wait(10)


def start_lmcache(work: Path, store: dict[str, Any]) -> dict[str, Any] | None:
    """Two ``lmcache server``s (L1 in shared memory): one with LMCache's own ``fs`` L2, one
    with our L2 adapter on node-a's agent. None when lmcache is not installed."""
    try:
        import lmcache  # noqa: F401

        from tiered_cache.tools.lmcache_launch import LMCacheServer, tiered_l2_adapter
    except ImportError:
        return None
    out: dict[str, Any] = {}
    for name, l2 in (
        ("fs", {"type": "fs", "base_path": str(work / "lmcache-fs")}),
        ("ours", tiered_l2_adapter(store)),
    ):
        out[name] = LMCacheServer(
            work / f"lmcache-server-{name}.log",
            l2_adapters=[l2],
            l1_size_gb=1.0,
            extra_args=["--shm-name", our_shm(f"tcb_lm_{name}_{uuid.uuid4().hex[:8]}")],
            env=dict(THREADS_ENV),
        )
    say("starting 2 lmcache servers (fs L2, our L2)")
    for srv in out.values():
        _LMCACHE_SERVERS.append(srv)  # stopped by main() whatever happens
        srv.start()
    for srv in out.values():
        srv.wait_ready(180)
    return out


def measure_lmcache(
    lm: dict[str, Any], prompt: list[int], runs: int, warm: list[int], cases: dict[str, Any]
) -> None:
    """LMCache MP: an L1 hit, then L2 hits after a server restart (L1 lost) from its ``fs``
    adapter (page cache warm) and from our tiers through our adapter."""
    fs, fs_vllm = lm["fs"], lm["fs_vllm"]
    ours, ours_vllm = lm["ours"], lm["ours_vllm"]

    def restarted(server: Any, v: VllmServer) -> Callable[[], None]:
        def go() -> None:
            with uninterrupted():
                server.stop()
            server.start().wait_ready(180)
            # vLLM re-registers its KV caches on the next heartbeat (1 s here); untimed.
            time.sleep(2.5)
            v.completion(warm, max_tokens=1, logprobs=0, timeout=600).raise_for_status()

        return go

    say("LMCache MP: store, L1 hits, then fs L2 hits after server restarts")
    cases["lmcache_store"] = measure(fs_vllm, prompt, 1)
    time.sleep(1.0)  # the store is asynchronous on the server side
    cases["lmcache_mp_l1_hit"] = measure(fs_vllm, prompt, runs)
    cases["lmcache_mp_l2_fs_hit"] = measure(fs_vllm, prompt, runs, before=restarted(fs, fs_vllm))
    cases["lmcache_mp_l2_fs_hit"]["page_cache"] = "warm"
    say("LMCache MP with our L2 adapter: store, then L2 hits after server restarts")
    cases["lmcache_ours_store"] = measure(ours_vllm, prompt, 1)
    time.sleep(1.0)
    cases["lmcache_mp_l2_ours_hit"] = measure(
        ours_vllm, prompt, runs, before=restarted(ours, ours_vllm)
    )
    for name in ("lmcache_mp_l1_hit", "lmcache_mp_l2_fs_hit", "lmcache_mp_l2_ours_hit"):
        cached = cases[name]["cached_tokens"]
        if not all(cached):
            cases[name]["warning"] = f"not every run reported cached tokens: {cached}"
    with uninterrupted():
        for x in (fs_vllm, ours_vllm, fs, ours):
            x.stop()


def measure_lmcache_nvme_only(
    work: Path,
    nv: Agent,
    srv: Callable[..., VllmServer],
    up: Callable[..., None],
    prompt: list[int],
    runs: int,
    warm: list[int],
    cases: dict[str, Any],
) -> None:
    """LMCache MP with our L2 adapter on an agent with NVMe and no DRAM tier (LMCache's
    ``local_cpu: False`` + ``local_disk``, issue 30): store, then L2 hits after a server
    restart, served from NVMe through the agent's inline replies."""
    from tiered_cache.tools.lmcache_launch import LMCacheServer, tiered_l2_adapter

    store = {"embedded": "never", "agent_socket": nv.sock}
    server = LMCacheServer(
        work / "lmcache-server-ours-nvme.log",
        l2_adapters=[tiered_l2_adapter(store)],
        l1_size_gb=1.0,
        extra_args=["--shm-name", our_shm(f"tcb_lm_nv_{uuid.uuid4().hex[:8]}")],
        env=dict(THREADS_ENV),
    )
    _LMCACHE_SERVERS.append(server)
    say("LMCache MP with our L2 adapter on an NVMe-only agent: store, then L2 hits")
    server.start().wait_ready(180)
    v = srv("lmcache-ours-nvme", server.kv_transfer_config(heartbeat_interval_s=1))
    up(v)
    try:
        cases["lmcache_ours_nvme_only_store"] = measure(v, prompt, 1)
        time.sleep(1.0)  # the store is asynchronous on the server side

        def restarted() -> None:
            with uninterrupted():
                server.stop()
            server.start().wait_ready(180)
            time.sleep(2.5)  # vLLM re-registers on its next heartbeat (1 s here); untimed
            v.completion(warm, max_tokens=1, logprobs=0, timeout=600).raise_for_status()

        hits0 = nv.stats().get("tiered_cache_hits_total{tier=nvme}", 0.0)
        case = measure(v, prompt, runs, before=restarted)
        case["nvme_hits"] = nv.stats().get("tiered_cache_hits_total{tier=nvme}", 0.0) - hits0
        case["load_failures"] = sum(
            x for k, x in nv.stats().items()
            if k.startswith("tiered_cache_client_load_failures_total")
        )  # fmt: skip
        if not all(case["cached_tokens"]):
            case["warning"] = f"not every run reported cached tokens: {case['cached_tokens']}"
        cases["lmcache_mp_l2_ours_nvme_only_hit"] = case
    finally:
        with uninterrupted():
            v.stop()
            server.stop()


def clean_up(
    servers: Sequence[VllmServer],
    agents: Sequence[Agent],
    procs: Sequence[subprocess.Popen[bytes]],
    shm_before: set[Path],
) -> None:
    """Stop everything a run started and remove what it left in /dev/shm."""
    # A second SIGTERM (or ^C) must not cut the cleanup short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for s in servers:
        s.stop()
    for ag in agents:
        ag.stop(signal.SIGKILL)
    for lms in _LMCACHE_SERVERS:
        lms.stop()
    for p in procs:
        stop_group(p)
    for net in _NETS:
        net.close()
    # vLLM workers killed in a group leave their shared-memory segments behind, and
    # stopped agents their DRAM pools (GBs over a few runs, until the next run is
    # OOM-killed): every process of ours is gone now. Only our own names: other
    # benches' and tests' pools may be in /dev/shm too.
    drop_mp_shm(shm_before)
    for name in _SHM_NAMES:
        unlink_shm(name)


def main() -> None:
    # SIGTERM (e.g. from `timeout`) runs the cleanup in `finally` too: without it the
    # vLLM servers, agents and namespaces this bench started outlive it.
    signal.signal(signal.SIGTERM, on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one timed run per case")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    runs = 1 if a.quick else a.runs
    work = Path(a.workdir or tempfile.mkdtemp(prefix="tc-e2e-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    servers: list[VllmServer] = []
    agents: list[Agent] = []
    shm_before = mp_shm()
    try:
        res = run(work, runs, procs, servers, agents)
    finally:
        clean_up(servers, agents, procs, shm_before)
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(res))
    else:
        print(json.dumps(res, indent=1))


def make_model() -> Path:
    """The bench's random-weight Llama (built once, then reused)."""
    model = REPO / ".models" / "bench-bf16"
    say(f"model: {model} (hidden 1024, 12 layers, 4 KV heads, bf16)")
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(model),
         "--preset", "bench", "--dtype", "bfloat16"],
        check=True,
        env=server_env(),
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return model


def start_redis_moto(
    work: Path, procs: list[subprocess.Popen[bytes]], host: str
) -> tuple[str, str]:
    """Redis and moto on ``host`` for the whole run, with the bucket "bench" made: their
    URLs."""
    redis_port, s3_port = free_port(), free_port()
    procs.append(
        spawn(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(redis_port),
                "--bind",
                host,
                "--protected-mode",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            work / "redis.log",
        )
    )
    procs.append(
        spawn(
            [sys.executable, "-m", "moto.server", "-H", host, "-p", str(s3_port)],
            work / "moto.log",
        )
    )
    s3_url = f"http://{host}:{s3_port}"
    import boto3
    import httpx

    os.environ.update(S3_ENV)
    for _ in range(100):
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(s3_url, timeout=1)
            break
        time.sleep(0.2)
    boto3.client("s3", endpoint_url=s3_url).create_bucket(Bucket="bench")
    return f"redis://{host}:{redis_port}/0", s3_url


def run(
    work: Path,
    runs: int,
    procs: list[subprocess.Popen[bytes]],
    servers: list[VllmServer],
    agents: list[Agent],
) -> dict[str, Any]:
    model = make_model()
    rng = np.random.default_rng(7)
    prompt = [int(x) for x in rng.integers(10, 500, PROMPT_TOKENS)]

    # Node B (the peer-hit and S3-hit decode) runs in its own network namespace when this
    # machine allows it, as another node would: its peer pulls cross a veth link to node
    # A, and a raw socket over the same link is the reference.
    from tiered_cache.netns import NetNodes, unavailable_reason

    why = unavailable_reason()
    net = NetNodes(["b"]) if why is None else None
    if net is not None:
        _NETS.append(net)
    host = net.host_ip if net is not None else "127.0.0.1"
    say(f"node B: {'network namespace ' + net.addr('b') if net else 'loopback (' + str(why) + ')'}")
    redis_url, s3_url = start_redis_moto(work, procs, host)

    def agent_cfg(node: str, *, nvme: bool, s3: bool) -> dict[str, Any]:
        c: dict[str, Any] = {
            "node_id": node,
            "redis_url": redis_url,
            "chunk_size": 256,
            "dram": {"capacity": "512MiB"},
            "agent": {
                "socket": str(work / f"{node}.sock"),
                "peer_port": free_port(),
                "peer_host": "0.0.0.0",
            },
        }
        if nvme:
            c["nvme"] = {
                "enabled": True,
                "path": str(work / f"nvme-{node}"),
                "capacity": "4GiB",
                "write_mode": "write_through",
            }
        if s3:
            c["s3"] = {
                "enabled": True,
                "url": "s3://bench/kv",
                "endpoint_url": s3_url,
                "region": "us-east-1",
                "write_mode": "write_through",
            }
        return c

    a = Agent("node-a", work, agent_cfg("node-a", nvme=True, s3=True))
    agents.append(a.start())
    # The decode servers' connectors connect at start-up, so both agents run first.
    on_b = net.prefix("b") if net is not None else []
    b = Agent("node-b", work, agent_cfg("node-b", nvme=False, s3=False), prefix=on_b)
    agents.append(b.start())

    def srv(
        name: str,
        kv: dict[str, Any] | None,
        env: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
        node_b: bool = False,
    ) -> VllmServer:
        s = VllmServer(
            name,
            str(model),
            free_port(),
            work / f"{name}.log",
            kv_config=kv,
            env={**S3_ENV, **(env or {})},
            dtype="bfloat16",
            max_model_len=4096,
            served_name="bench",
            max_num_seqs=1,
            extra_args=extra_args,
            host=net.addr("b") if node_b and net is not None else "127.0.0.1",
            prefix=on_b if node_b else (),
        )
        servers.append(s)  # main() stops whatever is still running
        return s

    warm = [int(x) for x in rng.integers(10, 500, 64)]

    def up(*batch: VllmServer) -> None:
        """Start ``batch`` at once (startups overlap), then an untimed warm-up of each."""
        t0 = time.monotonic()
        say(f"starting {', '.join(s.name for s in batch)}")
        start_servers(batch, 900)
        say(f"up in {time.monotonic() - t0:.0f}s; warming up")
        for s in batch:
            s.completion(warm, max_tokens=1, logprobs=0, timeout=600).raise_for_status()

    def down(*batch: VllmServer) -> None:
        with uninterrupted():
            for s in batch:
                s.stop()

    store_a = {"config_file": str(a.path), "embedded": "never", "agent_socket": a.sock}
    b_sock = b.sock
    store_b = {"config_file": str(a.path), "embedded": "never", "agent_socket": b_sock}
    example_dir = work / "example"
    rec = srv("recompute", None)
    pre = srv("prefill", kv_transfer_config("kv_producer", store_a))
    dec_a = srv(
        "decode-a",
        kv_transfer_config("kv_consumer", store_a, policy="recompute", wait_for_prefill=False),
    )
    dec_b = srv(
        "decode-b",
        kv_transfer_config("kv_consumer", store_b, policy="recompute", wait_for_prefill=False),
        node_b=True,
    )
    ex = srv(
        "example",
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(example_dir)},
        },
    )
    # decode-a starts with the first pair and idles until the DRAM hit; it serves the NVMe
    # cases too, after LMCache, so it stays up until then (beside the two LMCache vLLMs,
    # then beside decode-b and example: three at a time).
    up(rec, pre, dec_a)

    out: dict[str, Any] = {
        "model": "random Llama: hidden 1024, 12 layers, 16 heads, 4 KV heads, bf16",
        "prompt_tokens": PROMPT_TOKENS,
        "worker_threads": "VLLM_CPU_NUM_OF_RESERVED_CPU=1 on "
        f"{os.cpu_count()} cores -> {max(1, (os.cpu_count() or 2) - 1)} worker thread(s)",
        "cases": {},
    }
    cases = out["cases"]
    say("recompute")
    cases["recompute"] = measure(rec, prompt, runs)
    say("prefill (stores the prompt's chunks through node-a)")
    cases["prefill_store"] = measure(pre, prompt, 1)
    a.flush()
    # What saving costs a prefill: kv_producer against the same vLLM without a connector,
    # alternating on fresh prompts (nothing cached), same worker thread count.
    pairs = 3 if runs == 1 else 5
    say(f"producer vs plain vLLM: {pairs} alternating pairs of fresh prompts")
    plain_s: list[float] = []
    producer_s: list[float] = []
    for i in range(pairs):
        fresh_prompt = [int(x) for x in rng.integers(10, 500, PROMPT_TOKENS)]
        order = [(rec, plain_s), (pre, producer_s)]
        for server, into in order if i % 2 == 0 else order[::-1]:
            into.append(timed(server, fresh_prompt)[0])
    cases["producer_vs_plain"] = {
        "plain_s": plain_s, "producer_s": producer_s,
        "ratio": statistics.median(producer_s) / statistics.median(plain_s),
    }  # fmt: skip
    a.flush()
    # The prefill's chunks live on in node-a's agent (DRAM, NVMe, S3), not in its vLLM.
    down(rec, pre)

    say("DRAM hit (decode on node-a's agent)")
    cases["dram_hit"] = measure(dec_a, prompt, runs)

    lm = start_lmcache(work, store_a)
    if lm is None:
        for name in (
            "lmcache_mp_l1_hit",
            "lmcache_mp_l2_fs_hit",
            "lmcache_mp_l2_ours_hit",
            "lmcache_mp_l2_ours_nvme_only_hit",
        ):
            cases[name] = {"skipped": "lmcache is not installed in this environment"}
    else:
        lm["fs_vllm"] = srv("lmcache-fs", lm["fs"].kv_transfer_config(heartbeat_interval_s=1))
        lm["ours_vllm"] = srv("lmcache-ours", lm["ours"].kv_transfer_config(heartbeat_interval_s=1))
        up(lm["fs_vllm"], lm["ours_vllm"])
        measure_lmcache(lm, prompt, runs, warm, cases)  # stops its servers when done
        nv_cfg = agent_cfg("node-nv", nvme=True, s3=False)
        nv_cfg["dram"] = {"enabled": False}
        nv = Agent("node-nv", work, nv_cfg)
        agents.append(nv.start(fresh_dram=False))
        measure_lmcache_nvme_only(work, nv, srv, up, prompt, runs, warm, cases)

    # Both before the NVMe cases, while nothing is timed; each stops after its cases.
    up(dec_b, ex)

    def fresh(agent: Agent, server: VllmServer) -> Callable[[], None]:
        def go() -> None:
            agent.restart()  # empty DRAM pool
            # Untimed: the connector's client reconnects to the restarted agent here.
            server.completion(warm, max_tokens=1, logprobs=0, timeout=600).raise_for_status()

        return go

    say("NVMe hit, page cache warm (node-a restarted with an empty DRAM pool)")
    cases["nvme_hit_warm"] = measure(dec_a, prompt, runs, before=fresh(a, dec_a))

    def cold() -> None:
        fresh(a, dec_a)()
        if not drop_page_cache():
            raise PermissionError

    try:
        cases["nvme_hit_cold"] = measure(dec_a, prompt, runs, before=cold)
        cases["nvme_hit_cold"]["page_cache"] = "dropped (echo 3 > drop_caches)"
    except PermissionError:
        cases["nvme_hit_cold"] = {"skipped": "cannot drop the page cache here (read-only /proc)"}
    down(dec_a)

    say("peer hit (decode on node-b pulls from node-a over TCP)")
    cases["peer_hit"] = measure(dec_b, prompt, runs, before=fresh(b, dec_b))
    b_stats = b.stats()
    cases["peer_hit"]["node_b_hits"] = {
        k: v for k, v in b_stats.items() if k.startswith("tiered_cache_hits_total")
    }
    # Node B restarts before each run (empty DRAM), so its counters hold the last run's.
    peer_bytes = int(b_stats.get("tiered_cache_read_bytes_total{tier=peer}", 0))
    say(f"raw socket reference: {peer_bytes / 2**20:.1f} MiB from node A to node B over TCP")
    raw = raw_socket_s(host, on_b, peer_bytes, max(3, runs))
    cases["raw_socket"] = {
        "bytes": peer_bytes,
        "runs_s": raw,
        "ttft_s": statistics.median(raw),
        "link": "veth between network namespaces" if net else "loopback",
    }
    b.stop()
    a.stop(signal.SIGKILL)  # the peer is gone: only S3 is in common now
    c = Agent("node-c", work, agent_cfg("node-c", nvme=False, s3=True), prefix=on_b)
    c.cfg["agent"]["socket"] = b_sock
    agents.append(c.start())
    say("S3 hit (node-c has only S3 in common)")
    cases["s3_hit"] = measure(dec_b, prompt, runs, before=fresh(c, dec_b))
    cases["s3_hit"]["node_c_hits"] = {
        k: v for k, v in c.stats().items() if k.startswith("tiered_cache_hits_total")
    }
    down(dec_b)

    say("ExampleConnector: store, then hits from its files (page cache warm)")
    cases["example_store"] = measure(ex, prompt, 1)
    cases["example_hit"] = measure(ex, prompt, runs)

    # The floor: vLLM's own prefix cache, so the KV is already in place and a hit pays one
    # decode step and the API, nothing else. It runs alone, as it always has.
    down(ex)
    floor = srv("floor", None, extra_args=["--enable-prefix-caching"])
    up(floor)
    say("floor: vLLM's own prefix cache hit (no connector; the KV is already in place)")
    cases["floor_store"] = measure(floor, prompt, 1)
    cases["floor_prefix_cache_hit"] = measure(floor, prompt, runs)

    def t(name: str) -> float | None:
        v = cases.get(name, {}).get("ttft_s")
        return float(v) if v is not None else None

    r = t("recompute")
    peers = [x for x in (t("example_hit"), t("lmcache_mp_l1_hit")) if x]
    best_peer = min(peers) if peers else None

    def ratio(x: float | None, y: float | None) -> float | None:
        return None if x is None or not y else x / y

    dram, raw_s = t("dram_hit"), t("raw_socket")
    out["ratios"] = {
        "peer_hit_vs_dram_hit": ratio(t("peer_hit"), dram),
        "s3_hit_vs_dram_hit": ratio(t("s3_hit"), dram),
        # A peer hit's cost above a DRAM hit, against the link moving the same bytes.
        "peer_extra_vs_raw_socket": ratio(
            (t("peer_hit") or 0) - (dram or 0) if t("peer_hit") and dram else None, raw_s
        ),
        "producer_vs_plain": cases["producer_vs_plain"]["ratio"],
        "dram_hit_vs_recompute": ratio(t("dram_hit"), r),
        "nvme_hit_vs_recompute": ratio(t("nvme_hit_warm"), r),
        "peer_hit_vs_recompute": ratio(t("peer_hit"), r),
        "s3_hit_vs_recompute": ratio(t("s3_hit"), r),
        "dram_hit_vs_best_peer": ratio(t("dram_hit"), best_peer),
        "nvme_hit_vs_lmcache_l2": ratio(t("nvme_hit_warm"), t("lmcache_mp_l2_fs_hit")),
        # issue #4: our handoff against LMCache MP on the same prompt
        "dram_hit_vs_lmcache_l1": ratio(t("dram_hit"), t("lmcache_mp_l1_hit")),
        "lmcache_ours_l2_vs_lmcache_fs_l2": ratio(
            t("lmcache_mp_l2_ours_hit"), t("lmcache_mp_l2_fs_hit")
        ),
        # issue 30: our tiers without DRAM (NVMe only) behind LMCache MP
        "lmcache_ours_nvme_only_l2_vs_lmcache_fs_l2": ratio(
            t("lmcache_mp_l2_ours_nvme_only_hit"), t("lmcache_mp_l2_fs_hit")
        ),
        "lmcache_ours_nvme_only_l2_vs_recompute": ratio(t("lmcache_mp_l2_ours_nvme_only_hit"), r),
    }
    # What each hit costs above the floor: the handoff itself (lookup, load, copy-in).
    fl = t("floor_prefix_cache_hit")
    out["over_floor_s"] = {
        name: (v - fl if v is not None and fl is not None else None)
        for name, v in (
            (n, t(n)) for n in ("dram_hit", "example_hit", "lmcache_mp_l1_hit", "nvme_hit_warm")
        )
    }
    out["best_peer"] = "ExampleConnector" if best_peer == t("example_hit") else "LMCache MP L1"
    return out


if __name__ == "__main__":
    main()
