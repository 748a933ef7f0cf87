"""Page-locking host memory for CUDA DMA: the one core module that imports torch.

The DRAM pool is registered with ``cudaHostRegister`` when CUDA is present, so copies
between it and a GPU's KV cache run at DMA speed; elsewhere this is a no-op. torch is
imported only here (an import-linter contract checks it), and only when called.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def maybe_pin_host_memory(buf: memoryview) -> bool:
    """Page-lock the pool for fast H2D/D2H DMA when CUDA is present; no-op otherwise."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import ctypes

        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        rc = torch.cuda.cudart().cudaHostRegister(addr, buf.nbytes, 0)
        return int(rc) == 0
    except Exception as e:  # pinning is an optimisation, never a failure
        log.debug("cudaHostRegister unavailable: %s", e)
        return False
