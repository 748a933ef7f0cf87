"""Faults around the agent: Redis killed and restarted under load (no client errors, the
service goes on), S3 slow, answering 500 or stalling behind a fault proxy (puts into DRAM do
not wait for it; a slow S3 fills the bounded write-through queue, not memory)."""

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
    r = soak.phase_s3(
        tmp_path, s3_server.endpoint_url, puts=80, stall_s=2.0, background_mib=1, slow_s=4
    )
    assert r["stall"]["faults_injected"] > 0 and r["error_500"]["faults_injected"] > 0
    for fault in ("slow", "error_500", "stall"):
        assert r[fault]["put_p99_ms"] < 500, (fault, r)
    # Slow, every request answered: the write-through queue filled to its bound (copies
    # over it skipped and counted) instead of growing with the writes.
    slow = r["slow"]
    assert slow["faults_injected"] > 0 and slow["s3_requests"] >= 4, slow
    assert slow["puts"] >= 8 * slow["s3_requests"], slow  # ingest ~10x S3's pace
    assert slow["background_dropped"] > 0, slow
    assert slow["background_bytes_peak_mib"] <= 1 + 0.1, slow  # 1 MiB, plus one chunk
    assert r["torn_or_wrong_served"] == 0 and r["agent_alive"]
