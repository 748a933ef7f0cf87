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

from tiered_cache.breaker import Breaker
from tiered_cache.keys import IDENTITY_FIELDS, ModelFingerprint, chunk_keys
from tiered_cache.router_replies import (
    RETRY_STATUS,
    Retry,
    error_reply,
    passthrough_error,
    unauthorized,
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

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


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
    ) -> None:
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode server")
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
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._cache_guard = Breaker("router: node agent (cache-aware routing)", log)
        # Opened by a prefill that could not save its KV: while open, requests are not
        # split (a decode would only recompute what the prefill computed).
        self._handoff = Breaker(
            "router: KV handoff (the prefill's cache)", log, base_s=handoff_retry_s,
            clock=clock,
        )

    # ---------------------------------------------------------------- app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/router/stats", self.stats_handler)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        self._health_task = asyncio.ensure_future(self._health_loop())

    async def _cleanup(self, _: web.Application) -> None:
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
                "per_backend": self.stats.per_backend,
                "backends": [
                    {
                        "url": b.url,
                        "role": b.role,
                        "healthy": b.healthy,
                        "inflight": b.inflight,
                        "node_id": b.node_id,
                    }
                    for b in self.prefill + self.decode
                ],
            }
        )

    # ---------------------------------------------------------------- choice

    def _pick_decode(self) -> Backend | None:
        live = [b for b in self.decode if b.healthy]
        if not live:
            return None
        return self._least_loaded(live)

    async def _prompt_keys(
        self, path: str, body: dict[str, Any]
    ) -> tuple[list[str], int] | None:
        """Chunk keys of the prompt and the tokens after them (those a decode would
        compute itself), when the model's fingerprint is known."""
        fpp = self.fingerprints.get(str(body.get("model")))
        if fpp is None or self.cache is None:
            return None
        # The identity fields too (revision, weights, epoch...): without them the router's
        # keys would not be the connector's.
        fields = (*FINGERPRINT_FIELDS, *IDENTITY_FIELDS)
        fp = ModelFingerprint(**{k: fpp[k] for k in fields if k in fpp})
        prompt = body.get("prompt")
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            # Token ids already: no tokenizing round trip.
            return self._keys_and_rest(prompt, fp, body)
        dec = next((b for b in self.decode if b.healthy), None)  # any one can tokenize
        if dec is None:
            return None
        req: dict[str, Any] = {"model": body.get("model")}
        if path.endswith("chat/completions"):
            req["messages"] = body.get("messages", [])
            for k in ("chat_template", "add_generation_prompt", "chat_template_kwargs"):
                if k in body:
                    req[k] = body[k]
        else:
            if not isinstance(prompt, str):
                return None  # batched prompts: no cache-aware routing
            req["prompt"] = prompt
        try:
            async with self.session.post(dec.url + "/tokenize", json=req) as r:
                if r.status != 200:
                    return None
                toks = (await r.json())["tokens"]
        except (aiohttp.ClientError, KeyError, asyncio.TimeoutError):
            return None
        return self._keys_and_rest(toks, fp, body)

    @staticmethod
    def _keys_and_rest(
        toks: Sequence[int], fp: ModelFingerprint, body: dict[str, Any]
    ) -> tuple[list[str], int]:
        # vLLM always computes the last prompt token itself: only whole chunks of the
        # first n-1 tokens can come from the cache.
        keys = chunk_keys(toks[:-1], fp, cache_salt=body.get("cache_salt"))
        return keys, len(toks) - len(keys) * fp.chunk_size

    async def _choose_prefill(
        self, keys: list[str] | None, rest: int = 0
    ) -> tuple[Backend | None, bool]:
        """(prefill backend, skip_prefill). ``rest``: prompt tokens after ``keys``."""
        live = [b for b in self.prefill if b.healthy]
        if keys and self.cache is not None and self._cache_guard.allow():
            try:
                sources = await asyncio.to_thread(self.cache.lookup, keys)
                self._cache_guard.ok()
            except OSError as e:  # the agent is down: route without the cache for a while
                self._cache_guard.failed(e)
                sources = []
            except Exception as e:  # the cache is an optimisation for routing
                log.debug("cache lookup failed: %s", e)
                sources = []
            cap = self.max_local_prefill_tokens
            if keys and len(sources) == len(keys) and (cap is None or rest <= cap):
                return None, True
            if live and keys:
                try:
                    locs = await asyncio.to_thread(self.cache.locate, keys)
                except Exception:
                    locs = None
                if locs is not None:

                    def cached_prefix(node: str | None) -> int:
                        n = 0
                        for ls in locs:
                            if node is None or node not in ls:
                                break
                            n += 1
                        return n

                    best = max(
                        live,
                        key=lambda b: (
                            cached_prefix(b.node_id) - self.load_weight * b.inflight,
                            -b.inflight,
                        ),
                    )
                    return best, False
        if not live:
            return None, False
        return self._least_loaded(live), False

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
        if not self._handoff.allow():
            return await self._serve_whole(path, body, rid, request)
        got_keys = None if self._cache_guard.blocked else await self._prompt_keys(path, body)
        keys, rest = got_keys if got_keys is not None else (None, 0)
        pre, skip = await self._choose_prefill(keys, rest)
        if skip:
            # Every chunk is in the cache already: nothing is on its way for the decode
            # to wait for.
            self.stats.prefill_skipped += 1
            kv_params: dict[str, Any] = {"do_remote_prefill": True, "tiered_cache": {"keys": []}}
        else:
            got = await self._run_prefill(pre, path, body, rid)
            if isinstance(got, web.Response):
                return got
            kv_params, pre = got
            tc = kv_params.get("tiered_cache")
            if pre is not None and isinstance(tc, dict) and tc.get("unavailable"):
                # Nothing was saved: decode on the prefill server, whose own prefix
                # cache holds the prompt it just computed.
                self._handoff.failed("the prefill server reports its cache unavailable")
                self.stats.fallback("cache_down")
                out = await self._decode(pre, path, dict(body), rid, request)
                if not isinstance(out, Retry):
                    return out
                self.stats.retries += 1
                kv_params = {}
            elif isinstance(tc, dict):
                self._handoff.ok()
        # The KV sits in the cache tiers, not in one decode server: any decode server can
        # pull it, so a dead one is retried on another.
        tried: set[str] = set()
        dec = self._next_live(self.decode, tried)
        while dec is not None:
            tried.add(dec.url)
            dbody = dict(body)
            if kv_params:
                dbody["kv_transfer_params"] = kv_params
            out = await self._decode(dec, path, dbody, rid, request)
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
        out = await self._decode(srv, path, dict(body), rid, request)
        if isinstance(out, Retry):
            self.stats.errors += 1
            return out.error
        return out

    async def _run_prefill(
        self, pre: Backend | None, path: str, body: dict[str, Any], rid: str
    ) -> tuple[dict[str, Any], Backend | None] | web.Response:
        """The prefill's ``kv_transfer_params`` and the server that ran it; ({}, None)
        when no prefill server could (the decode server then computes the prompt itself:
        slower, never a failure)."""
        tried: set[str] = set()
        while pre is not None:
            tried.add(pre.url)
            got = await self._prefill(pre, path, body, rid)
            if isinstance(got, web.Response):
                return got
            if not isinstance(got, Retry):
                return got, pre
            self.stats.retries += 1
            pre = self._next_live(self.prefill, tried)
        self.stats.fallback("no_prefill")
        return {}, None

    async def _serve_whole(
        self, path: str, body: dict[str, Any], rid: str, request: web.Request
    ) -> web.StreamResponse:
        """No handoff while the cache is down: the least-loaded live server of either
        pool serves the request alone (each is a whole vLLM)."""
        self.stats.fallback("cache_down")
        tried: set[str] = set()
        while True:
            live = [b for b in (*self.decode, *self.prefill) if b.healthy and b.url not in tried]
            if not live:
                self.stats.errors += 1
                return error_reply(503, "no healthy decode or prefill server")
            srv = self._least_loaded(live)
            tried.add(srv.url)
            out = await self._decode(srv, path, dict(body), rid, request)
            if not isinstance(out, Retry):
                return out
            self.stats.retries += 1

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
        self, b: Backend, path: str, body: dict[str, Any], rid: str
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
        self.stats.per_backend[b.url] = self.stats.per_backend.get(b.url, 0) + 1
        try:
            async with self.session.post(
                b.url + path, json=pbody, headers={"X-Request-Id": rid}
            ) as r:
                data = await r.read()
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
        params = resp.get("kv_transfer_params") or {"do_remote_prefill": True}
        fpp = params.get("tc_fingerprint")
        if isinstance(fpp, dict) and all(k in fpp for k in FINGERPRINT_FIELDS):
            self.fingerprints[str(body.get("model"))] = fpp
        if params.get("tc_node_id"):
            b.node_id = str(params["tc_node_id"])
        return dict(params)

    async def _decode(
        self, b: Backend, path: str, body: dict[str, Any], rid: str, request: web.Request
    ) -> web.StreamResponse | Retry:
        b.inflight += 1
        started = False  # once bytes reached the client, a retry would duplicate them
        self.stats.per_backend[b.url] = self.stats.per_backend.get(b.url, 0) + 1
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
                    return web.Response(
                        body=await r.read(), status=200, content_type="application/json"
                    )
                out = web.StreamResponse(
                    status=200,
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
                )
                await out.prepare(request)
                started = True
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._mark_failed(b, str(e) or type(e).__name__)
            if not started:  # nothing reached the client: another server may serve it
                return Retry(error_reply(502, f"decode server {b.url} failed: {type(e).__name__}"))
            self.stats.errors += 1
            if started:
                return out  # mid-stream: the client sees the stream end without [DONE]
            return error_reply(502, f"decode server {b.url} failed: {type(e).__name__}")
        finally:
            b.inflight -= 1


def run_router(
    prefill: Sequence[str],
    decode: Sequence[str],
    host: str,
    port: int,
    cache: Any | None = None,
    tenants: Sequence[TenantSpec] = (),
    max_local_prefill_tokens: int | None = None,
) -> None:
    router = Router(
        prefill, decode, cache=cache, tenants=tenants,
        max_local_prefill_tokens=max_local_prefill_tokens,
    )
    web.run_app(router.app(), host=host, port=port, print=lambda *_: None)
