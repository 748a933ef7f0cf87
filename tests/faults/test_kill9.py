"""kill -9 of the agent during writes: nothing torn or wrong is served after the restart
(payload bytes compared with what was written, not only the agent's ok), and every chunk
acknowledged with ``wait`` comes back from NVMe. The last two tests damage a trial on
purpose, to show each check catches what it is there for."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import soak

MiB = 2**20


def kill9_agent(tmp: Path) -> soak.Agent:
    return soak.Agent(tmp, "kill9", {
        "nvme": {"enabled": True, "path": str(tmp / "nvme"), "capacity": 64 * MiB,
                 "write_mode": "write_through"},
    })  # fmt: skip


@pytest.mark.timeout(60)
def test_kill9_during_writes_serves_nothing_torn_and_loses_no_acked_chunk(
    tmp_path: Path,
) -> None:
    r = soak.phase_kill9(tmp_path, trials=3, seed=7)
    assert r["trials"] == 3 and r["acked"] >= 12
    assert r["torn_or_wrong_served"] == 0, r["bad_keys"]
    assert r["lost_acked"] == 0, r["bad_keys"]
    assert r["served_after_restart"] >= r["acked"]


@pytest.mark.timeout(60)
def test_the_trial_counts_a_served_chunk_whose_bytes_are_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers that put another payload under half their keys (valid chunks: every
    checksum matches, so agent and client serve them): the trial counts each such chunk."""

    def wrong_half(key: str) -> tuple[soak.codec.ChunkMeta, bytes]:
        meta, good = soak.chunk_meta(key, soak.PAYLOAD), soak.payload_of(key)
        return meta, good if int(key[0], 16) % 2 else soak.payload_of(key[::-1])

    monkeypatch.setattr(soak, "item", wrong_half)
    agent = kill9_agent(tmp_path)
    with soak.running(agent):
        r = soak.kill9_trial(agent, 0, random.Random(3))
    assert r["lost_acked"] == 0
    assert r["torn_or_wrong"] > 0
    assert all(int(k[0], 16) % 2 == 0 for k in r["wrong_keys"])


@pytest.mark.timeout(60)
def test_the_trial_counts_an_acked_chunk_missing_from_nvme(tmp_path: Path) -> None:
    """An acknowledged chunk's file removed while the agent is down (and DRAM then
    cleared): the trial counts it lost."""
    agent = kill9_agent(tmp_path)
    gone: list[str] = []

    def remove_one(acked: list[str]) -> None:
        k = acked[0]
        (tmp_path / "nvme" / k[:2] / f"{k}.kvc").unlink()
        gone.append(k)

    with soak.running(agent):
        r = soak.kill9_trial(agent, 0, random.Random(5), after_kill=remove_one)
    assert r["lost_keys"] == gone
