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

from tiered_cache.simulate.engine import (
    RunResult,
    TierResult,
    access_sequence,
    belady,
    build_store,
    prefix_hits_from_block_hits,
    simulate,
    unbounded,
)
from tiered_cache.simulate.report import format_report, run
from tiered_cache.simulate.specs import (
    TierSpec,
    check_admission,
    check_policy,
    load_trace,
    parse_policies,
    parse_tier,
)
from tiered_cache.simulate.stubs import (
    BLOCK_TOKENS,
    DEFAULT_BLOCK_BYTES,
    Record,
    SimError,
    SimTier,
    StubEncoder,
    block_key,
    stub_chunk,
)

__all__ = [
    "BLOCK_TOKENS",
    "DEFAULT_BLOCK_BYTES",
    "Record",
    "RunResult",
    "SimError",
    "SimTier",
    "StubEncoder",
    "TierResult",
    "TierSpec",
    "access_sequence",
    "belady",
    "block_key",
    "build_store",
    "check_admission",
    "check_policy",
    "format_report",
    "load_trace",
    "parse_policies",
    "parse_tier",
    "prefix_hits_from_block_hits",
    "run",
    "simulate",
    "stub_chunk",
    "unbounded",
]
