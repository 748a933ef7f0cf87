"""Fetch-or-recompute, wait budgets, the engine's recompute rate and the breaker."""

from __future__ import annotations

import logging

import pytest

from connectors.vllm_plan import (
    MIN_WAIT_S,
    RecomputeRate,
    choose_prefix,
    wait_budget_s,
)
from tiered_cache.breaker import Breaker

SPT = 1e-3  # an engine that computes 1,000 prompt tokens a second


def test_until_measured_every_found_chunk_is_loaded() -> None:
    c = choose_prefix([256, 256], [10.0, 10.0], 0, None)
    assert (c.chunks, c.decision) == (2, "load")


def test_cheap_chunks_load_and_expensive_ones_recompute() -> None:
    # Two DRAM chunks (2 ms each) then two S3 chunks slower than recomputing them.
    c = choose_prefix([256] * 4, [0.002, 0.002, 0.4, 0.4], 0, SPT)
    assert (c.chunks, c.decision) == (2, "prefix")
    assert c.gain_s == pytest.approx(2 * (0.256 - 0.002))
    # A slow chunk in the middle is still worth loading when what follows pays for it.
    c = choose_prefix([256] * 3, [0.002, 0.3, 0.002], 0, SPT)
    assert (c.chunks, c.decision) == (3, "load")
    c = choose_prefix([256] * 2, [1.0, 1.0], 0, SPT)
    assert (c.chunks, c.decision) == (0, "recompute")


def test_chunks_below_vllms_own_hit_are_not_chosen() -> None:
    c = choose_prefix([0, 256, 256], [0.0, 0.002, 0.002], 1, SPT)
    assert (c.chunks, c.decision) == (3, "load")
    assert choose_prefix([0, 0], [0.0, 0.0], 2, SPT).decision == "recompute"


def test_wait_budget_is_bounded_by_recompute_and_the_cap() -> None:
    assert wait_budget_s(5.0, None) == 5.0  # nothing measured: the cap
    assert wait_budget_s(5.0, None, expected_s=0.5) == 2.0  # ... or 4x a known transfer
    assert wait_budget_s(5.0, None, expected_s=0.01) == 1.0
    assert wait_budget_s(5.0, 0.3) == 0.3
    assert wait_budget_s(5.0, 0.3, expected_s=0.2) == 0.4  # twice the transfer
    assert wait_budget_s(5.0, 0.0) == MIN_WAIT_S
    assert wait_budget_s(1.0, 30.0) == 1.0


def test_recompute_rate_learns_the_slope_of_the_engines_steps() -> None:
    r = RecomputeRate()
    assert r.seconds_per_token() is None and r.cost_s(100) is None
    for tokens in (8, 600, 4, 1200, 16, 300, 900):  # decode steps and prefill steps
        r.observe(tokens, 0.02 + tokens * 2e-3)
    assert r.seconds_per_token() == pytest.approx(2e-3, rel=0.1)
    assert r.cost_s(500) == pytest.approx(1.0, rel=0.1)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_breaker_backs_off_and_logs_each_outage_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    b = Breaker("thing", logging.getLogger("t.breaker"), base_s=0.25, cap_s=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t.breaker"):
        assert b.allow()
        b.failed(ConnectionRefusedError("refused"))
        delays = []
        for _ in range(5):
            start = clock.t
            while not b.allow():
                clock.t += 0.125
            delays.append(round(clock.t - start, 2))
            b.failed("still down")
        assert delays == [0.25, 0.5, 1.0, 1.0, 1.0]  # doubling, capped
        assert b.skipped > 0 and b.attempts == 6
        clock.t += 1.0
        assert b.allow()
        b.ok()
        assert not b.down and b.allow()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "unavailable (ConnectionRefusedError: refused)" in lines[0]
    assert "is back" in lines[1]
