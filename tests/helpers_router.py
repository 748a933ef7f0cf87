"""A stand-in vLLM server for router tests: records what the router sends it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web


@dataclass
class FakeVllm:
    """Records each completion request (body and headers); answers the prefill stage with
    ``prefill_params(body)`` as its ``kv_transfer_params``: by default what our connector
    reports (chunks saved, or the cache unavailable)."""

    name: str
    cache_down: bool = False
    seen: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    def prefill_params(self, body: dict[str, Any]) -> dict[str, Any]:
        saved = 0 if self.cache_down else 2
        return {"tiered_cache": {"chunks": saved, "keys": [], "unavailable": self.cache_down}}

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(body)
        self.headers.append(dict(request.headers))
        resp: dict[str, Any] = {"choices": [{"text": f"from {self.name}"}]}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            resp["kv_transfer_params"] = self.prefill_params(body)
        return web.json_response(resp)

    def stages(self) -> list[str]:
        """'prefill' (split off), 'decode' (after a handoff) or 'whole', per request."""
        out = []
        for b in self.seen:
            kv = b.get("kv_transfer_params") or {}
            out.append("prefill" if kv.get("do_remote_decode")
                       else "decode" if kv else "whole")  # fmt: skip
        return out


class FingerprintVllm(FakeVllm):
    """The prefill stage answers with the connector's fingerprint (``helpers_agent.FP``),
    from which the router learns to compute chunk keys."""

    def prefill_params(self, body: dict[str, Any]) -> dict[str, Any]:
        from helpers_agent import FP

        from tiered_cache.router import FINGERPRINT_FIELDS

        fp = {k: getattr(FP, k) for k in FINGERPRINT_FIELDS}
        return {"tc_fingerprint": fp, "tiered_cache": {"keys": []}}


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Run ``app`` on a free loopback port; (runner, base URL)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@dataclass
class Rig:
    """A router between two ``FingerprintVllm`` servers, cache-aware through an agent."""

    p: FakeVllm
    d: FakeVllm
    router: Any  # tiered_cache.router.Router
    url: str
    http: aiohttp.ClientSession
    cache: Any  # tiered_cache.client.AgentClient

    async def complete(
        self, prompt: list[int], key: str | None = None, salt: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": 4}
        if salt is not None:
            body["cache_salt"] = salt
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        async with self.http.post(self.url + "/v1/completions", json=body, headers=headers) as r:
            return r.status, await r.json()


@asynccontextmanager
async def router_rig(cfg: Path, **router_kw: Any) -> AsyncIterator[Rig]:
    """``Rig`` on the agent of config ``cfg``; ``router_kw`` go to ``Router``."""
    from helpers_agent import socket_of

    from tiered_cache.client import AgentClient
    from tiered_cache.router import Router

    p, d = FingerprintVllm("prefill"), FingerprintVllm("decode")
    runners = []
    for srv in (p, d):
        runner, srv.url = await serve(srv.app())
        runners.append(runner)
    cache = AgentClient(socket_of(cfg), attach_pool=False)
    router = Router([p.url], [d.url], cache=cache, **router_kw)
    runner, url = await serve(router.app())
    runners.append(runner)
    try:
        async with aiohttp.ClientSession() as http:
            yield Rig(p, d, router, url, http, cache)
    finally:
        for r in reversed(runners):
            await r.cleanup()
        cache.close()
