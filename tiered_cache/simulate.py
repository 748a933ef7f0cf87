"""Trace-driven simulator: replay a Mooncake-format trace through the real ``TieredStore``.

The simulator drives the production hierarchy (``tiered_cache.hierarchy.TieredStore``) and
the production policy classes (``policies``); only payload I/O is stubbed out:

- ``SimTier`` is a ``Tier`` that keeps one tiny encoded chunk (the 256-byte codec header,
  empty payload) per key and *charges* every chunk ``block_bytes`` against its capacity,
  whatever the stub's length. Capacity, room checks, usage and bytes written are therefore
  in trace blocks of ``block_bytes`` each, while the store's code path (admission, make
  room, eviction, write-back demotion, verification, promotion) runs unchanged.
- The store reports to a plain ``StoreEvents`` (no-ops): Prometheus bookkeeping would
  dominate the replay time and the simulator counts what it reports itself.

Per request (one JSON record: ``hash_ids`` = one id per 512-token block, equal ids = equal
prefix), exactly what the vLLM connector does:

1. ``lookup(keys)``: the leading loadable blocks and the tier serving each. Their count
   is the request's prefix hit (later blocks found in a tier do not count: the prefix is
   broken).
2. ``get`` each hit block (``promote=True``): the tier's policy sees the access and a
   lower-tier hit is promoted to the top tier (background writes are flushed before the
   next step, so a replay is deterministic).
3. ``put`` every block after the hit (the connector saves from the first block that was
   not found) with ``EntryInfo(parent=previous block, position=index)``.

Reference figures, computed on the same block access sequence (per request, its blocks):

- ``belady``: Belady's MIN (``policies.belady``) on one tier of the *total* capacity of
  all tiers, in its bypass form (a missed block whose next use is farther than every
  resident's is not cached). This is the ceiling the online policies are compared with.
  On a prefix trace (a block id determines its parent, as Mooncake's remapped prefix
  hashes do) a block is always used no later than its children, so this MIN keeps the
  cache closed under prefixes: every block hit is a prefix hit, and since no policy gets
  more prefix hits than block hits, its prefix-hit figure is the optimum over all
  policies (``tests/test_simulate.py`` checks it against a brute-force search).
- ``belady_demand``: classic demand-paging MIN (every missed block is cached; the
  figure in /work/shared/traces/README.md). It can evict a parent while caching the
  child, so it can fall below the prefix optimum; in practice by well under 0.1%.
  Its bytes written (every miss) are reported as Belady's write volume.
- ``unbounded``: a cache that never evicts (only compulsory misses).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import xxhash

from policies import (
    ADMISSION_POLICIES,
    EVICTION_POLICIES,
    EntryInfo,
    make_admission,
    make_eviction,
)
from policies.belady import belady_hits
from tiered_cache import codec
from tiered_cache.api import TIERS
from tiered_cache.config import parse_size
from tiered_cache.events import StoreEvents
from tiered_cache.hierarchy import TieredStore, TierSlot
from tiered_cache.tiers.base import Tier, TierUsage

BLOCK_TOKENS = 512
# One 512-token block of Llama-3.1-8B KV in bf16: 2 (K, V) x 32 layers x 8 KV heads
# x 128 dims x 2 bytes = 128 KiB per token, 64 MiB per block.
DEFAULT_BLOCK_BYTES = 512 * 128 * 1024
_FINGERPRINT = b"tiered-cache-sim"  # 16 bytes
_HCRC = struct.Struct("<I")

Record = dict[str, Any]


class SimError(ValueError):
    """Bad simulator input (tier spec, policy name, trace). One line, for the CLI."""


# ----------------------------------------------------------------------------- stubs


class SimTier(Tier):
    """A size-only tier: every chunk costs ``block_bytes`` of ``capacity_bytes``.

    It keeps the (tiny) encoded stub it was given so reads, verification, promotion and
    write-back demotion run through the store's normal code path. ``bytes_written``
    counts ``block_bytes`` per stored chunk (SSD wear for an NVMe tier).
    """

    def __init__(self, name: str, capacity_bytes: int, block_bytes: int) -> None:
        if block_bytes < 1:
            raise SimError("block bytes must be >= 1")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self._data: dict[str, bytes | bytearray | memoryview] = {}
        self.writes = 0
        self.bytes_written = 0

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.block_bytes

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        d = self._data
        return [k in d for k in keys]

    async def get(self, key: str) -> bytes | bytearray | None:
        raw = self._data.get(key)
        if raw is None or isinstance(raw, bytes | bytearray):
            return raw
        return bytes(raw)

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._data[key] = data
        self.writes += 1
        self.bytes_written += self.block_bytes

    async def delete(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    def usage(self) -> TierUsage:
        n = len(self._data)
        return TierUsage(n * self.block_bytes, self.capacity_bytes, n)

    def entries(self) -> Iterator[tuple[str, int]]:
        return ((k, self.block_bytes) for k in list(self._data))

    def size_of(self, key: str) -> int | None:
        return self.block_bytes if key in self._data else None

    def fits(self, nbytes: int) -> bool:
        return self.block_bytes <= self.capacity_bytes

    def has_room(self, nbytes: int) -> bool:
        return (len(self._data) + 1) * self.block_bytes <= self.capacity_bytes


def block_key(hash_id: int) -> str:
    """The 32-hex chunk key of a trace block id (ids are 0 <= id < 2**128)."""
    return f"{hash_id:032x}"


def stub_chunk(key: str, block_tokens: int = BLOCK_TOKENS) -> bytes:
    """A valid encoded chunk for ``key`` with an empty payload (header only)."""
    meta = codec.ChunkMeta(key=key, fingerprint=_FINGERPRINT, num_tokens=block_tokens)
    return codec.pack_header(meta, b"")


class StubEncoder:
    """``stub_chunk`` in well under a microsecond: the header of an empty-payload chunk
    differs between keys only in the key field and the header checksum, so both are
    patched into a template built once by ``codec.pack_header`` (the result is
    byte-identical; the tests check it)."""

    _KEY_AT = 28  # magic 4 | version 2 | header_len 2 | flags 4 | fingerprint 16

    def __init__(self, block_tokens: int = BLOCK_TOKENS) -> None:
        probe = "ab" * 16
        tpl = stub_chunk(probe, block_tokens)
        at = self._KEY_AT
        if tpl[at : at + 16] != bytes.fromhex(probe) or len(tpl) != codec.HEADER_SIZE:
            raise RuntimeError("codec header layout changed: update StubEncoder")
        self._pre = tpl[:at]
        self._post = tpl[at + 16 : codec.HEADER_SIZE - 4]

    def __call__(self, key: str) -> bytes:
        body = self._pre + bytes.fromhex(key) + self._post
        return body + _HCRC.pack(xxhash.xxh32_intdigest(body))


# ----------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class TierSpec:
    name: str
    capacity_blocks: int
    eviction: str | None = None  # None: the run's policy
    admission: str | None = None  # None: the run's admission


_TIER_RE = re.compile(r"^\s*([A-Za-z0-9_]+)\s*=\s*([^:]+?)\s*(?::([^:]*))?(?::([^:]*))?\s*$")


def parse_tier(spec: str, block_bytes: int = DEFAULT_BLOCK_BYTES) -> TierSpec:
    """``NAME=SIZE[:EVICTION[:ADMISSION]]``. A bare SIZE counts blocks; with a unit
    (``64GiB``) it is bytes, turned into whole blocks of ``block_bytes``."""
    m = _TIER_RE.match(spec)
    if not m:
        raise SimError(f"bad --tier {spec!r}: use NAME=SIZE[:EVICTION[:ADMISSION]], e.g. dram=8000")
    name, size, ev, adm = m.group(1).lower(), m.group(2), m.group(3), m.group(4)
    if name not in TIERS:
        raise SimError(f"bad --tier {spec!r}: tier must be one of {', '.join(TIERS)}")
    if size.isdigit():
        blocks = int(size)
    else:
        try:
            blocks = parse_size(size) // block_bytes
        except ValueError as e:
            raise SimError(f"bad --tier {spec!r}: {e}") from None
    if blocks < 1:
        raise SimError(f"bad --tier {spec!r}: capacity must be at least one block")
    if ev:
        check_policy(ev)
    if adm:
        check_admission(adm)
    return TierSpec(name, blocks, ev.lower() if ev else None, adm.lower() if adm else None)


def check_policy(name: str) -> str:
    if name.lower() not in EVICTION_POLICIES:
        raise SimError(
            f"unknown policy {name!r}; valid: all, {', '.join(sorted(EVICTION_POLICIES))}"
        )
    return name.lower()


def check_admission(name: str) -> str:
    if name.lower() not in ADMISSION_POLICIES:
        raise SimError(
            f"unknown admission policy {name!r}; valid: {', '.join(sorted(ADMISSION_POLICIES))}"
        )
    return name.lower()


def parse_policies(spec: str) -> list[str]:
    """``all``, one name, or a comma-separated list."""
    if spec.strip().lower() == "all":
        return sorted(EVICTION_POLICIES)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise SimError("empty --policy")
    return [check_policy(n) for n in names]


def load_trace(path: str | Path, limit: int | None = None) -> list[Record]:
    """Read a Mooncake-format JSONL trace (``hash_ids`` and ``input_length`` needed)."""
    if limit is not None and limit < 1:
        raise SimError("--limit must be at least 1")
    p = Path(path)
    if not p.is_file():
        raise SimError(f"trace not found: {path}")
    out: list[Record] = []
    with open(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = rec["hash_ids"]
                if not isinstance(ids, list) or not all(
                    isinstance(x, int) and 0 <= x < 1 << 128 for x in ids
                ):
                    raise TypeError("hash_ids must be a list of integers in [0, 2**128)")
                rec.setdefault("input_length", len(ids) * BLOCK_TOKENS)
            except (ValueError, KeyError, TypeError) as e:
                raise SimError(f"{path}:{lineno}: not a Mooncake trace record ({e})") from None
            out.append(rec)
            if limit is not None and len(out) >= limit:
                break
    return out


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


# ----------------------------------------------------------------------------- report


def run(
    records: Sequence[Record],
    tiers: Sequence[TierSpec],
    policies: Sequence[str],
    admission: str = "always",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    block_tokens: int = BLOCK_TOKENS,
    capacity_hints: bool = False,
    demand_belady: bool = False,
) -> dict[str, Any]:
    """Every policy plus the references, as the JSON report the CLI prints.
    ``demand_belady`` adds demand-paging MIN (another O(n log n) pass), the only
    reference with a write volume."""
    total = sum(t.capacity_blocks for t in tiers)
    ref = belady(records, total, True, block_bytes, block_tokens)
    unb = unbounded(records, block_bytes, block_tokens)
    out: dict[str, Any] = {"policies": {}}
    for p in policies:
        r = simulate(records, tiers, p, admission, block_bytes, block_tokens, capacity_hints)
        d = r.to_dict()
        d["ratio_to_belady"] = (
            r.prefix_hit_ratio / ref.prefix_hit_ratio if ref.prefix_hit_ratio else None
        )
        out["policies"][p] = d
    out.update(
        {
            "belady_prefix_hit_ratio": ref.prefix_hit_ratio,
            "unbounded_prefix_hit_ratio": unb.prefix_hit_ratio,
            "belady": ref.to_dict(),
            "unbounded": unb.to_dict(),
            "requests": len(records),
            "blocks": ref.blocks,
            "capacity_blocks": total,
            "tiers": [
                {
                    "name": t.name,
                    "capacity_blocks": t.capacity_blocks,
                    "eviction": t.eviction,  # None: the run's policy
                    "admission": t.admission or admission,
                }
                for t in tiers
            ],
            "block_bytes": block_bytes,
            "admission": admission,
        }
    )
    if demand_belady:
        dem = belady(records, total, False, block_bytes, block_tokens)
        out["belady_demand_prefix_hit_ratio"] = dem.prefix_hit_ratio
        out["belady_demand"] = dem.to_dict()
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def format_report(rep: dict[str, Any]) -> str:
    """Human-readable table of a ``run`` report."""
    tiers = [t["name"] for t in rep["tiers"]]
    caps = ", ".join(
        f"{t['name']}={t['capacity_blocks']}"
        + (
            f" ({t['eviction'] or '*'}/{t['admission']})"
            if t["eviction"] or t["admission"] != rep["admission"]
            else ""
        )
        for t in rep["tiers"]
    )
    lines = [
        f"{rep['requests']} requests, {rep['blocks']} blocks; capacity {caps} blocks "
        f"({rep['block_bytes'] / 2**20:g} MiB each)",
        "",
    ]
    head = f"{'policy':<14}{'prefix hit':>11}{'/belady':>9}{'tok saved':>12}{'attn saved':>11}"
    head += "".join(f"{t + ' hit':>10}" for t in tiers)
    head += "".join(f"{t + ' written':>18}" for t in tiers)
    lines.append(head)
    for name, d in rep["policies"].items():
        row = f"{name:<14}{d['prefix_hit_ratio']:>11.3f}"
        ratio = d.get("ratio_to_belady")
        row += f"{ratio:>9.3f}" if ratio is not None else f"{'-':>9}"
        row += f"{d['prefill_tokens_saved']:>12,}{d['attention_saved_ratio']:>11.3f}"
        row += "".join(f"{d['tiers'][t]['hit_ratio']:>10.3f}" for t in tiers)
        row += "".join(f"{_gib(d['tiers'][t]['bytes_written']):>18}" for t in tiers)
        lines.append(row)
    for ref in ("belady", "belady_demand", "unbounded"):
        if ref not in rep:
            continue
        d = rep[ref]
        row = f"{ref:<14}{d['prefix_hit_ratio']:>11.3f}{'':>9}{d['prefill_tokens_saved']:>12,}"
        row += f"{d['attention_saved_ratio']:>11.3f}"
        row += (
            "   (unbounded"
            if ref == "unbounded"
            else f"   (one tier of {rep['capacity_blocks']} blocks"
        )
        if d["bytes_written"] is not None:
            row += f", {_gib(d['bytes_written'])} written"
        row += ")"
        lines.append(row)
    return "\n".join(lines)
