"""The scheduler half of the vLLM connector: which chunks a request can load (waiting
only for what its prefill listed, fetch or recompute, remote chunks copied into DRAM
first), the load and save plan of each step, and what a prefill reports to the router.
Bookkeeping only: the worker half moves the bytes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
)

from connectors import vllm_tp
from connectors.vllm_common import ConnectorArgs, ConnectorBase, _chunk_bytes, logger
from connectors.vllm_events import describe_chunks
from connectors.vllm_kvio import NULL_BLOCK, ChunkSpan, load_block_ranges, loadable_spans
from connectors.vllm_kvio import chunk_spans as _chunk_spans
from connectors.vllm_metadata import (
    LoadChunk,
    LoadJob,
    SaveChunk,
    TieredCacheConnectorMetadata,
    TieredCacheWorkerMeta,
)
from connectors.vllm_plan import RecomputeRate, choose_prefix, wait_budget_s
from tiered_cache import keys as tc_keys
from tiered_cache.api import NODE_TIERS, SlotStore
from tiered_cache.tenancy import tenant_of_salt

try:  # 0.32+: per-tier hit accounting
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

def _pool(f: int) -> int:
    """The read pool (``_Wait.kset``) of a chunk found under ``f`` (negative: a partial
    chunk found under pool ``-1 - f``)."""
    return f if f >= 0 else -1 - f


_SOURCE_TO_HIT = {"dram": "HOST", "nvme": "DISK", "peer": "P2P", "s3": "EXTERNAL_UNSPECIFIED"}


@dataclass
class _Match:
    """What ``get_num_new_matched_tokens`` told vLLM, for ``update_state_after_alloc``."""

    num_computed: int
    sources: list[str]  # where each chunk is loaded from (its prefix up to the last loaded)
    origins: list[str]  # where each chunk came from (a prefetched peer chunk: "peer")
    hit_end: int
    is_async: bool  # decided once, from the chunks that will be loaded
    # The last chunk is an earlier prompt's partial chunk, or the first blocks of one of
    # its whole chunks: (index, tokens, key, tokens the stored chunk holds).
    partial: tuple[int, int, str, int] | None = None
    keys: list[str] = field(default_factory=list)  # each chunk's key, as found
    shards: list[int] = field(default_factory=list)  # its writer's shards (0: this pool's)


@dataclass
class _Wait:
    """A request the connector may answer "ask again" for (scheduler side)."""

    t0: float  # when the request arrived
    coming: int  # leading chunks the prefill said it saved
    # The same chunks' keys under each pool's shard 0 this one reads (``_read_fps``:
    # its own first, then ``peer_tp_sizes``'); ``load_keys`` and ``src``: the key and
    # pool each found chunk was found under.
    kset: list[list[str]] = field(default_factory=list)
    salt: str | None = None
    prompt: Sequence[int] = ()
    coming_pool: int = 0  # the pool whose keys the prefill's list names
    load_keys: list[str] = field(default_factory=list)
    src: list[int] = field(default_factory=list)
    shard_keys: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    costs: list[float] = field(default_factory=list)
    looked_at: float = -1.0
    gave_up: bool = False  # stopped waiting for the prefill's chunks
    decided: str = ""  # fetch-or-recompute decision, counted once
    fetch_t0: float | None = None  # prefetch of remote chunks into DRAM started
    fetch_budget: float = 0.0
    origin: dict[int, str] = field(default_factory=dict)  # chunk -> remote source seen
    requested: set[int] = field(default_factory=set)  # chunks asked to be prefetched
    probed: bool = False  # looked for an earlier prompt's partial chunk
    partial_src: int = 0  # the read pool (``kset``) it was looked for under

    @property
    def keys(self) -> list[str]:
        """Its loadable chunks' keys (this pool's)."""
        return self.kset[0]
    # That chunk, when found: (index, tokens, key, source, expected load seconds, tokens
    # the stored chunk holds: more than ``tokens`` for a whole chunk's first blocks).
    partial: tuple[int, int, str, str, float, int] | None = None


@dataclass
class _ReqState:
    req_id: str
    prompt: list[int]
    salt: str | None
    keys: list[str]
    spans: list[ChunkSpan]
    # Its vLLM blocks, one list per KV cache group. A sliding-window group's blocks
    # before its window are freed as it is computed (and not updated here): only blocks
    # from ``KVGroups.first_live_block`` on are read (``_plan_saves``).
    blocks: list[list[int]] = field(default_factory=list)
    next_save: int = 0
    tail_key: str | None = None  # key of the block-aligned copy of the partial tail
    save: bool = False  # this request's computed chunks go to the cache (``_saved_elsewhere``)
    # Saved a step late: a decode saves what it computed for a later turn once its first
    # token is out, so the copy is not part of its TTFT (the prompt's blocks stay as they
    # are while it decodes). A request that ends at its first token saves nothing.
    lag: bool = False
    request: Request | None = None  # for its block hashes (KV events: ``_describe``)

    @property
    def block_ids(self) -> list[int]:
        """The first group's blocks (how many a request holds)."""
        return self.blocks[0] if self.blocks else []

    def set_blocks(self, ids: Sequence[Sequence[int]] | None, extend: bool = False) -> None:
        """vLLM's block ids of each group (``KVCacheBlocks.get_block_ids``), or with
        ``extend`` the blocks a step added to each."""
        if not ids or not any(ids):
            return
        if extend and self.blocks:
            for mine, more in zip(self.blocks, ids, strict=True):
                mine.extend(more)
        else:
            self.blocks = [list(g) for g in ids]


class SchedulerSide(ConnectorBase):
    def __init__(self, args: ConnectorArgs) -> None:
        super().__init__(args)
        self._reqs: dict[str, _ReqState] = {}
        self._matches: dict[str, _Match] = {}
        self._waits: dict[str, _Wait] = {}
        self._rate = RecomputeRate()  # this engine's prompt-token cost, from its steps
        self._chunk_bytes = _chunk_bytes(args.kv_cache_config, self._extra)
        self._first_seen: dict[str, float] = {}
        self._hit_sources: dict[str, dict[str, int]] = {}
        self._pending_loads: list[LoadJob] = []
        self._planned: dict[str, set[int]] = {}  # req -> blocks its load writes
        self._no_reload: set[str] = set()  # reqs whose load failed
        self._looked_up: set[str] = set()  # reqs counted in the lookups metric
        # Whether the last step ran no tokens (the engine only polls waiting requests), and
        # whether this step already held the scheduler for arriving chunks (once a step).
        self._idle = False
        self._held = False
        # Chunks of the pools at other TP sizes (``peer_tp_sizes``) are found under their
        # shard 0's keys; a chunk is loaded from the first pool that has it.
        self._read_shards = [self._tp_world, *self._peer_shards]
        self._read_fps = [self._fp] + [vllm_tp.shard_fingerprint(self._fp, 0, n)
                                       for n in self._peer_shards]  # fmt: skip
        mc = self._vllm_config.model_config  # the model KV events' topics name
        served = getattr(mc, "served_model_name", None)
        names = [served] if isinstance(served, str) else list(served or [])
        self._model_name = str(names[0]) if names else str(mc.model)

        policy = getattr(args.ktc, "kv_load_failure_policy", "recompute")
        if self._load_enabled and policy != "recompute":
            logger.warning(
                "TieredCacheConnector: kv_load_failure_policy=%r, so a chunk that is "
                "evicted or fails verification between lookup and load fails its request "
                "(HTTP 500). Set \"kv_load_failure_policy\": \"recompute\" in "
                "--kv-transfer-config to have vLLM recompute it instead.",
                policy,
            )
        # A config that cannot work fails at startup; an agent that is not up yet leaves
        # the connector serving without the cache until it is.
        self._guarded("connect", lambda st: None, None)

    def on_new_request(self, request: Request) -> None:
        if self._load_enabled:
            self._first_seen.setdefault(request.request_id, time.monotonic())

    def _coming(self, request: Request, keys: Sequence[str]) -> int:
        """How many leading chunks of ``keys`` are on their way: the ones the prefill said
        it saved (its ``kv_transfer_params``, passed on by the router). None are when the
        router skipped the prefill, and none without a hint unless ``wait_for_prefill``
        is ``true``."""
        if self._wait_timeout <= 0 or self._wait_mode in ("false", "0", "no", "never"):
            return 0
        params = getattr(request, "kv_transfer_params", None) or {}
        hint = params.get("tiered_cache") if isinstance(params, Mapping) else None
        if isinstance(hint, Mapping) and isinstance(hint.get("keys"), list):
            saved = set(hint["keys"])
            n = 0
            while n < len(keys) and keys[n] in saved:
                n += 1
            return n
        return len(keys) if self._wait_mode in ("true", "1", "yes", "always") else 0

    def _saved_elsewhere(self, request: Request) -> set[str] | None:
        """Whether this request's chunks are saved here: None if not, else the keys its
        prefill saved already (they need no second copy). A producer saves every prompt.
        A consumer saves what it computes of a P/D request (one with the router's
        ``tiered_cache`` hint) past the chunks its prefill listed: all of them when the
        router skipped the prefill, so the next turn finds this turn's tail."""
        if self._save_enabled:
            return set()
        if not (self._save_computed and self._load_enabled):
            return None
        params = getattr(request, "kv_transfer_params", None) or {}
        hint = params.get("tiered_cache") if isinstance(params, Mapping) else None
        if not isinstance(hint, Mapping) or not isinstance(hint.get("keys"), list):
            return None  # no P/D handoff: the role's default (a consumer saves nothing)
        return set(hint["keys"])

    def _found(self, rid: str, keys: Sequence[str]) -> int:
        """Leading chunks of ``keys`` the cache holds: what this request's own lookup
        found (no second round trip for a miss), else a lookup."""
        w = self._waits.get(rid)
        if w is not None and w.looked_at >= 0 and keys[: len(w.keys)] == w.keys:
            return len(w.sources)
        return len(self._lookup(keys))

    def _lookup(self, keys: Sequence[str]) -> list[str]:
        if not keys:
            return []
        return self._guarded("lookup", lambda st: list(st.lookup(keys)), [])

    def _lookup_priced(
        self, keys: Sequence[str], fresh: bool = False
    ) -> tuple[list[str], list[float]]:
        """``fresh``: chunks another node is writing for this request (its prefill's)
        must not be answered from the agent's recent misses."""

        def priced(st: SlotStore) -> tuple[list[str], list[float]]:
            if fresh:
                found, costs = st.lookup_priced(keys, self._chunk_bytes, fresh=True)
            else:
                found, costs = st.lookup_priced(keys, self._chunk_bytes)
            return list(found), list(costs)

        none: tuple[list[str], list[float]] = ([], [])
        return self._guarded("lookup", priced, none)

    def _in_dram(self, keys: Sequence[str]) -> list[bool]:
        """DRAM presence through the shared index (no round trip); the agent otherwise."""
        st = self._store
        direct = st.in_dram(keys) if st is not None else None
        if direct is not None:
            return list(direct)
        found = self._lookup(keys)
        return [i < len(found) and found[i] == "dram" for i in range(len(keys))]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Leading chunks to load, decided once the ones on their way have landed (or
        their wait ran out) and remote ones have been copied into this node's DRAM.
        ``None`` asks vLLM to ask again: the request waits in the queue holding no KV
        blocks. No side effects on vLLM; the connector keeps its own per-request state."""
        if not self._load_enabled or not self._cacheable(request):
            return 0, False
        rid = request.request_id
        prompt = request.prompt_token_ids or []
        n = len(prompt)
        spans = loadable_spans(n, self._chunk_size, self._block_size)
        if not spans or rid in self._no_reload:
            return 0, False
        first = next((s.index for s in spans if s.end > num_computed_tokens), len(spans))
        now = time.monotonic()
        w = self._waits.get(rid)
        if w is None:
            salt = self._salt(request)
            kset = [self._req_keys(prompt, salt, fp)[: len(spans)] for fp in self._read_fps]
            comings = [0 if rid in self._planned else self._coming(request, ks) for ks in kset]
            coming = max(comings)
            w = self._waits[rid] = _Wait(self._first_seen.setdefault(rid, now), coming, kset,
                                         salt, prompt, comings.index(coming))  # fmt: skip
        if self._guard.down:
            self._cache_up()  # maybe probe, off this request's path
            self._count_once(rid, "unavailable")
            return 0, False  # the cache is down: recompute, never wait for it
        if w.looked_at < 0 or now - w.looked_at >= self._poll_s:
            self._look(w, w.coming > 0 and not w.gave_up)
            w.looked_at = now
            for i, src in enumerate(w.sources):  # a staged chunk counts where it came from
                if src not in NODE_TIERS:
                    w.origin.setdefault(i, src)
            if self._guard.down:  # it just went down
                self._count_once(rid, "unavailable")
                return 0, False
        sources, costs = w.sources, w.costs
        hit = len(sources)

        # 1. Chunks the prefill saved that are not visible yet: wait, at most what
        #    recomputing them costs.
        if hit < w.coming and not w.gave_up:
            waited = sum(s.num_tokens for s in spans[hit : w.coming])
            if now - w.t0 < wait_budget_s(self._wait_timeout, self._rate.cost_s(waited)):
                return None, False
            w.gave_up = True
            self._count_once(rid, "deadline")
            logger.info(
                "req %s: %d of the %d chunks its prefill saved did not arrive within %.0f ms; "
                "recomputing from chunk %d", rid, w.coming - hit, w.coming,
                (now - w.t0) * 1e3, hit,
            )  # fmt: skip

        # 1b. The chunk after the found ones may exist as a shorter, block-aligned chunk
        #     an earlier prompt saved (the previous turn of this conversation).
        if not w.probed and hit < len(spans) and (hit >= w.coming or w.gave_up):
            w.probed = True
            w.partial = self._probe_partial(prompt, self._salt(request), w, spans[hit])
        keys = [*w.load_keys, *w.keys[len(w.load_keys):]]
        srcs = list(w.src)
        if w.partial is not None and hit == w.partial[0]:
            idx, ptok, pkey, psrc, pcost, _ = w.partial
            spans = [*spans[:hit], ChunkSpan(idx, spans[idx].start, spans[idx].start + ptok,
                                             self._block_size)]  # fmt: skip
            keys[idx] = pkey
            # Under the pool that wrote the chunk before it; negative: a partial chunk.
            sources, costs, srcs = [*sources, psrc], [*costs, pcost], [*srcs, -1 - w.partial_src]
            hit += 1

        # 2. Fetch or recompute: the prefix whose load saves the most time.
        toks = [0 if i < first else s.end - max(s.start, num_computed_tokens)
                for i, s in enumerate(spans[:hit])]  # fmt: skip
        spt = self._rate.seconds_per_token() if self._fetch_policy == "auto" else None
        choice = choose_prefix(toks, costs, first, spt)
        k = choice.chunks
        if not w.decided and hit > first:  # counted once, when there was a choice
            w.decided = choice.decision
            self._stats.inc("fetch_decisions", choice.decision)

        # 3. Chunks of that prefix on a peer or in S3: copied into this node's DRAM by the
        #    agent while the request waits in the queue, so no network I/O happens inside
        #    the forward pass. A chunk that lands on this node's NVMe instead (evicted by
        #    a busy DRAM) counts as arrived: local reads cost milliseconds.
        remote = [i for i in range(first, k) if sources[i] not in NODE_TIERS]
        if remote and self._prefetch_remote():
            every = {i: self._shard_keys(w, i, keys[i], srcs[i]) for i in remote}
            ask = [kd for i in remote if i not in w.requested for kd in every[i]]
            if ask:
                if w.fetch_t0 is None:
                    w.fetch_t0 = now
                    # ``always`` loads what is found: no cost bound, only the cap.
                    w.fetch_budget = self._wait_timeout if (
                        self._fetch_policy == "always"
                    ) else wait_budget_s(
                        self._wait_timeout,
                        self._rate.cost_s(sum(toks[i] for i in remote)),
                        sum(costs[i] for i in remote),
                    )
                w.requested.update(remote)
                self._prefetch(ask)
            self._mark_arrived(sources, every, remote)
            late = [i for i in remote if sources[i] not in NODE_TIERS]
            if late and self._idle and not self._held:
                self._held = True
                late = self._await_landing(w, every, sources, late, now)
                now = time.monotonic()
            if late:
                assert w.fetch_t0 is not None
                if now - w.fetch_t0 < w.fetch_budget:
                    return None, False
                k = late[0]  # load what arrived, recompute the rest
                self._count_once(rid, "fetch_deadline")
                logger.info(
                    "req %s: %d chunks (from %s) did not arrive in DRAM within %.0f ms; "
                    "recomputing from chunk %d", rid, len(late),
                    ",".join(sources[i] for i in late), w.fetch_budget * 1e3, k,
                )  # fmt: skip
        hit_end = min(spans[k - 1].end, n - 1) if k else 0
        ext = hit_end - num_computed_tokens
        if rid not in self._looked_up:  # once per request, not per poll or preemption
            self._looked_up.add(rid)
            self._stats.inc("lookups", "hit" if ext > 0 else "miss")
        if ext <= 0:
            return 0, False
        loaded = sources[first:k]
        # Copied group by group (``KVGroups.grouped``): async, as vLLM takes a failed load
        # of several groups only as a whole request (``failed_recving``), not as blocks.
        is_async = self._async_mode == "true" or self._groups.grouped or (
            self._async_mode == "auto" and any(src not in NODE_TIERS for src in loaded)
        )
        origins = [w.origin.get(i, sources[i]) for i in range(k)]
        partial = None
        if w.partial is not None and k == w.partial[0] + 1:
            partial = (w.partial[0], w.partial[1], w.partial[2], w.partial[5])
        shards = [self._read_shards[g] if (g := _pool(f)) else 0 for f in srcs[:k]]
        self._matches[rid] = _Match(
            num_computed_tokens, sources[:k], origins, hit_end, is_async, partial,
            keys[:k], shards,
        )  # fmt: skip
        return ext, is_async

    def _look(self, w: _Wait, fresh: bool) -> None:
        """Find ``w``'s leading chunks: under this pool's keys, and where those stop,
        under each other pool's (``peer_tp_sizes``), taking turns until none goes
        further (a decode's later turn: the prefill's chunks, then its own). One lookup
        without peers."""
        n = len(w.keys)
        sources: list[str] = []
        costs: list[float] = []
        keys: list[str] = []
        src: list[int] = []
        f, stalled = 0, 0
        while len(sources) < n and stalled < len(w.kset):
            pos = len(sources)
            # Fresh answers only for the chunks the prefill is writing (its pool's keys).
            new = fresh and f == w.coming_pool
            found, cost = self._lookup_priced(w.kset[f][pos:], new)
            if self._guard.down:
                break
            if found and f and self._read_shards[f] > 1:
                # A rank here joins several of that pool's shards: every one must be there
                # (one still being written by its rank is not loaded yet).
                n_all = self._all_shards(w, f, pos, len(found), new)
                found, cost = found[:n_all], cost[:n_all]
            if found:
                sources += found
                costs += cost
                keys += w.kset[f][pos : pos + len(found)]
                src += [f] * len(found)
                stalled = 1  # this pool just stopped: the others may go on
            else:
                stalled += 1
            f = (f + 1) % len(w.kset)
        w.sources, w.costs, w.load_keys, w.src = sources, costs, keys, src

    def _all_shards(self, w: _Wait, f: int, pos: int, n: int, fresh: bool) -> int:
        """How many of chunks [pos, pos + n), found under pool ``f``'s shard 0, every
        other shard of that pool holds too."""
        for s in range(1, self._read_shards[f]):
            chain = self._chain(w, f, s)
            n = min(n, len(self._lookup_priced(chain[pos : pos + n], fresh)[0]))
        return n

    def _chain(self, w: _Wait, f: int, s: int) -> list[str]:
        """Shard ``s``'s keys of ``w``'s prompt under read pool ``f`` (kept per request)."""
        if s == 0:
            return w.kset[f]
        ks = w.shard_keys.get((f, s))
        if ks is None:
            fp = vllm_tp.shard_fingerprint(self._read_fps[f], s, self._read_shards[f])
            ks = w.shard_keys[(f, s)] = self._req_keys(w.prompt, w.salt, fp)
        return ks

    def _partial_key(self, w: _Wait, f: int, s: int, i: int, n_tok: int) -> tuple[str, bytes]:
        """Shard ``s``'s key (and fingerprint) of pool ``f``'s ``n_tok``-token partial
        chunk at index ``i`` of ``w``'s prompt."""
        fp = vllm_tp.shard_fingerprint(self._read_fps[f], s, self._read_shards[f])
        return self._rank_key(self._chain(w, f, s), w.prompt, w.salt, i, n_tok, fp)[0], fp.digest

    def _shard_keys(self, w: _Wait, i: int, key: str, f: int) -> list[tuple[str, bytes]]:
        """The keys of chunk ``i`` a prefetch copies into DRAM, each with the fingerprint
        it is verified against (``key``: shard 0's, under read pool ``f``; negative: an
        earlier prompt's partial chunk under pool ``-1 - f``). Of another pool's chunk,
        every writer shard's, so that no rank joining them reads a remote tier in the
        forward pass; of this pool's, as before, the one the scheduler knows (shard 0)."""
        p = _pool(f)
        out = [(key, self._read_fps[p].digest)]
        if p == 0:
            return out
        for s in range(1, self._read_shards[p]):
            if f < 0:
                assert w.partial is not None
                out.append(self._partial_key(w, p, s, i, w.partial[1]))
            else:
                fp = vllm_tp.shard_fingerprint(self._read_fps[p], s, self._read_shards[p])
                out.append((self._chain(w, p, s)[i], fp.digest))
        return out

    def _prefetch(self, keys: Sequence[tuple[str, bytes]], wait: float = 0.0) -> None:
        """Copy ``keys`` into DRAM: one call per fingerprint they are verified against,
        only the last of them waiting (``wait``) for its copies to land."""
        by_fp: dict[bytes, list[str]] = {}
        for key, digest in keys:
            by_fp.setdefault(digest, []).append(key)
        for n, (digest, ks) in enumerate(by_fp.items(), 1):

            def ask(st: SlotStore, d: bytes = digest, k: list[str] = ks,
                    t: float = wait if n == len(by_fp) else 0.0) -> int:  # fmt: skip
                return st.prefetch(k, d, t)

            self._guarded("prefetch", ask, 0)

    def _mark_arrived(
        self, sources: list[str], every: Mapping[int, list[tuple[str, bytes]]],
        chunks: Sequence[int],
    ) -> None:
        """A chunk counts as in DRAM once every shard's copy is."""
        flat = [key for i in chunks for key, _ in every[i]]
        here = iter(self._in_dram(flat))
        for i in chunks:
            if all([next(here) for _ in every[i]]):
                sources[i] = "dram"

    def _await_landing(
        self, w: _Wait, every: Mapping[int, list[tuple[str, bytes]]], sources: list[str],
        late: list[int],
        now: float,
    ) -> list[int]:
        """With nothing else to run, the engine would only spin on this request (a step a
        millisecond, each asking again; on a small host that CPU is what the agent needs to
        pull the chunks). Instead hold the scheduler until the late chunks land, at most a
        poll interval (a new request waits that long at most) and the fetch's budget:
        the agent answers when its copies end, so the load starts at once. Returns the
        chunks still late."""
        assert w.fetch_t0 is not None
        wait = min(self._poll_s, w.fetch_budget - (now - w.fetch_t0))
        if wait <= 0:
            return late
        self._prefetch([kd for i in late for kd in every[i]], wait)
        self._mark_arrived(sources, every, late)
        return [i for i in late if sources[i] not in NODE_TIERS]

    def _probe_partial(
        self, prompt: Sequence[int], salt: str | None, w: _Wait, span: ChunkSpan
    ) -> tuple[int, int, str, str, float, int] | None:
        """The longest partial chunk at ``span`` that an earlier prompt saved and this
        prompt shares (its exact tail, or that tail's whole blocks), or the first blocks
        of an earlier prompt's whole chunk there (its aliases): one round trip for every
        candidate length."""
        # Shorter than the span: its whole length is the prompt's own key, looked up.
        lengths = tc_keys.probe_lengths(span.num_tokens - 1)
        if not lengths:
            return None
        # Under every pool's keys this one reads (a decode's own, for the tail it saved
        # of the previous turn; a prefill's, for that prompt's): longest first.
        text = prompt[span.start : span.end]
        cands = [(n_tok, f, key) for f, fp in enumerate(self._read_fps)
                 for n_tok, key in zip(lengths, tc_keys.partial_keys(
                     text, fp, salt, w.kset[f][span.index - 1] if span.index else None, 0,
                     lengths), strict=True)]  # fmt: skip
        cands.sort(key=lambda c: -c[0])  # stable: this pool's first at each length
        nbytes = self._chunk_bytes * lengths[0] // self._chunk_size

        def probe(st: SlotStore) -> list[tuple[str, float, str] | None]:
            return st.present([key for *_, key in cands], nbytes)

        none: list[tuple[str, float, str] | None] = []
        for (n_tok, f, key), found in zip(cands, self._guarded("lookup", probe, none),
                                          strict=False):  # fmt: skip
            if found is None:
                continue
            src, cost, load_key = found
            if f and self._read_shards[f] > 1:  # a join: every shard's partial is needed
                others = [self._partial_key(w, f, s, span.index, n_tok)[0]
                          for s in range(1, self._read_shards[f])]  # fmt: skip

                def more(st: SlotStore, o: list[str] = others) -> list[Any]:
                    return st.present(o, nbytes)

                if any(o is None for o in self._guarded("lookup", more, [None])):
                    continue
            whole = n_tok if load_key == key else self._chunk_size
            w.partial_src = f
            return span.index, n_tok, load_key, src, cost, whole
        return None

    def _prefetch_remote(self) -> bool:
        """Remote chunks go through this node's DRAM (see ``async_load``)."""
        st = self._store
        return self._async_mode == "auto" and st is not None and "dram" in st.tiers

    def _count_once(self, rid: str, reason: str) -> None:
        tag = f"fallback:{reason}:{rid}"
        if tag not in self._logged:
            self._logged.add(tag)
            self._stats.inc("recompute_fallbacks", reason)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if not self._cacheable(request):
            return
        st = self._reqs.get(rid)
        elsewhere = self._saved_elsewhere(request) if st is None else None
        if st is None and (num_external_tokens > 0 or elsewhere is not None):
            prompt = list(request.prompt_token_ids or [])
            salt = self._salt(request)
            st = _ReqState(
                rid,
                prompt,
                salt,
                self._req_keys(prompt, salt),
                _chunk_spans(len(prompt), self._chunk_size, self._block_size),
            )
            tail = st.spans[-1] if st.spans else None
            bs = self._block_size
            if tail is not None and tail.num_tokens < self._chunk_size and tail.num_tokens > bs:
                aligned = tail.num_tokens - tail.num_tokens % bs
                if aligned != tail.num_tokens:
                    parent = st.keys[tail.index - 1] if tail.index else None
                    st.tail_key = tc_keys.partial_keys(
                        prompt, self._fp, salt, parent, tail.start, [aligned]
                    )[0]
            st.request = request
            self._reqs[rid] = st
            if elsewhere is not None:
                # Chunks already in the cache, or saved by its prefill, need no second copy.
                # The prefill's list names its pool's keys (another TP size's, maybe).
                w = self._waits.get(rid)
                by_prefill = 0
                for ks in w.kset if w is not None else [st.keys]:
                    n = 0
                    while n < len(ks) and ks[n] in elsewhere:
                        n += 1
                    by_prefill = max(by_prefill, n)
                st.next_save = max(by_prefill, self._found(rid, st.keys))
                st.save = self._save_enabled or st.next_save < len(st.spans)
                # Not with a sliding window: by the next step its blocks are freed.
                st.lag = not self._save_enabled and not self._groups.windowed
        if st is None:
            return
        self._waits.pop(rid, None)  # scheduled: a preemption starts over (no waiting)
        if blocks is not None:
            st.set_blocks(blocks.get_block_ids())
        if num_external_tokens <= 0:
            return
        m = self._matches.get(rid)
        if m is None:
            raise RuntimeError(f"req {rid}: external tokens allocated without a match")
        start = m.num_computed
        end = start + num_external_tokens
        n_hit = len(m.sources)
        spans, keys = st.spans[:n_hit], (m.keys or st.keys)[:n_hit]
        stored: dict[int, int] = {}  # index -> tokens its stored chunk holds, where more
        if m.partial is not None:  # the last one is an earlier prompt's partial chunk
            idx, ptok, pkey, whole = m.partial
            spans[idx] = ChunkSpan(idx, spans[idx].start, spans[idx].start + ptok,
                                   self._block_size)  # fmt: skip
            keys[idx] = pkey
            if whole > ptok:  # the first blocks of a whole chunk: the worker reads those
                stored[idx] = whole
        ranges = load_block_ranges(spans, start, end)
        chunks: list[LoadChunk] = []
        by_source: dict[str, int] = {}
        for r in ranges:
            s = r.span
            src, origin = m.sources[s.index], m.origins[s.index]
            ntok = max(0, min(s.end, end) - max(s.start, start))
            whole = stored.get(s.index, s.num_tokens)
            chunks.append(
                LoadChunk(
                    index=s.index,
                    key=keys[s.index],
                    num_tokens=whole,
                    n_blocks=-(-whole // self._block_size),
                    lo=r.lo - s.first_block,
                    block_ids=st.block_ids[r.lo : r.hi],
                    source=src,
                    tokens=ntok,
                    origin=origin if origin != src else "",
                    shards=m.shards[s.index] if s.index < len(m.shards) else 0,
                    group_ids=self._group_ids(st, r.lo, r.hi),
                )
            )
            by_source[origin] = by_source.get(origin, 0) + ntok
        if ranges and len(st.block_ids) < ranges[-1].hi:
            # Cannot happen (vLLM allocates blocks for every token it schedules); a load
            # into missing blocks could not report its failure, so refuse loudly.
            raise RuntimeError(
                f"req {rid}: block table has {len(st.block_ids)} blocks, load needs "
                f"{ranges[-1].hi}"
            )
        self._hit_sources[rid] = by_source
        self._planned[rid] = {b for c in chunks for b in c.block_ids}
        # The agent copies what it loads into its DRAM: its KV events name vLLM's blocks.
        # Not a whole chunk read for its first blocks: its other tokens are another
        # prompt's.
        self._describe(st, [(c.key, st.spans[c.index].start, c.num_tokens)
                            for c in chunks if c.index not in stored])  # fmt: skip
        # Loaded chunks need no saving; a partial one does (its full chunk is new).
        full = [c.index + 1 for c in chunks if m.partial is None or c.index != m.partial[0]]
        st.next_save = max(st.next_save, max(full, default=0))
        # Sync or async as get_num_new_matched_tokens told vLLM: a job vLLM waits for in
        # WAITING_FOR_REMOTE_KVS must be reported by get_finished, so it must run async.
        is_async = m.is_async
        derive = self._tp_world > 1 or any(c.shards for c in chunks)
        job = LoadJob(
            rid,
            chunks,
            is_async,
            num_external_tokens,
            token_ids=st.prompt if derive else None,
            cache_salt=st.salt if derive else None,
        )
        self._pending_loads.append(job)
        logger.info(
            "req %s: loading %d of %d prompt tokens from the tiered cache (%s) in %d chunks, "
            "found in %s",
            rid,
            num_external_tokens,
            len(st.prompt),
            "async" if is_async else "sync",
            len(chunks),
            ",".join(f"{c.origin}->{c.source}" if c.origin else c.source for c in chunks),
        )

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        if num_external_tokens == 0 or CacheHitSource is None:
            return {}
        by_source = self._hit_sources.get(request.request_id) or {}
        out: dict[Any, int] = {}
        for src, n in by_source.items():
            hs = getattr(CacheHitSource, _SOURCE_TO_HIT.get(src, "EXTERNAL_UNSPECIFIED"))
            out[hs] = out.get(hs, 0) + n
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {k: v for k, v in out.items() if v}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, TieredCacheWorkerMeta):
            for tokens, seconds in wm.steps:
                self._rate.observe(tokens, seconds)
        # A grouped model's failed load comes back per request: not tried again (a
        # failure that repeats, a layout mismatch, would otherwise reload forever).
        self._no_reload.update(getattr(connector_output, "failed_recving", None) or ())
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad or not self._planned:
            return
        for rid, blocks in self._planned.items():
            if blocks & bad:
                self._no_reload.add(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TieredCacheConnectorMetadata(
            loads=self._pending_loads, step_tokens=scheduler_output.total_num_scheduled_tokens
        )
        self._pending_loads = []
        self._idle = scheduler_output.total_num_scheduled_tokens == 0
        self._held = False
        if not self._reqs:
            return meta
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None or not st.save:
                continue
            st.set_blocks(new.block_ids)
            done = new.num_computed_tokens + (0 if st.lag else sched.get(new.req_id, 0))
            self._plan_saves(st, done, meta, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None or not st.save:
                continue
            st.set_blocks(cached.new_block_ids[i], extend=rid not in resumed)
            done = cached.num_computed_tokens[i] + (0 if st.lag else sched.get(rid, 0))
            self._plan_saves(st, done, meta, cached.num_computed_tokens[i])
        return meta

    def _group_ids(self, st: _ReqState, lo: int, hi: int) -> list[list[int]]:
        """Blocks [lo, hi) of every KV cache group (none: copied as one group)."""
        return [g[lo:hi] for g in st.blocks] if self._groups.grouped else []

    def _plan_saves(
        self, st: _ReqState, computed: int, meta: TieredCacheConnectorMetadata, start: int
    ) -> None:
        """Plan the saves of the chunks done once ``computed`` tokens are (``start``: the
        tokens computed before this step)."""
        n = len(st.prompt)
        added = False
        first = len(meta.saves)
        whole: list[tuple[str, str | None, int]] = []  # (key, parent, start) for aliases
        live = self._groups.first_live_block(start, self._block_size)
        while st.next_save < len(st.spans):
            s = st.spans[st.next_save]
            if s.end > min(computed, n) or s.end_block > len(st.block_ids):
                break
            if s.num_tokens < self._chunk_size and not self._save_unfull:
                break  # the partial tail chunk stays out of the cache
            freed = self._groups.grouped and any(
                NULL_BLOCK in g[s.first_block : s.end_block] for g in st.blocks
            )
            if s.first_block < live or freed:
                # Its sliding-window blocks are freed (the prompt was computed over several
                # steps, and the window is shorter than the chunk): it cannot be saved, and
                # the chunks after it would never be a hit without it.
                self._stats.inc("saves_skipped", "window", len(st.spans) - st.next_save)
                st.next_save = len(st.spans)
                break
            parent = st.keys[s.index - 1] if s.index else None
            tenant = tenant_of_salt(st.salt)  # the chunks carry it: the agent's accounts
            meta.saves.append(
                SaveChunk(
                    st.req_id,
                    s.index,
                    st.keys[s.index],
                    s.num_tokens,
                    st.block_ids[s.first_block : s.end_block],
                    parent,
                    tenant=tenant,
                    group_ids=self._group_ids(st, s.first_block, s.end_block),
                )
            )
            if st.tail_key is not None and s.index == len(st.spans) - 1:
                n_al = s.num_tokens - s.num_tokens % self._block_size
                end_al = s.first_block + n_al // self._block_size
                meta.saves.append(SaveChunk(
                    st.req_id, s.index, st.tail_key, n_al,
                    st.block_ids[s.first_block : end_al],
                    parent, aligned=True, tenant=tenant,
                    group_ids=self._group_ids(st, s.first_block, end_al),
                ))  # fmt: skip
            if s.num_tokens == self._chunk_size:
                whole.append((st.keys[s.index], parent, s.start))
            st.next_save += 1
            added = True
        if added:
            self._describe(st, [(c.key, st.spans[c.index].start, c.num_tokens)
                                for c in meta.saves[first:]])  # fmt: skip
        if added and self._tp_world > 1:
            meta.save_tokens[st.req_id] = (st.prompt, st.salt)
        if whole and self._aliases:
            self._register_aliases(st, whole)

    def _describe(self, st: _ReqState, chunks: list[tuple[str, int, int]]) -> None:
        """Tell an agent that publishes KV events which vLLM blocks these chunks (key, first
        token, tokens) hold: its events then name them as vLLM's own do."""
        store = self._store
        if st.request is None or not chunks or store is None or not store.takes_descriptions:
            return
        if self._tp_world > 1:
            # Each rank stores its own shard under its own key: an event for rank 0's
            # would say a block is held while another rank's shard may be gone.
            return
        desc = describe_chunks(st.request, chunks, self._block_size, self._model_name)
        if desc is not None:
            self._guarded("describe", lambda s: s.describe(desc), None)

    def _register_aliases(self, st: _ReqState, whole: list[tuple[str, str | None, int]]) -> None:
        """Name the block-aligned prefixes of the whole chunks this step saves (the agent's
        ``aliases``): a prompt that shares only their first blocks loads those instead of
        recomputing them. Registered as the save is planned; an alias of a chunk that
        never lands is a miss."""
        bs = self._block_size
        lengths = list(range(bs, self._chunk_size, bs))
        aliases = [
            # Only the chunk's tokens: converting the whole prompt per chunk is quadratic.
            tc_keys.partial_keys(
                st.prompt[start : start + self._chunk_size], self._fp, st.salt, parent, 0, lengths
            )
            for _, parent, start in whole
        ]
        targets = [k for k, _, _ in whole]
        self._guarded("alias", lambda s: s.alias(targets, aliases), None)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self._matches.pop(rid, None)
        self._waits.pop(rid, None)
        self._first_seen.pop(rid, None)
        self._hit_sources.pop(rid, None)
        self._planned.pop(rid, None)
        self._no_reload.discard(rid)
        self._looked_up.discard(rid)
        for reason in ("unavailable", "deadline", "fetch_deadline"):
            self._logged.discard(f"fallback:{reason}:{rid}")
        params: dict[str, Any] | None = None
        if self._save_enabled and st is not None:
            # Tells a proxy, and through it the decode node, exactly which chunks this
            # prefill put in the cache: the decode waits for those and no others. None
            # while the agent is down (the saves were skipped).
            down = self._guard.down
            saved = 0 if down else st.next_save
            params = {
                "tiered_cache": {
                    "chunks": saved,
                    # The router stops splitting requests while this is true: a decode
                    # would only recompute the prompt.
                    "unavailable": down,
                    "prompt_tokens": len(st.prompt),
                    "chunk_size": self._chunk_size,
                    "keys": st.keys[:saved],
                },
                # For a cache-aware router: the fingerprint the chunk keys chain from, and
                # the node whose cache holds them.
                "tc_fingerprint": dataclasses.asdict(self._fp),
                "tc_node_id": self._store.node_id if self._store is not None else None,
            }
        return False, params

    def shutdown(self) -> None:
        self.close_store()
