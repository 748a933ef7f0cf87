"""Issue 15, item 6: no request, good or bad, and no client that goes away leaves the
DRAM pool's books changed. A real agent process is driven over its socket with raw frames
(bad batches, bad commits and puts, clients that vanish holding runs and leases), and the
pool's accounting (``stats`` -> ``pool``: free slots, reserved runs, leases, chunks) must
come back exactly to where it started."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from helpers_agent import FP, meta, payload, socket_of, start_agent, write_cfg

from tiered_cache import codec
from tiered_cache.client import AgentClient
from tiered_cache.keys import chunk_keys

N = 64 * 1024  # payload bytes: one chunk is HEADER_SIZE + N, one 128 KiB slot
SIZE = codec.HEADER_SIZE + N
_LEN = struct.Struct("!I")


class Raw:
    """A client speaking the agent's frames directly, so it can send what AgentClient
    never would; writes slot bytes through its own mapping of the pool."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        hello = self.call("hello")
        self.slot_bytes = int(hello["slot_bytes"])
        fd = os.open(f"/dev/shm/{hello['shm_name']}", os.O_RDWR)
        try:
            self.pool = mmap.mmap(fd, int(hello["pool_bytes"]))
        finally:
            os.close(fd)

    def send(self, op: str, **kw: Any) -> None:
        body = msgpack.packb({"op": op, **kw}, use_bin_type=True)
        self.sock.sendall(_LEN.pack(len(body)) + body)

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        (n,) = _LEN.unpack(self._exact(4))
        return dict(msgpack.unpackb(self._exact(n), raw=False))

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            if not got:
                raise EOFError("agent closed the connection")
            buf += got
        return buf

    def reserve(self, n: int = 1, size: int = SIZE) -> list[int]:
        r = self.call("reserve", sizes=[size] * n)
        assert r["ok"] and None not in r["slots"], r
        return [int(s) for s in r["slots"]]

    def fill(self, slot: int, key: str, i: int = 0) -> None:
        """A whole, valid chunk for ``key`` in the run at ``slot``."""
        off = slot * self.slot_bytes
        self.pool[off : off + SIZE] = codec.encode(meta(key, N), payload(i, N))

    def close(self) -> None:
        self.pool.close()
        self.sock.close()


def pool_books(sock: str) -> dict[str, int]:
    c = AgentClient(sock, attach_pool=False)
    try:
        return dict(c.admin("stats")["pool"])
    finally:
        c.close()


def quiet(sock: str, timeout: float = 15.0) -> dict[str, int]:
    """The books once no client holds a run or a lease (an AgentClient just closed hands
    back its stash of runs when the agent reads the end of its stream)."""
    deadline = time.monotonic() + timeout
    got = pool_books(sock)
    while (got["reserved_runs"] or got["leases"]) and time.monotonic() < deadline:
        got = pool_books(sock)
    return got


def settled(sock: str, want: dict[str, int], timeout: float = 15.0) -> dict[str, int]:
    """The books once they equal ``want`` (a closed client's runs are returned when the
    agent reads the end of its stream), or as they are at ``timeout``. Each look is a
    stats round trip: nothing sleeps."""
    deadline = time.monotonic() + timeout
    got = pool_books(sock)
    while got != want and time.monotonic() < deadline:
        got = pool_books(sock)
    return got


def _agent(tmp: Path) -> Iterator[str]:
    cfg = write_cfg(tmp, dram={"capacity": "2MiB", "slot_bytes": "128KiB"})
    proc = start_agent(cfg)
    yield socket_of(cfg)
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """DRAM (16 slots of 128 KiB) over NVMe: NVMe refuses a malformed key with an error,
    the way a failing key surfaces in the middle of a batch."""
    yield from _agent(tmp_path_factory.mktemp("leaks"))


@pytest.fixture(scope="module")
def empty_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Another, for the clients that vanish: the run a commit hands back for the next put
    is given only while a quarter of the pool stays free."""
    yield from _agent(tmp_path_factory.mktemp("gone"))


@pytest.fixture
def raw(agent: str) -> Iterator[Raw]:
    r = Raw(agent)
    yield r
    r.close()


def keys(start: int, n: int) -> list[str]:
    return chunk_keys(list(range(start, start + n * FP.chunk_size)), FP)


def put(sock: str, ks: list[str]) -> None:
    c = AgentClient(sock)
    try:
        c.put_many([(meta(k, N), payload(i, N)) for i, k in enumerate(ks)], wait=True)
    finally:
        c.close()


def test_books_are_consistent_when_idle(agent: str) -> None:
    b = pool_books(agent)
    assert b["reserved_runs"] == 0 and b["leases"] == 0 and b["zombie_runs"] == 0
    assert b["free_slots"] + b["chunk_slots"] == b["num_slots"]


def test_failing_key_in_a_batched_get_keeps_no_lease(agent: str, raw: Raw) -> None:
    (a, b) = keys(1_000, 2)
    put(agent, [a, b])
    before = quiet(agent)
    r = raw.call("get", keys=[a, "not-a-key", b])
    assert not r["ok"] and "invalid chunk key 'not-a-key'" in r["error"], r
    assert pool_books(agent) == before  # while the client is still connected
    # The good keys alone still lease, and release returns them.
    r = raw.call("get", keys=[a, b])
    assert r["ok"] and all("slot" in it for it in r["items"]), r
    assert pool_books(agent)["leases"] == before["leases"] + 2
    raw.send("release", slots=[it["slot"] for it in r["items"]], noreply=True)
    assert raw.call("hello")["ok"]  # the one-way release was taken before this
    assert pool_books(agent) == before


@pytest.mark.parametrize(
    "case",
    ["bad_key", "negative_length", "oversized_length", "no_header", "header_of_another_key",
     "length_not_the_headers", "slot_twice_in_one_batch", "malformed_item", "bad_parent"],
)  # fmt: skip
def test_refused_commit_changes_nothing(agent: str, raw: Raw, case: str) -> None:
    before = quiet(agent)
    k, k2 = keys(2_000 + 100 * len(case), 2)
    s, s2 = raw.reserve(2)
    raw.fill(s, k)
    raw.fill(s2, k2, 1)
    items: list[list[Any]] = {
        "bad_key": [["zz" * 16, s, SIZE, None, 0]],
        "negative_length": [[k, s, -1, None, 0]],
        "oversized_length": [[k, s, 1 << 40, None, 0]],
        "no_header": [[k, s2, SIZE, None, 0]],  # s2 holds k2's chunk
        "header_of_another_key": [[k2, s, SIZE, None, 0]],
        "length_not_the_headers": [[k, s, SIZE + 4096, None, 0]],
        "slot_twice_in_one_batch": [[k, s, SIZE, None, 0], [k2, s, SIZE, None, 0]],
        "malformed_item": [[k, s, SIZE]],
        "bad_parent": [[k, s, SIZE, "../../etc", 0]],
    }[case]
    if case == "no_header":
        off = s2 * raw.slot_bytes
        raw.pool[off : off + SIZE] = b"\0" * SIZE
        items = [[k2, s2, SIZE, None, 0]]
    r = raw.call("commit", items=items)
    assert not r["ok"] and r.get("kind") == "protocol", r
    assert "commit item" in r["error"]
    # Nothing committed; the runs the refused commit named are back in the pool, the
    # other reservation is still the client's.
    got = pool_books(agent)
    assert got["chunks"] == before["chunks"], (case, got, before)
    named = {it[1] for it in items}
    assert got["reserved_runs"] == before["reserved_runs"] + 2 - len(named), (case, got)
    raw.call("abort", slots=[s, s2])
    assert pool_books(agent) == before, case


def test_commit_of_a_run_another_client_reserved_is_refused(agent: str, raw: Raw) -> None:
    before = quiet(agent)
    other = Raw(agent)
    try:
        (k,) = keys(3_000, 1)
        (s,) = other.reserve(1)
        other.fill(s, k)
        r = raw.call("commit", items=[[k, s, SIZE, None, 0]])
        assert not r["ok"] and "not reserved by this client" in r["error"], r
        assert pool_books(agent)["reserved_runs"] == before["reserved_runs"] + 1
        r = other.call("commit", items=[[k, s, SIZE, None, 0]])  # still the owner's
        assert r["ok"], r
        again = other.call("commit", items=[[k, s, SIZE, None, 0]])  # a double commit
        assert not again["ok"] and "not reserved" in again["error"], again
    finally:
        other.close()
    got = pool_books(agent)
    assert got["chunks"] == before["chunks"] + 1 and got["reserved_runs"] == 0


@pytest.mark.parametrize("case", ["bad_key", "header_of_another_key", "truncated", "not_a_chunk"])
def test_refused_put_changes_nothing(agent: str, raw: Raw, case: str) -> None:
    before = quiet(agent)
    k, k2 = keys(4_000 + 100 * len(case), 2)
    data = codec.encode(meta(k, N), payload(7, N))
    key, body = {
        "bad_key": ("zz" * 16, data),
        "header_of_another_key": (k2, data),
        "truncated": (k, data[:-1]),
        "not_a_chunk": (k, b"\1" * SIZE),
    }[case]
    r = raw.call("put", key=key, data=body, wait=True)
    assert not r["ok"] and r.get("kind") == "protocol", r
    assert pool_books(agent) == before, case
    r = raw.call("put", key=k, data=data, wait=True)  # the good one is taken
    assert r["ok"], r
    assert pool_books(agent)["chunks"] == before["chunks"] + 1


def test_reserve_of_impossible_sizes_takes_nothing(agent: str, raw: Raw) -> None:
    before = quiet(agent)
    r = raw.call("reserve", sizes=[-1, 0, 1 << 40])
    assert r["ok"] and r["slots"] == [None, None, None], r
    assert pool_books(agent) == before


def test_client_gone_mid_reservation_returns_runs_and_leases(empty_agent: str) -> None:
    """A client that dies holding reserved runs (some filled), the runs a commit handed
    it for its next put, and leases: all of it comes back when its socket closes."""
    ks = keys(5_000, 4)
    put(empty_agent, ks[:1])
    before = quiet(empty_agent)
    raw = Raw(empty_agent)
    s = raw.reserve(3)
    raw.fill(s[0], ks[1])
    raw.fill(s[1], ks[2], 1)
    r = raw.call("commit", items=[[ks[1], s[0], SIZE, None, 0]], refill=2)
    assert r["ok"] and len(r["slots"]) == 1, r  # a run handed over for the next put
    r = raw.call("get", keys=[ks[0], ks[1]])
    assert r["ok"] and all("slot" in it for it in r["items"]), r
    held = pool_books(empty_agent)
    assert held["reserved_runs"] == 3 and held["leases"] == 2, held
    raw.close()  # gone: no abort, no release
    want = {**before, "chunks": before["chunks"] + 1}
    want["chunk_slots"] += 1
    want["free_slots"] -= 1
    want["used_bytes"] += SIZE
    assert settled(empty_agent, want) == want


def test_client_killed_mid_reservation_returns_runs(empty_agent: str, tmp_path: Path) -> None:
    """The same for a process killed with SIGKILL, its socket closed by the kernel."""
    before = quiet(empty_agent)
    script = tmp_path / "holder.py"
    script.write_text(
        "import sys\n"
        "from tiered_cache.client import AgentClient\n"
        "c = AgentClient(sys.argv[1])\n"
        f"res = c.reserve_payloads([{N}, {N}, {N}])\n"
        "assert res is not None\n"
        "print('reserved', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script), empty_agent],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "reserved"
        assert pool_books(empty_agent)["reserved_runs"] == before["reserved_runs"] + 3
    finally:
        proc.kill()
        proc.wait()
    assert settled(empty_agent, before) == before
