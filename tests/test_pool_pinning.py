"""Page-locking the DRAM pool (issue 24, item 4): only the process that asks for it (a GPU
worker, through ``client.pin_pool``) pins its mapping; a remap after an agent restart is
pinned again, and every pinned mapping is unpinned before the client closes it. Driven on a
CPU with recording pin functions in place of ``cudaHostRegister``."""

from __future__ import annotations

import signal
from pathlib import Path

import yaml
from helpers_agent import meta, payload, start_agent, write_cfg

from tiered_cache.client import AgentClient


def test_the_pool_is_pinned_by_the_worker_only_again_after_a_remap_and_unpinned_on_close(
    tmp_path: Path,
) -> None:
    cfg = write_cfg(tmp_path)
    proc = start_agent(cfg)
    sock = yaml.safe_load(cfg.read_text())["agent"]["socket"]
    pinned: list[int] = []  # addresses of the mappings pinned, in order
    unpinned: list[int] = []

    def addr(mv: memoryview) -> int:
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(mv))

    c = AgentClient(sock)
    try:
        assert pinned == []  # attaching pins nothing: scheduler-side clients never pin
        assert c.pin_pool(lambda mv: pinned.append(addr(mv)) is None, lambda mv: unpinned.append(addr(mv)))
        assert len(pinned) == 1
        c.put_many([(meta("a" * 32), payload(0))])
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        proc = start_agent(cfg)
        c.put_many([(meta("b" * 32), payload(1))])  # reconnects: a new mapping of the pool
        assert len(pinned) == 2
        assert unpinned == []  # the old mapping stays mapped (views may still use it)
    finally:
        c.close()
        proc.kill()
        proc.wait()
    assert sorted(unpinned) == sorted(pinned)  # every mapping pinned is unpinned at close
