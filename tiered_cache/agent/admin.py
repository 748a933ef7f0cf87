"""Operators' requests: stats, pins, ls, evict, flush, warm, clear, nodes, counters,
models. Admin writes need the agent's token when it has one, and, like chunk writes, a
local client of a trusted uid (``_check_access``)."""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, Any

from tiered_cache import codec
from tiered_cache.agent.state import AgentState
from tiered_cache.directory import Pin
from tiered_cache.metrics import Metrics
from tiered_cache.protocol import (
    ADMIN,
    Alias,
    Clear,
    Commit,
    Counters,
    Describe,
    Evict,
    Flush,
    Ls,
    Models,
    Nodes,
    PinAdd,
    PinLs,
    PinRm,
    Put,
    RegisterModel,
    Request,
    Reserve,
    Stats,
    Warm,
)
from tiered_cache.tiers.dram import DRAMTier

if TYPE_CHECKING:
    from tiered_cache.agent.local import Handler, _Conn

log = logging.getLogger("tiered_cache.agent")


# What a local client of another uid may not do: write chunks or registrations.
WRITES: frozenset[type[Request]] = frozenset(
    {Put, Commit, Reserve, RegisterModel, Alias, Describe}
)


def token_matches(given: object, want: str) -> bool:
    """Constant-time: how long a wrong token took to refuse says nothing about it."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), want.encode())


class AdminOps(AgentState):
    def _check_access(self, conn: _Conn, req: Request) -> None:
        """Chunk writes and admin ops need a trusted local uid (the agent's own, root, or
        ``agent.allowed_uids``: SO_PEERCRED, taken at connect); admin ops also need the
        token when one is configured. PermissionError (an ``auth`` reply) otherwise."""
        kind = type(req)
        if kind not in ADMIN and kind not in WRITES:
            return
        if not conn.trusted:
            raise PermissionError(
                f"{req.op} refused: local uid {conn.uid} is not this agent's user, root or"
                " in agent.allowed_uids"
            )
        want = self.cfg.agent.auth_token
        if kind in ADMIN and want is not None and not token_matches(getattr(req, "token", None), want):
            raise PermissionError(
                f"{req.op} refused: needs the admin token (the agent's auth token; the CLI"
                " takes --token or TIERED_CACHE_TOKEN)"
            )

    def _admin_handlers(self) -> dict[type[Request], Handler]:
        return {
            Stats: self._stats_op,
            PinAdd: self._pin_add,
            PinRm: self._pin_rm,
            PinLs: self._pin_ls,
            Evict: self._evict,
            Flush: self._flush,
            Ls: self._ls_op,
            Nodes: self._nodes,
            Counters: self._counters,
            Models: self._models_op,
            Warm: self._warm_op,
            Clear: self._clear_op,
        }

    async def _stats_op(self, conn: _Conn, req: Stats) -> dict[str, Any]:
        book = self.store.tenants
        if req.tenant:  # a tenant's own figures, nothing of the node's or of others
            return {
                "node_id": self.cfg.node_id,
                "tenant": req.tenant,
                "usage": book.usage(req.tenant),
            }
        top = self.store.slots[0].tier
        return {
            "node_id": self.cfg.node_id,
            "usage": self.store.usage(),
            "metrics": _metric_summary(self.metrics),
            # The DRAM pool's books (free slots, reserved runs, leases): leak checks.
            "pool": top.accounting() if isinstance(top, DRAMTier) else None,
            "tenants": {t: book.usage(t) for t in book.tenants()},
            "aliases": len(self.store.aliases),  # block-aligned prefixes kept (``present``)
            # KV events: where they go, how far the numbering is, chunks described.
            "kv_events": None if self.kv_events is None else {
                "endpoint": self.kv_events.publisher.endpoint,
                "replay_endpoint": self.kv_events.publisher.replay_address,
                "next_seq": self.kv_events.publisher.next_seq,
                "descriptions": len(self.kv_events.book),
            },
        }

    async def _pin_add(self, conn: _Conn, req: PinAdd) -> dict[str, Any]:
        pin = Pin.model_validate(req.pin)
        self.store.check_pin(pin, req.chunk_bytes)
        await self.directory.add_pin(pin)
        await self._sync_pins()
        return {"id": pin.id}

    async def _pin_rm(self, conn: _Conn, req: PinRm) -> dict[str, Any]:
        ok = await self.directory.remove_pin(req.id)
        await self._sync_pins()
        return {"removed": ok}

    async def _pin_ls(self, conn: _Conn, req: PinLs) -> dict[str, Any]:
        pins = await self.directory.list_pins()
        res = await self._residency(pins)
        return {"pins": [p.model_dump() for p in pins], "residency": res}

    async def _evict(self, conn: _Conn, req: Evict) -> dict[str, Any]:
        await self.store.delete(req.key, tiers=req.tiers)
        return {}

    async def _flush(self, conn: _Conn, req: Flush) -> dict[str, Any]:
        await self.store.flush()
        return {"written_back": await self.write_back_dirty()}

    async def _ls_op(self, conn: _Conn, req: Ls) -> dict[str, Any]:
        """Chunk keys with a prefix, across this node's tiers."""
        return self._ls(req.prefix, req.limit, req.tenant)

    async def _nodes(self, conn: _Conn, req: Nodes) -> dict[str, Any]:
        return {"nodes": await self.directory.nodes()}

    async def _counters(self, conn: _Conn, req: Counters) -> dict[str, Any]:
        return {"counters": await self.directory.counters()}

    async def _models_op(self, conn: _Conn, req: Models) -> dict[str, Any]:
        return {"models": [r.model_dump() for r in await self.directory.models()]}

    async def _warm_op(self, conn: _Conn, req: Warm) -> dict[str, Any]:
        pin = await self.directory.get_pin(req.id)
        if pin is None:
            raise ValueError(f"no pin with id {req.id}")
        return await self._warm(pin)

    async def _clear_op(self, conn: _Conn, req: Clear) -> dict[str, Any]:
        """Drop every chunk of one tier (pinned ones only when asked)."""
        return await self._clear(req.tier, req.include_pinned)

    def _ls(self, prefix: str, limit: int, tenant: str = "") -> dict[str, Any]:
        found: list[dict[str, Any]] = []
        owner = self.store.tenants.owner
        book = self.kv_events.book if self.kv_events is not None else None
        for slot in self.store.slots:
            pinned = self.store.pinned_keys(slot.name)
            for k, size in slot.tier.entries():
                of = owner(slot.name, k)
                if k.startswith(prefix) and (not tenant or of == tenant):
                    e = {"key": k, "tier": slot.name, "bytes": size, "pinned": k in pinned,
                         "tenant": of}  # fmt: skip
                    if book is not None:  # the vLLM blocks its KV events name
                        hs = book.hashes(k)
                        e["blocks"] = None if hs is None else [
                            h.hex() if isinstance(h, bytes) else h for h in hs
                        ]
                    found.append(e)
        found.sort(key=lambda e: e["key"])
        return {"entries": found[: max(0, limit)], "total": len(found)}

    async def _warm_source(self, key: str) -> bytes | bytearray | memoryview | None:
        """The nearest verified copy of ``key`` (a tier of this node, then a peer), read
        without counting a hit: warming is not traffic."""
        for slot in self.store.slots:
            if not (await slot.tier.contains_many([key]))[0]:
                continue
            raw = await slot.tier.get(key)
            if raw is None:
                continue
            try:
                codec.decode(raw, expect_key=key)
            except codec.ChunkError:
                self.metrics.verification_failures.labels(slot.name).inc()
                continue
            return bytes(raw)
        hit = await self.store._get_from_peer(key, None)
        return None if hit is None else hit.encoded()

    async def _warm(self, pin: Pin) -> dict[str, Any]:
        """Copy each chunk of ``pin`` into every pinned tier of this node that lacks it."""
        slots = [self.store.by_name[t] for t in pin.tiers if t in self.store.by_name]
        copied = 0
        missing: list[str] = []
        for key in pin.keys:
            lacking = [s for s in slots if not (await s.tier.contains_many([key]))[0]]
            if not lacking:
                continue
            raw = await self._warm_source(key)
            if raw is None:
                missing.append(key)
                continue
            for s in lacking:
                if await self.store._write_tier(s, key, raw, force=True):
                    copied += 1
        res = (await self._residency([pin]))[pin.id]
        return {"copied": copied, "missing": missing, "residency": res}

    async def _clear(self, tier: str, include_pinned: bool) -> dict[str, Any]:
        slot = self.store.by_name.get(tier)
        if slot is None:
            raise ValueError(
                f"this node has no {tier} tier (has {', '.join(s.name for s in self.store.slots)})"
            )
        pinned: set[str] = set() if include_pinned else self.store.pinned_keys(tier)
        held = [k for k, _ in slot.tier.entries()]
        keys = [k for k in held if k not in pinned]
        for k in keys:
            await self.store.delete(k, tiers=[tier])
        return {"removed": len(keys), "kept_pinned": len(held) - len(keys)}

    async def _residency(self, pins: list[Pin]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for p in pins:
            per: dict[str, str] = {}
            for t in p.tiers:
                slot = self.store.by_name.get(t)
                if slot is None:
                    per[t] = "n/a"
                    continue
                have = (
                    await slot.tier.contains_many(p.keys)
                    if t != "s3"
                    else [slot.tier.size_of(k) is not None for k in p.keys]
                )
                n = sum(have)
                per[t] = "resident" if n == len(p.keys) else ("missing" if n == 0 else "pending")
            out[p.id] = per
        return out


def _metric_summary(m: Metrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in m.registry.collect():
        for s in metric.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            lbl = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{lbl}}}" if lbl else s.name] = s.value
    return out
