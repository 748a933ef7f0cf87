"""The agent's Prometheus endpoint binds loopback unless told otherwise (it bound 0.0.0.0:
issue 15, remaining findings). 127.0.0.2 stands for "another address of this host": Linux
routes all of 127/8 to lo, so a wildcard bind answers there and a 127.0.0.1 bind does not."""

from __future__ import annotations

import socket
import subprocess
import urllib.request
from pathlib import Path

from conftest import free_port
from helpers_agent import start_agent, write_cfg


def answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def run_agent(tmp_path: Path, agent: dict[str, object], *args: str) -> subprocess.Popen[str]:
    cfg = write_cfg(tmp_path, agent={"socket": str(tmp_path / "agent.sock"), **agent})
    return start_agent(cfg, *args)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()


def test_metrics_listen_on_loopback_by_default(tmp_path: Path) -> None:
    port = free_port()
    proc = run_agent(tmp_path, {"metrics_port": port})
    try:
        assert "tiered_cache_" in metrics_text(port)
        assert not answers("127.0.0.2", port)
    finally:
        stop(proc)


def test_metrics_host_exposes_them(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "a").mkdir()
    proc = run_agent(tmp_path / "a", {"metrics_port": port, "metrics_host": "0.0.0.0"})
    try:
        assert answers("127.0.0.2", port)
    finally:
        stop(proc)
    # The command-line flag overrides the file.
    port = free_port()
    (tmp_path / "b").mkdir()
    proc = run_agent(tmp_path / "b", {}, "--metrics-port", str(port), "--metrics-host", "0.0.0.0")
    try:
        assert answers("127.0.0.2", port) and "tiered_cache_" in metrics_text(port)
    finally:
        stop(proc)
