"""Chunks of real model sizes through a node agent with the default configuration.

The KV shapes are vLLM's logical per-layer shape ``[num_blocks, H, block_size, C]``
(``C = 2 * head_dim``; MLA: ``H = 1``, ``C`` = latent + rope dims), built on torch's
``meta`` device: shapes only, no memory and no weights. Each model's 256-token chunk (and
a partial tail) is stored through the agent and read back byte-exact, from DRAM.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from connectors.vllm_kvio import PagedKV, dtype_name
from tiered_cache import codec
from tiered_cache.agent import spawn_agent
from tiered_cache.client import AgentClient
from tiered_cache.keys import ModelFingerprint, chunk_keys

CHUNK = 256
BLOCK = 16

# name -> (layers, KV heads per rank, channels per head (K|V or latent), dtype)
MODELS: dict[str, tuple[int, int, int, torch.dtype]] = {
    "llama-3-8b": (32, 8, 2 * 128, torch.bfloat16),  # 128 KiB / token: 32 MiB / chunk
    "llama-3-70b-tp1": (80, 8, 2 * 128, torch.bfloat16),  # 80 MiB / chunk
    "llama-3-70b-tp8": (80, 1, 2 * 128, torch.bfloat16),  # 10 MiB / chunk per rank
    "gqa-4-kv-heads": (28, 4, 2 * 128, torch.bfloat16),  # Qwen2.5-7B-like: 14 MiB
    "mla": (61, 1, 512 + 64, torch.bfloat16),  # DeepSeek-V3-like: 17.2 MiB
}
EXPECTED_MIB = {
    "llama-3-8b": 32,
    "llama-3-70b-tp1": 80,
    "llama-3-70b-tp8": 10,
    "gqa-4-kv-heads": 14,
    "mla": 17.15625,
}


def paged_kv(name: str) -> PagedKV:
    layers, heads, chans, dtype = MODELS[name]
    shape = (64, heads, BLOCK, chans)  # 64 blocks: plenty for one chunk
    return PagedKV([torch.empty(shape, dtype=dtype, device="meta") for _ in range(layers)])


def chunk_meta(name: str, key: str, kv: PagedKV, n_tokens: int) -> codec.ChunkMeta:
    nb = -(-n_tokens // BLOCK)
    return codec.ChunkMeta(
        key=key,
        fingerprint=fp(name).digest,
        num_tokens=n_tokens,
        dtype=dtype_name(kv.dtype),
        shape=kv.payload_shape(nb),
        kv_layout="LBNHC",
        block_size=BLOCK,
    )


def fp(name: str) -> ModelFingerprint:
    return ModelFingerprint(name, dtype="bfloat16", block_size=BLOCK, chunk_size=CHUNK)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_chunk_bytes_of_real_models(name: str) -> None:
    kv = paged_kv(name)
    assert kv.payload_nbytes(CHUNK // BLOCK) == EXPECTED_MIB[name] * 2**20


@pytest.fixture(scope="module")
def default_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An agent with the embedded defaults (1 GiB DRAM, slot size auto, no NVMe):
    only its name and socket are set."""
    tmp = tmp_path_factory.mktemp("sizes")
    sock = str(tmp / "agent.sock")
    cfg = tmp / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"node_id": f"sz-{uuid.uuid4().hex[:8]}",
                                   "agent": {"socket": sock}}))
    proc = spawn_agent(cfg, timeout=60, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    yield sock
    proc.terminate()
    proc.wait(30)
    Path(f"/dev/shm/tiered_cache_{yaml.safe_load(cfg.read_text())['node_id'].replace('-', '_')}"
         ).unlink(missing_ok=True)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("zero_copy", [True, False], ids=["reserve", "put_many"])
def test_real_model_chunks_stored_in_dram_and_read_back(
    default_agent: str, name: str, zero_copy: bool
) -> None:
    """A full chunk and a partial tail (100 tokens) of each model round-trip through
    DRAM, on both write paths the connector uses: zero-copy slots and ``put_many``."""
    kv = paged_kv(name)
    tokens = np.arange(CHUNK + 100) + (1 if zero_copy else 2)  # distinct keys per case
    keys = chunk_keys(tokens, fp(name), include_partial=True)
    metas = [chunk_meta(name, keys[0], kv, CHUNK), chunk_meta(name, keys[1], kv, 100)]
    rng = np.random.default_rng(len(name))
    payloads = [
        rng.integers(0, 255, kv.payload_nbytes(-(-m.num_tokens // BLOCK)), dtype=np.uint8)
        for m in metas
    ]
    c = AgentClient(default_agent)
    try:
        if zero_copy:
            res = c.reserve_payloads([p.nbytes for p in payloads])
            assert res is not None, "default DRAM refused a reservation"
            for view, p in zip(res.views, payloads, strict=True):
                np.frombuffer(view, dtype=np.uint8)[:] = p
            c.commit_payloads(res, metas)
        else:
            c.put_many(list(zip(metas, [p.data for p in payloads], strict=True)))
        assert c.lookup(keys) == ["dram", "dram"]
        got = c.get_many(keys, fp(name).digest)
        for g, p in zip(got, payloads, strict=True):
            assert g is not None
            assert g[1].nbytes == p.nbytes and bytes(g[1]) == p.tobytes()
    finally:
        c.close()


@pytest.mark.parametrize(
    ("config", "name"),
    [
        ({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
          "num_key_value_heads": 8}, "llama-3-8b"),
        ({"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
          "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, "mla"),
    ],
)  # fmt: skip
def test_pin_size_estimate_is_the_chunks_payload(
    tmp_path: Path, config: dict[str, int], name: str
) -> None:
    """`pin add` sizes a pin from the model's config.json: an MLA model's chunk is its
    latent plus rope key a layer (DeepSeek-V3: 576 values), not K and V of 128 heads."""
    from tiered_cache.cli.pin_prefix import _chunk_bytes

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _chunk_bytes(str(tmp_path), "bfloat16", CHUNK) == paged_kv(name).payload_nbytes(
        CHUNK // BLOCK
    )
