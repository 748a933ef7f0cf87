"""What the planner needs of a model: KV bytes per token (what a handoff and a tier
move), and weights and per-token FLOPs (what a roofline engine prices when no calibration
run is given)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1,
                "int8": 1}  # fmt: skip


class PlanError(ValueError):
    """A planner input that cannot be used (one line, for the CLI)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kv_bytes_per_token: int  # K and V of every layer (MLA: the latent and the rope key)
    params: float  # active parameters per token (MoE: the experts a token runs)
    weight_bytes: float  # all weights (MoE: every expert), as stored
    layers: int = 0
    attn_dim: int = 0  # query heads x head dim: attention FLOPs per token pair and layer / 4
    mla: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kv_bytes_per_token": self.kv_bytes_per_token,
            "params": self.params, "weight_bytes": self.weight_bytes, "layers": self.layers,
            "mla": self.mla,
        }  # fmt: skip


def _get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is None:
        raise PlanError(f"config.json has none of {', '.join(names)}")
    return default


def from_hf_config(cfg: dict[str, Any], name: str = "model", dtype: str | None = None
                   ) -> ModelSpec:  # fmt: skip
    """A Hugging Face ``config.json``: GQA (``num_key_value_heads``), MLA (``kv_lora_rank``
    + ``qk_rope_head_dim``: one latent vector per token and layer, no K/V split), MoE
    (``num_experts_per_tok`` of ``n_routed_experts``/``num_local_experts``)."""
    if "text_config" in cfg:  # multimodal wrappers keep the language model's here
        cfg = {**cfg, **cfg["text_config"]}
    dt = str(dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dt not in _DTYPE_BYTES:
        raise PlanError(f"unknown dtype {dt!r} ({', '.join(_DTYPE_BYTES)})")
    db = _DTYPE_BYTES[dt]
    layers = int(_get(cfg, "num_hidden_layers", "n_layer", "num_layers"))
    hidden = int(_get(cfg, "hidden_size", "n_embd", "d_model"))
    heads = int(_get(cfg, "num_attention_heads", "n_head"))
    vocab = int(_get(cfg, "vocab_size", default=32000))
    inter = int(_get(cfg, "intermediate_size", "ffn_dim", default=4 * hidden))
    if layers <= 0 or hidden <= 0 or heads <= 0:
        raise PlanError("layers, hidden size and heads must be > 0")
    mla = cfg.get("kv_lora_rank") is not None
    if mla:
        per_layer = int(cfg["kv_lora_rank"]) + int(_get(cfg, "qk_rope_head_dim", default=64))
        head_dim = int(_get(cfg, "v_head_dim", default=hidden // heads))
    else:
        kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
        head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
        per_layer = 2 * kv_heads * head_dim
    kv = layers * per_layer * db
    if mla:  # q, o full; the latent's down and up projections
        attn = 2 * hidden * heads * head_dim + hidden * per_layer + per_layer * heads * 2 * head_dim
    else:  # q and o full, k and v at the KV heads'
        attn = 2 * hidden * heads * head_dim + hidden * per_layer
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    per_tok = cfg.get("num_experts_per_tok")
    moe_inter = int(cfg.get("moe_intermediate_size") or inter)
    if experts and per_tok:
        mlp_active = 3 * hidden * moe_inter * (int(per_tok) + int(cfg.get("n_shared_experts") or 0))
        mlp_all = 3 * hidden * moe_inter * (int(experts) + int(cfg.get("n_shared_experts") or 0))
    else:
        mlp_active = mlp_all = 3 * hidden * inter
    embed = 2 * vocab * hidden
    params = layers * (attn + mlp_active) + embed
    weights = (layers * (attn + mlp_all) + embed) * db
    return ModelSpec(name, kv, float(params), float(weights), layers, heads * head_dim, mla)


def load_model(spec: str, dtype: str | None = None) -> ModelSpec:
    """A ``config.json`` path (or a directory holding one), or explicit numbers:
    ``kv_bytes_per_token=327680,params=70e9[,weight_bytes=...,layers=80]``."""
    if "=" in spec and not Path(spec).exists():
        vals: dict[str, float] = {}
        for item in spec.split(","):
            k, _, v = item.partition("=")
            try:
                vals[k.strip()] = float(v)
            except ValueError:
                raise PlanError(f"--model: {item!r} is not KEY=NUMBER") from None
        unknown = set(vals) - {"kv_bytes_per_token", "params", "weight_bytes", "layers"}
        if unknown or "kv_bytes_per_token" not in vals or "params" not in vals:
            raise PlanError("--model numbers: kv_bytes_per_token=N,params=N "
                            "[,weight_bytes=N,layers=N]")  # fmt: skip
        if vals["kv_bytes_per_token"] <= 0 or vals["params"] <= 0:
            raise PlanError("--model: kv_bytes_per_token and params must be > 0")
        return ModelSpec(
            "custom", int(vals["kv_bytes_per_token"]), vals["params"],
            vals.get("weight_bytes", 2 * vals["params"]), int(vals.get("layers", 0)),
        )  # fmt: skip
    p = Path(spec)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlanError(f"--model: no config.json at {spec}")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"--model: {p} is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"--model: {p} is not a config object")
    try:
        return from_hf_config(cfg, cfg.get("_name_or_path") or p.parent.name, dtype)
    except (TypeError, ValueError, KeyError) as e:
        raise PlanError(f"--model: {p}: {e}") from None
