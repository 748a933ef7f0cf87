"""The recorded layouts (tests/gpu/layouts.py) against vLLM itself, where it is installed
(CI; not the GPU machine): the backends' declared kernel block sizes and layouts, and the
views vLLM's own ``create_kv_cache_views`` builds, element for element."""

from __future__ import annotations

import importlib

import pytest
import torch

from gpu.layouts import BACKENDS, LAYOUTS, KVShape, build_kv_caches, natural_strides, splittable

pytest.importorskip("vllm")

CLASSES = {
    "FLASH_ATTN": ("flash_attn", "FlashAttentionBackend"),
    "FLASHINFER": ("flashinfer", "FlashInferBackend"),
    "TRITON_ATTN": ("triton_attn", "TritonAttentionBackend"),
    "FLEX_ATTENTION": ("flex_attention", "FlexAttentionBackend"),
    "FLASHMLA": ("mla.flashmla", "FlashMLABackend"),
    "CUTLASS_MLA": ("mla.cutlass_mla", "CutlassMLABackend"),
    "FLASH_ATTN_MLA": ("mla.flashattn_mla", "FlashAttnMLABackend"),
    "TRITON_MLA": ("mla.triton_mla", "TritonMLABackend"),
    "FLASHINFER_MLA": ("mla.flashinfer_mla", "FlashInferMLABackend"),
}
# Backends whose module needs CUDA or flashinfer to import on this CPU build: their facts
# are recorded from the source file named in layouts.py, and cannot be compared here.
UNIMPORTABLE_HERE = {"FLASHINFER", "CUTLASS_MLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA"}


def test_every_recorded_backend_is_named() -> None:
    assert set(CLASSES) == {b.name for b in BACKENDS}


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.name not in UNIMPORTABLE_HERE],
                         ids=lambda b: b.name)
def test_recorded_facts_match_vllms_classes(backend: object) -> None:
    from vllm.v1.attention.backend import MultipleOf

    b = backend
    mod, cls_name = CLASSES[b.name]  # type: ignore[attr-defined]
    cls = getattr(importlib.import_module(f"vllm.v1.attention.backends.{mod}"), cls_name)
    assert cls.get_name() == b.name  # type: ignore[attr-defined]
    sizes = cls.get_supported_kernel_block_sizes()
    fixed = tuple(s for s in sizes if isinstance(s, int))
    mult = [s.base for s in sizes if isinstance(s, MultipleOf)]
    assert fixed == b.kernel_sizes  # type: ignore[attr-defined]
    assert (mult[0] if mult else 0) == b.multiple_of  # type: ignore[attr-defined]
    layouts = cls.supported_kv_cache_layouts()
    want = tuple(LAYOUTS) if layouts is None else tuple(x.name for x in layouts)
    assert set(want) == set(b.layouts)  # type: ignore[attr-defined]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("mla", [False, True])
def test_views_match_vllms_create_kv_cache_views(layout: str, split: int, mla: bool) -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    bs, nb, nl = 64, 6, 3
    if mla:
        spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        shape = KVShape(nl, nb, bs, 1, 576, torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
        shape = KVShape(nl, nb, bs, 2, 16, torch.bfloat16)
    kbs = bs // split
    # vLLM's placement of the layers: their L and B strides in bytes
    isz = 2
    st = natural_strides((nl, nb, shape.num_heads, bs, shape.content), LAYOUTS[layout])
    tensor = KVCacheTensor(size=nl * nb * shape.page_bytes(), layers=[f"l{i}" for i in range(nl)],
                           layer_stride=st[0] * isz, block_stride=st[1] * isz)  # fmt: skip
    if split > 1 and not splittable(shape, layout):  # both refuse to split a non-dense page
        with pytest.raises(ValueError):
            build_kv_caches(shape, layout, kbs)
        with pytest.raises(ValueError, match="dense"):
            create_kv_cache_views(torch.zeros(tensor.size, dtype=torch.int8), spec, nb,
                                  KVCacheLayout[layout], tensor, kernel_block_size=kbs)  # fmt: skip
        return
    raw, mine = build_kv_caches(shape, layout, kbs)
    raw.random_(-128, 128)
    theirs = create_kv_cache_views(raw, spec, nb, KVCacheLayout[layout], tensor,
                                   kernel_block_size=kbs if split > 1 else None)  # fmt: skip
    assert len(theirs) == nl
    for a, b in zip(mine, theirs, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert a.storage_offset() == b.storage_offset()
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
