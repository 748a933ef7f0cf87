"""Faults around the agent: Redis killed and restarted under load (no client errors, the
service goes on), S3 answering 500 or stalling behind a fault proxy (puts into DRAM do not
wait for it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import soak
from conftest import S3Server


@pytest.mark.timeout(90)
def test_redis_killed_and_restarted_costs_clients_no_errors(tmp_path: Path) -> None:
    r = soak.phase_redis(tmp_path, ops_per_stage=300, stage_cap_s=20)
    assert r["errors"] == {"before": 0, "down": 0, "after": 0}, r["first_errors"]
    assert r["ops"]["down"] >= 300 and r["ops"]["after"] >= 300  # service went on
    assert r["torn_or_wrong_served"] == 0 and r["agent_alive"]


@pytest.mark.timeout(90)
def test_puts_to_dram_do_not_wait_for_a_failing_or_stalled_s3(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """Write-through to S3 with a 1 s read timeout: a put that waited for S3 would take a
    second or more while every request stalls for 2 s."""
    r = soak.phase_s3(tmp_path, s3_server.endpoint_url, puts=60, stall_s=2.0)
    assert r["faults_injected"] > 0 and r["stall"]["faults_injected"] > 0
    for fault in ("error_500", "stall"):
        assert r[fault]["put_p99_ms"] < 500, (fault, r)
    assert r["torn_or_wrong_served"] == 0 and r["agent_alive"]
