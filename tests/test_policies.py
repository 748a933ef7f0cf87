"""Eviction/admission policies, Belady's optimum and the synthetic trace generator."""

from __future__ import annotations

import functools
import inspect
import math
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import (
    ADMISSION_POLICIES,
    ARC,
    EVICTION_POLICIES,
    LFU,
    S3FIFO,
    SIEVE,
    CostAware,
    EntryInfo,
    EvictionPolicy,
    PrefixAware,
    TinyLFU,
    make_admission,
    make_eviction,
)
from policies.belady import belady_hits, next_uses
from policies.tracegen import BLOCK_TOKENS, generate_trace

ALL = sorted(EVICTION_POLICIES)


def make(name: str, capacity: int | None = None) -> EvictionPolicy:
    cls = EVICTION_POLICIES[name]
    if capacity is not None and "capacity_hint" in inspect.signature(cls).parameters:
        return make_eviction(name, capacity_hint=capacity)
    return make_eviction(name)


def chain_info(k: int) -> EntryInfo:
    """Keys 0..N form chains of 4: 0<-1<-2<-3, 4<-5<-6<-7, ... (parent = k-1)."""
    pos = k % 4
    return EntryInfo(parent=str(k - 1) if pos else None, position=pos)


class Tier:
    """Mimics the hierarchy: a tier of ``capacity`` entries with pins and a policy."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self.resident: dict[str, EntryInfo] = {}
        self.pinned: set[str] = set()
        self.evicted: list[str] = []

    @property
    def evictable(self) -> set[str]:
        return set(self.resident) - self.pinned

    def evict_one(self) -> str | None:
        v = self.policy.victim()
        if v is None:
            assert not self.evictable
            return None
        assert v in self.resident, f"victim {v!r} is not resident"
        assert v not in self.pinned, f"victim {v!r} is pinned"
        assert self.policy.victim() == v, "victim() must be stable until on_remove"
        del self.resident[v]
        self.policy.on_remove(v)
        self.evicted.append(v)
        return v

    def put(self, key: str, info: EntryInfo | None = None, size: int = 1) -> bool:
        if key in self.resident:
            self.access(key)
            return True
        while len(self.resident) >= self.capacity:
            if self.evict_one() is None:
                return False  # everything pinned
        self.resident[key] = info or EntryInfo()
        self.policy.on_insert(key, size, info)
        return True

    def access(self, key: str) -> bool:
        if key in self.resident:
            self.policy.on_access(key)
            return True
        return False

    def delete(self, key: str) -> None:
        if self.resident.pop(key, None) is not None:
            self.pinned.discard(key)
            self.policy.on_remove(key)

    def pin(self, key: str) -> None:
        if key in self.resident and key not in self.pinned:
            self.pinned.add(key)
            self.policy.on_remove(key)

    def unpin(self, key: str) -> None:
        if key in self.pinned:
            self.pinned.discard(key)
            self.policy.on_insert(key, 1, self.resident[key])

    def check(self, universe: Sequence[str]) -> None:
        assert len(self.resident) <= self.capacity
        assert len(self.policy) == len(self.evictable)
        assert {k for k in universe if k in self.policy} == self.evictable


# ---------------------------------------------------------------- registry


def test_registry_names() -> None:
    assert set(EVICTION_POLICIES) == {"lru", "lfu", "arc", "s3fifo", "sieve", "prefix", "cost", "wtinylfu"}
    assert set(ADMISSION_POLICIES) == {"always", "frequency", "tinylfu"}
    for name in EVICTION_POLICIES:
        assert make_eviction(name.upper()).name == name
    for name in ADMISSION_POLICIES:
        assert make_admission(name).name == name


def test_unknown_names_list_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: arc, cost, lfu, lru, prefix, s3fifo, sieve"):
        make_eviction("mru")
    with pytest.raises(ValueError, match="valid: always, frequency, tinylfu"):
        make_admission("never")


# ---------------------------------------------------------------- invariants


@pytest.mark.parametrize("name", ALL)
def test_capacity_victim_and_pins(name: str) -> None:
    rng = random.Random(7)
    cap = 16
    tier = Tier(make(name, cap), cap)
    universe = [str(k) for k in range(80)]
    for step in range(3000):
        k = rng.randrange(80) if rng.random() < 0.5 else rng.randrange(20)
        key = str(k)
        r = rng.random()
        if r < 0.6:
            tier.put(key, chain_info(k))
        elif r < 0.85:
            tier.access(key)
        elif r < 0.9:
            tier.pin(key)
        elif r < 0.95:
            tier.unpin(key)
        else:
            tier.delete(key)
        if step % 50 == 0:
            tier.check(universe)
    tier.check(universe)
    assert tier.evicted


@pytest.mark.parametrize("name", ALL)
def test_pinned_never_evicted(name: str) -> None:
    cap = 8
    tier = Tier(make(name, cap), cap)
    for k in range(8):
        tier.put(str(k), chain_info(k))
        tier.access(str(k))
    pinned = {"0", "1", "5"}
    for key in pinned:
        tier.pin(key)
    for k in range(100, 400):
        assert tier.put(str(k), chain_info(k))
        assert not pinned & set(tier.evicted)
    assert pinned <= set(tier.resident)
    # fill with pins: victim() must say "nothing to evict" rather than hand out a pin
    for key in list(tier.resident):
        tier.pin(key)
    assert tier.policy.victim() is None
    assert not tier.put("fresh")
    for key in pinned:
        tier.unpin(key)
    assert tier.policy.victim() in pinned


@pytest.mark.parametrize("name", ALL)
def test_unknown_keys_are_noops(name: str) -> None:
    p = make(name, 4)
    assert p.victim() is None
    p.on_remove("ghost")
    p.on_access("ghost")
    assert len(p) == 0 and "ghost" not in p and p.victim() is None
    for k in range(3):
        p.on_insert(str(k), 1, chain_info(k))
    before = p.victim()
    p.on_remove("nope")
    p.on_access("nope")
    assert len(p) == 3 and "nope" not in p and p.victim() == before
    p.on_remove(str(0))
    p.on_remove(str(0))  # twice: second is a no-op
    assert len(p) == 2


@pytest.mark.parametrize("name", ALL)
def test_reinsert_of_resident_key_does_not_duplicate(name: str) -> None:
    p = make(name, 4)
    p.on_insert("a", 1)
    p.on_insert("a", 1)
    assert len(p) == 1
    assert p.victim() == "a"
    p.on_remove("a")
    assert len(p) == 0 and p.victim() is None


@pytest.mark.parametrize("hint", [None, 32])
def test_arc_ghosts_bounded(hint: int | None) -> None:
    cap = 32
    p = ARC(capacity_hint=hint)
    tier = Tier(p, cap)
    rng = random.Random(1)
    for _ in range(20_000):
        k = int(rng.paretovariate(0.6)) % 5000
        tier.put(str(k))
        b1, b2 = p.ghost_sizes()
        assert b1 + len(p._t1) <= p.capacity
        assert b1 + b2 <= 2 * p.capacity
    assert p.capacity == cap
    assert sum(p.ghost_sizes()) > 0
    assert 0.0 <= p.p <= cap


@pytest.mark.parametrize("hint", [None, 40])
def test_s3fifo_ghost_bounded(hint: int | None) -> None:
    cap = 40
    p = S3FIFO(capacity_hint=hint)
    tier = Tier(p, cap)
    rng = random.Random(2)
    for _ in range(20_000):
        k = int(rng.paretovariate(0.6)) % 5000
        tier.put(str(k))
        if rng.random() < 0.3:
            tier.access(str(k))
        assert p.ghost_size() <= p.ghost_limit <= cap
    assert p.ghost_size() > 0
    assert p.small_target == 4


@pytest.mark.parametrize("name", ["lfu", "cost", "prefix"])
def test_lazy_heaps_stay_bounded(name: str) -> None:
    p = make(name, 10)
    for k in range(10):
        p.on_insert(str(k), 1, EntryInfo(position=k))
    for i in range(10_000):
        p.on_access(str(i % 10))
    heap = p._heap  # type: ignore[attr-defined]
    assert len(heap) <= 2 * len(p) + 65


# ---------------------------------------------------------------- known answers


def drive(name: str, cap: int, ops: list[str], **kw: object) -> Tier:
    """ops: "+k" insert, "k" access, "-k" delete. Returns the tier (see .evicted)."""
    p = make_eviction(name, **kw) if kw else make(name, cap)
    tier = Tier(p, cap)
    for op in ops:
        if op.startswith("+"):
            tier.put(op[1:])
        elif op.startswith("-"):
            tier.delete(op[1:])
        else:
            assert tier.access(op), op
    return tier


def test_lru_evicts_least_recent() -> None:
    t = drive("lru", 3, ["+a", "+b", "+c", "a", "+d", "c", "+e"])
    assert t.evicted == ["b", "a"]


def test_lfu_evicts_least_frequent() -> None:
    t = drive("lfu", 3, ["+a", "+b", "+c", "a", "a", "b", "c", "c", "c", "+d", "+e"])
    # freq a=3 b=2 c=4: b goes first, then d (freq 1, L raised to 2 -> K=3 = a's K; d newer)
    assert t.evicted == ["b", "a"]


def test_lfu_ties_go_to_least_recent() -> None:
    t = drive("lfu", 3, ["+a", "+b", "+c", "+d"])
    assert t.evicted == ["a"]


def test_lfu_aging_lets_old_popular_keys_go() -> None:
    p = LFU()
    tier = Tier(p, 2)
    tier.put("old")
    for _ in range(5):
        tier.access("old")  # freq 6: plain LFU would keep it forever
    for i in range(20):
        tier.put(f"n{i}")
        tier.access(f"n{i}")  # every newcomer has freq 2
        if "old" in tier.evicted:
            break
    assert "old" in tier.evicted
    assert p.frequency("old") == 0


def test_lfu_keeps_frequency_across_pin() -> None:
    p = LFU()
    p.on_insert("a", 1)
    p.on_access("a")
    p.on_remove("a")  # pinned (not via victim)
    p.on_access("a")  # read while pinned
    p.on_insert("a", 1)  # unpinned
    assert p.frequency("a") == 3
    p.on_insert("b", 1)
    assert p.victim() == "b"


def test_arc_protects_frequent_entries_from_a_scan() -> None:
    ops = ["+a", "+b", "a", "b"] + [f"+s{i}" for i in range(20)]
    t = drive("arc", 4, ops)
    assert {"a", "b"} <= set(t.resident)
    assert len(t.evicted) == 18
    # LRU on the same sequence loses them
    assert {"a", "b"} <= set(drive("lru", 4, ops).evicted)


def test_arc_ghost_hit_adapts_target() -> None:
    p = ARC(capacity_hint=3)
    tier = Tier(p, 3)
    tier.put("a")
    tier.put("b")
    tier.access("b")  # T2 = [b]
    tier.put("c")
    tier.put("d")  # evicts a (T1's LRU) into B1
    assert tier.evicted == ["a"] and p.ghost_sizes() == (1, 0)
    assert p.p == 0
    tier.put("a")  # B1 hit: T1 was too small
    assert tier.evicted == ["a", "c"]
    assert p.p == 1
    assert "a" in p._t2 and p.ghost_sizes() == (1, 0)


def test_s3fifo_one_hit_wonders_leave_through_small_queue() -> None:
    cap = 10
    p = S3FIFO(capacity_hint=cap)
    tier = Tier(p, cap)
    hot = [f"h{i}" for i in range(5)]
    for k in hot:
        tier.put(k)
        tier.access(k)
    for i in range(50):
        tier.put(f"w{i}")  # one-hit wonders
    assert set(hot) <= set(tier.resident)
    assert all(p.queue_of(k) == "main" for k in hot)
    assert all(v.startswith("w") for v in tier.evicted)
    assert p.queue_of(tier.evicted[-1]) == "ghost"


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    p = S3FIFO(capacity_hint=10)
    tier = Tier(p, 10)
    for i in range(11):
        tier.put(f"k{i}")
    assert tier.evicted == ["k0"] and p.queue_of("k0") == "ghost"
    tier.put("k0")
    assert p.queue_of("k0") == "main"


def test_s3fifo_main_queue_gives_second_chances_capped_at_three() -> None:
    p = S3FIFO(capacity_hint=10)
    p.on_insert("a", 1)
    for _ in range(10):
        p.on_access("a")
    assert p._freq["a"] == 3


def test_sieve_visited_bit() -> None:
    p = SIEVE()
    tier = Tier(p, 3)
    for k in "abc":
        tier.put(k)
    tier.access("a")
    tier.put("d")  # hand at a: visited -> cleared, skipped; b evicted
    assert tier.evicted == ["b"]
    assert not p.visited("a")
    tier.put("e")  # hand continues from c (b's newer neighbour)
    assert tier.evicted == ["b", "c"]
    tier.access("d")
    tier.put("f")  # hand: d visited (cleared) -> e evicted; a stays in place
    assert tier.evicted == ["b", "c", "e"]
    tier.put("g")  # hand wraps to the tail: a (unvisited now) goes
    assert tier.evicted == ["b", "c", "e", "a"]


def test_prefix_evicts_leaves_before_ancestors() -> None:
    p = PrefixAware()
    tier = Tier(p, 5)
    tier.put("a", EntryInfo(None, 0))
    tier.put("b", EntryInfo("a", 1))
    tier.put("c", EntryInfo("b", 2))
    tier.put("x", EntryInfo(None, 0))
    tier.put("y", EntryInfo("x", 1))
    assert p.is_leaf("c") and p.is_leaf("y") and not p.is_leaf("a")
    # a is the least recent chunk, but it has a child: the oldest *leaf* goes first
    for k in ["z1", "z2", "z3", "z4", "z5"]:
        tier.put(k, EntryInfo(None, 0))
    assert tier.evicted == ["c", "b", "a", "y", "x"]


def test_prefix_leaf_order_is_recency() -> None:
    p = PrefixAware()
    tier = Tier(p, 4)
    tier.put("a", EntryInfo(None, 0))
    tier.put("b", EntryInfo("a", 1))
    tier.put("x", EntryInfo(None, 0))
    tier.access("a")
    tier.access("b")  # chain a-b now more recent than x
    tier.put("y", EntryInfo(None, 0))
    tier.put("z", EntryInfo(None, 0))
    assert tier.evicted == ["x"]
    tier.put("w", EntryInfo(None, 0))
    assert tier.evicted == ["x", "b"]


def test_prefix_child_inserted_before_parent() -> None:
    p = PrefixAware()
    p.on_insert("b", 1, EntryInfo("a", 1))
    p.on_insert("a", 1, EntryInfo(None, 0))
    assert p.victim() == "b"


def test_cost_keeps_deep_chunks_over_shallow() -> None:
    p = CostAware()
    tier = Tier(p, 2)
    tier.put("deep", EntryInfo("p", 20))
    tier.put("shallow", EntryInfo(None, 0))  # more recent, same size, cheaper
    tier.put("new", EntryInfo(None, 0))
    assert tier.evicted == ["shallow"]


def test_cost_ties_are_lru_and_aging_evicts_idle_expensive_chunks() -> None:
    p = CostAware()
    tier = Tier(p, 2)
    tier.put("a", EntryInfo(None, 3))
    tier.put("b", EntryInfo(None, 3))
    tier.put("c", EntryInfo(None, 3))
    assert tier.evicted == ["a"]
    tier2 = Tier(CostAware(), 2)
    tier2.put("deep", EntryInfo(None, 3))  # cost 7
    for i in range(20):
        tier2.put(f"s{i}", EntryInfo(None, 0))  # cost 1, each eviction raises L
        if "deep" in tier2.evicted:
            break
    assert "deep" in tier2.evicted


def test_cost_uses_size() -> None:
    p = CostAware()
    p.on_insert("big", 100, EntryInfo(None, 5))
    p.on_insert("small", 1, EntryInfo(None, 5))
    assert p.victim() == "big"


# ---------------------------------------------------------------- hypothesis model check

OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "access", "remove", "evict", "pin", "unpin"]),
        st.integers(0, 11),
    ),
    max_size=80,
)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, cap=st.integers(1, 6), hint=st.booleans())
def test_residency_matches_reference_model(
    name: str, ops: list[tuple[str, int]], cap: int, hint: bool
) -> None:
    p = make(name, cap if hint else None)
    universe = [str(k) for k in range(12)]
    model: set[str] = set()  # evictable residents
    pinned: set[str] = set()
    for op, k in ops:
        key = str(k)
        if op == "insert" and key not in model and key not in pinned:
            if len(model) + len(pinned) >= cap and model:
                v = p.victim()
                assert v in model
                model.discard(v)
                p.on_remove(v)
            if len(model) + len(pinned) < cap:
                p.on_insert(key, 1, chain_info(k))
                model.add(key)
        elif op == "insert" and key in model:
            p.on_insert(key, 1, chain_info(k))
        elif op == "access":
            p.on_access(key)
        elif op == "remove":
            p.on_remove(key)
            model.discard(key)
            pinned.discard(key)
        elif op == "evict":
            v = p.victim()
            if not model:
                assert v is None
            else:
                assert v in model
                if name == "prefix":  # never an ancestor of a resident chunk
                    assert str(int(v) + 1) not in model or int(v) % 4 == 3
                p.on_remove(v)
                model.discard(v)
        elif op == "pin" and key in model:
            p.on_remove(key)
            model.discard(key)
            pinned.add(key)
        elif op == "unpin" and key in pinned:
            pinned.discard(key)
            p.on_insert(key, 1, chain_info(k))
            model.add(key)
        assert {u for u in universe if u in p} == model
        assert len(p) == len(model)
        v = p.victim()
        assert (v in model) if model else v is None


# ---------------------------------------------------------------- admission


def test_tinylfu_threshold_and_doorkeeper() -> None:
    a = TinyLFU(threshold=2)
    assert not a.admit("k", 1)  # first sighting only reaches the doorkeeper
    assert a.estimate("k") == 1
    assert a._sketch_min(*a._hashes("k")) == 0
    assert a.admit("k", 1)
    assert a.estimate("k") == 2
    a.on_access("k")
    assert a.estimate("k") == 3


def test_tinylfu_never_underestimates_before_reset() -> None:
    a = TinyLFU(width=256, sample_factor=1000)
    rng = random.Random(3)
    counts: dict[str, int] = {}
    for _ in range(3000):
        key = f"k{int(rng.paretovariate(1.0)) % 400}"
        counts[key] = counts.get(key, 0) + 1
        a.on_access(key)
    assert a.resets == 0
    for key, c in counts.items():
        assert a.estimate(key) >= min(c, 16)
    hot = max(counts, key=counts.__getitem__)
    assert a.estimate(hot) == 16  # 15 (4-bit cap) + doorkeeper


def test_tinylfu_reset_halves_and_clears_doorkeeper() -> None:
    a = TinyLFU(width=16, sample_factor=4)  # reset every 64 sightings
    for _ in range(9):
        a.on_access("hot")
    assert a.estimate("hot") == 9
    for i in range(64 - 9):
        a.on_access(f"cold{i}")
    assert a.resets == 1
    assert a.estimate("hot") <= 4  # (8 >> 1) from the sketch, doorkeeper cleared


def test_tinylfu_admit_against_victim() -> None:
    a = TinyLFU(count_on_admit=False)
    for _ in range(5):
        a.on_access("hot")
    a.on_access("cold")
    assert not a.admit_against("cold", 1, "hot")
    assert a.admit_against("hot", 1, "cold")
    assert a.admit_against("cold", 1, None)


def test_tinylfu_validates() -> None:
    with pytest.raises(ValueError):
        TinyLFU(threshold=0)
    with pytest.raises(ValueError):
        TinyLFU(width=4)


# ---------------------------------------------------------------- Belady


def brute_force_hits(seq: Sequence[str], cap: int, bypass: bool) -> int:
    """Max hits over every eviction choice (and, with bypass, every admit/skip choice)."""

    @functools.cache
    def best(i: int, cache: frozenset[str]) -> int:
        if i == len(seq):
            return 0
        x = seq[i]
        if x in cache:
            return 1 + best(i + 1, cache)
        options = []
        if bypass or cap == 0:
            options.append(best(i + 1, cache))
        if cap > 0:
            if len(cache) < cap:
                options.append(best(i + 1, cache | {x}))
            else:
                options.extend(best(i + 1, (cache - {v}) | {x}) for v in cache)
        return max(options)

    return best(0, frozenset())


@settings(max_examples=300, deadline=None)
@given(
    seq=st.lists(st.sampled_from("abcde"), max_size=10),
    cap=st.integers(1, 3),
    bypass=st.booleans(),
)
def test_belady_matches_brute_force(seq: list[str], cap: int, bypass: bool) -> None:
    hits = belady_hits(seq, cap, bypass)
    assert len(hits) == len(seq)
    assert sum(hits) == brute_force_hits(seq, cap, bypass)


def test_belady_basics() -> None:
    assert belady_hits([], 3) == []
    assert belady_hits("aaa", 0) == [False] * 3
    assert belady_hits("aba", 1) == [False, False, False]
    assert belady_hits("aba", 1, bypass=True) == [False, False, True]
    assert next_uses("abab") == [2, 3, 4, 4]
    # works on ints and big inputs quickly
    rng = random.Random(0)
    seq = [int(rng.paretovariate(1.0)) % 2000 for _ in range(50_000)]
    hits = belady_hits(seq, 200)
    lru = Tier(make_eviction("lru"), 200)
    lru_hits = 0
    for x in seq:
        lru_hits += lru.access(str(x))
        lru.put(str(x))
    assert sum(hits) >= lru_hits


# ---------------------------------------------------------------- trace generator


@pytest.mark.parametrize("kind", ["zipf", "multiturn", "scan"])
def test_tracegen_shape_and_determinism(kind: str) -> None:
    recs = generate_trace(kind, 300, seed=5)
    assert recs == generate_trace(kind, 300, seed=5)
    assert recs != generate_trace(kind, 300, seed=6)
    assert len(recs) == 300
    last_ts = -1
    for r in recs:
        assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert r["timestamp"] >= last_ts
        last_ts = r["timestamp"]
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / BLOCK_TOKENS) >= 1
        assert r["output_length"] >= 1
        assert len(set(r["hash_ids"])) == len(r["hash_ids"])


def _first_block_sharing(recs: list[dict[str, object]]) -> float:
    seen: set[int] = set()
    shared = 0
    for r in recs:
        ids = r["hash_ids"]
        assert isinstance(ids, list)
        shared += ids[0] in seen
        seen.add(ids[0])
    return shared / len(recs)


def test_tracegen_kinds_have_their_structure() -> None:
    zipf = generate_trace("zipf", 2000, seed=1)
    assert _first_block_sharing(zipf) > 0.8  # few hot system prompts
    heads = [r["hash_ids"][0] for r in zipf]
    top = max(set(heads), key=heads.count)
    assert heads.count(top) > len(heads) / 20  # Zipf head

    multi = generate_trace("multiturn", 500, seed=1)
    prefixes: set[tuple[int, ...]] = set()
    extends = 0
    for r in multi:
        ids = r["hash_ids"]
        extends += any(tuple(ids[:n]) in prefixes for n in range(len(ids) - 1, 2, -1))
        prefixes.update(tuple(ids[:n]) for n in range(1, len(ids) + 1))
    assert extends > 0.5 * len(multi)  # most turns extend an earlier turn

    scan = generate_trace("scan", 2000, seed=1, scan_fraction=0.5)
    counts: dict[int, int] = {}
    for r in scan:
        for h in r["hash_ids"]:
            counts[h] = counts.get(h, 0) + 1
    once = sum(1 for c in counts.values() if c == 1)
    assert once > 0.8 * len(counts)  # scans are one-hit wonders
    assert max(counts.values()) > 20  # and a hot set is re-read


def test_tracegen_unknown_kind() -> None:
    with pytest.raises(ValueError, match="valid: zipf, multiturn, scan"):
        generate_trace("bursty", 10, 0)
