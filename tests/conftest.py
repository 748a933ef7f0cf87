"""Shared fixtures: real redis-server and moto S3 server processes on free ports."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open in {timeout}s")


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen[bytes]
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.proc = _spawn_redis(self.port, self.password)


def _spawn_redis(
    port: int, password: str | None = None, bind: str = "127.0.0.1"
) -> subprocess.Popen[bytes]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (scripts/setup.sh installs it with apt)")
    args = [exe, "--port", str(port), "--bind", bind, "--save", "", "--appendonly", "no",
            "--protected-mode", "no"]  # fmt: skip
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, host=bind.split()[0])
    return proc


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for one test (so tests can stop and restart it)."""
    port = free_port()
    srv = RedisServer(port, _spawn_redis(port))
    yield srv
    srv.stop()


@dataclass
class S3Server:
    endpoint_url: str
    server: object

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's threaded S3-compatible server, reached over real HTTP."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    wait_port(port)
    yield S3Server(f"http://127.0.0.1:{port}", server)
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh bucket per test."""
    name = f"tc-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def nvme_dir(tmp_path: Path) -> Path:
    d = tmp_path / "nvme"
    d.mkdir()
    return d


REDIS_TEST_PASSWORD = "pw-Zq7-not-a-real-secret"


@pytest.fixture
def redis_server_auth() -> Iterator[RedisServer]:
    """A private redis-server that requires ``REDIS_TEST_PASSWORD`` (``.url`` carries it)."""
    port = free_port()
    srv = RedisServer(port, _spawn_redis(port, REDIS_TEST_PASSWORD), REDIS_TEST_PASSWORD)
    yield srv
    srv.stop()


@dataclass
class RedisCluster:
    ports: list[int]
    procs: list[subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            p.wait(timeout=10)


def _cluster_ports(n: int) -> list[int]:
    """Free ports whose cluster bus port (port + 10000) is free too."""
    import random

    ports: list[int] = []
    while len(ports) < n:
        p = random.randint(20000, 45000)
        if p in ports:
            continue
        try:
            for candidate in (p, p + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        ports.append(p)
    return ports


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A 3-master Redis Cluster (no replicas) shared by the session; ~1-2 s to start.

    Tests must use their own key namespace."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        pytest.fail("redis-server/redis-cli are not installed (scripts/setup.sh installs them with apt)")
    d = tmp_path_factory.mktemp("redis-cluster")
    ports = _cluster_ports(3)
    procs = []
    for p in ports:
        args = [
            exe, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{p}.conf",
            "--cluster-node-timeout", "2000", "--dir", str(d),
        ]  # fmt: skip
        procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    cluster = RedisCluster(ports, procs)
    try:
        for p in ports:
            wait_port(p)
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            states = [
                subprocess.run(
                    [cli, "-p", str(p), "cluster", "info"], capture_output=True, text=True
                ).stdout
                for p in ports
            ]
            if all("cluster_state:ok" in s for s in states):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """A node agent process on ``helpers_agent.write_cfg``'s defaults: (config, process)."""
    from helpers_agent import start_agent, write_cfg

    cfg = write_cfg(tmp_path)
    proc = start_agent(cfg)
    yield cfg, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# Pools and indexes the tests' agents leave in /dev/shm: a clean stop keeps the DRAM pool
# for a warm restart, and so does a crash. Each module's are removed once its fixtures
# (agents, vLLM servers) are torn down, so a full run never holds more than one module's.
_SHM = Path("/dev/shm")
_OUR_SHM = ("tiered_cache_", "tc_", "tcns_", "tcpa_", "tcb_", "tcserve_")


def _our_shm() -> set[str]:
    try:
        return {p.name for p in _SHM.iterdir() if p.name.startswith(_OUR_SHM)}
    except OSError:
        return set()


def _shm_in_use() -> set[str]:
    """Segments some live process maps or holds open: a concurrent run's (a second pytest,
    the demo, a bench) on the same host, which must not be pulled from under it."""
    used: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    used.add(line.rsplit("/dev/shm/", 1)[1].split(" ")[0])
            for fd in (proc / "fd").iterdir():
                target = str(fd.readlink())
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/") :])
        except OSError:  # gone, or not ours to read
            continue
    return used


@pytest.fixture(scope="module", autouse=True)
def _drop_module_pools() -> Iterator[None]:
    before = _our_shm()
    yield
    for name in _our_shm() - before - _shm_in_use():
        (_SHM / name).unlink(missing_ok=True)
