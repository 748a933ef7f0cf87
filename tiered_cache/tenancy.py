"""Tenancy (docs/operations.md, "Tenancy"): which tenant a request and its chunks belong
to, the router's tenant table, and the agent's bytes per tenant per tier.

A chunk key hashes the request's ``cache_salt``, so tenants with different salts never
share a key. The router maps an API key to its tenant and sets ``cache_salt`` to
``tenant_salt(name, secret)``: the secret keeps another tenant from naming the same keys,
and the name, readable in front of it, is how the connector tags the chunks it writes
(``ChunkMeta.tenant``) and how the agent accounts for them, without either learning a
secret. A client that reaches vLLM without the router can put any name there: accounting,
like isolation, assumes clients go through the router.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, model_validator

from tiered_cache.config_values import Size, check_secret

TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")  # fits the chunk header's 32 bytes
SALT_PREFIX = "tc-tenant:"


def check_tenant_name(v: str) -> str:
    if not TENANT_RE.fullmatch(v):
        raise ValueError(
            f"tenant name {v!r} must be 1-32 letters, digits, '_', '.' or '-' (first a letter"
            " or digit)"
        )
    return v


TenantName = Annotated[str, AfterValidator(check_tenant_name)]


def tenant_salt(name: str, secret: str) -> str:
    """The ``cache_salt`` the router gives a tenant's requests."""
    return f"{SALT_PREFIX}{name}:{secret}"


def tenant_of_salt(salt: str | None) -> str:
    """The tenant a ``cache_salt`` names ("" for none). The connector may have appended to
    it (``|lora=...``): only the name after the prefix counts."""
    if not salt or not salt.startswith(SALT_PREFIX):
        return ""
    name = salt[len(SALT_PREFIX) :].split(":", 1)[0]
    return name if TENANT_RE.fullmatch(name) else ""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TenantSpec(_Strict):
    """One tenant of the router: its API key and secret salt (both from the environment:
    ``${ACME_KEY}``)."""

    name: TenantName
    api_key: SecretStr
    salt: SecretStr

    @model_validator(mode="after")
    def _secrets(self) -> TenantSpec:
        env = re.sub(r"[^A-Z0-9]", "_", self.name.upper())
        for field, what in (("api_key", "API key"), ("salt", "salt")):
            var = f"{env}_{'KEY' if field == 'api_key' else 'SALT'}"
            try:
                check_secret(getattr(self, field).get_secret_value(), f"tenant {what}", var)
            except ValueError as e:
                raise ValueError(f"{field}: {e}") from None
        return self


class KVEventSource(_Strict):
    """One agent's KV event stream (its ``kv_events`` endpoints), for ``lookup: events``."""

    endpoint: str = Field(pattern=r"^(tcp|ipc|inproc)://.+")
    replay_endpoint: str | None = Field(default=None, pattern=r"^(tcp|ipc|inproc)://.+")


class RouterConfig(_Strict):
    # With tenants, every request needs ``Authorization: Bearer <api_key>`` and is served
    # with its tenant's salt; without, requests pass as they are.
    tenants: list[TenantSpec] = Field(default_factory=list)
    # A prompt whose whole chunks are all cached skips the prefill server when at most
    # this many tokens are left for the decode to compute, the last prompt token (which
    # vLLM always computes) included (null: up to a chunk).
    # 0 sends every prompt through prefill: decodes never run a prompt of their own.
    max_local_prefill_tokens: int | None = Field(default=None, ge=0)
    # Whole or split (``tiered_cache.split``): ``split`` sends every request through the
    # prefill pool (but those the cache nearly covers, above); ``whole`` serves each on one
    # server of either pool (by cached prefix and load); ``auto`` prices both per request
    # and takes the cheaper: set it where both pools run ``kv_both``, so either can serve
    # a request whole and save what it computes.
    split: Literal["split", "whole", "auto"] = "split"
    # The cost model's starting points, replaced by what the router measures once requests
    # flow: one server's prefill rate, what a split adds to the first token (the second
    # request, the save and the load), one decode step.
    prefill_tokens_per_s: float = Field(default=4000.0, gt=0)
    handoff_s: float = Field(default=0.2, ge=0)
    decode_step_s: float = Field(default=0.03, ge=0)
    # Where the cached prefix of a prompt comes from: ``agent``, a lookup (and partial
    # probe) per request, to the token; ``events``, the agents' KV event streams, kept in
    # the router's memory: no round trip, block granularity (docs/operations.md).
    lookup: Literal["agent", "events"] = "agent"
    # The streams for ``events``; empty: this config's own ``kv_events`` endpoints.
    kv_event_sources: list[KVEventSource] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> RouterConfig:
        for what, values in (
            ("name", [t.name for t in self.tenants]),
            ("api_key", [t.api_key.get_secret_value() for t in self.tenants]),
            ("salt", [t.salt.get_secret_value() for t in self.tenants]),
        ):
            if len(set(values)) != len(values):
                raise ValueError(f"tenants: two tenants share one {what}")
        return self


class TenantQuota(_Strict):
    """Bytes one tenant's chunks may take in each tier (unset: no quota there)."""

    dram: Size | None = None
    nvme: Size | None = None
    s3: Size | None = None

    def limit(self, tier: str) -> int | None:
        v = getattr(self, tier, None)
        return v if isinstance(v, int) else None


class TenantAuth:
    """The router's API keys. Every key is compared (constant time) whatever matched, so
    how long a refusal took says nothing about the keys."""

    def __init__(self, tenants: Iterable[TenantSpec]) -> None:
        self._keys = [(t.api_key.get_secret_value().encode(), t) for t in tenants]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def match(self, authorization: str | None) -> TenantSpec | None:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        got = given.strip().encode()
        found = None
        for key, spec in self._keys:
            if hmac.compare_digest(got, key):
                found = spec
        return found


class TenantBook:
    """Bytes and chunks per tenant per tier in one agent, kept by the tiered store as
    chunks enter and leave its tiers (untagged chunks are not kept: they belong to no
    tenant), and each tenant's quotas."""

    def __init__(self, tiers: Iterable[str], quotas: Mapping[str, TenantQuota]) -> None:
        self.quotas = dict(quotas)
        self._owner: dict[str, dict[str, tuple[str, int]]] = {t: {} for t in tiers}
        self._bytes: dict[str, dict[str, int]] = {t: {} for t in self._owner}
        self._chunks: dict[str, dict[str, int]] = {t: {} for t in self._owner}

    def add(self, tier: str, key: str, tenant: str, size: int) -> None:
        self.remove(tier, key)
        if not tenant:
            return
        self._owner[tier][key] = (tenant, size)
        self._bytes[tier][tenant] = self._bytes[tier].get(tenant, 0) + size
        self._chunks[tier][tenant] = self._chunks[tier].get(tenant, 0) + 1

    def remove(self, tier: str, key: str) -> None:
        got = self._owner[tier].pop(key, None)
        if got is None:
            return
        tenant, size = got
        self._bytes[tier][tenant] -= size
        self._chunks[tier][tenant] -= 1
        if not self._chunks[tier][tenant]:
            del self._bytes[tier][tenant], self._chunks[tier][tenant]

    def owner(self, tier: str, key: str) -> str:
        got = self._owner[tier].get(key)
        return got[0] if got is not None else ""

    def used(self, tier: str, tenant: str) -> int:
        return self._bytes[tier].get(tenant, 0)

    def over(self, tier: str, tenant: str, nbytes: int) -> bool:
        """Whether ``nbytes`` more would put ``tenant`` over its quota in ``tier``."""
        q = self.quotas.get(tenant) if tenant else None
        limit = q.limit(tier) if q is not None else None
        return limit is not None and self.used(tier, tenant) + nbytes > limit

    def fits(self, tier: str, tenant: str, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` could ever fit ``tenant``'s quota in ``tier``."""
        q = self.quotas.get(tenant) if tenant else None
        limit = q.limit(tier) if q is not None else None
        return limit is None or nbytes <= limit

    def tenants(self) -> list[str]:
        names = set(self.quotas)
        for per in self._bytes.values():
            names.update(per)
        return sorted(names)

    def usage(self, tenant: str) -> dict[str, dict[str, int | None]]:
        """Per tier: the tenant's bytes, chunks and quota."""
        q = self.quotas.get(tenant)
        return {
            tier: {
                "used_bytes": self._bytes[tier].get(tenant, 0),
                "chunks": self._chunks[tier].get(tenant, 0),
                "quota_bytes": q.limit(tier) if q is not None else None,
            }
            for tier in self._owner
        }
