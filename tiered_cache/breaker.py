"""Fail fast while a dependency is down: a circuit breaker with exponential backoff.

After a failure the breaker opens: ``allow()`` says no (callers take their fallback: a
miss, a skipped save) until a retry time, ``base_s`` after the first failure and doubling
up to ``cap_s`` while failures go on. The first call after the retry time is the probe
(the breaker re-arms at once, so concurrent callers keep their fallback); its success
closes the breaker. Callers that must not pay for a probe run it off the request's path
(``connectors.vllm``: a thread; the S3 tier: a task). An outage costs one warning line
when it starts and one when it ends, never a line per call. Thread-safe.

``attempts`` counts calls that were let through, ``skipped`` the ones refused: tests bound
what an outage costs by counting, not by the clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class Breaker:
    def __init__(
        self,
        name: str,
        log: logging.Logger,
        *,
        base_s: float = 0.25,
        cap_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.log = log
        self.base_s = base_s
        self.cap_s = cap_s
        self.clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._delay = base_s
        self.attempts = 0
        self.skipped = 0
        self.outages = 0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    @property
    def blocked(self) -> bool:
        """Down and not yet due for a retry (does not count as a call)."""
        return self._down_since is not None and self.clock() < self._retry_at

    def allow(self) -> bool:
        """Whether to call the dependency now (always while it is up)."""
        with self._lock:
            if self._down_since is not None:
                now = self.clock()
                if now < self._retry_at:
                    self.skipped += 1
                    return False
                self._retry_at = now + self._delay  # this call is the probe
            self.attempts += 1
            return True

    def ok(self) -> None:
        """The call succeeded: the dependency is up."""
        if self._down_since is None:
            return
        with self._lock:
            since, self._down_since = self._down_since, None
            self._delay = self.base_s
        if since is not None:
            self.log.warning(
                "%s is back after %.1fs; %d calls skipped meanwhile",
                self.name, self.clock() - since, self.skipped,
            )  # fmt: skip

    def failed(self, err: BaseException | str) -> None:
        """The call failed because the dependency is unavailable."""
        with self._lock:
            now = self.clock()
            first = self._down_since is None
            if first:
                self._down_since = now
                self._delay = self.base_s
                self.outages += 1
            else:
                self._delay = min(self.cap_s, self._delay * 2)
            self._retry_at = now + self._delay
        if first:
            self.log.warning(
                "%s unavailable (%s): serving without it, retrying with backoff up to %gs",
                self.name, err if isinstance(err, str) else _describe(err), self.cap_s,
            )  # fmt: skip


def _describe(e: BaseException) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
