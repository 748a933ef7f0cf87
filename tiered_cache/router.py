"""OpenAI-compatible P/D router: prefill (max_tokens=1) on one server, decode on another,
the KV moving between them through the cache tiers.

Follows vLLM's P/D proxy protocol: the prefill request carries
``kv_transfer_params={"do_remote_decode": true}``; the prefill server's connector answers
with ``kv_transfer_params`` (here including the chunk fingerprint and its node id), which
go to the decode request unchanged.

Cache-aware: the router tokenizes the prompt on a decode server (``/tokenize``), computes
the chunk keys, and asks the cache where they are. If the whole chunk-aligned prompt is
loadable but for at most ``max_local_prefill_tokens`` tokens it skips prefill (the decode
computes those few itself, as Dynamo's conditional disaggregation does); otherwise it picks
the prefill server whose node holds the longest cached prefix, weighed against its
in-flight load.

When a prefill server's connector reports its cache unavailable, a handoff would only make
the decode recompute the prompt: the router stops splitting requests (each goes whole to
the least-loaded live server of either pool) until a later prefill, sent on a backoff
schedule, saves its chunks again.

Whole or split (``router.split``, ``tiered_cache.split``): ``split`` sends every request
through the prefill pool (but those the cache nearly covers); ``whole`` serves each on one
server of either pool, picked by cached prefix and load (``--replica`` servers: a replica
router, as llm-d's prefix-cache-aware scheduler); ``auto`` prices both per request from the
prompt's cached tokens, each server's running decodes and queued prefill tokens, and the
measured prefill, handoff and decode-step times, and takes the cheaper. Decisions and the
time of each phase (tokenize, lookup, prefill, decode's first byte) are metrics on
``/metrics``.

Tenants (``router.tenants`` in the config, ``tiered_cache.tenancy``): each request must
carry one's API key (``Authorization: Bearer``), and goes on with that tenant's salt as
its ``cache_salt``, whatever the client sent, so its chunk keys are its tenant's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tiered_cache.breaker import Breaker
from tiered_cache.keys import (
    IDENTITY_FIELDS,
    ModelFingerprint,
    chunk_keys,
    partial_keys,
    probe_lengths,
)
from tiered_cache.kv_events.index import BlockIndex, EventSubscriber
from tiered_cache.protocol import Models
from tiered_cache.router_replies import (
    RETRY_STATUS,
    Retry,
    error_reply,
    passthrough_error,
    unauthorized,
)
from tiered_cache.split import (
    SPLIT_MODES,
    Choice,
    DecayingRate,
    Ewma,
    Rates,
    ServerView,
    SplitMode,
    decide,
)
from tiered_cache.tenancy import TenantAuth, TenantSpec, tenant_salt

log = logging.getLogger("tiered_cache.router")

FINGERPRINT_FIELDS = (
    "model_id",
    "dtype",
    "kv_layout",
    "block_size",
    "tp_rank",
    "tp_world_size",
    "chunk_size",
)


@dataclass
class Backend:
    url: str
    role: str
    inflight: int = 0
    healthy: bool = True
    failures: int = 0
    node_id: str | None = None
    last_error: str = ""
    running: int = 0  # requests past their first token here
    queued_tokens: int = 0  # prefill tokens sent here whose first token has not come back
    arrivals: DecayingRate = field(default_factory=DecayingRate)  # prefill tokens sent

    def score_load(self) -> float:
        return float(self.inflight)


@dataclass
class RouterStats:
    requests: int = 0
    prefill_skipped: int = 0
    errors: int = 0
    unauthorized: int = 0  # requests refused for a missing or unknown API key
    retries: int = 0  # requests moved to another backend after one failed
    per_backend: dict[str, int] = field(default_factory=dict)
    # Requests served by the pool that was left (each server is a whole vLLM):
    # no_prefill (the decode computed the prompt), no_decode (a prefill server decoded),
    # cache_down (no handoff: the cache was unavailable, one server served it whole).
    fallbacks: dict[str, int] = field(default_factory=dict)

    # split (prefill, then decode), whole (one server), skip (split mode: the cache held
    # nearly all of the prompt, the decode computed the rest)
    decisions: dict[str, int] = field(default_factory=dict)

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


@dataclass
class PromptInfo:
    """A prompt as the router sees it once tokenized."""

    tokens: int
    keys: list[str]  # whole chunks of all tokens but the last (vLLM computes that one)
    chunk_size: int
    cached: int = 0  # leading tokens the cache holds: whole chunks, then part of one

    @property
    def uncached(self) -> int:
        return self.tokens - self.cached


@dataclass
class _Timing:
    """One request's clock: when the router got it, the prefill tokens its decode (or
    whole) server computes, and whether a handoff came before (its first byte then
    measures the handoff)."""

    t_in: float
    uncached: int = 0
    handoff: bool = False


PHASES = ("tokenize", "lookup", "prefill", "decode_first_byte", "ttft")
_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class RouterMetrics:
    """The router's own registry, on its ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        p = "tiered_cache_router_"
        self.decisions = Counter(
            p + "decisions", "Requests by how they were served (kind: split, whole, skip)",
            ["kind"], registry=self.registry,
        )  # fmt: skip
        self.phase = Histogram(
            p + "phase_seconds",
            "Time in each phase of a request (tokenize, lookup: the cache's chunks; prefill:"
            " the prefill request; decode_first_byte: the decode request to its first byte;"
            " ttft: the router's receipt to the first byte)",
            ["phase"], buckets=_PHASE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        for k in ("split", "whole", "skip"):
            self.decisions.labels(kind=k)
        for ph in PHASES:
            self.phase.labels(phase=ph)


class Router:
    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        cache: Any | None = None,
        load_weight: float = 1.0,
        timeout_s: float = 600.0,
        health_interval_s: float = 2.0,
        handoff_retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        tenants: Sequence[TenantSpec] = (),
        max_local_prefill_tokens: int | None = None,
        split: SplitMode = "split",
        round_robin: bool = False,
        prefill_tokens_per_s: float = 4000.0,
        handoff_s: float = 0.2,
        decode_step_s: float = 0.03,
        kv_event_sources: Sequence[tuple[str, str | None]] = (),
    ) -> None:
        if split not in SPLIT_MODES:
            raise ValueError(f"split must be one of {', '.join(SPLIT_MODES)}, got {split!r}")
        if split == "whole":
            if not prefill and not decode:
                raise ValueError("the router needs at least one server")
        elif not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode server")
        if prefill_tokens_per_s <= 0 or handoff_s < 0 or decode_step_s < 0:
            raise ValueError("prefill_tokens_per_s must be > 0, handoff_s and decode_step_s >= 0")
        self.split_mode: SplitMode = split
        self.round_robin = round_robin  # whole requests: strict rotation (no cache, no load)
        self.prefill_tps = Ewma(prefill_tokens_per_s)
        self.handoff_s = Ewma(handoff_s)
        self.step_s = Ewma(decode_step_s)
        self.metrics = RouterMetrics()
        self._models_tried: dict[str, float] = {}  # model -> when the agent was last asked
        self.prefill = [Backend(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Backend(u.rstrip("/"), "decode") for u in decode]
        self.cache = cache  # an AgentClient (lookup + locate), optional
        self.load_weight = load_weight
        # Tokens a decode may compute itself when every whole chunk before them is cached
        # (None: any partial tail, i.e. fewer than a chunk).
        if max_local_prefill_tokens is not None and max_local_prefill_tokens < 0:
            raise ValueError("max_local_prefill_tokens must be >= 0")
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.health_interval_s = health_interval_s
        self.fingerprints: dict[str, dict[str, Any]] = {}  # model -> fingerprint params
        self.stats = RouterStats()
        self.tenants = TenantAuth(tenants)
        self._rr = {"prefill": itertools.count(), "decode": itertools.count(),
                    "any": itertools.count()}  # fmt: skip
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._cache_guard = Breaker("router: node agent (cache-aware routing)", log)
        # Opened by a prefill that could not save its KV: while open, requests are not
        # split (a decode would only recompute what the prefill computed).
        self._handoff = Breaker(
            "router: KV handoff (the prefill's cache)", log, base_s=handoff_retry_s,
            clock=clock,
        )
        self.clock = clock
        # ``lookup: events``: the cached prefix from the agents' KV event streams (PUB,
        # replay endpoints), instead of a lookup round trip per request.
        self.kv_index: BlockIndex | None = BlockIndex() if kv_event_sources else None
        self._kv_subs = [
            EventSubscriber(self.kv_index, pub, rep)
            for pub, rep in kv_event_sources
            if self.kv_index is not None
        ]

    # ---------------------------------------------------------------- app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/router/stats", self.stats_handler)
        app.router.add_get("/metrics", self.metrics_handler)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        self._health_task = asyncio.ensure_future(self._health_loop())
        for sub in self._kv_subs:
            sub.start()

    async def _cleanup(self, _: web.Application) -> None:
        for sub in self._kv_subs:
            await sub.close()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None
        return self._session

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(b) for b in self.prefill + self.decode))
            await asyncio.sleep(self.health_interval_s)

    async def _probe(self, b: Backend) -> None:
        try:
            async with self.session.get(
                b.url + "/health", timeout=aiohttp.ClientTimeout(total=2)
            ) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok != b.healthy:
            log.warning("%s backend %s is now %s", b.role, b.url, "up" if ok else "DOWN")
        b.healthy = ok
        if ok:
            b.failures = 0

    def _mark_failed(self, b: Backend, err: str) -> None:
        b.failures += 1
        b.last_error = err
        if b.failures >= 1:
            b.healthy = False  # out of rotation until the health probe sees it again
        log.warning("%s backend %s failed: %s", b.role, b.url, err)

    async def health(self, _: web.Request) -> web.Response:
        up_p = [b.url for b in self.prefill if b.healthy]
        up_d = [b.url for b in self.decode if b.healthy]
        body = {"prefill": up_p, "decode": up_d}
        # Either pool alone serves requests (degraded): unhealthy only with neither.
        return web.json_response(body, status=200 if up_d or up_p else 503)

    def _tenant(self, request: web.Request) -> TenantSpec | web.Response | None:
        """The request's tenant (None without tenants configured), or the 401 answer."""
        if not self.tenants:
            return None
        tenant = self.tenants.match(request.headers.get("Authorization"))
        if tenant is None:
            self.stats.unauthorized += 1
            return unauthorized()
        return tenant

    async def models(self, request: web.Request) -> web.StreamResponse:
        refused = self._tenant(request)
        if isinstance(refused, web.Response):
            return refused
        b = self._pick_decode() or self._next_live(self.prefill, set())
        if b is None:
            return error_reply(503, "no healthy server")
        async with self.session.get(b.url + "/v1/models") as r:
            return web.json_response(await r.json(), status=r.status)

    async def stats_handler(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "requests": self.stats.requests,
                "prefill_skipped": self.stats.prefill_skipped,
                "errors": self.stats.errors,
                "unauthorized": self.stats.unauthorized,
                "retries": self.stats.retries,
                "fallbacks": self.stats.fallbacks,
                "decisions": self.stats.decisions,
                "split": self.split_mode,
                "rates": {
                    "prefill_tokens_per_s": round(self.prefill_tps.value, 1),
                    "handoff_s": round(self.handoff_s.value, 4),
                    "decode_step_s": round(self.step_s.value, 4),
                },
                "per_backend": self.stats.per_backend,
                "kv_events": None if self.kv_index is None else {
                    "blocks": len(self.kv_index),
                    "block_size": self.kv_index.block_size,
                    "batches": sum(sub.batches for sub in self._kv_subs),
                },
                "backends": [
                    {
                        "url": b.url,
                        "role": b.role,
                        "healthy": b.healthy,
                        "inflight": b.inflight,
                        "running": b.running,
                        "queued_tokens": b.queued_tokens,
                        "node_id": b.node_id,
                    }
                    for b in self.prefill + self.decode
                ],
            }
        )

    async def metrics_handler(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    def _decided(self, kind: str) -> None:
        self.stats.decisions[kind] = self.stats.decisions.get(kind, 0) + 1
        self.metrics.decisions.labels(kind=kind).inc()

    def _phase(self, phase: str, seconds: float) -> None:
        self.metrics.phase.labels(phase=phase).observe(seconds)

    # ---------------------------------------------------------------- choice

    def _pick_decode(self) -> Backend | None:
        live = [b for b in self.decode if b.healthy]
        if not live:
            return None
        return self._least_loaded(live)

    async def _fingerprint(self, model: str) -> ModelFingerprint | None:
        """The model's chunk fingerprint: from a prefill's answer, else from the
        connectors' registrations with the agent (a router that never splits learns it
        there), asked at most every 10 s per model."""
        fpp = self.fingerprints.get(model)
        if fpp is None and self.cache is not None and hasattr(self.cache, "_call"):
            now = time.monotonic()
            if now - self._models_tried.get(model, -1e9) >= 10.0:
                self._models_tried[model] = now
                try:
                    reply = await asyncio.to_thread(self.cache._call, Models())
                except Exception as e:  # routing without the cache: never a failure
                    log.debug("models lookup failed: %s", e)
                    reply = {}
                for reg in reply.get("models", []):
                    if model in (reg.get("model_id"), *reg.get("aliases", [])):
                        self.fingerprints[model] = fpp = dict(reg)
                        break
        if fpp is None:
            return None
        # The identity fields too (revision, weights, epoch...): without them the router's
        # keys would not be the connector's.
        fields = (*FINGERPRINT_FIELDS, *IDENTITY_FIELDS)
        return ModelFingerprint(**{k: fpp[k] for k in fields if k in fpp})

    async def _prompt(self, path: str, body: dict[str, Any]) -> PromptInfo | None:
        """The prompt's tokens, chunk keys and cached prefix, when the model's
        fingerprint is known and the cache reachable."""
        if self.cache is None:
            return None
        fp = await self._fingerprint(str(body.get("model")))
        if fp is None:
            return None
        prompt = body.get("prompt")
        t0 = time.perf_counter()
        toks: Sequence[int]
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            toks = prompt  # token ids already: no tokenizing round trip
        else:
            got = await self._tokenize(path, body)
            if got is None:
                return None
            toks = got
            self._phase("tokenize", time.perf_counter() - t0)
        if not toks:
            return None
        salt = body.get("cache_salt")
        keys = chunk_keys(toks[:-1], fp, cache_salt=salt)
        info = PromptInfo(len(toks), keys, fp.chunk_size)
        index = self.kv_index
        if index is not None and index.block_size:  # caught up with some stream
            t1 = time.perf_counter()
            blocks = index.cached_blocks(toks, salt, str(body.get("model") or ""))
            info.cached = min(len(toks) - 1, blocks * index.block_size)
            self._phase("lookup", time.perf_counter() - t1)
        elif self._cache_guard.allow():
            t1 = time.perf_counter()
            info.cached = await asyncio.to_thread(self._cached_tokens, toks, fp, salt, keys)
            self._phase("lookup", time.perf_counter() - t1)
        return info

    async def _tokenize(self, path: str, body: dict[str, Any]) -> list[int] | None:
        dec = next((b for b in (*self.decode, *self.prefill) if b.healthy), None)
        if dec is None:
            return None
        req: dict[str, Any] = {"model": body.get("model")}
        if path.endswith("chat/completions"):
            req["messages"] = body.get("messages", [])
            for k in ("chat_template", "add_generation_prompt", "chat_template_kwargs"):
                if k in body:
                    req[k] = body[k]
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return None  # batched prompts: no cache-aware routing
            req["prompt"] = prompt
        try:
            async with self.session.post(dec.url + "/tokenize", json=req) as r:
                if r.status != 200:
                    return None
                return list((await r.json())["tokens"])
        except (aiohttp.ClientError, KeyError, asyncio.TimeoutError):
            return None

    def _cached_tokens(
        self, toks: Sequence[int], fp: ModelFingerprint, salt: str | None, keys: list[str]
    ) -> int:
        """Leading prompt tokens the cache holds: the whole chunks found, then the longest
        part of the next one an earlier prompt saved (its partial tail, that tail's whole
        blocks, or the first blocks of a whole chunk), probed as the connector does:
        what a decode that skips prefill loads, not only whole chunks. Runs in a thread."""
        cs = fp.chunk_size
        cache = self.cache
        assert cache is not None
        try:
            found = len(cache.lookup(keys)) if keys else 0
            self._cache_guard.ok()
        except OSError as e:  # the agent is down: route without the cache for a while
            self._cache_guard.failed(e)
            return 0
        except Exception as e:  # the cache is an optimisation for routing
            log.debug("cache lookup failed: %s", e)
            return 0
        start = found * cs
        span = min(cs, len(toks) - start)
        lengths = probe_lengths(span - 1)
        part = 0
        if lengths and hasattr(cache, "present"):
            parent = keys[found - 1] if found else None
            cands = partial_keys(toks, fp, salt, parent, start, lengths)
            try:
                hits = cache.present(cands)
            except Exception as e:
                log.debug("partial chunk probe failed: %s", e)
                hits = []
            part = next((n for n, h in zip(lengths, hits, strict=False) if h is not None), 0)
        return min(len(toks) - 1, start + part)

    async def _located_prefix(self, keys: list[str]) -> Callable[[str | None], int] | None:
        """Per node: how many leading chunks it holds (None when unknown)."""
        if not keys or self.cache is None:
            return None
        try:
            locs = await asyncio.to_thread(self.cache.locate, keys)
        except Exception:
            return None

        def cached_prefix(node: str | None) -> int:
            n = 0
            for ls in locs:
                if node is None or node not in ls:
                    break
                n += 1
            return n

        return cached_prefix

    def _skips(self, info: PromptInfo | None) -> bool:
        """Split mode: the cache holds all of the prompt but at most
        ``max_local_prefill_tokens`` (default: a chunk), which the decode computes."""
        if info is None or not info.keys or info.cached <= 0:
            return False
        cap = self.max_local_prefill_tokens
        return info.uncached <= (info.chunk_size if cap is None else cap)

    async def _choose_prefill(self, info: PromptInfo | None) -> tuple[Backend | None, bool]:
        """(prefill backend, skip_prefill)."""
        live = [b for b in self.prefill if b.healthy]
        if self._skips(info):
            return None, True
        if live and info is not None and info.keys:
            prefix = await self._located_prefix(info.keys)
            if prefix is not None:
                best = max(
                    live,
                    key=lambda b: (
                        prefix(b.node_id) - self.load_weight * b.inflight,
                        -b.inflight,
                    ),
                )
                return best, False
        if not live:
            return None, False
        return self._least_loaded(live), False

    def _rates(self) -> Rates:
        return Rates(self.prefill_tps.value, self.handoff_s.value, self.step_s.value)

    async def _decide(self, info: PromptInfo | None, body: dict[str, Any]) -> Choice | None:
        """Whole or split, and where (modes ``whole`` and ``auto``)."""
        live = [b for b in (*self.prefill, *self.decode) if b.healthy]
        if not live:
            return None
        if info is None or self.round_robin:
            # Nothing known of the prompt: auto splits (the prefill's answer teaches the
            # router the model's fingerprint); whole takes the next server.
            pre = [b for b in live if b.role == "prefill"]
            dec = [b for b in live if b.role == "decode"]
            if self.split_mode == "auto" and pre and dec and not self.round_robin:
                p, d = self._least_loaded(pre), self._least_loaded(dec)
                return Choice("split", d.url, p.url, 0.0, 0)
            srv = self._rotate(live) if self.round_robin else self._least_loaded_any(live)
            return Choice("whole", srv.url, None, 0.0, 0)
        prefix = None
        if len({b.node_id for b in live}) > 1:  # several nodes: who holds the prefix
            prefix = await self._located_prefix(info.keys)
        now = self.clock()
        views = []
        n_rr = next(self._rr["any"])
        for i in range(len(live)):  # rotated: ties go round robin
            b = live[(i + n_rr) % len(live)]
            cached = info.cached
            if prefix is not None and b.node_id is not None:
                cached = min(cached, prefix(b.node_id) * info.chunk_size)
            views.append(ServerView(
                b.url, b.role, b.running, b.queued_tokens, cached, b.arrivals.rate(now),
            ))  # fmt: skip
        out = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        return decide(views, info.tokens, int(out), self._rates(), self.split_mode)

    # ---------------------------------------------------------------- proxy

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests += 1
        tenant = self._tenant(request)
        if isinstance(tenant, web.Response):
            return tenant
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_reply(400, "request body must be JSON")
        if not isinstance(body, dict):
            return error_reply(400, "request body must be a JSON object")
        if tenant is not None:
            # The client's own salt is dropped: the tenant's secret one seeds every key
            # (the router's below, the connectors' in prefill and decode).
            body["cache_salt"] = tenant_salt(tenant.name, tenant.salt.get_secret_value())
        path = request.path
        rid = request.headers.get("X-Request-Id") or f"tc-{time.monotonic_ns():x}"
        t_in = time.perf_counter()
        if not self._handoff.allow():
            return await self._serve_whole(path, body, rid, request, _Timing(t_in))
        info = None if self._cache_guard.blocked else await self._prompt(path, body)
        if info is not None:
            log.debug(
                "%s: %d prompt tokens, %d cached, known %.0f ms after arrival",
                rid, info.tokens, info.cached, 1e3 * (time.perf_counter() - t_in),
            )  # fmt: skip
        prefer: Backend | None = None  # the decode server the cost model chose
        uncached = info.uncached if info is not None else 0
        if self.split_mode == "split":
            pre, skip = await self._choose_prefill(info)
        else:
            choice = await self._decide(info, body)
            if choice is None:
                self.stats.errors += 1
                return error_reply(503, "no healthy decode or prefill server")
            if choice.kind == "whole":
                self._decided("whole")
                first = self._backend(choice.server)
                return await self._serve_whole(
                    path, body, rid, request, _Timing(t_in, choice.uncached), first=first
                )
            pre, skip = self._backend(choice.prefill), False
            prefer = self._backend(choice.server)
            uncached = choice.uncached
        if skip:
            # Every chunk is in the cache already: nothing is on its way for the decode
            # to wait for.
            self.stats.prefill_skipped += 1
            self._decided("skip")
            kv_params: dict[str, Any] = {"do_remote_prefill": True, "tiered_cache": {"keys": []}}
            timing = _Timing(t_in, uncached)
        else:
            self._decided("split")
            got = await self._run_prefill(pre, path, body, rid, uncached)
            if isinstance(got, web.Response):
                return got
            kv_params, pre = got
            timing = _Timing(t_in, 0 if pre is not None else uncached, handoff=pre is not None)
            tc = kv_params.get("tiered_cache")
            if pre is not None and isinstance(tc, dict) and tc.get("unavailable"):
                # Nothing was saved: decode on the prefill server, whose own prefix
                # cache holds the prompt it just computed.
                self._handoff.failed("the prefill server reports its cache unavailable")
                self.stats.fallback("cache_down")
                out = await self._decode(pre, path, dict(body), rid, request, _Timing(t_in))
                if not isinstance(out, Retry):
                    return out
                self.stats.retries += 1
                kv_params = {}
                timing = _Timing(t_in, uncached)
            elif isinstance(tc, dict):
                self._handoff.ok()
        # The KV sits in the cache tiers, not in one decode server: any decode server can
        # pull it, so a dead one is retried on another.
        tried: set[str] = set()
        dec = prefer if prefer is not None and prefer.healthy else None
        dec = dec or self._next_live(self.decode, tried)
        while dec is not None:
            tried.add(dec.url)
            dbody = dict(body)
            if kv_params:
                dbody["kv_transfer_params"] = kv_params
            out = await self._decode(dec, path, dbody, rid, request, timing)
            if not isinstance(out, Retry):
                return out
            self.stats.retries += 1
            dec = self._next_live(self.decode, tried)
        # No decode server left: a prefill server is a whole vLLM, it decodes the request
        # itself (from its own KV, or the cache's).
        srv = self._next_live(self.prefill, set())
        if srv is None:
            self.stats.errors += 1
            return error_reply(503, "no healthy decode or prefill server")
        self.stats.fallback("no_decode")
        out = await self._decode(srv, path, dict(body), rid, request, _Timing(t_in, uncached))
        if isinstance(out, Retry):
            self.stats.errors += 1
            return out.error
        return out

    async def _run_prefill(
        self, pre: Backend | None, path: str, body: dict[str, Any], rid: str, uncached: int = 0
    ) -> tuple[dict[str, Any], Backend | None] | web.Response:
        """The prefill's ``kv_transfer_params`` and the server that ran it; ({}, None)
        when no prefill server could (the decode server then computes the prompt itself:
        slower, never a failure)."""
        tried: set[str] = set()
        while pre is not None:
            tried.add(pre.url)
            got = await self._prefill(pre, path, body, rid, uncached)
            if isinstance(got, web.Response):
                return got
            if not isinstance(got, Retry):
                return got, pre
            self.stats.retries += 1
            pre = self._next_live(self.prefill, tried)
        self.stats.fallback("no_prefill")
        return {}, None

    async def _serve_whole(
        self,
        path: str,
        body: dict[str, Any],
        rid: str,
        request: web.Request,
        timing: _Timing,
        first: Backend | None = None,
    ) -> web.StreamResponse:
        """One server serves the request alone (each is a whole vLLM): ``first`` (the cost
        model's pick), else, and while the cache is down (no handoff), the least-loaded
        live server of either pool."""
        if first is None:
            self.stats.fallback("cache_down")
        tried: set[str] = set()
        while True:
            live = [b for b in (*self.decode, *self.prefill) if b.healthy and b.url not in tried]
            if not live:
                self.stats.errors += 1
                return error_reply(503, "no healthy decode or prefill server")
            srv = first if first is not None and first in live else self._least_loaded_any(live)
            first = None
            tried.add(srv.url)
            out = await self._decode(srv, path, dict(body), rid, request, timing)
            if not isinstance(out, Retry):
                return out
            self.stats.retries += 1

    def _backend(self, url: str | None) -> Backend | None:
        return next((b for b in (*self.prefill, *self.decode) if b.url == url), None)

    def _least_loaded_any(self, live: list[Backend]) -> Backend:
        """Across pools: fewest in-flight requests; ties rotate."""
        r = next(self._rr["any"])
        n = len(live)
        return live[min(range(n), key=lambda i: (live[i].inflight, (i - r) % n))]

    def _rotate(self, live: list[Backend]) -> Backend:
        """Strict round robin over the live servers (a plain load balancer)."""
        return live[next(self._rr["any"]) % len(live)]

    def _least_loaded(self, live: list[Backend]) -> Backend:
        """Fewest in-flight requests; ties rotate round-robin."""
        r = next(self._rr[live[0].role])  # one counter per pool, one step per pick
        n = len(live)
        return live[min(range(n), key=lambda i: (live[i].inflight, (i - r) % n))]

    def _next_live(self, pool: list[Backend], tried: set[str]) -> Backend | None:
        live = [b for b in pool if b.healthy and b.url not in tried]
        if not live:
            return None
        return self._least_loaded(live)

    async def _prefill(
        self, b: Backend, path: str, body: dict[str, Any], rid: str, uncached: int = 0
    ) -> dict[str, Any] | web.Response | Retry:
        pbody = dict(body)
        pbody.update(
            max_tokens=1,
            stream=False,
            kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
        )
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        for k in ("stream_options", "min_tokens", "min_completion_tokens"):
            pbody.pop(k, None)
        b.inflight += 1
        ahead = b.queued_tokens
        b.queued_tokens += uncached
        b.arrivals.add(uncached, self.clock())
        self.stats.per_backend[b.url] = self.stats.per_backend.get(b.url, 0) + 1
        t0 = time.perf_counter()
        try:
            async with self.session.post(
                b.url + path, json=pbody, headers={"X-Request-Id": rid}
            ) as r:
                data = await r.read()
                took = time.perf_counter() - t0
                if r.status == 200:
                    self._phase("prefill", took)
                    self._sample_prefill(ahead + uncached, took)
                if r.status != 200:
                    if r.status >= 500:
                        self._mark_failed(b, f"HTTP {r.status}")
                    if r.status in RETRY_STATUS:
                        return Retry(passthrough_error(r.status, data, "prefill"))
                    self.stats.errors += 1
                    return passthrough_error(r.status, data, "prefill")
                resp = json.loads(data)
        except aiohttp.ClientConnectionError as e:
            self._mark_failed(b, str(e) or type(e).__name__)
            return Retry(error_reply(502, f"prefill server {b.url} failed: {type(e).__name__}"))
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            # Nothing reached the client yet: another prefill server, or the decode alone.
            self._mark_failed(b, str(e) or type(e).__name__)
            return Retry(error_reply(502, f"prefill server {b.url} failed: {type(e).__name__}"))
        finally:
            b.inflight -= 1
            b.queued_tokens -= uncached
        params = resp.get("kv_transfer_params") or {"do_remote_prefill": True}
        fpp = params.get("tc_fingerprint")
        if isinstance(fpp, dict) and all(k in fpp for k in FINGERPRINT_FIELDS):
            self.fingerprints[str(body.get("model"))] = fpp
        if params.get("tc_node_id"):
            b.node_id = str(params["tc_node_id"])
        return dict(params)

    def _sample_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill rate sample: ``tokens`` computed (queued ones included) in
        ``seconds``. Short prompts measure the request's overhead, not the rate."""
        if tokens >= 128 and seconds > 0:
            self.prefill_tps.add(tokens / seconds)

    async def _decode(
        self,
        b: Backend,
        path: str,
        body: dict[str, Any],
        rid: str,
        request: web.Request,
        timing: _Timing | None = None,
    ) -> web.StreamResponse | Retry:
        tm = timing or _Timing(time.perf_counter())
        b.inflight += 1
        ahead = b.queued_tokens
        b.queued_tokens += tm.uncached
        b.arrivals.add(tm.uncached, self.clock())
        queued = True  # until its first byte: then it is a running decode
        started = False  # once bytes reached the client, a retry would duplicate them
        self.stats.per_backend[b.url] = self.stats.per_backend.get(b.url, 0) + 1
        t0 = time.perf_counter()

        def first_byte() -> float:
            nonlocal queued
            now = time.perf_counter()
            if queued:
                queued = False
                b.queued_tokens -= tm.uncached
                b.running += 1
                self._phase("decode_first_byte", now - t0)
                self._phase("ttft", now - tm.t_in)
                log.debug(
                    "%s: first byte %.0f ms after arrival: %.0f ms in the router (tokenize,"
                    " lookup, prefill), %.0f ms on %s (%d tokens to compute, %d queued ahead)",
                    rid, 1e3 * (now - tm.t_in), 1e3 * (t0 - tm.t_in), 1e3 * (now - t0),
                    b.url, tm.uncached, ahead,
                )  # fmt: skip
                if tm.handoff:
                    self.handoff_s.add(now - t0)
                else:
                    self._sample_prefill(ahead + tm.uncached, now - t0)
            return now

        try:
            async with self.session.post(
                b.url + path, json=body, headers={"X-Request-Id": rid}
            ) as r:
                if r.status != 200:
                    data = await r.read()
                    if r.status >= 500:
                        self._mark_failed(b, f"HTTP {r.status}")
                    if r.status in RETRY_STATUS:
                        return Retry(passthrough_error(r.status, data, "decode"))
                    self.stats.errors += 1
                    return passthrough_error(r.status, data, "decode")
                if not body.get("stream"):
                    data = await r.read()
                    first_byte()
                    return web.Response(body=data, status=200, content_type="application/json")
                out = web.StreamResponse(
                    status=200,
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
                )
                await out.prepare(request)
                started = True
                t_first: float | None = None
                events = 0
                async for chunk in r.content.iter_any():
                    if t_first is None:
                        t_first = first_byte()
                    events += chunk.count(b"data: ")
                    await out.write(chunk)
                await out.write_eof()
                # One SSE event a token, then [DONE]: the decode step this server ran at.
                if t_first is not None and events > 3:
                    self.step_s.add((time.perf_counter() - t_first) / (events - 2))
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._mark_failed(b, str(e) or type(e).__name__)
            if not started:  # nothing reached the client: another server may serve it
                return Retry(error_reply(502, f"decode server {b.url} failed: {type(e).__name__}"))
            self.stats.errors += 1
            return out  # mid-stream: the client sees the stream end without [DONE]
        finally:
            b.inflight -= 1
            if queued:
                b.queued_tokens -= tm.uncached
            else:
                b.running -= 1


def run_router(
    prefill: Sequence[str],
    decode: Sequence[str],
    host: str,
    port: int,
    cache: Any | None = None,
    tenants: Sequence[TenantSpec] = (),
    max_local_prefill_tokens: int | None = None,
    **kw: Any,
) -> None:
    router = Router(
        prefill, decode, cache=cache, tenants=tenants,
        max_local_prefill_tokens=max_local_prefill_tokens, **kw,
    )
    web.run_app(router.app(), host=host, port=port, print=lambda *_: None)
