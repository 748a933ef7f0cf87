"""The router's cost model: serve a request whole on one server, or split it (prefill on
one server, handoff through the cache, decode on another).

The seed's decision table, turned into seconds. Every option is priced as the latency it
adds, summed over the requests it touches:

- ``wait``: this request's time to first token: the prefill tokens queued ahead of it on
  the server, then its own uncached tokens, at the measured prefill rate (a split adds
  the handoff: the second request, the save and the load through the cache);
- ``harm``: the stall its prefill puts on the decodes running on that server (each one
  waits the prefill's time: a chunked prefill shares the steps, the total is the same);
- ``exposure``: the stall its own decode can expect from the prefills that server takes
  while it decodes (the server's measured prefill-token arrival rate, over the decode's
  length).

A short prompt on a server with few running decodes: whole (a handoff would cost more
than it saves). A long uncached prompt where decodes run: prefilled where none run. A long
answer on a server that takes many prefills: decoded elsewhere. ``split``/``whole`` force
one kind; ``auto`` takes the cheapest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

SplitMode = Literal["split", "whole", "auto"]
SPLIT_MODES: tuple[SplitMode, ...] = ("split", "whole", "auto")


@dataclass(frozen=True)
class ServerView:
    """What the router knows of one server when a request arrives."""

    url: str
    pool: str  # "prefill" or "decode"
    running: int = 0  # decodes in flight (requests past their first token)
    queued_tokens: int = 0  # prefill tokens sent to it whose first token has not come back
    cached_tokens: int = 0  # of this prompt, loadable there without a prefill
    arrival_tps: float = 0.0  # prefill tokens/s it has been sent lately


@dataclass(frozen=True)
class Rates:
    prefill_tps: float  # prefill tokens/s of one server
    handoff_s: float  # what a split adds to the request's first token
    step_s: float  # one decode step
    tail_tokens: int = 32  # what a decode computes after a handoff: about a block


@dataclass(frozen=True)
class Choice:
    kind: Literal["split", "whole"]
    server: str  # whole: the server; split: the decode server
    prefill: str | None  # split: the prefill server
    cost_s: float
    uncached: int  # tokens the chosen server (the prefill's, when split) computes


def _uncached(s: ServerView, n: int) -> int:
    # vLLM always computes the last prompt token itself.
    return max(1, n - s.cached_tokens)


def whole_cost(s: ServerView, n: int, out: int, r: Rates) -> float:
    u = _uncached(s, n)
    wait = (s.queued_tokens + u) / r.prefill_tps
    harm = s.running * u / r.prefill_tps
    exposure = s.arrival_tps * out * r.step_s / r.prefill_tps
    return wait + harm + exposure


def split_cost(p: ServerView, d: ServerView, n: int, out: int, r: Rates) -> float:
    u = _uncached(p, n)
    wait = (p.queued_tokens + u) / r.prefill_tps + r.handoff_s
    # The decode computes only the tail the prefill saved no chunk for (about a block):
    # its running decodes wait that long.
    harm = (p.running * u + d.running * min(u, r.tail_tokens)) / r.prefill_tps
    exposure = d.arrival_tps * out * r.step_s / r.prefill_tps
    return wait + harm + exposure


def decide(
    servers: Sequence[ServerView], n: int, out: int, rates: Rates, mode: SplitMode
) -> Choice | None:
    """The cheapest way to serve an ``n``-token prompt with ``out`` tokens to generate,
    or None without a server that can. ``split`` splits whenever both pools have a
    server; ``whole`` never splits, on a server of either pool."""
    if rates.prefill_tps <= 0:
        raise ValueError("prefill_tps must be > 0")
    pre = [s for s in servers if s.pool == "prefill"]
    dec = [s for s in servers if s.pool == "decode"]
    options: list[Choice] = []
    if mode != "whole" and pre and dec:
        for p in pre:
            for d in dec:
                c = split_cost(p, d, n, out, rates)
                options.append(Choice("split", d.url, p.url, c, _uncached(p, n)))
    if mode != "split" or not options:
        for s in servers:
            c = whole_cost(s, n, out, rates)
            options.append(Choice("whole", s.url, None, c, _uncached(s, n)))
    if not options:
        return None
    # Ties: the first listed (the caller rotates the list for round robin).
    return min(options, key=lambda c: c.cost_s)


class Ewma:
    """An exponentially weighted mean; ``value`` is the prior until a sample comes."""

    def __init__(self, prior: float, alpha: float = 0.2) -> None:
        self.value = prior
        self.alpha = alpha
        self.samples = 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else self.value + self.alpha * (x - self.value)
        self.samples += 1


class DecayingRate:
    """Events' weight per second, decaying with time constant ``tau_s`` (prefill tokens
    sent to one server: its ``arrival_tps``)."""

    def __init__(self, tau_s: float = 10.0) -> None:
        self.tau_s = tau_s
        self._level = 0.0
        self._t: float | None = None

    def _decay(self, now: float) -> None:
        if self._t is not None and now > self._t:
            self._level *= math.exp(-(now - self._t) / self.tau_s)
        self._t = now

    def add(self, weight: float, now: float) -> None:
        self._decay(now)
        self._level += weight

    def rate(self, now: float) -> float:
        self._decay(now)
        return self._level / self.tau_s
