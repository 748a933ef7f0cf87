"""The agent inside a process (``EmbeddedAgent``, on its own event loop thread) or as
a child process (``spawn_agent``), and waiting for its socket."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiered_cache.agent.node import NodeAgent
from tiered_cache.config import CacheConfig, load_config


class EmbeddedAgent:
    """Runs a NodeAgent on its own event loop thread inside the current process."""

    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.agent: NodeAgent | None = None
        self.thread = threading.Thread(target=self._run, name="tiered-cache-agent", daemon=True)
        self.thread.start()
        if not self._ready.wait(60):
            raise TimeoutError("embedded agent did not start")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def boot() -> None:
            self.agent = NodeAgent(self.cfg)
            await self.agent.start()

        try:
            self.loop.run_until_complete(boot())
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        if self.agent is None or not self.loop.is_running():
            return
        fut = asyncio.run_coroutine_threadsafe(self.agent.stop(), self.loop)
        try:
            fut.result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def spawn_agent(
    cfg_path: str | os.PathLike[str],
    *args: str,
    timeout: float = 60.0,
    prefix: Sequence[str] = (),
    **popen: Any,
) -> subprocess.Popen[Any]:
    """``tiered-cache agent -c CFG ARGS`` as a child process (how a node runs it), returned
    once its socket accepts. ``prefix`` runs it under another command (``ip netns exec
    NS``: a node with its own address). ``popen`` goes to ``subprocess.Popen`` (stdout,
    env, ...). If the agent does not come up it is killed, and the error carries its
    output when piped."""
    socket_path = load_config(cfg_path).socket_path
    Path(socket_path).unlink(missing_ok=True)  # a killed agent leaves it behind
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "tiered_cache.cli", "agent", "-c", str(cfg_path), *args],
        **popen,
    )
    try:
        wait_for_socket(socket_path, timeout, alive=lambda: proc.poll() is None)
    except TimeoutError as e:
        proc.kill()
        out = proc.communicate()[0] if proc.stdout is not None else None
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        raise TimeoutError(f"{e}:\n{out}" if out else str(e)) from None
    return proc


def wait_for_socket(
    path: str, timeout: float = 30.0, alive: Callable[[], bool] | None = None
) -> None:
    """Until a unix socket at ``path`` accepts; TimeoutError after ``timeout`` s, or as soon
    as ``alive()`` says the process that should open it has gone."""
    import socket as _s

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise TimeoutError(f"agent exited before its socket {path} appeared")
        try:
            with _s.socket(_s.AF_UNIX) as s:
                s.connect(path)
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"agent socket {path} did not appear in {timeout}s")
