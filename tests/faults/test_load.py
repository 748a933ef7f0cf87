"""Load held (a short run of the soak's load phase): client threads and a peer puller
against one agent with eviction all the while; nothing wrong served, no client error, and
with every client gone no slot of the pool is leased or reserved."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import soak

from tiered_cache.ipc import call_sync
from tiered_cache.protocol import Reserve, encode


@pytest.mark.timeout(60)
def test_a_short_load_serves_nothing_wrong_and_leaks_no_slot(tmp_path: Path) -> None:
    r = soak.phase_load(tmp_path, seconds=15, threads=2, warmup=5)
    assert r["ops"] > 500 and r["peer_hits"] > 0
    assert r["errors"] == 0, r["first_errors"]
    assert r["torn_or_wrong_served"] == 0
    assert r["leaked_slots"] == 0 and r["leaked_slots_probe"] == 0
    assert r["rss_growth"] is not None and r["agent_alive"]


@pytest.mark.timeout(60)
def test_the_leak_probe_counts_a_reservation_still_held(tmp_path: Path) -> None:
    """A client that holds two reserved slots (its connection open): the probe finds
    exactly those two missing; once it disconnects, none (the probe waits for the agent
    to read the close)."""
    agent = soak.Agent(tmp_path, "leak")
    with soak.running(agent), socket.socket(socket.AF_UNIX) as s:
        s.connect(agent.socket)
        got = call_sync(s, encode(Reserve([soak.SLOT, soak.SLOT])))["slots"]
        assert None not in got
        assert soak.leaked_slots(agent.socket, settle_s=0) == 2
        s.close()
        assert soak.leaked_slots(agent.socket) == 0
