"""The dashboard's web app: samples the ``Collector`` on a timer and serves the page,
its JSON (``/api/state``) and ``/healthz``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from importlib.resources import files
from typing import Any

from tiered_cache.dashboard.figures import History, build_state, cumulative
from tiered_cache.dashboard.sources import Collector

log = logging.getLogger(__name__)

# The self-contained page (inline JS and SVG, no external assets), shipped as package data.
PAGE = files("tiered_cache.dashboard").joinpath("page.html").read_text(encoding="utf-8")


class Dashboard:
    def __init__(
        self,
        collector: Collector,
        *,
        interval_s: float = 1.0,
        history: int = 900,
        window_s: float = 30.0,
    ) -> None:
        self.collector = collector
        self.interval_s = interval_s
        self.hist = History(history, window_s)
        self.started = time.time()
        self.state: dict[str, Any] = {"updated": None, "error": "no reading yet"}
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> None:
        rd = await self.collector.read()
        self.hist.add(rd.t, cumulative(rd))
        self.state = build_state(rd, self.hist, started=self.started)

    async def _loop(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception as e:
                log.exception("dashboard reading failed")
                self.state = {**self.state, "error": f"{type(e).__name__}: {e}"}
            await asyncio.sleep(self.interval_s)

    def app(self) -> Any:
        from aiohttp import web

        async def index(_: web.Request) -> web.Response:
            return web.Response(text=PAGE, content_type="text/html", charset="utf-8")

        async def state(_: web.Request) -> web.Response:
            return web.Response(
                text=json.dumps(self.state, default=str),
                content_type="application/json",
                headers={"Cache-Control": "no-store"},
            )

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok\n")

        async def on_startup(_: web.Application) -> None:
            self._task = asyncio.ensure_future(self._loop())

        async def on_cleanup(_: web.Application) -> None:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            await self.collector.close()

        app = web.Application()
        app.router.add_get("/", index)
        app.router.add_get("/api/state", state)
        app.router.add_get("/healthz", healthz)
        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app


def serve(dash: Dashboard, host: str, port: int) -> None:
    from aiohttp import web

    web.run_app(dash.app(), host=host, port=port, print=None, handle_signals=True)
