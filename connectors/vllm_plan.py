"""Scheduler-side decisions of the vLLM connector, free of vLLM: fetch or recompute, and
how long a request may wait for chunks that are on their way.

**Fetch or recompute.** For each request the connector knows, per leading chunk, where it
is and what loading it is expected to cost (the agent's fitted source estimates,
``tiered_cache.estimates``), and what recomputing its tokens costs this engine (its own
measured prefill rate: ``RecomputeRate``). vLLM recomputes everything after the first
chunk it does not load, so the choice is a prefix: load chunks ``[first, k)`` for the
``k`` that saves the most time, ``sum(recompute_i - load_i)``. A fast local prefix
followed by slow remote chunks loads the prefix and recomputes the rest; when nothing
saves time, it recomputes all. Until the engine has measured its rate it loads every
chunk it found (the behaviour of every cache in this field).

**Waiting.** A chunk the prefill said it saved but that is not visible yet is waited for
at most what recomputing the waited-for tokens would cost, and never longer than the
configured cap: a wait can never cost much more than the recompute it tries to avoid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiered_cache.estimates import SourceEstimator

MIN_WAIT_S = 0.02  # a chunk committed a moment ago is worth this much patience


class RecomputeRate:
    """The engine's cost of computing prompt tokens, fitted over its own steps as
    ``t = a + b * tokens`` (``SourceEstimator``: forgetting, clipped outliers). Recomputing
    ``n`` more tokens in a step costs the slope: ``b * n``."""

    MIN_SAMPLES = 2
    # No model prefills faster than 10M tokens/s.
    MIN_SECONDS_PER_TOKEN = 1e-7

    def __init__(self) -> None:
        self._fit = SourceEstimator()
        self._max_tokens = 0

    def observe(self, tokens: int, seconds: float) -> None:
        self._fit.observe("recompute", tokens, seconds)
        self._max_tokens = max(self._max_tokens, tokens)

    def seconds_per_token(self) -> float | None:
        """The fitted slope, or None (unmeasured: load what was found) while the timings do
        not grow with the tokens. Timings of kernel launches (a host clock around a CUDA
        forward) fit a flat line: their slope would price every recompute at nothing and
        never load. A real forward's largest step costs more in tokens than in overhead."""
        est = self._fit.estimate("recompute")
        if est.samples < self.MIN_SAMPLES:
            return None
        spt = 1.0 / est.bandwidth_bps
        if spt < self.MIN_SECONDS_PER_TOKEN or spt * self._max_tokens < est.latency_s:
            return None
        return spt

    def cost_s(self, tokens: int) -> float | None:
        spt = self.seconds_per_token()
        return None if spt is None else spt * max(0, tokens)


@dataclass(frozen=True)
class Choice:
    chunks: int  # load chunks [first, chunks)
    decision: str  # "load" (all found), "prefix" (a fast prefix), "recompute" (none)
    gain_s: float  # expected seconds saved against recomputing them


def choose_prefix(
    tokens: Sequence[int], costs: Sequence[float], first: int, sec_per_token: float | None
) -> Choice:
    """Which prefix of the found chunks to load. ``tokens[i]``: prompt tokens chunk ``i``
    would provide (0 before ``first``), ``costs[i]``: its expected load seconds."""
    n = len(costs)
    if n <= first:
        return Choice(first, "recompute", 0.0)
    if sec_per_token is None:
        return Choice(n, "load", 0.0)
    best_k, best, gain = first, 0.0, 0.0
    for i in range(first, n):
        gain += tokens[i] * sec_per_token - costs[i]
        if gain > best:
            best, best_k = gain, i + 1
    decision = "load" if best_k == n else ("prefix" if best_k > first else "recompute")
    return Choice(best_k, decision, best)


def wait_budget_s(cap_s: float, recompute_s: float | None, expected_s: float = 0.0) -> float:
    """How long to wait for chunks on their way: what recomputing them costs (at least
    twice their expected transfer, at least ``MIN_WAIT_S``), never more than ``cap_s``.
    Before the engine has measured its rate: four times the expected transfer when there
    is one (at least a second), else the cap."""
    if recompute_s is None:
        return cap_s if expected_s <= 0 else min(cap_s, max(1.0, 4 * expected_s))
    return min(cap_s, max(MIN_WAIT_S, recompute_s, 2 * expected_s))
