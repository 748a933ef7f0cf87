"""Bad input: malformed frames to the local socket and to the peer port (the agent in a
network namespace of its own, attacked from another address), then idle connections. The
agent must neither die nor stop answering well-formed requests (a probe after every
batch); the peer port must serve nothing before the handshake."""

from __future__ import annotations

import dataclasses
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import soak
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_cache.netns import NetNodes
from tiered_cache.protocol import REQUESTS


def on_node(tmp: Path, node: NetNodes, **kw: Any) -> dict[str, Any]:
    return soak.phase_fuzz(tmp, prefix=node.prefix("agent"), peer_host=node.addr("agent"), **kw)


@pytest.mark.timeout(60)
def test_the_local_socket_survives_malformed_frames(tmp_path: Path, node: NetNodes) -> None:
    r = on_node(tmp_path, node, local_frames=4000, peer_frames=0, seed=11, probe_every=1000,
                idle=0)  # fmt: skip
    assert r["fuzz_frames"] == 4000
    assert r["fuzz_crashes"] == 0, r["crashes"]
    assert r["by_port"]["local"]["hung"] == 0
    assert r["agent_starts"] == 1
    # At most one log line a bad frame (refusals, broken frames and failures in handlers
    # each wrote a line or a traceback).
    assert r["by_port"]["local"]["log_lines_per_frame"] <= 1, r["by_port"]["local"]


@pytest.mark.timeout(60)
def test_the_peer_port_survives_malformed_frames_and_serves_nothing_unauthenticated(
    tmp_path: Path, node: NetNodes
) -> None:
    r = on_node(tmp_path, node, local_frames=0, peer_frames=3000, seed=12, probe_every=1000,
                idle=0)  # fmt: skip
    assert r["fuzz_frames"] == 3000
    assert r["fuzz_crashes"] == 0, r["crashes"]
    peer = r["by_port"]["peer"]
    assert peer["hung"] == 0 and peer["bytes_before_handshake"] == 0
    # At most one log line a bad frame (a fetch of a malformed key logged a traceback).
    assert peer["log_lines_per_frame"] <= 1, peer["log_lines"]


@pytest.mark.timeout(60)
def test_a_thousand_idle_connections_do_not_stop_service(tmp_path: Path, node: NetNodes) -> None:
    """1,000 idle connections to the socket and 1,000 to the peer port: a good client
    still puts and gets, and a puller with the secret still fetches byte-exact."""
    r = on_node(tmp_path, node, local_frames=0, peer_frames=0, idle=1000)
    assert r["idle"]["connections"] == 2000
    assert r["idle"]["service_ok"], r["idle"]["why"]


@pytest.mark.timeout(60)
def test_the_probe_notices_an_agent_that_stopped_answering(tmp_path: Path) -> None:
    """What counts a crash: a stopped (SIGSTOP) agent fails the probe, a running one passes."""
    agent = soak.Agent(tmp_path, "probe")
    with soak.running(agent):
        assert soak.probe(agent, "0" * 32, None, None) is None
        assert agent.proc is not None
        agent.proc.send_signal(19)  # SIGSTOP: alive, answering nothing
        try:
            assert soak.probe(agent, "0" * 32, None, None) is not None
        finally:
            agent.proc.send_signal(18)  # SIGCONT


# -- hypothesis: frames built from the protocol's own operations and any msgpack values

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=40) | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)  # fmt: skip
_fields = sorted({f.name for c in REQUESTS.values() for f in dataclasses.fields(c)} | {"v", "x"})
_requests = st.builds(
    lambda op, fields: {"op": op, **fields},
    st.sampled_from([*REQUESTS, "fetch", ""]) | _values,
    st.dictionaries(st.sampled_from(_fields), _values, max_size=5),
)


@pytest.fixture(scope="module")
def fuzz_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[soak.Agent]:
    agent = soak.Agent(tmp_path_factory.mktemp("hyp"), "hyp")
    with soak.running(agent):
        yield agent


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=_requests)
def test_any_request_map_is_answered_and_the_agent_serves_on(
    fuzz_agent: soak.Agent, msg: dict[str, Any]
) -> None:
    """Whatever map arrives, one reply (a refusal or a result) and the connection stays
    usable: a hello on it right after is answered."""
    msg.pop("noreply", None)
    body = msgpack.packb(msg, use_bin_type=True)
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(fuzz_agent.socket)
        s.sendall(struct.pack("!I", len(body)) + body + soak.pack({"op": "hello", "v": 2}))
        first = soak.recv_frame(s)
        assert isinstance(first, dict) and isinstance(first.get("ok"), bool)
        hello = soak.recv_frame(s)
        assert hello["ok"] and hello["node_id"] == fuzz_agent.cfg["node_id"]
