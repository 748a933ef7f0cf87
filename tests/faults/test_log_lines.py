"""Each bad frame costs one log line at most: a client that repeats a bad request, a
broken frame or a request the tiers cannot take must not write a line (or a traceback)
each time, or anyone who reaches the socket fills the disk and buries the lines that
matter. Repeated lines of one kind are held back and counted in the next one."""

from __future__ import annotations

import logging
import socket
import struct
from pathlib import Path

import pytest
import soak

from tiered_cache.ipc import call_sync
from tiered_cache.logthrottle import LogThrottle
from tiered_cache.protocol import Hello, encode

MiB = 2**20
REPEAT = 200


def bad_frames() -> dict[str, bytes]:
    """Each sent ``REPEAT`` times: every one was a line or a traceback before."""
    bad_keys = ["é" * 16, "0" * 31, "../" * 10]
    return {
        # Keys the NVMe tier refuses: a traceback per key, in the background.
        "prefetch_bad_keys": soak.pack({"op": "prefetch", "v": 2, "keys": bad_keys}),
        "lookup_bad_keys": soak.pack({"op": "lookup", "v": 2, "keys": bad_keys}),
        # Past decode, raising in its handler: a traceback each.
        "touch_bad_hits": soak.pack({"op": "touch", "v": 2, "hits": [[1, 2, 3, 4]]}),
        # Refused by decode: a line each.
        "unknown_op": soak.pack({"op": "nope", "v": 2}),
    }


def breakers() -> dict[str, bytes]:
    """Frames that break the stream (each on a connection of its own): the handler task
    ended with an exception that asyncio logged with its traceback."""
    return {
        "truncated": struct.pack("!I", 100) + b"\x81" * 10,
        "not_msgpack": struct.pack("!I", 1) + b"\xc1",
        "not_a_map": struct.pack("!I", 4) + b"\x93\x01\x02\x03",  # [1, 2, 3]
    }


@pytest.mark.timeout(60)
def test_repeated_bad_frames_on_the_local_socket_cost_a_bounded_number_of_lines(
    tmp_path: Path,
) -> None:
    agent = soak.Agent(tmp_path, "loglines", {
        "nvme": {"enabled": True, "path": str(tmp_path / "nvme"), "capacity": 8 * MiB},
    })  # fmt: skip
    with soak.running(agent):
        before = agent.log_lines()
        frames = bad_frames()
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(agent.socket)
            for _ in range(REPEAT):
                for name, data in frames.items():
                    s.sendall(data)  # without ``noreply``: touch is answered too
                    reply = soak.recv_frame(s)
                    assert isinstance(reply, dict) and "ok" in reply, (name, reply)
        closed = 0
        for _ in range(REPEAT):
            for data in breakers().values():
                s2 = socket.socket(socket.AF_UNIX)
                s2.settimeout(30)
                s2.connect(agent.socket)
                with s2:
                    s2.sendall(data)
                    s2.shutdown(socket.SHUT_WR)
                    soak.until_closed(s2, 30)  # the agent dropped it
                    closed += 1
        with socket.socket(socket.AF_UNIX) as s:  # still serving, and past every handler
            s.settimeout(30)
            s.connect(agent.socket)
            assert call_sync(s, encode(Hello()))["node_id"] == agent.cfg["node_id"]
        sent = REPEAT * len(frames) + closed
        lines = agent.log_lines() - before
        text = agent.log_path.read_text(errors="replace")
    # One line (with a traceback for a failure past decode) per kind, not per frame.
    assert lines <= 60, f"{lines} log lines for {sent} bad frames:\n{text[-3000:]}"


def test_lines_held_back_are_counted_in_the_next_line(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    throttle = LogThrottle(logging.getLogger("tc.test"), every_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tc.test"):
        for i in range(100):
            throttle.log("refused", logging.WARNING, "refused a request: %s", f"bad\nframe {i}")
        throttle.log("other", logging.WARNING, "another kind")  # its own key: logged
        now[0] = 61.0
        throttle.log("refused", logging.WARNING, "refused a request: %s", "bad frame 100")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a request: bad | frame 0",  # folded onto one line
        "another kind",
        "refused a request: bad frame 100 (99 more since the last such line)",
    ]
