"""Page-locking host memory for CUDA DMA: the one core module that imports torch.

Only a process that copies between a GPU and the DRAM pool registers it: the vLLM worker,
once its KV caches are on CUDA (``connectors.kv_device.CudaDevice.pin_host``). The agent
and the scheduler never do: registering creates a CUDA context (hundreds of MiB of GPU
memory) in each process that does it.

A registration must be undone before its mapping goes away (a pool remapped after an
agent restart, a client closed); otherwise the driver keeps pinning pages of an unmapped
range, and a later mapping at the same address fails to register. Registrations are kept
here by address so ``unregister_host`` is safe to call for any buffer, registered or not.
torch is imported only here (an import-linter contract checks it), and only when called.
"""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable
_lock = threading.Lock()
_registered: dict[int, int] = {}  # address -> bytes


def _address(buf: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def register_host(buf: memoryview) -> bool:
    """Page-lock ``buf`` for fast H2D/D2H DMA. False (and one log line) if CUDA is absent
    or the driver refuses: copies then go through pageable memory, slower but correct."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        addr = _address(buf)
        with _lock:
            if addr in _registered:
                return True
            # Portable: pinned for every CUDA context, whichever thread or device pins.
            rc = int(torch.cuda.cudart().cudaHostRegister(addr, buf.nbytes, _PORTABLE))
            if rc != 0:
                log.warning(
                    "cudaHostRegister of the DRAM pool (%d MiB) failed (error %d): loads and "
                    "saves use pageable copies", buf.nbytes >> 20, rc,
                )
                return False
            _registered[addr] = buf.nbytes
            return True
    except Exception as e:  # pinning is an optimisation, never a failure
        log.warning("cudaHostRegister unavailable (%r): pageable copies", e)
        return False


def unregister_host(buf: memoryview) -> None:
    """Undo ``register_host`` for ``buf`` (a no-op if it was not registered)."""
    try:
        addr = _address(buf)
    except (TypeError, ValueError):  # released or read-only: never registered by us
        return
    with _lock:
        if _registered.pop(addr, None) is None:
            return
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(addr)
    except Exception as e:
        log.debug("cudaHostUnregister: %r", e)


def registered_bytes() -> int:
    """Bytes currently registered by this process (tests, stats)."""
    with _lock:
        return sum(_registered.values())
