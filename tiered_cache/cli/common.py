"""Shared by the command modules: the one-line error type, config loading, the common
options, and access to this node's agent and to Redis (registrations, pins)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from tiered_cache.api import TIERS
from tiered_cache.config import CacheConfig, ConfigError, load_config
from tiered_cache.keys import ModelFingerprint

if TYPE_CHECKING:
    from tiered_cache.directory import ModelRegistration

F = TypeVar("F", bound=Callable[..., Any])


class CliError(click.ClickException):
    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def friendly(fn: F) -> F:
    """Turn expected failures into one-line errors."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        from tiered_cache.directory import DirectoryUnavailable
        from tiered_cache.hierarchy import PinRefused
        from tiered_cache.ipc import IPCError

        try:
            return fn(*a, **kw)
        except (ConfigError, PinRefused, DirectoryUnavailable, IPCError, ValueError) as e:
            raise CliError(str(e)) from None
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise CliError(str(e)) from None

    return wrapper  # type: ignore[return-value]


def _load(config: str | None) -> CacheConfig:
    return load_config(config) if config else load_config(None)


_cfg_opt = click.option("-c", "--config", type=click.Path(dir_okay=False), help="YAML config.")
_token_opt = click.option(
    "--token", envvar="TIERED_CACHE_TOKEN", help="Admin token (env TIERED_CACHE_TOKEN)."
)
_json_opt = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def _tier_list(tiers: str, what: str = "tier") -> list[str]:
    tier_list = [t.strip() for t in tiers.split(",") if t.strip()]
    bad = [t for t in tier_list if t not in TIERS]
    if bad or not tier_list:
        raise CliError(f"unknown {what} {', '.join(bad) or '(none)'}; valid: {', '.join(TIERS)}")
    return list(dict.fromkeys(tier_list))


def _agent_op(cfg: CacheConfig, op: str, *, hint: str = "", **kw: Any) -> dict[str, Any]:
    """One request to this node's agent over its socket (no shared-memory attach)."""
    from tiered_cache.protocol import AgentUnreachable, agent_call, request

    try:
        return asyncio.run(agent_call(cfg.socket_path, request(op, **kw)))
    except AgentUnreachable:
        raise CliError(
            f"no node agent at {cfg.socket_path}; start `tiered-cache agent`{hint}"
        ) from None


def _redis(cfg: CacheConfig, fn: Callable[[Any], Any], *, check: bool = True) -> Any:
    """Run ``fn(directory)`` against Redis. Reads check reachability first, since the
    directory answers reads from its last known state when Redis is down."""
    from tiered_cache.directory import RedisDirectory

    async def go() -> Any:
        d = RedisDirectory.from_url(cfg.redis_url or "")
        try:
            if check:
                await d.check()
            return await fn(d)
        finally:
            await d.close()

    return asyncio.run(go())


def _registered_models(cfg: CacheConfig) -> list[ModelRegistration]:
    """Fingerprints vLLM connectors registered: from Redis, else from this node's agent."""
    from tiered_cache.directory import ModelRegistration

    if cfg.redis_url:
        return list(_redis(cfg, lambda d: d.models()))
    docs = _agent_op(cfg, "models", hint=" or set redis_url")["models"]
    return [ModelRegistration.model_validate(d) for d in docs]


def _canon(name: str) -> str:
    return os.path.realpath(name) if os.path.exists(name) else name


def _registrations_for(
    cfg: CacheConfig, model: str, chunk_size: int | None
) -> list[ModelRegistration]:
    """Every registered fingerprint of ``model`` (its id, a served name or its directory)."""
    regs = _registered_models(cfg)
    want = _canon(model)
    mine = [r for r in regs if want in {_canon(n) for n in r.names()}]
    if not mine:
        known = sorted({r.model_id for r in regs})
        raise CliError(
            f"no vLLM instance has registered model {model!r} yet"
            + (f" (registered: {', '.join(known)})" if known else "")
            + "; start it with the TieredCacheConnector (it registers its KV fingerprint "
            "with the node agent), or pass --fingerprint, or --kv-layout/--block-size/"
            "--dtype/--tp-size to build the fingerprint by hand"
        )
    if chunk_size:
        sized = [r for r in mine if r.chunk_size == chunk_size]
        if not sized:
            have = ", ".join(str(c) for c in sorted({r.chunk_size for r in mine}))
            raise CliError(
                f"model {model!r} is registered with chunk size {have}, not --chunk-size "
                f"{chunk_size}"
            )
        mine = sized
    return mine


@dataclasses.dataclass(frozen=True)
class _GivenFingerprint(ModelFingerprint):
    """A fingerprint known only by its digest (as the vLLM connector logs it)."""

    given: bytes = b""

    @property
    def digest(self) -> bytes:
        return self.given


class _Admin:
    """Pin-list writes go through this node's agent, which checks the token (and the
    caller's uid) itself; with Redis and no agent running, straight to Redis, which only
    the holder of its credentials (redis_url) can write."""

    def __init__(self, cfg: CacheConfig, token: str | None) -> None:
        self.cfg = cfg
        self.token = token

    def _need_token(self, what: str) -> None:
        # No agent to ask: refuse early rather than write what the agent would refuse.
        # Constant-time, like the agent's check.
        from tiered_cache.agent.admin import token_matches

        want = self.cfg.agent.auth_token
        if want is not None and not token_matches(self.token, want):
            raise CliError(f"{what} needs the admin token (--token or TIERED_CACHE_TOKEN)")

    def _op(self, op: str, **kw: Any) -> dict[str, Any]:
        hint = "" if self.cfg.redis_url else " or set redis_url"
        return _agent_op(self.cfg, op, hint=hint, **kw)

    def _agent_write(self, op: str, **kw: Any) -> dict[str, Any] | None:
        """``op`` through the agent; None when no agent answers and Redis is configured."""
        from tiered_cache.protocol import AgentUnreachable, agent_call, request

        if not self.cfg.redis_url:
            return self._op(op, token=self.token, **kw)
        try:
            return asyncio.run(
                agent_call(self.cfg.socket_path, request(op, token=self.token, **kw))
            )
        except AgentUnreachable:
            return None

    def add(self, pin: Any, chunk_bytes: int) -> str:
        r = self._agent_write("pin_add", pin=pin.model_dump(), chunk_bytes=chunk_bytes)
        if r is not None:
            return str(r["id"])
        self._need_token("pin add")
        _redis(self.cfg, lambda d: d.add_pin(pin), check=False)
        return str(pin.id)

    def remove(self, pin_id: str) -> bool:
        r = self._agent_write("pin_rm", id=pin_id)
        if r is not None:
            return bool(r["removed"])
        self._need_token("pin rm")
        return bool(_redis(self.cfg, lambda d: d.remove_pin(pin_id), check=False))

    def list(
        self, *, fleet: bool = False
    ) -> tuple[list[Any], dict[str, dict[str, str]], dict[str, dict[str, list[str]]]]:
        """Pins, their residency on this node (when its agent runs) and, with Redis and
        ``fleet``, the nodes holding each pin per tier."""
        from tiered_cache.dashboard import Collector
        from tiered_cache.directory import Pin
        from tiered_cache.protocol import AgentUnreachable, PinLs, agent_call

        pins: list[Any] = []
        res: dict[str, dict[str, str]] = {}
        try:
            r = asyncio.run(agent_call(self.cfg.socket_path, PinLs()))
            pins = [Pin.model_validate(p) for p in r["pins"]]
            res = r["residency"]
            have_agent = True
        except AgentUnreachable:
            if not self.cfg.redis_url:
                raise CliError(
                    f"no node agent at {self.cfg.socket_path} and no redis_url configured; "
                    "start `tiered-cache agent` or set redis_url"
                ) from None
            have_agent = False
        where: dict[str, dict[str, list[str]]] = {}
        if self.cfg.redis_url and (fleet or not have_agent):

            async def read(d: Any) -> tuple[list[Any], dict[str, dict[str, list[str]]]]:
                ps = pins if have_agent else await d.list_pins()
                f = await Collector._fleet(d, [p.model_dump() for p in ps]) if fleet else {}
                return ps, f

            pins, where = _redis(self.cfg, read)
        return pins, res, where

    def get(self, pin_id: str) -> Any:
        pins, _, _ = self.list()
        for p in pins:
            if p.id == pin_id:
                return p
        raise CliError(f"no pin with id {pin_id}")
