"""Fault and soak suite (issue 15): reliability as figures, against real agents, a real
redis-server and moto S3 on this machine (loopback only).

Phases (each also a function that ``tests/faults`` calls with smaller counts):
- ``load``: client threads put and get distinct and repeated chunks through an agent with a
  small DRAM pool over NVMe (eviction and promotion all the while) and a peer puller
  fetches over the authenticated peer port, for ``--minutes``; the agent's RSS is sampled.
  ``rss_growth`` = (last sample - sample at the end of warm-up) / warm-up sample. Then
  ``leaked_slots``: with every client gone, a reservation of every slot of the pool, one
  slot each, must get them all (eviction steps over leased runs and cannot free reserved
  ones, so each slot it cannot get is a leaked lease or reservation).
- ``kill9``: ``kill -9`` of an agent (DRAM over write-through NVMe) while clients write with
  ``wait``; after each restart every chunk written is read and its payload compared with
  what was written (``torn_or_wrong_served``), then DRAM is cleared and every acknowledged
  chunk must come back from NVMe (``lost_acked``).
- ``redis``: redis-server killed (-9) and restarted under load: client errors by phase.
- ``s3``: S3 (behind ``tests/fault_proxy.py``) healthy; slow (every request delayed and
  answered, the writer paced at 10 chunks per S3 request: the write-through queue fills
  and ``agent.max_background_bytes`` bounds memory); stalling; answering 500, each on an
  agent of its own: put latency into DRAM, S3 requests, peak RSS against the bound.
- ``disk_full``: NVMe on a 6 MiB tmpfs that a ballast file fills: DRAM serves on, the
  failed NVMe writes are counted, nothing torn is served, NVMe takes writes once space
  returns (skipped where a tmpfs cannot be mounted).
- ``hung_peer``: the directory names ``tests/hung_peer.py`` (half a reply, then nothing)
  as a chunk's holder: the read fails within ``agent.peer_fetch_timeout_s``, the peer's
  breaker opens, the agent's own chunks are served.
- ``fuzz``: malformed frames to the local socket and the peer port (oversized length
  prefixes, truncated frames, non-msgpack, non-maps, unknown ops, wrong types, bad keys,
  random bytes), a well-formed probe after every batch (``fuzz_crashes``: the agent died or
  did not answer one), log lines per bad frame per socket; then 1,000 idle connections
  to each and a good client.
- ``auth``: a peer without the cluster secret (``unauthorized_accepted`` counts chunks it
  got); admin writes without the token over the socket and the CLI (counted likewise);
  chunks planted in NVMe and S3 with a wrong checksum, for another key, or re-checksummed
  with the attacker's payload (``forged_accepted`` counts any served).

``python bench/soak.py --quick --json`` finishes in under 10 minutes on 2 cores; progress
goes to stderr, and with ``--json`` the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import FP, chunk_meta, free_port  # noqa: E402

from tiered_cache import codec  # noqa: E402
from tiered_cache.agent import spawn_agent  # noqa: E402
from tiered_cache.agent.peers import CLIENT, NONCE_BYTES, SERVER, peer_mac  # noqa: E402
from tiered_cache.client import AgentClient  # noqa: E402
from tiered_cache.ipc import call_sync, pack  # noqa: E402
from tiered_cache.protocol import REQUESTS, Abort, Hello, Reserve, encode  # noqa: E402

PAYLOAD = 48 * 1024  # payload bytes per chunk: header + payload fit one 64 KiB slot
SLOT = 64 * 1024
MiB = 2**20
_T0 = time.monotonic()


def say(msg: str) -> None:
    """Progress, on stderr (stdout's last line is the JSON)."""
    print(f"[soak {time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- chunks


def key_of(tag: str, i: int) -> str:
    return hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).hexdigest()


def payload_of(key: str, n: int = PAYLOAD) -> bytes:
    """What is written under ``key``: a function of the key, so any reader can check a
    served payload byte for byte without remembering it."""
    return np.random.default_rng(int(key[:16], 16)).bytes(n)


def item(key: str) -> tuple[codec.ChunkMeta, bytes]:
    return chunk_meta(key, PAYLOAD), payload_of(key)


class Served:
    """What readers were served: chunks whose payload differs from the one written
    under their key are torn or wrong (the agent and client checks passed them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.served = 0
        self.wrong = 0
        self.wrong_keys: list[str] = []

    def check(self, key: str, got: bytes | bytearray | memoryview) -> bool:
        ok = bytes(got) == payload_of(key)
        with self.lock:
            self.served += 1
            if not ok:
                self.wrong += 1
                self.wrong_keys.append(key)
        return ok


# ---------------------------------------------------------------- processes


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def drop_pool(name: str) -> None:
    for seg in (name, f"{name}_ix"):
        Path("/dev/shm", seg).unlink(missing_ok=True)


class Agent:
    """A node agent process (``tiered-cache agent -c``) with its config, log file and
    DRAM pool (named ``tc_soak_*``: the tests' fixtures remove such pools)."""

    def __init__(
        self, tmp: Path, name: str, over: dict[str, Any] | None = None,
        prefix: list[str] | None = None,
    ) -> None:  # fmt: skip
        tag = uuid.uuid4().hex[:8]
        self.name = name
        self.tmp = tmp
        self.prefix = prefix or []
        self.shm = f"tc_soak_{tag}"
        cfg: dict[str, Any] = {
            "node_id": f"soak-{name}-{tag}",
            "dram": {"capacity": 8 * MiB, "slot_bytes": SLOT, "shm_name": self.shm},
            "agent": {"socket": str(tmp / f"{name}-{tag}.sock"), "usage_log_interval_s": 3600},
        }
        self.cfg = merge(cfg, over or {})
        self.socket = str(self.cfg["agent"]["socket"])
        self.path = tmp / f"{name}-{tag}.yaml"
        self.path.write_text(yaml.safe_dump(self.cfg))
        self.log_path = tmp / f"{name}-{tag}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, *args: str) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = spawn_agent(
                self.path, *args, timeout=60, prefix=self.prefix, stdout=log,
                stderr=subprocess.STDOUT, cwd=str(ROOT),
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
        self.starts += 1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def close(self) -> None:
        self.stop()
        drop_pool(self.shm)

    def rss(self) -> int:
        """Resident bytes (VmRSS) of the agent process; 0 when it is gone."""
        if self.proc is None:
            return 0
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def log_lines(self) -> int:
        try:
            with open(self.log_path, "rb") as f:
                return sum(1 for _ in f)
        except OSError:
            return 0

    def client(self, timeout: float = 30.0) -> AgentClient:
        return AgentClient(self.socket, timeout=timeout)

    def admin(self, op: str, **kw: Any) -> dict[str, Any]:
        c = AgentClient(self.socket, attach_pool=False, timeout=30)
        try:
            return c.admin(op, **kw)
        finally:
            c.close()


@contextlib.contextmanager
def running(agent: Agent, *args: str) -> Iterator[Agent]:
    agent.start(*args)
    try:
        yield agent
    finally:
        agent.close()


class Redis:
    """A private redis-server on a free loopback port, to kill and restart."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
        self.exe = exe
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_port(self.port)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def wait_port(port: int, timeout: float = 15.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host}:{port} did not open in {timeout}s") from None
            time.sleep(0.05)


# ---------------------------------------------------------------- raw wire


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            raise EOFError("closed")
        buf += part
    return bytes(buf)


def recv_frame(s: socket.socket) -> Any:
    (n,) = struct.unpack("!I", recv_exact(s, 4))
    return msgpack.unpackb(recv_exact(s, n), raw=False)


def peer_connect(
    addr: tuple[str, int], secret: bytes | None, timeout: float = 10.0
) -> socket.socket:
    """A TCP connection to a peer port, through the handshake when ``secret`` is given
    (EOFError or AssertionError when the server refuses or fails it)."""
    s = socket.create_connection(addr, timeout=timeout)
    try:
        if secret is not None:
            nc = os.urandom(NONCE_BYTES)
            s.sendall(pack({"op": "auth", "v": 1, "nonce": nc}))
            reply = recv_frame(s)
            assert isinstance(reply, dict) and reply.get("ok"), f"refused: {reply!r}"
            ns = reply["nonce"]
            assert reply["mac"] == peer_mac(secret, SERVER, nc, ns), "server failed the proof"
            s.sendall(pack({"op": "auth_proof", "mac": peer_mac(secret, CLIENT, nc, ns)}))
    except BaseException:
        s.close()
        raise
    return s


def peer_fetch(s: socket.socket, key: str) -> bytes | None:
    """One raw fetch on an open peer connection: the chunk's bytes, or None."""
    s.sendall(pack({"op": "fetch", "key": key, "raw": True}))
    head = recv_frame(s)
    if not isinstance(head, dict) or not head.get("ok"):
        return None
    n = head.get("len")
    if isinstance(n, int):
        return None if n < 0 else recv_exact(s, n)
    data = head.get("data")
    return bytes(data) if isinstance(data, bytes) else None


def until_closed(s: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes (TimeoutError if it keeps it open)."""
    s.settimeout(timeout)
    got = b""
    while True:
        try:
            part = s.recv(1 << 16)
        except (ConnectionResetError, BrokenPipeError):
            return got
        if not part:
            return got
        got += part


# ---------------------------------------------------------------- load held


def leaked_slots(sock_path: str, settle_s: float = 10.0) -> int:
    """Slots of the pool that cannot be had with no client connected: a leaked lease
    (eviction steps over leased runs) or a reservation nobody holds. Evicts everything.
    The agent frees a closed client's slots when it reads the close, which may come
    after our request: a shortfall is asked again for up to ``settle_s``."""
    deadline = time.monotonic() + settle_s
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(120)
        s.connect(sock_path)
        hello = call_sync(s, encode(Hello()))
        n, size = int(hello["num_slots"]), int(hello["slot_bytes"])
        while True:
            got = [g for g in call_sync(s, encode(Reserve([size] * n)))["slots"] if g is not None]
            call_sync(s, encode(Abort(got)))
            if len(got) == n or time.monotonic() > deadline:
                return n - len(got)
            time.sleep(0.1)  # closes still on their way


def pool_books(agent: Agent) -> dict[str, Any] | None:
    """The DRAM pool's books from the stats op (free slots, reserved runs, leases), where
    the agent reports them (None where it does not)."""
    pool = agent.admin("stats").get("pool")
    return dict(pool) if isinstance(pool, dict) else None


def phase_load(
    tmp: Path, seconds: float, threads: int = 4, warmup: float | None = None, seed: int = 1
) -> dict[str, Any]:
    secret = f"soak-load-secret-{uuid.uuid4().hex}"
    port = free_port()
    agent = Agent(tmp, "load", {
        "nvme": {"enabled": True, "path": str(tmp / "load-nvme"), "capacity": 48 * MiB,
                 "write_mode": "write_back"},
        "agent": {"peer_port": port, "peer_secret": secret},
    })  # fmt: skip
    warmup = max(10.0, 0.2 * seconds) if warmup is None else warmup
    served = Served()
    stop = threading.Event()
    lock = threading.Lock()
    written: list[str] = []
    have_keys = threading.Event()
    n = {"ops": 0, "puts": 0, "gets": 0, "hits": 0, "peer_fetches": 0, "peer_hits": 0,
         "errors": 0}  # fmt: skip
    errors: list[str] = []

    def count(**kw: int) -> None:
        with lock:
            for k, v in kw.items():
                n[k] += v

    def fail(e: BaseException) -> None:
        with lock:
            n["errors"] += 1
            if len(errors) < 5:
                errors.append(f"{type(e).__name__}: {e}")

    def recent(rnd: random.Random) -> str | None:
        with lock:
            if not written:
                return None
            return written[-rnd.randint(1, min(len(written), 3000))]

    def client_loop(i: int) -> None:
        rnd = random.Random(seed * 1000 + i)
        c = agent.client()
        j = 0
        try:
            while not stop.is_set():
                r = rnd.random()
                old = recent(rnd)
                try:
                    if r < 0.4 or old is None:  # a new chunk
                        key = key_of(f"load-{seed}-{i}", j)
                        j += 1
                        c.put_many([item(key)])
                        with lock:
                            written.append(key)
                        have_keys.set()
                        count(ops=1, puts=1)
                    elif r < 0.5:  # a chunk already there (content-addressed: kept)
                        c.put_many([item(old)])
                        count(ops=1, puts=1)
                    else:  # a read: DRAM, or promoted from NVMe, or a miss
                        got = c.get_many([old], FP.digest)[0]
                        count(ops=1, gets=1, hits=got is not None)
                        if got is not None:
                            served.check(old, got[1])
                except Exception as e:
                    fail(e)
        finally:
            c.close()

    def puller() -> None:
        rnd = random.Random(seed)
        s: socket.socket | None = None
        have_keys.wait(60)
        while not stop.is_set():
            key = recent(rnd)
            if key is None:
                break
            try:
                if s is None:
                    s = peer_connect(("127.0.0.1", port), secret.encode())
                got = peer_fetch(s, key)
                count(peer_fetches=1, ops=1, peer_hits=got is not None)
                if got is not None:
                    _, pl = codec.decode(got, expect_key=key)
                    served.check(key, pl)
            except Exception as e:
                fail(e)
                if s is not None:
                    s.close()
                s = None
        if s is not None:
            s.close()

    samples: list[tuple[float, int]] = []
    with running(agent):
        workers = [threading.Thread(target=client_loop, args=(i,)) for i in range(threads)]
        workers.append(threading.Thread(target=puller))
        t0 = time.monotonic()
        for w in workers:
            w.start()
        rss_warm = 0
        next_say = t0
        while (now := time.monotonic()) - t0 < seconds and agent.alive:
            samples.append((now - t0, agent.rss()))
            if not rss_warm and now - t0 >= warmup:
                rss_warm = samples[-1][1]
            if now >= next_say:
                say(
                    f"load: {n['ops']:,} ops in {now - t0:.0f}/{seconds:.0f} s, agent RSS "
                    f"{samples[-1][1] / MiB:.0f} MiB, {served.wrong} wrong, {n['errors']} errors"
                )
                next_say = now + 10
            stop.wait(1.0)  # the sampling interval
        stop.set()
        for w in workers:
            w.join(60)
        elapsed = time.monotonic() - t0
        alive = agent.alive
        rss_last = samples[-1][1] if samples else 0  # the last sample under load
        probed = leaked_slots(agent.socket) if alive else None  # waits for the closes
        books = pool_books(agent) if alive else None
    rss_warm = rss_warm or (samples[0][1] if samples else 0)
    return {
        "seconds": round(elapsed, 1),
        "warmup_s": warmup,
        "threads": threads,
        **n,
        "ops_per_s": round(n["ops"] / elapsed, 1),
        "torn_or_wrong_served": served.wrong,
        "rss_warm_mib": round(rss_warm / MiB, 1),
        "rss_last_mib": round(rss_last / MiB, 1),
        "rss_peak_mib": round(max((r for _, r in samples), default=0) / MiB, 1),
        "rss_growth": round((rss_last - rss_warm) / rss_warm, 4) if rss_warm else None,
        # Idle, every slot is free or holds a chunk, and no lease is held.
        "leaked_slots": probed
        if books is None
        else (books["num_slots"] - books["free_slots"] - books["chunk_slots"] + books["leases"]),
        "leaked_slots_probe": probed,
        "pool_books": books,
        "agent_alive": alive,
        "first_errors": errors,
    }


# ---------------------------------------------------------------- kill -9


def kill9_trial(
    agent: Agent, trial: int, rnd: random.Random, writers: int = 2,
    after_kill: Callable[[list[str]], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Writers put chunks with ``wait`` (acknowledged = on NVMe) until a random number
    are acknowledged; ``kill -9``; restart; read back every chunk attempted, then, with
    DRAM cleared, every acknowledged one from NVMe. ``after_kill(acked)`` runs while the
    agent is down (the tests damage what it left, to show the checks catch it)."""
    target = rnd.randint(4, 40)
    cv = threading.Condition()
    acked: list[str] = []
    attempted: set[str] = set()
    killed = threading.Event()

    def write(w: int) -> None:
        try:
            c = agent.client(timeout=30)
        except OSError:
            return
        try:
            for i in range(100000):
                key = key_of(f"k9-{trial}-{w}", i)
                with cv:
                    attempted.add(key)
                c.put_many([item(key)], wait=True)
                with cv:
                    acked.append(key)
                    cv.notify_all()
                if killed.is_set():  # the ack raced the kill: it still counts
                    return
        except Exception:  # the agent died under the put: unacknowledged
            return
        finally:
            c.close()

    ts = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in ts:
        t.start()
    with cv:
        cv.wait_for(lambda: len(acked) >= target, timeout=60)
    agent.kill()
    killed.set()
    for t in ts:
        t.join(60)
    with cv:
        acked_now, tried = list(acked), sorted(attempted)
    if after_kill is not None:
        after_kill(acked_now)
    agent.start()  # re-adopts the DRAM pool, re-indexes NVMe
    served = Served()
    c = agent.client()
    try:
        for key, got in zip(tried, c.get_many(tried, FP.digest), strict=True):
            if got is not None:
                served.check(key, got[1])
        agent.admin("clear", tier="dram")
        from_nvme = Served()

        def sink(i: int, meta: codec.ChunkMeta, payload: memoryview) -> None:
            from_nvme.check(acked_now[i], payload)

        rep = c.load_report(acked_now, FP.digest, sink)
        lost = [k for k, ok, src in zip(acked_now, rep.ok, rep.sources, strict=True)
                if not ok or src != "nvme"]  # fmt: skip
        agent.admin("clear", tier="dram")
        agent.admin("clear", tier="nvme")  # the next trial starts empty
    finally:
        c.close()
    return {
        "acked": len(acked_now),
        "attempted": len(tried),
        "served_after_restart": served.served,
        "torn_or_wrong": served.wrong + from_nvme.wrong,
        "lost_acked": len(lost),
        "wrong_keys": served.wrong_keys + from_nvme.wrong_keys,
        "lost_keys": lost,
    }


def phase_kill9(tmp: Path, trials: int, seed: int = 1) -> dict[str, Any]:
    agent = Agent(tmp, "kill9", {
        "nvme": {"enabled": True, "path": str(tmp / "kill9-nvme"), "capacity": 256 * MiB,
                 "write_mode": "write_through"},
    })  # fmt: skip
    rnd = random.Random(seed)
    out: dict[str, Any] = {"trials": 0, "acked": 0, "attempted": 0, "served_after_restart": 0,
                           "torn_or_wrong_served": 0, "lost_acked": 0}  # fmt: skip
    bad: list[str] = []
    t0 = time.monotonic()
    with running(agent):
        for t in range(trials):
            r = kill9_trial(agent, t, rnd)
            out["trials"] += 1
            for k in ("acked", "attempted", "served_after_restart"):
                out[k] += r[k]
            out["torn_or_wrong_served"] += r["torn_or_wrong"]
            out["lost_acked"] += r["lost_acked"]
            bad += r["wrong_keys"] + r["lost_keys"]
            say(
                f"kill -9 trial {t + 1}/{trials}: {r['acked']} acked, {r['attempted']} tried,"
                f" {r['torn_or_wrong']} wrong, {r['lost_acked']} lost"
            )
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["bad_keys"] = bad[:10]
    return out


# ---------------------------------------------------------------- redis, S3


def phase_redis(tmp: Path, ops_per_stage: int = 1500, stage_cap_s: float = 30.0) -> dict[str, Any]:
    """Clients keep putting, reading and looking up while redis-server is killed (-9) and
    then restarted on its port; every exception a client sees is an error."""
    redis = Redis()
    agent = Agent(tmp, "redis", {
        "redis_url": redis.url,
        "nvme": {"enabled": True, "path": str(tmp / "redis-nvme"), "capacity": 64 * MiB,
                 "write_mode": "write_back"},
    })  # fmt: skip
    served = Served()
    cv = threading.Condition()
    stage = ["before"]
    ops = {"before": 0, "down": 0, "after": 0}
    errs = {"before": 0, "down": 0, "after": 0}
    misses = {"before": 0, "down": 0, "after": 0}
    first: list[str] = []
    stop = threading.Event()

    def loop(i: int) -> None:
        rnd = random.Random(i)
        c = agent.client()
        mine: list[str] = []
        j = 0
        try:
            while not stop.is_set():
                st = stage[0]
                try:
                    r = rnd.random()
                    if r < 0.4 or not mine:
                        key = key_of(f"redis-{i}", j)
                        j += 1
                        c.put_many([item(key)])
                        mine.append(key)
                    elif r < 0.8:
                        key = mine[-rnd.randint(1, min(len(mine), 500))]
                        got = c.get_many([key], FP.digest)[0]
                        if got is None:
                            with cv:
                                misses[st] += 1
                        else:
                            served.check(key, got[1])
                    else:  # keys nobody wrote: the directory is asked (or is down)
                        c.lookup([key_of(f"nobody-{i}", j + k) for k in range(4)])
                except Exception as e:
                    with cv:
                        errs[st] += 1
                        if len(first) < 5:
                            first.append(f"{st}: {type(e).__name__}: {e}")
                with cv:
                    ops[st] += 1
                    cv.notify_all()
        finally:
            c.close()

    def reach(st: str) -> float:
        t0 = time.monotonic()
        with cv:
            cv.wait_for(lambda: ops[st] >= ops_per_stage, timeout=stage_cap_s)
        return round(time.monotonic() - t0, 1)

    durations: dict[str, float] = {}
    try:
        with running(agent):
            ts = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            durations["before"] = reach("before")
            redis.kill()
            stage[0] = "down"
            say("redis: killed")
            durations["down"] = reach("down")
            redis.start()
            stage[0] = "after"
            say("redis: restarted")
            durations["after"] = reach("after")
            stop.set()
            for t in ts:
                t.join(60)
            alive = agent.alive
    finally:
        redis.close()
    return {
        "ops": ops, "errors": errs, "read_misses": misses, "stage_seconds": durations,
        "torn_or_wrong_served": served.wrong, "agent_alive": alive, "first_errors": first,
    }  # fmt: skip


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def metric_sum(stats: dict[str, Any], prefix: str) -> float:
    """The sum of the agent's metric series (``stats`` -> ``metrics``) named ``prefix``."""
    return float(sum(v for k, v in stats["metrics"].items() if k.startswith(prefix)))


def agent_rss(agent: Agent) -> float:
    return float(agent.rss())


def background_bytes(agent: Agent) -> float:
    """Bytes the agent's queued background copies hold now (its gauge)."""
    return metric_sum(agent.admin("stats"), "tiered_cache_background_bytes")


class Sampler:
    """Samples ``fn`` every ``every`` seconds in a thread until closed; keeps the peak."""

    def __init__(self, fn: Callable[[], float], every: float = 0.05) -> None:
        self.fn, self.every = fn, every
        self.peak = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # the agent may be gone: no sample
                self.peak = max(self.peak, self.fn())
                self.samples += 1
            self._stop.wait(self.every)

    def close(self) -> float:
        self._stop.set()
        self._t.join(10)
        return self.peak


def phase_s3(
    tmp: Path, moto_url: str, puts: int = 300, stall_s: float = 3.0, slowdown: float = 10.0,
    background_mib: int = 4, slow_s: float = 10.0, slow_delay_s: float = 0.05,
) -> dict[str, Any]:  # fmt: skip
    """Put latency into DRAM (write-through to S3 in the background) while S3, behind a
    fault proxy, is healthy (``puts`` puts); slow for ``slow_s`` seconds (every request
    delayed ``slow_delay_s``, all answered, and the writer paced at ``slowdown`` chunks per
    request S3 has taken: the write-through queue fills and ``agent.max_background_bytes``
    must bound the agent's memory); stalling every request past the read timeout;
    answering 500 to everything. Each condition on an agent of its own: a breaker opened
    by one would meet the next."""
    import boto3

    if str(ROOT / "tests") not in sys.path:
        sys.path.append(str(ROOT / "tests"))
    from fault_proxy import FaultProxy

    bound = background_mib * MiB
    concurrency = 4
    served = Served()
    out: dict[str, Any] = {"max_background_bytes": bound, "s3_max_concurrency": concurrency,
                           "slow_delay_s": slow_delay_s}  # fmt: skip
    proxy = FaultProxy(moto_url)
    try:
        for name in ("healthy", "slow", "stall", "error_500"):
            bucket = f"tc-soak-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1").create_bucket(
                Bucket=bucket
            )
            agent = Agent(tmp, f"s3-{name}", {
                "s3": {"enabled": True, "url": f"s3://{bucket}/soak", "endpoint_url": proxy.url,
                       "region": "us-east-1", "write_mode": "write_through",
                       "read_timeout_s": 1.0, "connect_timeout_s": 1.0, "max_attempts": 2,
                       "max_concurrency": concurrency},
                "agent": {"max_background_bytes": bound},
            })  # fmt: skip
            with running(agent):
                rss0 = agent.rss()
                rss = Sampler(functools.partial(agent_rss, agent))
                queued = Sampler(functools.partial(background_bytes, agent), every=0.2)
                if name == "slow":
                    proxy.delay_next(-1, slow_delay_s)
                elif name == "stall":
                    proxy.stall_next(-1, stall_s)
                elif name == "error_500":
                    proxy.fail_next(-1, 500)
                seen0, hit0 = proxy.requests, proxy.faults_injected
                times: list[float] = []
                c = agent.client()
                t0 = time.perf_counter()
                try:
                    i = 0
                    while i < puts if name != "slow" else time.perf_counter() - t0 < slow_s:
                        # Slow: ``slowdown`` chunks per request S3 has received, so that
                        # ingest runs that many times faster than S3 whatever its pace.
                        if name == "slow" and i >= slowdown * (proxy.requests - seen0 + 1):
                            time.sleep(0.001)
                            continue
                        key = key_of(f"s3-{name}", i)
                        i += 1
                        t = time.perf_counter()
                        c.put_many([item(key)])
                        times.append(time.perf_counter() - t)
                        got = c.get_many([key], FP.digest)[0]  # from DRAM
                        if got is not None:
                            served.check(key, got[1])
                    elapsed = time.perf_counter() - t0
                    stats = agent.admin("stats")
                finally:
                    c.close()
                    peak_rss, peak_queued = rss.close(), queued.close()
                s3_requests = proxy.requests - seen0
                out[name] = {
                    "puts": i,
                    "seconds": round(elapsed, 1),
                    "puts_per_s": round(i / elapsed, 1),
                    "put_p50_ms": round(_pct(times, 0.5) * 1e3, 2),
                    "put_p99_ms": round(_pct(times, 0.99) * 1e3, 2),
                    "put_max_ms": round(max(times) * 1e3, 2),
                    "s3_requests": s3_requests,
                    "s3_requests_per_s": round(s3_requests / elapsed, 1),
                    "faults_injected": proxy.faults_injected - hit0,
                    "rss_before_mib": round(rss0 / MiB, 1),
                    "rss_peak_mib": round(peak_rss / MiB, 1),
                    "rss_peak_growth_mib": round((peak_rss - rss0) / MiB, 1),
                    "background_bytes_peak_mib": round(peak_queued / MiB, 2),
                    "background_dropped": metric_sum(stats, "tiered_cache_background_dropped"),
                    "s3_write_errors": metric_sum(
                        stats, "tiered_cache_write_errors_total{reason=io,tier=s3"
                    )
                    + metric_sum(stats, "tiered_cache_write_errors_total{reason=full,tier=s3"),
                    "agent_alive": agent.alive,
                }
                say(
                    f"s3 {name}: {out[name]['puts_per_s']} puts/s, put p99"
                    f" {out[name]['put_p99_ms']} ms, {s3_requests} S3 requests, RSS peak"
                    f" +{out[name]['rss_peak_growth_mib']} MiB (bound {background_mib} MiB)"
                )
                proxy.clear()
                agent.kill()  # its queued S3 writes would wait out the faults
    finally:
        proxy.close()
    slow = out["slow"]
    # How much slower than the writers S3 was: chunks written per second over chunks
    # S3 took per second (each chunk is one PUT).
    out["slow_factor"] = (
        round(slow["puts_per_s"] / slow["s3_requests_per_s"], 1)
        if slow["s3_requests_per_s"]
        else None
    )
    # Beyond what the same writes cost with a healthy S3 (the pool's pages, allocator
    # arenas, S3 connections), the slow condition may hold at most the queue's bound.
    excess = slow["rss_peak_growth_mib"] - out["healthy"]["rss_peak_growth_mib"]
    out["slow_rss_excess_over_healthy_mib"] = round(excess, 1)
    out["slow_rss_within_bound"] = excess * MiB <= bound
    out["faults_injected"] = proxy.faults_injected
    out["torn_or_wrong_served"] = served.wrong
    out["agent_alive"] = all(
        out[n]["agent_alive"] for n in ("healthy", "slow", "stall", "error_500")
    )
    return out


# ---------------------------------------------------------------- disk full


@contextlib.contextmanager
def small_filesystem(path: Path, size: int) -> Iterator[str | None]:
    """A tmpfs of ``size`` bytes mounted at ``path`` (root only); yields None when
    mounted, else why it could not be (the phase is then skipped, not faked)."""
    path.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                        str(path)], capture_output=True, text=True)  # fmt: skip
    if p.returncode != 0:
        yield f"cannot mount a tmpfs here: {(p.stderr or p.stdout).strip()}"
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> int:
    """Write a ballast file until the filesystem refuses (ENOSPC): bytes written."""
    n = 0
    block = b"\0" * (64 * 1024)
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:  # unbuffered: nothing left to flush (and fail) at close
            n += f.write(block) or 0
    return n


def phase_disk_full(tmp: Path, chunks: int = 200) -> dict[str, Any]:
    """NVMe (write-through below DRAM) on a 6 MiB filesystem that a ballast file fills:
    writes go on into DRAM, the failed NVMe writes are counted, nothing torn is served
    (from DRAM, or from NVMe after DRAM is cleared), and once the ballast is gone NVMe
    takes writes again."""
    mnt = tmp / "diskfull-mnt"
    with small_filesystem(mnt, 6 * MiB) as why:
        if why is not None:
            return {"skipped": why}
        nvme = mnt / "nvme"
        agent = Agent(tmp, "diskfull", {
            # Capacity beyond the filesystem: the disk, not the tier's budget, says no.
            "dram": {"capacity": 16 * MiB},
            "nvme": {"enabled": True, "path": str(nvme), "capacity": 64 * MiB,
                     "write_mode": "write_through"},
        })  # fmt: skip
        served = Served()
        out: dict[str, Any] = {}

        def errors(c: AgentClient) -> float:
            return metric_sum(c.admin("stats"), "tiered_cache_write_errors_total{reason=full")

        def stage(c: AgentClient, name: str, n: int) -> dict[str, Any]:
            keys = [key_of(f"diskfull-{name}", i) for i in range(n)]
            failed0 = errors(c)
            put_err = 0
            for k in keys:
                try:
                    c.put_many([item(k)], wait=True)  # returns once NVMe took it or failed
                except Exception:
                    put_err += 1
            dram = sum(
                g is not None and served.check(k, g[1])
                for k, g in zip(keys, c.get_many(keys, FP.digest), strict=True)
            )
            # tiered_cache_write_errors_total{tier=nvme,reason=full}: the tier and the
            # store each count a failed write (2 per write at this commit).
            return {"puts": n, "put_errors": put_err, "served_from_dram": dram,
                    "nvme_write_errors_counted": errors(c) - failed0, "keys": keys}  # fmt: skip

        with running(agent):
            c = agent.client()
            try:
                before = stage(c, "before", 20)
                ballast = fill(mnt / "ballast")
                full = stage(c, "full", chunks)
                Path(mnt / "ballast").unlink()
                after = stage(c, "after", 20)
                # DRAM cleared: every chunk now comes from NVMe or not at all, and what
                # comes must be whole (no torn file left by a failed write).
                agent.admin("clear", tier="dram")
                from_nvme: dict[str, int] = {}
                for name, st in (("before", before), ("full", full), ("after", after)):
                    keys = st.pop("keys")
                    got = c.get_many(keys, FP.digest)
                    from_nvme[name] = sum(
                        g is not None and served.check(k, g[1])
                        for k, g in zip(keys, got, strict=True)
                    )
                    st["nvme_writes_failed"] = len(keys) - from_nvme[name]
                leftovers = len(list((nvme / ".tmp").iterdir())) if (nvme / ".tmp").exists() else 0
                out = {
                    "filesystem_mib": 6, "ballast_mib": round(ballast / MiB, 1),
                    "before": before, "full": full, "after": after,
                    "served_from_nvme_after_clear": from_nvme,
                    "tmp_leftovers": leftovers, "agent_alive": agent.alive,
                }  # fmt: skip
            finally:
                c.close()
        out["torn_or_wrong_served"] = served.wrong
        out["served"] = served.served
        say(
            f"disk full: {full['nvme_writes_failed']} NVMe writes failed of {chunks} (counted"
            f" {full['nvme_write_errors_counted']:.0f}), "
            f"{full['served_from_dram']} served from DRAM, {served.wrong} wrong; after: "
            f"{from_nvme['after']}/20 from NVMe"
        )
        return out


# ---------------------------------------------------------------- hung peer


def phase_hung_peer(tmp: Path, reads: int = 20, timeout_s: float = 2.0) -> dict[str, Any]:
    """A peer (``tests/hung_peer.py``) that passes the handshake, then answers each fetch
    with half a chunk and stalls; the directory names it as the holder of ``reads``
    chunks. The first read must fail within ``agent.peer_fetch_timeout_s``, the peer's
    breaker open (later reads skip it at once) while the agent's own chunks are served."""
    import asyncio

    from tiered_cache.directory import RedisDirectory

    secret = f"soak-hung-secret-{uuid.uuid4().hex}"
    redis = Redis()
    chunks = tmp / "hung-chunks"
    chunks.mkdir()
    keys = [key_of("hung", i) for i in range(reads)]
    mac = codec.chunk_mac_key(secret.encode())
    for k in keys:
        (chunks / k).write_bytes(codec.encode(chunk_meta(k, PAYLOAD), payload_of(k), mac_key=mac))
    port = free_port()
    peer = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "hung_peer.py"), str(port), secret, str(chunks)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    node = f"hung-{uuid.uuid4().hex[:6]}"
    agent = Agent(tmp, "hung", {
        "redis_url": redis.url,
        "agent": {"peer_secret": secret, "peer_fetch_timeout_s": timeout_s},
    })  # fmt: skip
    served = Served()
    out: dict[str, Any] = {"peer_fetch_timeout_s": timeout_s}
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "listening"

        async def publish() -> None:
            d = RedisDirectory.from_url(redis.url)
            try:
                await d.heartbeat(node, {"peer": ["127.0.0.1", port]}, 600)
                await d.publish(node, "dram", keys, 600)
                await d.flush()
            finally:
                await d.close()

        asyncio.run(publish())
        with running(agent):
            c = agent.client(timeout=60)
            try:
                mine = [key_of("hung-own", i) for i in range(reads)]
                c.put_many([item(k) for k in mine])
                out["lookup_before"] = c.lookup(keys[:1])
                t = time.monotonic()
                first = c.get_many(keys[:1], FP.digest)[0]
                out["first_read_s"] = round(time.monotonic() - t, 3)
                out["first_read_served"] = first is not None
                out["lookup_after"] = c.lookup(keys)  # the breaker open: the peer not offered
                times = []
                for k in keys[1:]:
                    t = time.monotonic()
                    if c.get_many([k], FP.digest)[0] is not None:
                        out["served_from_hung_peer"] = out.get("served_from_hung_peer", 0) + 1
                    times.append(time.monotonic() - t)
                out["later_read_max_ms"] = round(max(times) * 1e3, 1)
                own = c.get_many(mine, FP.digest)  # service goes on
                out["own_served"] = sum(
                    g is not None and served.check(k, g[1]) for k, g in zip(mine, own, strict=True)
                )
                m = c.admin("stats")
                out["peer_read_errors"] = metric_sum(m, "tiered_cache_read_errors_total{tier=peer")
                out["peer_fetches_skipped"] = metric_sum(m, "tiered_cache_peer_fetches_skipped")
            finally:
                c.close()
            out["agent_alive"] = agent.alive
    finally:
        peer.kill()
        peer.wait(10)
        redis.close()
    out["failed_within_timeout"] = (
        not out.get("first_read_served") and out.get("first_read_s", 1e9) < timeout_s * 1.5
    )
    out["breaker_opened"] = (
        out.get("lookup_after") == [] and out.get("later_read_max_ms", 1e9) < 300
    )
    out["torn_or_wrong_served"] = served.wrong
    say(
        f"hung peer: first read failed in {out.get('first_read_s')} s (timeout {timeout_s} s),"
        f" later reads at most {out.get('later_read_max_ms')} ms, own chunks"
        f" {out.get('own_served')}/{reads}"
    )
    return out


# ---------------------------------------------------------------- bad input

_BAD_KEYS = [
    "", "0" * 31, "0" * 33, "g" * 32, "A" * 32, "0" * 32 + "\n", "../" * 10 + "etc/passwd",
    "\x00" * 32, "0" * 32 + "/../x", "é" * 16, " " + "0" * 31, "0x" + "0" * 30,
]  # fmt: skip
_INTS = [-1, 0, 1, -(2**63), 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, 7, 1 << 40]


class Fuzzer:
    """Malformed frames from a seeded ``random.Random``: fast and reproducible."""

    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)

    def key(self) -> Any:
        r = self.rnd
        return f"{r.getrandbits(128):032x}" if r.random() < 0.4 else r.choice(_BAD_KEYS)

    def junk(self, depth: int = 0) -> Any:
        r = self.rnd
        k = r.randrange(12 if depth < 2 else 8)
        if k == 0:
            return None
        if k == 1:
            return r.random() < 0.5
        if k == 2:
            return r.choice(_INTS)
        if k == 3:
            return r.choice([0.0, -1.5, float("inf"), float("nan"), 1e308])
        if k == 4:
            return "".join(chr(r.randrange(32, 0x2FF)) for _ in range(r.randrange(40)))
        if k == 5:
            return r.randbytes(r.randrange(64))
        if k in (6, 7):
            return self.key()
        if k == 8:
            return [self.junk(depth + 1) for _ in range(r.randrange(5))]
        if k == 9:
            return {
                str(self.junk(depth + 1))[:20]: self.junk(depth + 1) for _ in range(r.randrange(4))
            }
        if k == 10:
            return [self.key() for _ in range(r.randrange(20))]
        return [[self.key(), r.choice(_INTS), r.choice(_INTS), self.junk(depth + 1), r.choice(_INTS)]
                for _ in range(r.randrange(4))]  # fmt: skip

    def local_request(self) -> dict[str, Any]:
        """A map the local server must refuse or survive: an op (real or not) with its
        fields missing, extra, of the wrong type, or of the right type with bad values."""
        r = self.rnd
        ops = [*REQUESTS, "fetch", "auth", "", "HELLO", "x" * 300]
        msg: dict[str, Any] = {}
        u = r.random()
        if u < 0.9:
            msg["op"] = r.choice(ops)
        elif u < 0.95:
            msg["op"] = self.junk()
        op = msg.get("op")
        cls = REQUESTS.get(op) if isinstance(op, str) else None
        if cls is not None:
            for f in dataclasses.fields(cls):
                if r.random() < 0.75:
                    msg[f.name] = self.junk() if r.random() < 0.5 else self.plausible(f.name)
        if r.random() < 0.1:
            msg["v"] = self.junk()
        if r.random() < 0.1:
            msg[f"extra_{r.randrange(9)}"] = self.junk()
        if r.random() < 0.03:
            msg["noreply"] = True
        return msg

    def plausible(self, name: str) -> Any:
        """The right type for field ``name``, with a value that is out of range or bad."""
        r = self.rnd
        if name in ("keys",):
            return [self.key() for _ in range(r.randrange(1, 16))]
        if name in ("key", "id", "tier", "prefix"):
            return r.choice([self.key(), "dram", "nvme", "s3", "gpu", ""])
        if name in ("sizes", "slots"):
            return [r.choice(_INTS) for _ in range(r.randrange(1, 16))]
        if name in ("items", "hits"):
            return self.junk(1) if r.random() < 0.2 else [
                [self.key(), r.choice(_INTS), r.choice(_INTS), self.key(), r.choice(_INTS)]
                for _ in range(r.randrange(1, 4))]  # fmt: skip
        if name in ("nbytes", "limit", "refill", "chunk_bytes"):
            return r.choice(_INTS)
        if name in ("fp", "data"):
            return r.randbytes(r.choice([0, 15, 16, 17, 300, 4096]))
        if name in ("pin", "model"):
            return {"id": self.key(), "keys": [self.key()], "tiers": ["dram"], "model": self.junk()}
        if name == "token":
            return self.junk()
        return self.junk()

    def peer_request(self) -> dict[str, Any]:
        r = self.rnd
        msg: dict[str, Any] = {"op": r.choice(["fetch", "fetch", "auth", "auth_proof", "get", ""])}
        if r.random() < 0.05:
            msg["op"] = self.junk()
        if r.random() < 0.9:
            msg["key"] = self.key() if r.random() < 0.7 else self.junk()
        if r.random() < 0.5:
            msg["raw"] = r.random() < 0.5
        if r.random() < 0.2:
            msg[f"x{r.randrange(5)}"] = self.junk()
        return msg

    def breaker(self) -> bytes:
        """Bytes that break the stream: the server must drop the connection, nothing else."""
        r = self.rnd
        k = r.randrange(8)
        if k == 0:  # a length prefix far beyond any request
            n = r.choice([2**31 - 1, 2**32 - 1, 2**31, 2**20 + 1, 2**24, 2**30])
            return struct.pack("!I", n) + r.randbytes(r.randrange(64))
        if k == 1:  # truncated
            n = r.randint(10, 5000)
            return struct.pack("!I", n) + r.randbytes(r.randrange(n))
        if k == 2:  # not msgpack (or not a map, or a map: whatever random bytes say)
            b = r.randbytes(r.randint(1, 200))
            return struct.pack("!I", len(b)) + b
        if k == 3:  # msgpack, not a map
            b = msgpack.packb(r.choice([1, [1, 2], "hello", None, b"\x00" * 8, 1.5, True]))
            return struct.pack("!I", len(b)) + b
        if k == 4:
            return struct.pack("!I", 0)
        if k == 5:  # half a length prefix
            return r.randbytes(r.randint(1, 3))
        if k == 6:
            return r.randbytes(r.randint(1, 500))
        b = msgpack.packb({"op": "hello"}) + b"\xc1"  # trailing garbage (0xc1: never used)
        return struct.pack("!I", len(b)) + b


def _send_breaker(connect: Callable[[], socket.socket], data: bytes, timeout: float) -> bool:
    """Send ``data`` on a fresh connection, end our side, and wait for the server to
    close: True when it did within ``timeout``."""
    s = connect()
    try:
        with contextlib.suppress(OSError):
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        until_closed(s, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        s.close()


def _replies_expected(msg: dict[str, Any]) -> int:
    return 0 if msg.get("noreply") else 1


def fuzz_local(fz: Fuzzer, sock_path: str, frames: int, batch: int = 32) -> dict[str, int]:
    """``frames`` malformed frames to the local socket: most as maps on one connection
    (each answered with a refusal), one in five as stream breakers on connections of
    their own."""
    sent = closed_early = hung = 0

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(30)
        s.connect(sock_path)
        return s

    conn: socket.socket | None = None
    while sent < frames:
        if fz.rnd.random() < 0.2:
            hung += not _send_breaker(connect, fz.breaker(), 30)
            sent += 1
            continue
        msgs = [fz.local_request() for _ in range(min(batch, frames - sent))]
        try:
            if conn is None:
                conn = connect()
            conn.sendall(b"".join(pack(m) for m in msgs))
            for _ in range(sum(_replies_expected(m) for m in msgs)):
                reply = recv_frame(conn)
                assert isinstance(reply, dict) and "ok" in reply, f"odd reply {reply!r}"
        except (OSError, EOFError):
            closed_early += 1  # the server dropped a connection of well-formed maps
            if conn is not None:
                conn.close()
            conn = None
        sent += len(msgs)
    if conn is not None:
        conn.close()
    return {"frames": sent, "closed_early": closed_early, "hung": hung}


def fuzz_peer(
    fz: Fuzzer, addr: tuple[str, int], secret: bytes | None, frames: int, batch: int = 32
) -> dict[str, int]:
    """``frames`` malformed frames to a peer port: before the handshake (each on a
    connection of its own, which the server must close) and, with ``secret``, after it
    (maps answered in order, then a breaker)."""
    sent = closed_early = hung = 0
    bytes_leaked = 0  # chunk bytes served before a handshake (a secret is set)

    def connect() -> socket.socket:
        return socket.create_connection(addr, timeout=30)

    conn: socket.socket | None = None
    while sent < frames:
        u = fz.rnd.random()
        if u < 0.25 or (secret is None and u < 0.5):
            data = fz.breaker() if fz.rnd.random() < 0.6 else pack(fz.peer_request())
            s = connect()
            try:
                with contextlib.suppress(OSError):
                    s.sendall(data)
                    s.shutdown(socket.SHUT_WR)
                got = until_closed(s, 30)
                if secret is not None and len(got) > 200:  # more than one refusal frame
                    bytes_leaked += len(got)
            except TimeoutError:
                hung += 1
            finally:
                s.close()
            sent += 1
            continue
        msgs = [fz.peer_request() for _ in range(min(batch, frames - sent))]
        try:
            if conn is None:
                conn = peer_connect(addr, secret, timeout=30)
            conn.sendall(b"".join(pack(m) for m in msgs))
            for m in msgs:
                head = recv_frame(conn)
                assert isinstance(head, dict), f"odd reply {head!r}"
                if m.get("raw") and isinstance(head.get("len"), int) and head["len"] >= 0:
                    recv_exact(conn, head["len"])
        except (OSError, EOFError, AssertionError):
            closed_early += 1
            if conn is not None:
                conn.close()
            conn = None
        sent += len(msgs)
    if conn is not None:
        conn.close()
    return {"frames": sent, "closed_early": closed_early, "hung": hung,
            "bytes_before_handshake": bytes_leaked}  # fmt: skip


def probe(agent: Agent, key: str, peer: tuple[str, int] | None, secret: bytes | None) -> str | None:
    """None when the agent answers a well-formed request on its socket (and the peer port
    serves ``key``, byte for byte); else what went wrong."""
    if not agent.alive:
        return "agent process exited"
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(15)
            s.connect(agent.socket)
            call_sync(s, encode(Hello()))
        if peer is not None:
            # Put it (again): a fuzzed ``clear`` or ``evict`` may have removed it.
            c = agent.client(timeout=15)
            try:
                c.put_many([item(key)])
            finally:
                c.close()
            with contextlib.closing(peer_connect(peer, secret, timeout=15)) as p:
                got = peer_fetch(p, key)
                if got is None or bytes(codec.decode(got, expect_key=key)[1]) != payload_of(key):
                    return "peer port did not serve a good chunk"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def idle_connections(
    agent: Agent, key: str, peer: tuple[str, int] | None, secret: bytes | None, n: int = 1000
) -> dict[str, Any]:
    """``n`` idle connections to the local socket and ``n`` to the peer port; then a good
    client must still put and get, and a puller with the secret still fetch."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * n + 200
    if soft < want and (hard == resource.RLIM_INFINITY or hard >= want):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX)
            s.connect(agent.socket)
            socks.append(s)
        if peer is not None:
            for _ in range(n):
                socks.append(socket.create_connection(peer, timeout=10))
        why = probe(agent, key, peer, secret)
        good = None
        if why is None:
            c = agent.client(timeout=15)
            try:
                k2 = key_of("idle", 0)
                c.put_many([item(k2)])
                got = c.get_many([k2], FP.digest)[0]
                good = got is not None and bytes(got[1]) == payload_of(k2)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
            finally:
                c.close()
        return {"connections": len(socks), "service_ok": why is None and bool(good), "why": why}
    finally:
        for s in socks:
            s.close()


def phase_fuzz(
    tmp: Path, local_frames: int, peer_frames: int, seed: int = 1, probe_every: int = 2000,
    idle: int = 1000, prefix: list[str] | None = None, peer_host: str = "127.0.0.1",
) -> dict[str, Any]:  # fmt: skip
    secret = f"soak-fuzz-secret-{uuid.uuid4().hex}".encode()
    port = free_port()
    agent = Agent(tmp, "fuzz", {
        "nvme": {"enabled": True, "path": str(tmp / "fuzz-nvme"), "capacity": 32 * MiB},
        "agent": {"peer_port": port, "peer_host": peer_host, "peer_secret": secret.decode()},
    }, prefix=prefix)  # fmt: skip
    peer = (peer_host, port)
    fz = Fuzzer(seed)
    key = key_of("fuzz-probe", seed)
    crashes: list[str] = []
    totals: dict[str, dict[str, float]] = {}
    with running(agent):
        c = agent.client()
        c.put_many([item(key)])
        c.close()
        rss0 = agent.rss()
        lines0 = agent.log_lines()
        t0 = time.monotonic()
        for name, frames in (("local", local_frames), ("peer", peer_frames)):
            done = 0
            lines_before = agent.log_lines()
            while done < frames:
                step = min(probe_every, frames - done)
                try:
                    r = (fuzz_local(fz, agent.socket, step) if name == "local"
                         else fuzz_peer(fz, peer, secret, step))  # fmt: skip
                except OSError as e:  # could not even connect
                    r = {"frames": step, "connect_failed": 1}
                    crashes.append(f"{name}: {type(e).__name__}: {e}")
                tot = totals.setdefault(name, {})
                for k, v in r.items():
                    tot[k] = tot.get(k, 0) + v
                done += step
                why = probe(agent, key, peer, secret)
                if why is not None:
                    crashes.append(f"after {done} {name} frames: {why}")
                    say(f"fuzz: agent failed a probe: {why}")
                    if not agent.alive:  # count it, restart, go on
                        agent.kill()
                        agent.start()
                        c = agent.client()
                        c.put_many([item(key)])
                        c.close()
                say(
                    f"fuzz {name}: {done:,}/{frames:,} frames, agent RSS {agent.rss() / MiB:.0f}"
                    f" MiB, {len(crashes)} crashes"
                )
            if frames:  # what this socket's bad frames cost in log lines
                tot = totals[name]
                tot["log_lines"] = agent.log_lines() - lines_before
                tot["log_lines_per_frame"] = round(tot["log_lines"] / tot["frames"], 4)
        elapsed = time.monotonic() - t0
        rss1 = agent.rss()
        lines = agent.log_lines() - lines0
        idle_r = idle_connections(agent, key, peer, secret, idle) if idle else None
    frames_sent = sum(t.get("frames", 0) for t in totals.values())
    return {
        "fuzz_frames": frames_sent,
        "fuzz_crashes": len(crashes),
        "crashes": crashes[:10],
        "by_port": totals,
        "frames_per_s": round(frames_sent / elapsed, 1) if elapsed else None,
        "log_lines": lines,
        "log_lines_per_frame": round(lines / frames_sent, 3) if frames_sent else None,
        "rss_before_mib": round(rss0 / MiB, 1),
        "rss_after_mib": round(rss1 / MiB, 1),
        "idle": idle_r,
        "agent_starts": agent.starts,
    }


# ---------------------------------------------------------------- let no one in

ADMIN_TOKEN = "soak-admin-token-" + "7f3a9c21e4b85d60"
WRONG_SECRET = b"another-clusters-peer-secret-987654321"


def unauthorized_peer_reads(addr: tuple[str, int], key: str, secret: bytes) -> dict[str, int]:
    """Ways to ask a guarded peer port for ``key`` without the secret; each that gets
    chunk bytes is a success that should have failed."""
    tries: dict[str, Callable[[socket.socket], bytes | None]] = {}

    def straight(s: socket.socket) -> bytes | None:  # no handshake at all
        return peer_fetch(s, key)

    def wrong_secret(s: socket.socket) -> bytes | None:
        nc = os.urandom(NONCE_BYTES)
        s.sendall(pack({"op": "auth", "v": 1, "nonce": nc}))
        reply = recv_frame(s)
        ns = reply.get("nonce", b"\0" * NONCE_BYTES) if isinstance(reply, dict) else b""
        s.sendall(pack({"op": "auth_proof", "mac": peer_mac(WRONG_SECRET, CLIENT, nc, ns)}))
        return peer_fetch(s, key)

    def echo_server_mac(s: socket.socket) -> bytes | None:  # the server's proof sent back
        nc = os.urandom(NONCE_BYTES)
        s.sendall(pack({"op": "auth", "v": 1, "nonce": nc}))
        reply = recv_frame(s)
        mac = reply.get("mac", b"") if isinstance(reply, dict) else b""
        s.sendall(pack({"op": "auth_proof", "mac": mac}))
        return peer_fetch(s, key)

    def replayed_proof(s: socket.socket) -> bytes | None:  # a proof for other nonces
        nc = os.urandom(NONCE_BYTES)
        s.sendall(pack({"op": "auth", "v": 1, "nonce": nc}))
        recv_frame(s)
        old = peer_mac(secret, CLIENT, b"\1" * NONCE_BYTES, b"\2" * NONCE_BYTES)
        s.sendall(pack({"op": "auth_proof", "mac": old}))
        return peer_fetch(s, key)

    def skip_proof(s: socket.socket) -> bytes | None:  # hello, then straight to a fetch
        s.sendall(pack({"op": "auth", "v": 1, "nonce": os.urandom(NONCE_BYTES)}))
        recv_frame(s)
        return peer_fetch(s, key)

    tries = {"no_handshake": straight, "wrong_secret": wrong_secret,
             "server_mac_echoed": echo_server_mac, "replayed_proof": replayed_proof,
             "proof_skipped": skip_proof}  # fmt: skip
    out: dict[str, int] = {}
    for name, fn in tries.items():
        got: bytes | None = None
        with (
            socket.create_connection(addr, timeout=15) as s,
            contextlib.suppress(OSError, EOFError, ValueError, msgpack.UnpackException),
        ):
            got = fn(s)
        out[name] = int(got is not None)
    return out


def unauthorized_admin(agent: Agent, key: str) -> dict[str, int]:
    """Admin writes without the token (and with a wrong one) over the socket, and from
    the CLI: 1 for each the agent carried out."""
    out: dict[str, int] = {}
    pin = {"id": "soak-pin", "keys": [key], "tiers": ["dram"]}
    writes: list[tuple[str, dict[str, Any]]] = [
        ("evict", {"key": key}), ("clear", {"tier": "dram"}), ("flush", {}),
        ("pin_add", {"pin": pin}), ("pin_rm", {"id": "soak-pin"}), ("warm", {"id": "soak-pin"}),
    ]  # fmt: skip
    for token in (None, "wrong-token-0123456789abcdef"):
        for op, kw in writes:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(30)
                s.connect(agent.socket)
                s.sendall(pack({"op": op, "v": 2, **kw, "token": token}))
                reply = recv_frame(s)
            # Refused for want of the token, not for some other fault of the request.
            refused = (
                isinstance(reply, dict)
                and reply.get("ok") is False
                and (reply.get("kind") == "auth")
            )
            out[f"socket_{op}_{'none' if token is None else 'wrong'}"] = int(not refused)
    env = {k: v for k, v in os.environ.items() if k != "TIERED_CACHE_TOKEN"}
    env["PYTHONPATH"] = str(ROOT)
    cli = {"evict": ["evict", key], "write_back": ["flush", "--write-back"],
           "clear": ["flush", "--tier", "dram", "--yes"]}  # fmt: skip
    for name, args in cli.items():
        p = subprocess.run(
            [sys.executable, "-m", "tiered_cache.cli", args[0], "-c", str(agent.path), *args[1:]],
            capture_output=True, text=True, timeout=60, env=env, cwd=str(ROOT),
        )  # fmt: skip
        refused = p.returncode != 0 and "token" in (p.stdout + p.stderr).lower()
        out[f"cli_{name}"] = int(not refused)
    return out


def _forge_payload(key: str) -> bytes:
    return np.full(PAYLOAD, 0x41, dtype=np.uint8).tobytes()  # the attacker's "KV"


def forgeries(key: str, donor: bytes) -> dict[str, bytes]:
    """Encoded chunks an attacker with write access to NVMe or S3 could plant for ``key``:
    a genuine chunk with flipped payload bytes (its checksum no longer matches), another
    key's genuine chunk, and the attacker's payload with a correct (unkeyed) checksum."""
    good = codec.encode(chunk_meta(key, PAYLOAD), payload_of(key))
    flipped = bytearray(good)
    flipped[codec.HEADER_SIZE + 100 : codec.HEADER_SIZE + 108] = b"\xff" * 8
    return {
        "bad_checksum": bytes(flipped),
        "other_key": donor,
        "rechecksummed": codec.encode(chunk_meta(key, PAYLOAD), _forge_payload(key)),
    }


def phase_auth(tmp: Path, moto_url: str | None, with_secret: bool = True) -> dict[str, Any]:
    """``with_secret=False``: the same attacks on an agent without ``agent.peer_secret``
    (no handshake, no chunk MAC), to show what the secret is for."""
    import boto3

    secret = f"soak-auth-secret-{uuid.uuid4().hex}".encode()
    port = free_port()
    bucket = f"tc-soak-{uuid.uuid4().hex[:8]}"
    over: dict[str, Any] = {
        "nvme": {"enabled": True, "path": str(tmp / "auth-nvme"), "capacity": 32 * MiB,
                 "write_mode": "write_through"},
        "agent": {"peer_port": port, "auth_token": ADMIN_TOKEN,
                  "peer_secret": secret.decode() if with_secret else None},
    }  # fmt: skip
    s3 = None
    if moto_url is not None:
        s3 = boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1")
        s3.create_bucket(Bucket=bucket)
        over["s3"] = {"enabled": True, "url": f"s3://{bucket}/soak", "endpoint_url": moto_url,
                      "region": "us-east-1", "write_mode": "write_back"}  # fmt: skip
    agent = Agent(tmp, "auth", over)
    out: dict[str, Any] = {}
    with running(agent):
        c = agent.client()
        try:
            keys = [key_of("auth", i) for i in range(8)]
            c.put_many([item(k) for k in keys], wait=True)
            peer = unauthorized_peer_reads(("127.0.0.1", port), keys[0], secret)
            with contextlib.closing(
                peer_connect(("127.0.0.1", port), secret if with_secret else None)
            ) as p:
                got = peer_fetch(p, keys[0])  # the control: with the secret it works
            out["peer"] = peer
            out["peer_with_secret_ok"] = got is not None
            admin = unauthorized_admin(agent, keys[1])
            out["admin"] = admin
            still = c.get_many([keys[1]], FP.digest)[0]
            out["admin_refused_chunk_still_there"] = still is not None
            # Forged chunks. NVMe: a file replaced under a key the agent indexed (DRAM
            # copy evicted first, with the token, so the read goes to the file).
            forged: dict[str, int] = {}
            donor = codec.encode(chunk_meta(keys[7], PAYLOAD), payload_of(keys[7]))
            for i, (kind, data) in enumerate(forgeries(keys[2], donor).items()):
                k = keys[2 + i]
                blob = data if kind == "other_key" else forgeries(k, donor)[kind]
                c.admin("evict", key=k, tiers=["dram"], token=ADMIN_TOKEN)
                f = Path(over["nvme"]["path"]) / k[:2] / f"{k}.kvc"
                f.write_bytes(blob)
                forged[f"nvme_{kind}"] = _served_forgery(c, k)
            # S3: objects planted under keys nobody wrote (a lookup HEADs S3 for them).
            if s3 is not None:
                for kind in ("bad_checksum", "other_key", "rechecksummed"):
                    k = key_of("auth-s3", len(forged))
                    blob = donor if kind == "other_key" else forgeries(k, donor)[kind]
                    s3.put_object(Bucket=bucket, Key=f"soak/{k[:2]}/{k}.kvc", Body=blob)
                    forged[f"s3_{kind}"] = _served_forgery(c, k)
            out["forged"] = forged
            stats = c.admin("stats")["metrics"]
            # Refusals the agent counted: damaged or misplaced, and (with a MAC key) forged.
            out["refused_counts"] = {
                k: v for k, v in stats.items()
                if k.startswith(("tiered_cache_verification_failures", "tiered_cache_forged"))
            }  # fmt: skip
        finally:
            c.close()
    out["unauthorized_accepted"] = sum(out["peer"].values()) + sum(out["admin"].values())
    out["forged_accepted"] = sum(out["forged"].values())
    return out


def _served_forgery(c: AgentClient, key: str) -> int:
    """1 when a read of ``key`` was served anything but its genuine payload. A lookup
    first: it is what finds an object nobody listed in S3."""
    c.lookup([key])
    got = c.get_many([key], FP.digest)[0]
    return int(got is not None and bytes(got[1]) != payload_of(key))


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer trials and frames (< 10 min)")
    ap.add_argument("--minutes", type=float, help="load phase length (default 10; 1.5 quick)")
    ap.add_argument("--threads", type=int, default=4, help="client threads in the load phase")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--phases", default="load,kill9,redis,s3,disk_full,hung_peer,fuzz,auth,auth_no_secret"
    )
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = ap.parse_args()
    q = args.quick
    minutes = args.minutes if args.minutes is not None else (1.5 if q else 10.0)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    res: dict[str, Any] = {
        "mode": "quick" if q else "full",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
    }
    durations: dict[str, float] = {}
    from _common import moto_server

    with tempfile.TemporaryDirectory(prefix="tc-soak-") as d, moto_server() as moto:
        tmp = Path(d)
        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "load": lambda: phase_load(tmp, minutes * 60, args.threads, seed=args.seed),
            "kill9": lambda: phase_kill9(tmp, 10 if q else 50, args.seed),
            "redis": lambda: phase_redis(tmp, 800 if q else 3000),
            "s3": lambda: phase_s3(tmp, moto, 400 if q else 1500, slow_s=10 if q else 60),
            "disk_full": lambda: phase_disk_full(tmp, 150 if q else 500),
            "hung_peer": lambda: phase_hung_peer(tmp, 20 if q else 100),
            "fuzz": lambda: phase_fuzz(tmp, 12000 if q else 70000, 8000 if q else 40000,
                                       args.seed),
            "auth": lambda: phase_auth(tmp, moto),
            "auth_no_secret": lambda: phase_auth(tmp, moto, with_secret=False),
        }  # fmt: skip
        for name in phases:
            say(f"phase {name}")
            t0 = time.monotonic()
            try:
                res[name] = runs[name]()
            except Exception as e:
                res[name] = {"error": f"{type(e).__name__}: {e}"}
                traceback.print_exc(file=sys.stderr)
            durations[name] = round(time.monotonic() - t0, 1)
    g = res.get
    res["phase_seconds"] = durations
    summary = {
        "rss_growth": (g("load") or {}).get("rss_growth"),
        "leaked_slots": (g("load") or {}).get("leaked_slots"),
        "chunk_ops": (g("load") or {}).get("ops"),
        "torn_or_wrong_served": sum(
            int((g(p) or {}).get("torn_or_wrong_served") or 0)
            for p in ("load", "kill9", "redis", "s3", "disk_full", "hung_peer")
        ),
        "lost_acked": (g("kill9") or {}).get("lost_acked"),
        "kill9_trials": (g("kill9") or {}).get("trials"),
        "redis_outage_errors": ((g("redis") or {}).get("errors") or {}).get("down"),
        "s3_healthy_put_p99_ms": ((g("s3") or {}).get("healthy") or {}).get("put_p99_ms"),
        "s3_slow_factor": (g("s3") or {}).get("slow_factor"),
        "s3_slow_rss_peak_growth_mib": ((g("s3") or {}).get("slow") or {}).get(
            "rss_peak_growth_mib"
        ),
        "s3_slow_rss_within_bound": (g("s3") or {}).get("slow_rss_within_bound"),
        "s3_stall_put_p99_ms": ((g("s3") or {}).get("stall") or {}).get("put_p99_ms"),
        "s3_500_put_p99_ms": ((g("s3") or {}).get("error_500") or {}).get("put_p99_ms"),
        "disk_full_nvme_writes_failed": ((g("disk_full") or {}).get("full") or {}).get(
            "nvme_writes_failed"
        ),
        "disk_full_nvme_after_space_returned": (
            (g("disk_full") or {}).get("served_from_nvme_after_clear") or {}
        ).get("after"),
        "disk_full_served_from_dram": ((g("disk_full") or {}).get("full") or {}).get(
            "served_from_dram"
        ),
        "hung_peer_first_read_s": (g("hung_peer") or {}).get("first_read_s"),
        "hung_peer_breaker_opened": (g("hung_peer") or {}).get("breaker_opened"),
        "fuzz_frames": (g("fuzz") or {}).get("fuzz_frames"),
        "fuzz_crashes": (g("fuzz") or {}).get("fuzz_crashes"),
        "log_lines_per_bad_frame": {
            port: t.get("log_lines_per_frame")
            for port, t in ((g("fuzz") or {}).get("by_port") or {}).items()
        },
        "idle_1000_service_ok": (((g("fuzz") or {}).get("idle")) or {}).get("service_ok"),
        "forged_accepted": (g("auth") or {}).get("forged_accepted"),
        "unauthorized_accepted": (g("auth") or {}).get("unauthorized_accepted"),
        "forged_accepted_without_secret": (g("auth_no_secret") or {}).get("forged_accepted"),
    }
    res = {**summary, **res}
    for k, v in summary.items():
        print(f"{k:>24}: {v}")
    if args.json:
        print(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
