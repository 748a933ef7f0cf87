"""Nodes with their own network addresses on one machine, for tests and benchmarks.

Agents on one host that all bind 127.0.0.1 hide every bug where a node publishes an
address only it can use. ``NetNodes`` gives each named node a Linux network namespace with
its own address on a private /24, joined by a bridge in the root namespace (which gets
the ``.254`` address, so services there, e.g. Redis, and the test itself reach every
node). Unix sockets bound to file paths, shared memory and files cross namespaces; only
the network is separate. Needs root and ``ip`` (iproute2); everything is removed on close.

Host names: ``hosts={"redis.internal": "host"}`` makes the name resolve, inside every
node, to the bridge address (``"host"``) or to a node's address (its name), through
``/etc/netns/<ns>/hosts`` (``ip netns exec`` mounts it over ``/etc/hosts``).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (Debian package iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _used_subnets() -> set[int]:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    used = set()
    for word in out.split():
        if word.startswith("10.231."):
            with contextlib.suppress(ValueError, IndexError):
                used.add(int(word.split(".")[2]))
    return used


class NetNodes:
    """Named nodes, each in its own network namespace (see the module docstring)."""

    def __init__(self, names: Sequence[str], hosts: Mapping[str, str] | None = None) -> None:
        why = unavailable_reason()
        if why is not None:
            raise RuntimeError(f"cannot make network namespaces: {why}")
        if not names or len(set(names)) != len(names) or len(names) > 200:
            raise ValueError(f"give up to 200 distinct node names, got {list(names)}")
        self.tag = uuid.uuid4().hex[:6]
        free = sorted(set(range(1, 255)) - _used_subnets())
        if not free:
            raise RuntimeError("no free 10.231.x.0/24 subnet")
        self.subnet = random.choice(free)
        self.host_ip = f"10.231.{self.subnet}.254"
        self.bridge = f"tcb{self.tag}"
        self._addr = {n: f"10.231.{self.subnet}.{i + 1}" for i, n in enumerate(names)}
        self._ns = {n: f"tc-{self.tag}-{i}" for i, n in enumerate(names)}
        self._made: list[str] = []
        try:
            self._build(hosts or {})
        except BaseException:
            self.close()
            raise

    def _build(self, hosts: Mapping[str, str]) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        lines = [
            f"{self.host_ip if to == 'host' else self._addr[to]} {name}"
            for name, to in hosts.items()
        ]
        for i, (name, ns) in enumerate(self._ns.items()):
            veth = f"tcv{self.tag}{i}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{self._addr[name]}/24", "dev", "eth0")
            _ip("netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(
                "\n".join(["127.0.0.1 localhost", f"{self._addr[name]} {name}", *lines]) + "\n"
            )

    def addr(self, node: str) -> str:
        return self._addr[node]

    def netns(self, node: str) -> str:
        return self._ns[node]

    def prefix(self, node: str) -> list[str]:
        """Command prefix that runs a program on ``node``."""
        return ["ip", "netns", "exec", self._ns[node]]

    def close(self) -> None:
        """Delete the namespaces (their veths go with them), the bridge and hosts files.
        Processes still running inside are the caller's to stop first."""
        for item in reversed(self._made):
            if item == "bridge":
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("link", "del", self.bridge)
            else:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("netns", "del", item)
                shutil.rmtree(Path("/etc/netns") / item, ignore_errors=True)
        self._made.clear()

    def __enter__(self) -> NetNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
