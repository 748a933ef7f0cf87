#!/usr/bin/env python3
"""Build a random-weight Llama model and a byte-level BPE tokenizer fully offline.

    python scripts/make_tiny_model.py --out DIR [--preset tiny|bench] [--dtype float32|bfloat16]

``tiny`` (default): 2 layers, hidden 128, 4 heads / 2 KV heads, vocab 512, float32 (tests).
``bench``: 12 layers, hidden 1024, 16 heads / 4 KV heads, vocab 512, bfloat16 (TTFT runs).
``demo``: 8 layers, hidden 512, 8 heads / 4 KV heads, vocab 512, bfloat16: a prefill of a
thousand tokens costs this kind of CPU around half a second (the demo).
``wide``: 6 layers, hidden 256, 4 heads of 256 dims, all KV heads, float32: 48 KiB of KV
a token, so a 256-token chunk is 12 MiB, the size class of real models (tests).
``kvheavy``: 16 layers, hidden 256, 8 heads of 256 dims, all KV heads, bfloat16: 128 KiB
of KV a token like Llama-3-8B (32 MiB a 256-token chunk) at a fraction of its compute
(serving benchmark).
``window``: the tiny Llama with 4 layers, alternately sliding-window (128 tokens) and full
attention, as Gemma 2/3 and gpt-oss interleave them (vLLM gives it two KV cache groups;
the sliding-window tests).
``bench-window``: ``bench`` with its layers alternately sliding-window (512 tokens) and
full attention (the several-groups benchmark, bench/e2e_window.py).
``mla``: a DeepSeek-V2 (MLA) model, 2 layers, hidden 128, 4 heads, a 512-wide latent plus
a 64-dim rope key (576 values a token, the head size vLLM's MLA kernels take), dense MLPs
(vLLM's CPU MoE router refuses this small a MoE), vocab 512, bfloat16 (vLLM's CPU MLA
kernels take no float32; the MLA tests).

Weights come from a fixed seed and the tokenizer is trained in-process on a built-in text,
so the same arguments always give the same model. A marker file records the arguments:
when ``DIR`` already holds a matching model nothing is rebuilt. Takes a few seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

MARKER = ".tiny-model.json"
FORMAT_VERSION = 1
SEED = 1234

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
        dtype="float32",
    ),
    "bench": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=4096,
        dtype="bfloat16",
    ),
    "demo": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=4096,
        dtype="bfloat16",
    ),
    "wide": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=512,
        max_position_embeddings=4096,
        dtype="float32",
    ),
    "mla": dict(
        arch="deepseek_v2",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,  # required fields; unused: every layer is dense
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        vocab_size=512,
        max_position_embeddings=4096,
        dtype="bfloat16",
    ),
    "kvheavy": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=512,
        max_position_embeddings=8192,
        dtype="bfloat16",
    ),
}

# Sliding-window variants: layers alternately sliding-window and full attention, as Gemma
# 2/3 and gpt-oss interleave them (two KV cache groups under vLLM's hybrid allocator).
PRESETS["window"] = dict(PRESETS["tiny"], num_hidden_layers=4, sliding_window=128,
                         layer_types=["sliding_attention", "full_attention"] * 2)
PRESETS["bench-window"] = dict(PRESETS["bench"], sliding_window=512,
                               layer_types=["sliding_attention", "full_attention"] * 6)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# Training text for the tokenizer: enough variety for ~500 merges, no external data.
_CORPUS = """
A tiered key-value cache keeps the attention keys and values of a prompt so that a later
request with the same prefix does not pay for the prefill again. Chunks of tokens are
written to host memory, to a local solid state disk, and to an object store; a decoder
pulls each chunk from the nearest tier that holds it. Anything missing or damaged is
recomputed, and garbage is never loaded.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
In the beginning the scheduler asks the connector how many tokens it can supply; the
worker then copies whole blocks between the paged buffer and a staging area, layer by
layer, and hands the bytes to the store. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048.
Prefill and decode run on different machines. The prefill node writes, the decode node
reads; the handoff is mediated by the cache rather than by a point-to-point transfer.
Once upon a time there was a small model with random weights that generated tokens very
quickly on a processor without any accelerator, and everybody was happy with the tests.
"""


def _key(preset: str, cfg: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT_VERSION, "seed": SEED, "preset": preset, **cfg}


def _matches(out: Path, key: dict[str, Any]) -> bool:
    try:
        have = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json")
    return have == key and all((out / n).exists() for n in needed)


def _build_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [ln for ln in _CORPUS.strip().splitlines() if ln.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _llama(cfg: dict[str, Any], special: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **{f: cfg[f] for f in ("layer_types", "sliding_window") if f in cfg},
        **special,
    )


def _deepseek_v2(cfg: dict[str, Any], special: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    fields = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
              "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
              "first_k_dense_replace", "max_position_embeddings")  # fmt: skip
    config = DeepseekV2Config(
        **{f: cfg[f] for f in fields},
        q_lora_rank=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **special,
    )
    return config, DeepseekV2ForCausalLM


def build(out: Path, preset: str = "tiny", dtype: str | None = None, force: bool = False) -> Path:
    """Write the model into ``out`` (skipped when a matching one is there). Returns ``out``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = dict(PRESETS[preset])
    if dtype:
        cfg["dtype"] = dtype
    key = _key(preset, cfg)
    out = Path(out)
    if not force and _matches(out, key):
        return out

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer(cfg["vocab_size"])
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["dtype"]]
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if cfg.get("arch") == "deepseek_v2":
        config, model_cls = _deepseek_v2(cfg, special)
    else:
        config, model_cls = _llama(cfg, special), LlamaForCausalLM
    torch.manual_seed(SEED)
    with torch.no_grad():
        model = model_cls(config).to(torch_dtype)
        model.config.dtype = torch_dtype
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and swap in, so a concurrent reader never sees half a model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    digest = hashlib.sha256((tmp / "tokenizer.json").read_bytes()).hexdigest()[:16]
    (tmp / MARKER).write_text(json.dumps(key, sort_keys=True))
    out.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()
    print(f"wrote {preset} model to {out} (tokenizer {digest})", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--force", action="store_true", help="rebuild even if a matching model exists")
    args = ap.parse_args(argv)
    build(args.out, args.preset, args.dtype, args.force)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
