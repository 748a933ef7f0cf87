"""TP ranks are separate processes: when several find no node agent at once, exactly one
embedded agent starts and every rank uses it (a second would unlink the first's socket and
DRAM pool, and ranks would write to one agent and read from another)."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from helpers_agent import FP, meta, payload, write_cfg


def _rank(cfg_path: str, rank: int, barrier: Any, out: Any) -> None:
    import os

    from tiered_cache.client import connect, shutdown_embedded
    from tiered_cache.config import load_config

    cfg = load_config(cfg_path)
    try:
        barrier.wait(30)  # every rank looks for the agent at the same moment
        client = connect(cfg, embedded="auto", timeout=30)
        key = f"{rank:032x}"
        client.put_many([(meta(key), payload(rank))])
        barrier.wait(30)  # every rank has written its chunk
        got = client.get_many([f"{r:032x}" for r in range(3)], FP.digest)
        found = [g is not None for g in got]
        out.put((rank, os.getpid(), found))
        barrier.wait(30)  # the agent's process stays up until every rank has read
        client.close()
    except Exception as e:
        out.put((rank, os.getpid(), repr(e)))
        barrier.abort()
    finally:
        shutdown_embedded()


def test_ranks_that_find_no_agent_share_one_embedded_agent(tmp_path: Path) -> None:
    cfg = write_cfg(tmp_path, nvme={"enabled": False})
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(str(cfg), r, barrier, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, _, found in results:
        assert found == [True, True, True], f"rank {rank}: {found}"
    assert len(list(tmp_path.glob("*.start-lock"))) == 1


def test_the_start_lock_leaves_a_new_runtime_dir_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default socket lives in the per-user runtime dir, which the agent refuses if it
    is open to others: the start lock must not be what creates it 0755."""
    from tiered_cache.client import connect, shutdown_embedded
    from tiered_cache.config import load_config

    run = tmp_path / "run-not-yet"
    monkeypatch.setenv("TIERED_CACHE_RUNTIME_DIR", str(run))
    old = os.umask(0o022)
    try:
        cfg = load_config(write_cfg(tmp_path, nvme={"enabled": False}, agent={}))
        client = connect(cfg, embedded="auto", timeout=30)
        try:
            assert client.node_id
            assert stat.S_IMODE(run.stat().st_mode) == 0o700
        finally:
            client.close()
    finally:
        os.umask(old)
        shutdown_embedded()
