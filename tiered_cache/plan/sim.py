"""A discrete-event replay of vLLM servers behind the router, through the production
store and policies: what the planner's figures come from.

Each server is vLLM V1's scheduler reduced to what costs time: a FIFO of requests,
continuous batching up to ``max_num_seqs``, chunked prefill within
``max_batched_tokens`` (decodes first), a prefix cache of ``block_tokens`` blocks (LRU,
the blocks of running requests held), and admission only while the KV space holds the
request whole. A step costs ``Engine.step``. Servers with the cache share one
``TieredStore`` built as the agent builds it (``simulate.engine.build_store``: the
production eviction and admission policies over size-only tiers); a request's leading
chunks found there are loaded (each tier's ``Link``; a chunk another node wrote crosses
``Hardware.net``), its new whole chunks saved after its prefill.

Routing is the router's own: ``tiered_cache.split.decide`` over the same
``ServerView``s (``whole`` for replicas, ``auto`` for P/D), ``split`` as its split mode
(prefill, then the decode after the handoff, a prompt the cache nearly covers straight
to the decode), or round robin. One cost model, online and offline.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

from policies import EntryInfo
from tiered_cache.hierarchy import TieredStore
from tiered_cache.plan.hardware import Engine, Hardware, Link
from tiered_cache.simulate.engine import build_store
from tiered_cache.simulate.specs import TierSpec
from tiered_cache.simulate.stubs import StubEncoder
from tiered_cache.split import DecayingRate, Rates, ServerView, decide

Routing = Literal["none", "round_robin", "whole", "split", "auto"]


@dataclass
class SimRequest:
    arrival: float
    n: int  # prompt tokens
    out: int  # tokens to generate
    keys: list[int]  # chained keys of the prompt's whole blocks (block_tokens each)
    kind: str = ""


@dataclass
class Outcome:
    arrival: float
    ttft: float = 0.0
    done: float = 0.0
    out: int = 1
    kind: str = ""
    split: bool = False
    prompt: int = 0
    local_hit: int = 0  # tokens from the serving vLLM's own prefix cache
    tier_hit: dict[str, int] = field(default_factory=dict)  # tokens loaded, by tier
    load_bytes: float = 0.0
    load_s: float = 0.0
    link_s: dict[str, float] = field(default_factory=dict)  # load seconds by link
    save_bytes: float = 0.0

    @property
    def tpot(self) -> float | None:
        return (self.done - self.arrival - self.ttft) / (self.out - 1) if self.out > 1 else None


@dataclass
class ServerLayout:
    name: str
    pool: str  # "prefill", "decode" or "whole"
    units: int
    node: int = 0
    cache: bool = True  # kv_both on the shared store


@dataclass
class Layout:
    name: str
    servers: list[ServerLayout]
    routing: Routing


@dataclass
class _Job:
    req: SimRequest
    res: Outcome
    out: int  # 1: a split's prefill leg
    leg: str  # "whole", "prefill", "decode"
    computed: int = 0
    gen: int = 0
    held: int = 0  # KV blocks it holds while running
    ready: float = 0.0  # an async load done (GPU)
    pending: int = 0  # prompt tokens still to compute (the router's queued_tokens)


class _Server:
    def __init__(self, lay: ServerLayout, hw: Hardware) -> None:
        self.lay = lay
        self.engine: Engine = hw.engine(lay.units)
        self.cap = max(1, hw.kv_tokens[lay.units] // hw.block_tokens)
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.waiting: deque[_Job] = deque()
        self.running: list[_Job] = []
        self.busy = False
        self.prefilling = False  # its step in progress computes prompt tokens
        self.arrivals = DecayingRate(10.0)

    @property
    def held(self) -> int:
        return sum(j.held for j in self.running)

    def view(self, cached: int, now: float) -> ServerView:
        decoding = sum(1 for j in self.running if j.gen > 0)
        queued = sum(j.pending for j in (*self.waiting, *self.running))
        pool = "decode" if self.lay.pool == "decode" else "prefill"
        return ServerView(self.lay.name, pool, decoding, queued, cached, self.arrivals.rate(now))


class Sim:
    def __init__(self, layout: Layout, hw: Hardware, kv_bpt: int, policy: str = "s3prefix"
                 ) -> None:  # fmt: skip
        self.layout, self.hw, self.kv_bpt = layout, hw, kv_bpt
        self.servers = [_Server(s, hw) for s in layout.servers]
        self.by_name = {s.lay.name: s for s in self.servers}
        self.bt = hw.block_tokens
        self.cb = max(1, hw.chunk_tokens // self.bt)  # blocks a chunk
        chunk_bytes = hw.chunk_tokens * kv_bpt
        self.chunk_bytes = chunk_bytes
        tiers = []
        if any(s.cache for s in layout.servers):
            if hw.dram_bytes >= chunk_bytes:
                tiers.append(TierSpec("dram", int(hw.dram_bytes // chunk_bytes), policy))
            if hw.nvme_bytes >= chunk_bytes:
                tiers.append(TierSpec("nvme", int(hw.nvme_bytes // chunk_bytes), policy,
                                      "frequency"))  # fmt: skip
            if hw.s3_bytes >= chunk_bytes:
                tiers.append(TierSpec("s3", int(hw.s3_bytes // chunk_bytes), policy))
        self.store: TieredStore | None = (
            build_store(tiers, policy, block_bytes=chunk_bytes) if tiers else None
        )
        self.stub = StubEncoder(hw.chunk_tokens)
        self.writer: dict[str, int] = {}  # chunk key -> node that saved it
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.rr = itertools.count()
        self.now = 0.0
        e = self.servers[0].engine
        self.rates = Rates(e.prefill_tps(), hw.hop_s, e.step(1, 1000, 0, 0))

    # ------------------------------------------------------------------ the store

    def _chunk_keys(self, req: SimRequest) -> list[str]:
        keys = req.keys
        return [f"{keys[i] & (2**128 - 1):032x}" for i in range(self.cb - 1, len(keys), self.cb)]

    async def _lookup(self, req: SimRequest) -> list[str]:
        if self.store is None:
            return []
        return await self.store.lookup(self._chunk_keys(req))

    def _link(self, tier: str, key: str, node: int) -> tuple[Link, str]:
        """The link a load of ``key`` from ``tier`` crosses, and its name ("net": another
        node's DRAM, through the network)."""
        link = {"dram": self.hw.dram, "nvme": self.hw.nvme, "s3": self.hw.s3}[tier]
        net = self.hw.net
        if tier == "dram" and net is not None and self.writer.get(key, node) != node:
            return Link(min(link.bytes_per_s, net.bytes_per_s),
                        link.latency_s + net.latency_s), "net"  # fmt: skip
        return link, tier

    # ------------------------------------------------------------------ events

    def _at(self, t: float, kind: str, obj: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj))

    def _enqueue(self, srv: _Server, job: _Job) -> None:
        job.pending = job.req.n
        srv.waiting.append(job)
        srv.arrivals.add(job.req.n, self.now)
        if not srv.busy:
            srv.busy = True
            self._at(self.now, "step", srv)

    async def _route(self, req: SimRequest, res: Outcome) -> None:
        servers = self.servers
        mode = self.layout.routing
        if mode in ("none", "round_robin"):
            srv = servers[next(self.rr) % len(servers)]
            self._enqueue(srv, _Job(req, res, req.out, "whole"))
            return
        sources = await self._lookup(req)
        cached = min(len(sources) * self.hw.chunk_tokens, req.n)
        if mode == "split":
            pre = [s for s in servers if s.lay.pool == "prefill"]
            dec = [s for s in servers if s.lay.pool == "decode"]
            d = min(dec, key=lambda s: len(s.running) + len(s.waiting))
            if cached > 0 and req.n - cached <= self.hw.chunk_tokens:  # the router's skip
                self._enqueue(d, _Job(req, res, req.out, "decode"))
                return
            p = min(pre, key=lambda s: sum(j.pending for j in (*s.waiting, *s.running)))
            res.split = True
            self._enqueue(p, _Job(req, res, 1, "prefill"))
            return
        n_rr = next(self.rr)
        order = [servers[(i + n_rr) % len(servers)] for i in range(len(servers))]
        views = [s.view(cached, self.now) for s in order]
        c = decide(views, req.n, req.out, self.rates, "whole" if mode == "whole" else "auto")
        assert c is not None
        if c.kind == "whole":
            self._enqueue(self.by_name[c.server], _Job(req, res, req.out, "whole"))
        else:
            assert c.prefill is not None
            res.split = True
            self._enqueue(self.by_name[c.prefill], _Job(req, res, 1, "prefill"))

    # ------------------------------------------------------------------ a step

    async def _admit(self, srv: _Server, job: _Job) -> float:
        """Prefix-cache and store hits of a newly scheduled request; returns its load's
        seconds."""
        req, res, bt = job.req, job.res, self.bt
        top = (req.n - 1) // bt  # vLLM computes the last prompt token itself
        local = 0
        while local < min(top, len(req.keys)) and req.keys[local] in srv.lru:
            srv.lru.move_to_end(req.keys[local])
            local += 1
        job.computed = local * bt
        load_s = 0.0
        if srv.lay.cache and self.store is not None:
            ckeys = self._chunk_keys(req)
            sources = await self.store.lookup(ckeys)
            ext_tokens = min(len(sources) * self.hw.chunk_tokens, req.n - 1)
            if ext_tokens > job.computed:
                first = job.computed // self.hw.chunk_tokens  # chunks the blocks cover
                moved: dict[str, tuple[Link, float]] = {}  # by link: its bytes
                for i in range(first, len(sources)):
                    await self.store.get(ckeys[i], promote=True)
                    tier = sources[i]
                    lk, lname = self._link(tier, ckeys[i], srv.lay.node)
                    moved[lname] = (lk, moved.get(lname, (lk, 0.0))[1] + self.chunk_bytes)
                    if job.leg != "prefill":  # hit rates: the answered request's
                        res.tier_hit[tier] = res.tier_hit.get(tier, 0) + self.hw.chunk_tokens
                    res.load_bytes += self.chunk_bytes
                for lname, (lk, nbytes) in moved.items():  # the links work in parallel
                    t = lk.seconds(nbytes)
                    res.link_s[lname] = res.link_s.get(lname, 0.0) + t
                    load_s = max(load_s, t)
                res.load_s += load_s
                job.computed = ext_tokens
        if job.leg != "prefill":  # the tokens of the request that is answered
            res.local_hit = local * bt
        job.pending = req.n - job.computed
        job.held = -(-(req.n + job.out) // bt)
        return load_s

    async def _save(self, srv: _Server, job: _Job) -> float:
        req = job.req
        for k in req.keys[: (req.n - 1) // self.bt]:
            srv.lru[k] = None
            srv.lru.move_to_end(k)
        # vLLM's pool: the running requests' blocks (``held``, their cached prompt blocks
        # among them) and, in what is left, the cached blocks of finished ones, LRU first.
        busy = {k for j in srv.running for k in j.req.keys[: j.computed // self.bt]}
        over = len(srv.lru) - len(busy & srv.lru.keys()) - (srv.cap - srv.held)
        if over > 0:
            for k in [k for k in srv.lru if k not in busy][:over]:
                del srv.lru[k]
        if not srv.lay.cache or self.store is None:
            return 0.0
        ckeys = self._chunk_keys(req)
        have = len(await self.store.lookup(ckeys))
        parent = ckeys[have - 1] if have else None
        nbytes = 0.0
        for i in range(have, len(ckeys)):
            await self.store.put(ckeys[i], self.stub(ckeys[i]), info=EntryInfo(parent, i))
            self.writer[ckeys[i]] = srv.lay.node
            parent = ckeys[i]
            nbytes += self.chunk_bytes
        await self.store.flush()
        job.res.save_bytes += nbytes
        return self.hw.dram.seconds(nbytes) if self.hw.save_blocks else 0.0

    async def _step(self, srv: _Server) -> None:
        hw, now = self.hw, self.now
        budget = hw.max_batched_tokens
        decodes, ctx, stall = 0, 0, 0.0
        chunks: list[tuple[_Job, int]] = []
        for j in srv.running:
            if j.gen > 0:
                decodes += 1
                ctx += j.req.n + j.gen
                budget -= 1
        for j in srv.running:
            if j.gen == 0 and budget > 0 and j.ready <= now:
                c = min(j.req.n - j.computed, budget)
                chunks.append((j, c))
                budget -= c
        while srv.waiting and budget > 0 and len(srv.running) < hw.max_num_seqs:
            j = srv.waiting[0]
            need = -(-(j.req.n + j.out) // self.bt)
            if srv.running and srv.held + need > srv.cap:
                break  # waits for KV space (vLLM: no preemption modelled)
            srv.waiting.popleft()
            load_s = await self._admit(srv, j)
            srv.running.append(j)
            # A load stalls the step (CPU) or only its own request (GPU, async).
            if hw.load_blocks:
                stall += load_s
            else:
                j.ready = now + load_s
                if load_s > 0:
                    self._at(j.ready, "wake", srv)
                    continue
            c = min(j.req.n - j.computed, budget)
            chunks.append((j, c))
            budget -= c
        if not chunks and decodes == 0:
            srv.busy = False
            return
        pairs = sum(c * (j.computed + c / 2) for j, c in chunks)
        mem, comp = srv.engine.parts(decodes, ctx, sum(c for _, c in chunks), pairs)
        srv.prefilling = bool(chunks)
        near = [o for o in self.servers if o.busy and o is not srv and o.lay.node == srv.lay.node]
        slow = (hw.neighbour_prefill if any(o.prefilling for o in near)
                else hw.neighbour_decode if near else 0.0)  # fmt: skip
        dur = srv.engine.combine(mem, comp) * (1 + slow) + stall
        for j, c in chunks:
            j.computed += c
            j.pending = j.req.n - j.computed
            if j.computed >= j.req.n:
                dur += await self._save(srv, j)
        self._at(now + dur, "end", (srv, chunks))

    async def _end(self, srv: _Server, chunks: list[tuple[_Job, int]]) -> None:
        now = self.now
        prefilled = {id(j) for j, _ in chunks}
        keep = []
        for j in srv.running:
            if id(j) in prefilled:
                if j.computed < j.req.n:
                    keep.append(j)
                    continue
                j.gen = 1
                if j.leg == "prefill":  # the handoff: the decode's request follows
                    self._at(now + self.hw.hop_s, "handoff", j)
                    continue
                j.res.ttft = now - j.req.arrival + srv.engine.overhead_s
            elif j.gen > 0:
                j.gen += 1
            if j.gen >= j.out and j.gen > 0:
                j.res.done = now + srv.engine.overhead_s
                continue
            keep.append(j)
        srv.running = keep
        self._at(now, "step", srv)

    async def _handoff(self, j: _Job) -> None:
        dec = [s for s in self.servers if s.lay.pool == "decode"]
        d = min(dec, key=lambda s: len(s.running) + len(s.waiting))
        self._enqueue(d, _Job(j.req, j.res, j.req.out, "decode"))

    def handoff_s(self, reqs: Sequence[SimRequest]) -> float:
        """What the router learns a handoff costs (its EWMA of measured handoffs): the
        second request, and the mean prompt's KV saved and loaded across the link between
        the pools (the network when they sit on different nodes)."""
        nbytes = sum(r.n for r in reqs) / max(1, len(reqs)) * self.kv_bpt
        pre = {s.lay.node for s in self.servers if s.lay.pool == "prefill"}
        dec = {s.lay.node for s in self.servers if s.lay.pool == "decode"}
        link = self.hw.net if self.hw.net is not None and pre != dec else self.hw.dram
        save = self.hw.dram.seconds(nbytes) if self.hw.save_blocks else 0.0
        return self.hw.hop_s + save + link.seconds(nbytes)

    async def run(self, reqs: Sequence[SimRequest]) -> list[Outcome]:
        outs = [Outcome(r.arrival, out=r.out, kind=r.kind, prompt=r.n) for r in reqs]
        self.rates = Rates(self.rates.prefill_tps, self.handoff_s(reqs), self.rates.step_s)
        proxy = self.hw.router_s if self.layout.routing != "none" else 0.0
        for r, o in zip(reqs, outs, strict=True):
            self._at(r.arrival + proxy, "arrive", (r, o))
        while self.events:
            t, _, kind, obj = heapq.heappop(self.events)
            self.now = t
            if kind == "arrive":
                r, o = obj  # type: ignore[misc]
                await self._route(r, o)
            elif kind == "step":
                srv = obj
                assert isinstance(srv, _Server)
                await self._step(srv)
            elif kind == "wake":
                srv = obj
                assert isinstance(srv, _Server)
                if not srv.busy:
                    srv.busy = True
                    await self._step(srv)
            elif kind == "end":
                end_srv, chunks = cast(tuple[_Server, list[tuple[_Job, int]]], obj)
                await self._end(end_srv, chunks)
            elif kind == "handoff":
                assert isinstance(obj, _Job)
                await self._handoff(obj)
        return outs


def replay(layout: Layout, hw: Hardware, reqs: Sequence[SimRequest], kv_bpt: int,
           policy: str = "s3prefix") -> list[Outcome]:  # fmt: skip
    return asyncio.run(Sim(layout, hw, kv_bpt, policy).run(reqs))
