"""What the directory stores besides locations: pins and model registrations."""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tiered_cache.api import TIERS
from tiered_cache.keys import ModelFingerprint, is_valid_key

log = logging.getLogger(__name__)

# Checked with fullmatch: "$" would also accept a trailing newline.
_PIN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HEX_RE = re.compile(r"[0-9a-f]*")
# Agents refresh the registrations of connected vLLM instances with every heartbeat; one
# not refreshed for this long belongs to a retired deployment and is dropped.
MODEL_KEEP_S = 7 * 24 * 3600.0


class DirectoryUnavailable(Exception):
    """An admin operation could not reach Redis. The message never holds credentials."""

    def __init__(self, url: str, reason: str = "") -> None:
        self.url = url
        self.reason = reason
        msg = f"cannot reach Redis at {url}"
        super().__init__(f"{msg}: {reason}" if reason else msg)


@dataclass(frozen=True)
class Location:
    node_id: str
    tier: str


class Pin(BaseModel):
    """A prefix kept resident: its chunk keys stay in ``tiers`` until removed or expired."""

    # extra="ignore": pins written by a newer version still load on an older agent.
    model_config = ConfigDict(extra="ignore")

    id: str = Field(default_factory=lambda: secrets.token_hex(6))
    name: str = ""
    note: str = ""
    keys: list[str]
    tiers: list[str] = Field(default_factory=lambda: ["dram"])
    ttl_s: float | None = None  # None = hard pin
    owner: str = ""
    created_at: float = Field(default_factory=time.time)
    expires_at: float | None = None
    fingerprint: str
    num_tokens: int = 0
    bytes_per_chunk: int | None = None
    # The prefix's token ids, so `pin warm` can prefill it through vLLM; None when unknown.
    tokens: list[int] | None = None
    tenant: str = ""  # whose prefix (``tenancy``): its keys carry that tenant's salt

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not _PIN_ID_RE.fullmatch(v):
            raise ValueError(f"pin id must match {_PIN_ID_RE.pattern}")
        return v

    @field_validator("keys")
    @classmethod
    def check_keys(cls, v: list[str]) -> list[str]:
        bad = [k for k in v if not is_valid_key(k)]
        if bad:
            raise ValueError(f"invalid chunk key(s): {bad[:3]}")
        return v

    @field_validator("tiers")
    @classmethod
    def _check_tiers(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if t not in TIERS]
        if bad or not v:
            raise ValueError(f"tiers must be a non-empty subset of {TIERS}, got {v}")
        return list(dict.fromkeys(v))

    @field_validator("fingerprint")
    @classmethod
    def _check_fp(cls, v: str) -> str:
        v = v.lower()
        if not _HEX_RE.fullmatch(v):
            raise ValueError("fingerprint must be hex")
        return v

    @model_validator(mode="after")
    def _fill_expiry(self) -> Pin:
        if self.ttl_s is not None:
            if not self.ttl_s > 0:
                raise ValueError("ttl_s must be positive (or None for a hard pin)")
            if self.expires_at is None:
                self.expires_at = self.created_at + self.ttl_s
        return self

    def expired(self, now: float | None = None) -> bool:
        """True once a TTL pin is past ``expires_at`` (epoch seconds). Hard pins never."""
        if self.expires_at is None:
            return False
        return (time.time() if now is None else now) >= self.expires_at

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> Pin:
        return cls.model_validate_json(data)


class ModelRegistration(BaseModel):
    """A fingerprint a vLLM connector writes chunks under, registered through its node agent
    so that ``pin add --model`` can name the exact keys (the KV layout and block size are
    only known inside vLLM)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model_id: str
    dtype: str
    kv_layout: str
    block_size: int
    tp_rank: int = 0
    tp_world_size: int = 1
    chunk_size: int
    # Which weights (keys.IDENTITY_FIELDS); "" from connectors that predate them.
    revision: str = ""
    quantization: str = ""
    overrides: str = ""
    weights: str = ""
    cache_epoch: str = ""
    aliases: list[str] = Field(default_factory=list)  # served model names
    tokenizer: str | None = None
    node_id: str = ""  # the node that last refreshed it
    last_seen: float = 0.0  # epoch s

    @model_validator(mode="after")
    def _valid(self) -> ModelRegistration:
        self.fingerprint()  # raises ValueError on inconsistent fields
        return self

    def fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint(
            model_id=self.model_id,
            dtype=self.dtype,
            kv_layout=self.kv_layout,
            block_size=self.block_size,
            tp_rank=self.tp_rank,
            tp_world_size=self.tp_world_size,
            chunk_size=self.chunk_size,
            revision=self.revision,
            quantization=self.quantization,
            overrides=self.overrides,
            weights=self.weights,
            cache_epoch=self.cache_epoch,
        )

    @property
    def hex(self) -> str:
        return self.fingerprint().hex

    def names(self) -> set[str]:
        return {self.model_id, *self.aliases}


def newest_first(regs: Sequence[ModelRegistration]) -> list[ModelRegistration]:
    return sorted(regs, key=lambda r: (-r.last_seen, r.model_id, r.tp_rank, r.hex))
