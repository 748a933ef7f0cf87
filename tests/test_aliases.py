"""Aliases: keys of a whole chunk's block-aligned prefixes, answered by ``present`` with
the chunk itself (``tiered_cache.hierarchy.aliases``), through a real agent."""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers_agent import FP, meta, payload, socket_of

from tiered_cache.client import AgentClient
from tiered_cache.hierarchy.aliases import AliasMap
from tiered_cache.keys import chunk_keys, partial_keys

TOKENS = list(range(5000, 5064))  # two whole 32-token chunks


def test_alias_map_is_bounded_least_recently_used_first() -> None:
    m = AliasMap(cap=3)
    m.add(["t1"], [["a", "b"]])
    m.add(["t2"], [["c", "d"]])
    assert len(m) == 3 and m.target("a") is None
    assert (m.target("b"), m.target("d")) == ("t1", "t2")
    m.add(["t3"], [["t3"]])  # a chunk is not its own alias
    assert m.target("t3") is None
    # A used alias outlives newer ones: a hot shared prefix keeps its aliases.
    m.used("b")
    m.add(["t4"], [["e"]])
    assert m.target("b") == "t1" and m.target("c") is None
    m.drop("b")
    assert m.target("b") is None and len(m) == 2


def test_present_answers_an_alias_with_its_chunk(agent: tuple[Path, subprocess.Popen[str]]) -> None:
    client = AgentClient(socket_of(agent[0]))
    try:
        assert client.takes_aliases  # this uid may register them (test_admin_auth: others not)
        k0, k1 = chunk_keys(TOKENS, FP)
        client.put_many([(meta(k0), payload(0)), (meta(k1), payload(1))], wait=True)
        # The keys a prompt sharing 16 of chunk 1's tokens asks for, and one it does not.
        a16, a24 = partial_keys(TOKENS, FP, None, k0, 32, [16, 24])
        assert client.present([a16, a24]) == [None, None]
        # Fire-and-forget, but frames on one connection are handled in order.
        client.alias([k1], [[a16]])
        found = client.present([a16, a24, k1])
        assert client.admin("stats")["aliases"] == 1
        assert found[0] is not None and found[0][0] == "dram" and found[0][2] == k1
        assert found[1] is None
        assert found[2] is not None and found[2][2] == k1  # a key is its own key to load
        # Once no tier holds the chunk, its alias is a miss, and forgotten: a new save
        # of the chunk names its aliases again.
        client.admin("evict", key=k1)
        assert client.present([a16]) == [None]
        assert client.admin("stats")["aliases"] == 0
        client.put_many([(meta(k1), payload(1))], wait=True)
        assert client.present([a16]) == [None]
        client.alias([k1], [[a16]])
        found = client.present([a16])
        assert found[0] is not None and found[0][2] == k1
    finally:
        client.close()
