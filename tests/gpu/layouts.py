"""The KV cache tensors each CUDA attention backend of vLLM 0.32 hands a KV connector,
rebuilt without vLLM (the GPU machine has torch but no vLLM).

What vLLM does (``vllm/v1/worker/utils.py::allocate_kv_cache`` and
``vllm/v1/kv_cache_interface.py::create_kv_cache_views``): one int8 backing buffer; each
layer a strided ``[B, H, N, C]`` view whose physical axis order is the resolved
``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``); where the backend's kernels take
smaller blocks than ``--block-size``, B counts kernel blocks (``B * ratio`` of ``N /
ratio`` tokens), which vLLM allows only when a block is one dense page (layer-outermost
layouts). ``tests/gpu/test_layouts_vllm.py`` checks this rebuild against vLLM's own
functions where vLLM is installed.

The per-backend facts below were read from vLLM 0.32's source; the file is cited with each.
Kernel block sizes are what ``get_supported_kernel_block_sizes`` returns; the layouts what
``supported_kv_cache_layouts`` returns (None: any, LBNHC preferred,
``v1/attention/backends/utils.py::_DEFAULT_LAYOUT_PREFERENCE``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Logical [L, B, H, N, C] -> physical order (vllm/v1/kv_cache_layout.py::KVCacheLayout).
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


@dataclass(frozen=True)
class Backend:
    name: str  # get_name()
    source: str  # file under vllm/v1/attention/backends/
    kernel_sizes: tuple[int, ...]  # fixed sizes it takes (empty: any multiple of `multiple_of`)
    multiple_of: int  # MultipleOf(n) it takes (0: none)
    layouts: tuple[str, ...]  # layouts it takes
    mla: bool = False  # one latent "head" of C = kv_lora_rank + rope dim

    def kernel_block_size(self, block_size: int) -> int:
        """What vLLM picks for --block-size (``v1/worker/utils.py::select_common_block_size``):
        the block size itself if taken, else the largest fixed size dividing it."""
        if self.multiple_of and block_size % self.multiple_of == 0:
            return block_size
        if block_size in self.kernel_sizes:
            return block_size
        fits = [s for s in self.kernel_sizes if block_size % s == 0]
        if not fits:
            raise ValueError(f"{self.name} takes no kernel block dividing {block_size}")
        return max(fits)


_ANY = tuple(LAYOUTS)
BACKENDS: tuple[Backend, ...] = (
    # get_supported_kernel_block_sizes: [MultipleOf(16)] (Hopper/Ampere, no FA4 special case)
    Backend("FLASH_ATTN", "flash_attn.py", (), 16, _ANY),
    # [16, 32, 64] (large pages only on Blackwell trtllm-gen); HND (LBHNC/BLHNC) on SM100,
    # any layout elsewhere: both NHD and HND are tested.
    Backend("FLASHINFER", "flashinfer.py", (16, 32, 64), 0, _ANY),
    Backend("TRITON_ATTN", "triton_attn.py", (), 16, _ANY),
    # supported_kv_cache_layouts: (LBNHC,)
    Backend("FLEX_ATTENTION", "flex_attention.py", (), 16, ("LBNHC",)),
    Backend("FLASHMLA", "mla/flashmla.py", (64,), 0, _ANY, mla=True),
    Backend("CUTLASS_MLA", "mla/cutlass_mla.py", (128,), 0, _ANY, mla=True),
    Backend("FLASH_ATTN_MLA", "mla/flashattn_mla.py", (), 16, _ANY, mla=True),
    Backend("TRITON_MLA", "mla/triton_mla.py", (), 16, _ANY, mla=True),
    Backend("FLASHINFER_MLA", "mla/flashinfer_mla.py", (32, 64), 0, _ANY, mla=True),
)
BY_NAME = {b.name: b for b in BACKENDS}

# KV cache dtypes: the model's (auto), and fp8 caches, which vLLM keeps as uint8 tensors
# (vllm/utils/torch_utils.py::STR_DTYPE_TO_TORCH_DTYPE: "fp8", "fp8_e4m3", "fp8_e5m2").
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.uint8,
    "fp8_e5m2": torch.uint8,
}


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_blocks: int  # scheduler (manager) blocks
    block_size: int  # tokens per scheduler block
    num_heads: int  # KV heads on this rank (1 for MLA)
    content: int  # C: elements per token per head (2 * head_size; MLA: 576)
    dtype: torch.dtype

    def page_bytes(self) -> int:
        return self.num_heads * self.block_size * self.content * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def splittable(spec: KVShape, layout: str) -> bool:
    """Whether vLLM may split blocks into kernel blocks in ``layout``: only where a block
    is one dense page (``create_kv_cache_views``): L and B outermost, or a layout that
    reduces to it (one head)."""
    shape = (spec.num_layers, spec.num_blocks, spec.num_heads, spec.block_size, spec.content)
    return natural_strides(shape, LAYOUTS[layout])[1] == spec.num_heads * spec.block_size * spec.content


def natural_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides of logical ``shape`` stored in physical ``order`` (innermost last)."""
    strides = [0] * len(shape)
    cur = 1
    for dim in reversed(order):
        strides[dim] = cur
        cur *= shape[dim]
    return tuple(strides)


def build_kv_caches(
    spec: KVShape, layout: str, kernel_block_size: int | None = None,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(backing buffer, one ``[B*ratio, H, N/ratio, C]`` view per layer) as vLLM builds them."""
    order = LAYOUTS[layout]
    kbs = kernel_block_size or spec.block_size
    if spec.block_size % kbs:
        raise ValueError(f"kernel block {kbs} does not divide block {spec.block_size}")
    ratio = spec.block_size // kbs
    if ratio > 1 and not splittable(spec, layout):
        # create_kv_cache_views refuses: a block is not one dense page in this layout.
        raise ValueError(f"{layout} cannot split blocks into kernel blocks")
    shape = (spec.num_layers, spec.num_blocks * ratio, spec.num_heads, kbs, spec.content)
    strides = natural_strides(shape, order)
    total = spec.num_layers * spec.num_blocks * spec.page_bytes()
    raw = torch.zeros(total, dtype=torch.int8, device=device)
    view5 = torch.as_strided(raw.view(spec.dtype), shape, strides)
    return raw, [view5[li] for li in range(spec.num_layers)]


# Bytes per element is what a copy sees of a dtype: one 2-byte and one 1-byte (fp8) case
# covers the grid; the property test draws every dtype.
GRID_DTYPES = ("bfloat16", "fp8_e4m3")


def cases(block_sizes: tuple[int, ...] = (16, 64, 256),
          dtypes: tuple[str, ...] = tuple(DTYPES)) -> list[tuple[str, str, str, int]]:
    """(backend, layout, dtype name, block size) for every combination vLLM could build,
    each backend at block sizes where it keeps blocks whole and where it splits them."""
    out = []
    for b in BACKENDS:
        for layout in b.layouts:
            for bs in block_sizes:
                try:
                    kbs = b.kernel_block_size(bs)
                except ValueError:
                    continue
                if kbs != bs and not splittable(spec_for(b, "bfloat16", bs), layout):
                    continue  # vLLM refuses to split blocks that are not dense pages
                for dt in dtypes:
                    out.append((b.name, layout, dt, bs))
    return out


def spec_for(backend: Backend, dtype: str, block_size: int, *, num_blocks: int = 24,
             num_layers: int = 3, heads: int = 2, head_size: int = 16) -> KVShape:
    """A small cache of the backend's shape class (MLA: one head of 576 elements)."""
    if backend.mla:
        return KVShape(num_layers, num_blocks, block_size, 1, 576, DTYPES[dtype])
    return KVShape(num_layers, num_blocks, block_size, heads, 2 * head_size, DTYPES[dtype])
