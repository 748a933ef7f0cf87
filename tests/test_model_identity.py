"""The model fingerprint names the weights, not just the model's path (issue 15, item 10):
new weights at the same path, another revision, quantization or override, or an operator's
``cache_epoch`` bump give another fingerprint, so the old weights' KV is never served.
Driven through the real vLLM connector (no engine: its scheduler and worker halves by
hand, as in test_connector_unit.py) over a real checkpoint directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tiered_cache.api import MemoryChunkStore
from tiered_cache.directory import ModelRegistration
from tiered_cache.keys import ModelFingerprint

pytest.importorskip("vllm")

PROMPT = list(range(100, 250))  # 150 tokens: two full chunks and a tail
BLOCKS = list(range(10, 20))

# The connector built from a SimpleNamespace vLLM config; importable by a subprocess.
CONNECTOR_SRC = textwrap.dedent(
    """
    from types import SimpleNamespace
    import torch

    BS, CHUNK, LAYERS, H, HS = 16, 64, 2, 2, 8

    def make_connector(model, role, kv_role, mc=None, cache=None, parallel=None,
                       spec_dtype=torch.float32, **extra):
        import connectors.vllm as mod
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
        )

        ktc = KVTransferConfig(
            kv_connector="TieredCacheConnector",
            kv_connector_module_path="connectors.vllm",
            kv_role=kv_role,
            kv_connector_extra_config={"chunk_size": CHUNK, **extra},
        )
        cfg = SimpleNamespace(
            kv_transfer_config=ktc,
            model_config=SimpleNamespace(model=model, dtype=torch.float32, **(mc or {})),
            cache_config=SimpleNamespace(
                **{"cache_dtype": "auto", "kv_cache_layout": "LBHNC", **(cache or {})}
            ),
            parallel_config=SimpleNamespace(
                **{"pipeline_parallel_size": 1, "tensor_parallel_size": 1, **(parallel or {})}
            ),
            load_config=SimpleNamespace(download_dir=None, load_format="auto"),
        )
        spec = FullAttentionSpec(
            block_size=BS, num_kv_heads=H, head_size=HS, dtype=spec_dtype
        )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        kcc = KVCacheConfig(
            num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
        )
        kcc.kv_cache_layout = "LBHNC"
        r = KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER
        return mod.TieredCacheConnector(cfg, r, kcc)

    def fingerprint(model, **kw):
        c = make_connector(model, "scheduler", "kv_consumer", **kw)
        return c.scheduler._fp.hex
    """
)
_ns: dict[str, Any] = {}
exec(compile(CONNECTOR_SRC, "<connector helper>", "exec"), _ns)
make_connector = _ns["make_connector"]
fingerprint = _ns["fingerprint"]
BS, LAYERS, H, HS = _ns["BS"], _ns["LAYERS"], _ns["H"], _ns["HS"]


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryChunkStore]:
    st = MemoryChunkStore()
    import tiered_cache.client as client

    monkeypatch.setattr(client, "open_store", lambda extra: st)
    yield st


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["TinyForCausalLM"]}))
    (d / "model.safetensors").write_bytes(b"\0" * 4096)
    (d / "tokenizer.json").write_text("{}")
    return d


def schedule_prompt(sched: Any) -> tuple[Any, Any]:
    """(request, scheduler output) of PROMPT in BLOCKS, allocated on ``sched`` (a
    scheduler-side connector) as vLLM allocates a new request."""
    req = SimpleNamespace(request_id="p1", prompt_token_ids=PROMPT, cache_salt=None,
                          kv_transfer_params=None, mm_features=[], lora_request=None)  # fmt: skip
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (BLOCKS,)), 0)
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="p1", prompt_token_ids=PROMPT,
                                            block_ids=(BLOCKS,), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens={"p1": len(PROMPT)},
        total_num_scheduled_tokens=len(PROMPT),
    )  # fmt: skip
    return req, so


def save_prompt(model: str, store: MemoryChunkStore, **extra: Any) -> list[str]:
    """A producer saves PROMPT's KV through the connector's two halves."""
    sched = make_connector(model, "scheduler", "kv_producer", **extra)
    worker = make_connector(model, "worker", "kv_producer", **extra)
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(64, H, BS, 2 * HS, generator=g) for _ in range(LAYERS)]
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)})
    req, so = schedule_prompt(sched)
    worker.bind_connector_metadata(sched.build_connector_meta(so))
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.drain_saves()  # commits run on a helper thread
    worker.clear_connector_metadata()
    _, params = sched.request_finished(req, BLOCKS)
    keys: list[str] = params["tiered_cache"]["keys"]
    assert keys and all(k in store._data for k in keys)
    return keys


def hits(model: str, **extra: Any) -> int:
    """Tokens a fresh consumer of ``model`` would load for PROMPT."""
    sched = make_connector(model, "scheduler", "kv_consumer", **extra)
    req = SimpleNamespace(request_id="d1", prompt_token_ids=PROMPT, cache_salt=None,
                          kv_transfer_params=None, mm_features=[], lora_request=None)  # fmt: skip
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    return int(n or 0)


def test_rewritten_weights_at_the_same_path_are_not_served_old_kv(
    checkpoint: Path, store: MemoryChunkStore
) -> None:
    model = str(checkpoint)
    save_prompt(model, store)
    assert hits(model) == len(PROMPT) - 1  # unchanged weights: the KV is found
    before = fingerprint(model)

    # New weights written over the old file (a fine-tune saved in place).
    w = checkpoint / "model.safetensors"
    st = w.stat()
    w.write_bytes(b"\1" * 8192)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fingerprint(model) != before
    assert hits(model) == 0  # no stale hit

    # Same size, only the mtime moved (a same-shape checkpoint copied over it).
    before = fingerprint(model)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    assert fingerprint(model) != before
    # ... unless the operator asked for sizes only (nodes whose copies differ in mtime).
    assert fingerprint(model, weights_identity="size") == fingerprint(
        model, weights_identity="size"
    )
    sized = fingerprint(model, weights_identity="size")
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 3 * 10**9))
    assert fingerprint(model, weights_identity="size") == sized
    # Files that are not weights or config do not count.
    before = fingerprint(model)
    (checkpoint / "tokenizer.json").write_text('{"changed": true}')
    (checkpoint / "README.md").write_text("notes")
    assert fingerprint(model) == before


def test_cache_epoch_retires_the_cache(
    checkpoint: Path, store: MemoryChunkStore, tmp_path: Path
) -> None:
    model = str(checkpoint)
    save_prompt(model, store)
    assert hits(model) == len(PROMPT) - 1
    # From kv_connector_extra_config ...
    assert hits(model, cache_epoch=2) == 0
    assert fingerprint(model, cache_epoch=2) != fingerprint(model)
    assert fingerprint(model, cache_epoch=2) != fingerprint(model, cache_epoch=3)
    # ... from our config file ...
    ours = tmp_path / "tc.yaml"
    ours.write_text("cache_epoch: 2\n")
    assert fingerprint(model, config_file=str(ours)) == fingerprint(model, cache_epoch=2)
    assert hits(model, config_file=str(ours)) == 0
    # ... and from an LMCache-format file's tiered_cache section.
    lm = tmp_path / "lmcache.yaml"
    lm.write_text("chunk_size: 64\nlocal_cpu: true\nmax_local_cpu_size: 1\n"
                  "extra_config:\n  tiered_cache:\n    cache_epoch: 2\n")  # fmt: skip
    assert fingerprint(model, config_file=str(lm)) == fingerprint(model, cache_epoch=2)


def test_revision_quantization_and_overrides_are_part_of_it(checkpoint: Path) -> None:
    model = str(checkpoint)
    base = fingerprint(model)
    variants = [
        {"revision": "v2"},
        {"code_revision": "abc"},
        {"quantization": "fp8"},
        {"hf_overrides": {"rope_scaling": {"type": "yarn", "factor": 4.0}}},
    ]
    fps = [fingerprint(model, mc=v) for v in variants]
    assert len({base, *fps}) == len(variants) + 1
    assert fingerprint(model, mc=variants[3]) == fps[3]  # deterministic


def test_a_hub_id_is_identified_by_its_cached_commit(tmp_path: Path) -> None:
    """A hub id names no files here: the commit its revision resolves to in the local
    Hugging Face cache (vLLM's download_dir) stands for the weights."""
    from connectors.vllm_common import weights_identity

    refs = tmp_path / "hub" / "models--org--tiny" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)
    hub = str(tmp_path / "hub")
    assert weights_identity("org/tiny", None, hub_cache=hub) == "a" * 40
    (refs / "main").write_text("b" * 40)  # `main` moved: new weights
    assert weights_identity("org/tiny", None, hub_cache=hub) == "b" * 40
    assert weights_identity("org/tiny", "c" * 40, hub_cache=hub) == "c" * 40
    assert weights_identity("org/other", None, hub_cache=hub) == ""
    with pytest.raises(ValueError, match="weights_identity"):
        weights_identity("org/tiny", None, mode="hash")


def test_registration_keeps_the_identity(checkpoint: Path) -> None:
    """`pin add --model` rebuilds the fingerprint from the registration: it must be the
    connector's, identity fields included."""
    import dataclasses

    c = make_connector(str(checkpoint), "scheduler", "kv_consumer", cache_epoch=5,
                       mc={"revision": "v2", "quantization": "fp8"})  # fmt: skip
    fp: ModelFingerprint = c.scheduler._fp
    assert fp.weights and fp.cache_epoch == "5" and fp.revision == "v2"
    reg = ModelRegistration.model_validate(
        json.loads(json.dumps({**dataclasses.asdict(fp), "aliases": []}))
    )
    assert reg.hex == fp.hex


def test_unchanged_weights_give_the_same_fingerprint_in_another_process(
    checkpoint: Path,
) -> None:
    """Stable across processes (no hash seed, no listing order), and still telling the
    epochs apart there."""
    model = str(checkpoint)
    here = [fingerprint(model, cache_epoch=e, mc={"revision": "v2"}) for e in ("e1", "e2")]
    code = CONNECTOR_SRC + (
        "\nfor e in ('e1', 'e2'):\n"
        f"    print(fingerprint({model!r}, cache_epoch=e, mc={{'revision': 'v2'}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == here
    assert here[0] != here[1]
