"""The replay through a ``TieredStore`` of ``SimTier``s, and the reference figures
(Belady's MIN, unbounded) computed on the same block access sequence."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from policies import EVICTION_POLICIES, EntryInfo, make_admission, make_eviction
from policies.belady import belady_hits
from tiered_cache.events import StoreEvents
from tiered_cache.hierarchy import TieredStore, TierSlot
from tiered_cache.simulate.specs import TierSpec, check_admission, check_policy
from tiered_cache.simulate.stubs import (
    BLOCK_TOKENS,
    DEFAULT_BLOCK_BYTES,
    Record,
    SimError,
    SimTier,
    StubEncoder,
)

# ----------------------------------------------------------------------------- results


@dataclass
class TierResult:
    name: str
    eviction: str
    admission: str
    capacity_blocks: int
    hit_blocks: int = 0  # leading blocks this tier served
    hit_ratio: float = 0.0  # hit_blocks / all blocks
    writes: int = 0  # chunks written (puts, demotions, promotions)
    bytes_written: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "eviction": self.eviction,
            "admission": self.admission,
            "capacity_blocks": self.capacity_blocks,
            "hit_blocks": self.hit_blocks,
            "hit_ratio": self.hit_ratio,
            "writes": self.writes,
            "bytes_written": self.bytes_written,
        }


@dataclass
class RunResult:
    """One replay: an online policy through the store, or a reference (Belady, unbounded)."""

    name: str
    requests: int
    blocks: int
    hit_blocks: int  # leading cached blocks, summed over requests
    tokens_saved: int
    prompt_tokens: int
    tiers: list[TierResult] = field(default_factory=list)
    seconds: float = 0.0
    # Attention prefill work in units of one block pair: a request of n blocks costs
    # n**2 (block i attends to i+1 blocks, 2i+1 half-pairs); a prefix hit of h saves h**2.
    attention_saved: int = 0
    attention_total: int = 0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def attention_saved_ratio(self) -> float:
        return self.attention_saved / self.attention_total if self.attention_total else 0.0

    @property
    def bytes_written(self) -> int | None:
        return sum(t.bytes_written for t in self.tiers) if self.tiers else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefix_hit_ratio": self.prefix_hit_ratio,
            "hit_blocks": self.hit_blocks,
            "blocks": self.blocks,
            "prefill_tokens_saved": self.tokens_saved,
            "prompt_tokens": self.prompt_tokens,
            "attention_saved_ratio": self.attention_saved_ratio,
            "bytes_written": self.bytes_written,
            "tiers": {t.name: t.to_dict() for t in self.tiers},
            "seconds": round(self.seconds, 3),
            "requests_per_s": round(self.requests / self.seconds, 1) if self.seconds else None,
        }


def _tokens_saved(rec: Record, hit: int, block_tokens: int) -> int:
    """Prompt tokens a prefix hit of ``hit`` blocks spares (the last block may be partial)."""
    return min(hit * block_tokens, int(rec.get("input_length", 0)))


# ----------------------------------------------------------------------------- replay


def _policy_kwargs(cls: type, capacity_blocks: int, hint: bool) -> dict[str, Any]:
    if hint and "capacity_hint" in inspect.signature(cls).parameters:
        return {"capacity_hint": capacity_blocks}
    return {}


def build_store(
    tiers: Sequence[TierSpec],
    policy: str,
    admission: str = "always",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    capacity_hints: bool = False,
) -> TieredStore:
    """A ``TieredStore`` over ``SimTier``s, policies built like the agent builds them
    (``make_eviction(name)``; with ``capacity_hints`` the tier size is passed too)."""
    if not tiers:
        raise SimError("at least one --tier is needed")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise SimError(f"duplicate tiers: {', '.join(names)}")
    slots = []
    for t in tiers:
        ev = t.eviction or check_policy(policy)
        adm = t.admission or check_admission(admission)
        ev_cls = EVICTION_POLICIES[ev]
        slots.append(
            TierSlot(
                tier=SimTier(t.name, t.capacity_blocks * block_bytes, block_bytes),
                eviction=make_eviction(
                    ev, **_policy_kwargs(ev_cls, t.capacity_blocks, capacity_hints)
                ),
                admission=make_admission(adm),
                write_mode="write_back",
            )
        )
    return TieredStore(slots, events=StoreEvents())


async def _replay(
    store: TieredStore, records: Sequence[Record], block_tokens: int
) -> tuple[int, int, int, dict[str, int]]:
    hit_blocks = tokens_saved = attention = 0
    served: dict[str, int] = {s.name: 0 for s in store.slots}
    lookup, get, put, flush = store.lookup, store.get, store.put, store.flush
    stub = StubEncoder(block_tokens)
    for rec in records:
        ids = rec["hash_ids"]
        if not ids:
            continue
        keys = [f"{h:032x}" for h in ids]
        sources = await lookup(keys)
        hit = len(sources)
        if hit:
            for src in sources:
                served[src] = served.get(src, 0) + 1
            for k in keys[:hit]:
                await get(k, promote=True)
            await flush()  # promotions land before this request's own writes
        parent = keys[hit - 1] if hit else None
        for i in range(hit, len(keys)):
            k = keys[i]
            await put(k, stub(k), info=EntryInfo(parent, i))
            parent = k
        hit_blocks += hit
        attention += hit * hit
        tokens_saved += _tokens_saved(rec, hit, block_tokens)
    await flush()
    return hit_blocks, tokens_saved, attention, served


def _attention_total(records: Sequence[Record]) -> int:
    return sum(len(r["hash_ids"]) ** 2 for r in records)


def _totals(records: Sequence[Record]) -> tuple[int, int]:
    return (
        sum(len(r["hash_ids"]) for r in records),
        sum(int(r.get("input_length", 0)) for r in records),
    )


def simulate(
    records: Sequence[Record],
    tiers: Sequence[TierSpec],
    policy: str,
    admission: str = "always",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    block_tokens: int = BLOCK_TOKENS,
    capacity_hints: bool = False,
) -> RunResult:
    """Replay ``records`` through a ``TieredStore`` with ``policy`` on every tier that
    does not name its own."""
    store = build_store(tiers, policy, admission, block_bytes, capacity_hints)
    t0 = time.perf_counter()
    hit, saved, attention, served = asyncio.run(_replay(store, records, block_tokens))
    seconds = time.perf_counter() - t0
    blocks, prompt_tokens = _totals(records)
    res = RunResult(
        policy,
        len(records),
        blocks,
        hit,
        saved,
        prompt_tokens,
        seconds=seconds,
        attention_saved=attention,
        attention_total=_attention_total(records),
    )
    for slot, spec in zip(store.slots, tiers, strict=True):
        st = cast(SimTier, slot.tier)
        res.tiers.append(
            TierResult(
                name=slot.name,
                eviction=slot.eviction.name,
                admission=slot.admission.name,
                capacity_blocks=spec.capacity_blocks,
                hit_blocks=served.get(slot.name, 0),
                hit_ratio=served.get(slot.name, 0) / blocks if blocks else 0.0,
                writes=st.writes,
                bytes_written=st.bytes_written,
            )
        )
    return res


# ----------------------------------------------------------------------------- references


def access_sequence(records: Sequence[Record]) -> list[int]:
    """The block access sequence the store sees: per request, its blocks in order."""
    return [h for r in records for h in r["hash_ids"]]


def prefix_hits_from_block_hits(records: Sequence[Record], hits: Sequence[bool]) -> list[int]:
    """Per request, the length of its leading run of block hits."""
    out: list[int] = []
    j = 0
    for r in records:
        n = len(r["hash_ids"])
        h = 0
        while h < n and hits[j + h]:
            h += 1
        out.append(h)
        j += n
    return out


def _reference(
    name: str,
    records: Sequence[Record],
    hits: Sequence[bool],
    capacity_blocks: int | None,
    block_bytes: int,
    block_tokens: int,
    inserts: int | None,
) -> RunResult:
    per_req = prefix_hits_from_block_hits(records, hits)
    blocks, prompt_tokens = _totals(records)
    hit = sum(per_req)
    saved = sum(_tokens_saved(r, h, block_tokens) for r, h in zip(records, per_req, strict=True))
    res = RunResult(
        name,
        len(records),
        blocks,
        hit,
        saved,
        prompt_tokens,
        attention_saved=sum(h * h for h in per_req),
        attention_total=_attention_total(records),
    )
    if inserts is None:
        return res
    res.tiers.append(
        TierResult(
            name="all",
            eviction=name,
            admission="always",
            capacity_blocks=capacity_blocks if capacity_blocks is not None else -1,
            hit_blocks=hit,
            hit_ratio=hit / blocks if blocks else 0.0,
            writes=inserts,
            bytes_written=inserts * block_bytes,
        )
    )
    return res


def belady(
    records: Sequence[Record],
    capacity_blocks: int,
    bypass: bool = True,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    block_tokens: int = BLOCK_TOKENS,
) -> RunResult:
    """Belady's MIN on one tier of ``capacity_blocks``; prefix hits counted like the store.
    ``bypass=True``: the prefix-hit optimum (see the module doc); False: demand paging."""
    t0 = time.perf_counter()
    seq = access_sequence(records)
    hits = belady_hits(seq, capacity_blocks, bypass=bypass)
    # Demand paging writes every miss; with bypass the writes are not observable from
    # the hit pattern alone, so none are reported.
    inserts = (len(hits) - sum(hits)) if capacity_blocks > 0 and not bypass else None
    res = _reference(
        "belady" if bypass else "belady_demand",
        records,
        hits,
        capacity_blocks,
        block_bytes,
        block_tokens,
        inserts,
    )
    res.seconds = time.perf_counter() - t0
    return res


def unbounded(
    records: Sequence[Record],
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    block_tokens: int = BLOCK_TOKENS,
) -> RunResult:
    """A cache that never evicts: only first sightings miss."""
    seen: set[int] = set()
    hits: list[bool] = []
    for h in access_sequence(records):
        hits.append(h in seen)
        seen.add(h)
    return _reference(
        "unbounded", records, hits, None, block_bytes, block_tokens, inserts=len(seen)
    )
