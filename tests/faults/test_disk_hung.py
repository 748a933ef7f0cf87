"""Disk full and a peer hung mid-reply (the soak's ``disk_full`` and ``hung_peer``
phases with small counts): DRAM keeps serving while NVMe's filesystem is full, and a
fetch from a peer that sends half a reply fails within ``agent.peer_fetch_timeout_s``,
after which its breaker is open and the agent's own chunks are served."""

from __future__ import annotations

from pathlib import Path

import pytest
import soak


@pytest.mark.timeout(90)
def test_a_full_disk_costs_nvme_copies_not_service_and_nothing_torn(tmp_path: Path) -> None:
    r = soak.phase_disk_full(tmp_path, chunks=40)
    if "skipped" in r:
        pytest.skip(r["skipped"])
    before, full, after = r["before"], r["full"], r["after"]
    assert before["nvme_writes_failed"] == 0 and before["served_from_dram"] == 20
    # Every write to the full disk failed and was counted; every put still served.
    assert full["nvme_writes_failed"] == 40 and full["served_from_dram"] == 40, full
    assert full["nvme_write_errors_counted"] >= 40 and before["nvme_write_errors_counted"] == 0
    assert after["nvme_writes_failed"] == 0, after  # space back: NVMe takes writes again
    nvme = r["served_from_nvme_after_clear"]
    assert nvme == {"before": 20, "full": 0, "after": 20}, nvme
    assert r["tmp_leftovers"] == 0 and r["torn_or_wrong_served"] == 0 and r["agent_alive"]


@pytest.mark.timeout(90)
def test_a_peer_hung_mid_reply_costs_one_timeout_then_its_breaker_is_open(
    tmp_path: Path,
) -> None:
    r = soak.phase_hung_peer(tmp_path, reads=5, timeout_s=1.5)
    assert r["lookup_before"] == ["peer"]
    assert r["failed_within_timeout"] and r["first_read_s"] >= 1.5 * 0.9, r
    assert r["breaker_opened"] and r["peer_fetches_skipped"] >= 4, r
    assert r["own_served"] == 5 and r["torn_or_wrong_served"] == 0 and r["agent_alive"]
