"""tests/gpu run on CUDA where torch sees a GPU, on CPU tensors elsewhere; they import
neither vLLM nor the services the rest of the suite starts, so the GPU machine (torch,
no vLLM) runs them as ``pytest --confcutdir=tests/gpu tests/gpu``."""

from __future__ import annotations

import asyncio
import gc
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from connectors.kv_device import device_for


@pytest.fixture(scope="session")
def device() -> torch.device:
    want = os.environ.get("TC_TEST_DEVICE")
    if want:
        return torch.device(want)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def dram(device: torch.device) -> Iterator[Any]:
    """A real shared-memory DRAM tier, page-locked on CUDA as a GPU worker pins it."""
    from tiered_cache.tiers.dram import DRAMTier

    tier = DRAMTier(256 << 20, 64 << 10, shm_name=f"tc-gpu-{uuid.uuid4().hex[:8]}")
    dev = device_for(torch.empty(0, device=device))
    pinned = dev.pin_host(tier._buf)
    assert pinned == (device.type == "cuda")
    yield tier
    gc.collect()  # payload tensors over the pool, before it closes
    dev.unpin_host(tier._buf)
    asyncio.run(tier.close())


@pytest.fixture(scope="module")
def nvme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tiered_cache.tiers.nvme import NVMeTier

    tier = NVMeTier(tmp_path_factory.mktemp("nvme"), 1 << 30, fsync=False)
    yield tier
    asyncio.run(tier.close())
