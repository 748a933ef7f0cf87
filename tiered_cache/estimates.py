"""Expected transfer time per chunk source, learned from real transfers.

A decode node can often read a chunk from more than one place: its own NVMe, one of several
peers' DRAM, S3. It picks the source with the least expected time for the chunk's size,
``latency + bytes / bandwidth``, per source (``dram``, ``nvme``, ``peer:<node_id>``, ``s3``).

Each source fits ``t = a + b·n`` by least squares over its recent transfers (exponential
forgetting), anchored by two prior pseudo-transfers (64 KiB and 32 MiB) that never fade out:
with chunks of a single size the slope alone is unidentifiable, and the anchors keep the fit
sane while the observed point dominates at the sizes actually seen. Until a source has been
used its priors give the static order DRAM < NVMe < peer < S3.

A transfer slower than ``_CLIP``× its source's current expectation counts as that bound: one
scheduling stall on a busy host must not hand every later chunk to a slower source. A source
that stays slow still loses its place: within 2-3 transfers when it has little history, and
within about a dozen after a long one (the estimate is a forgetting average, so it rises by
less than ``_CLIP``× per transfer). Faster-than-expected transfers are taken as they are.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# (latency s, bandwidth B/s) before any transfer is seen. Deliberately conservative so the
# static order holds until measurements say otherwise.
PRIORS: dict[str, tuple[float, float]] = {
    "dram": (20e-6, 8e9),
    "nvme": (200e-6, 2e9),
    "peer": (1e-3, 1e9),
    "s3": (20e-3, 2e8),
    # An engine computing prompt tokens (connectors.vllm_plan): per step, tokens per s.
    "recompute": (1e-3, 2e3),
}
_ANCHORS = (64 * 2**10, 32 * 2**20)
# Where the prior's pseudo-transfers sit must match the sizes a source sees: a far anchor
# has great leverage on the fitted slope. Recompute "sizes" are tokens per engine step.
_ANCHORS_BY_KIND = {"recompute": (16, 4096)}
_ANCHOR_WEIGHT = 0.01  # a 100th of a real transfer: measurements win after a few
_MIN_SECONDS_PER_BYTE = 1 / 200e9  # no source beats 200 GB/s: keeps b > 0
_CLIP = 4.0  # a transfer counts as at most this many times its expected time


def kind_of(source: str) -> str:
    """``peer:node-b`` -> ``peer``."""
    return source.split(":", 1)[0]


@dataclass
class Estimate:
    latency_s: float
    bandwidth_bps: float
    samples: int

    def expected_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bps


class _Fit:
    """Weighted least squares of t on n with forgetting; O(1) per observation."""

    __slots__ = ("s0", "s1", "s2", "samples", "t0", "t1")

    def __init__(self) -> None:
        self.s0 = self.s1 = self.s2 = self.t0 = self.t1 = 0.0
        self.samples = 0

    def add(self, n: float, t: float, w: float) -> None:
        self.s0 += w
        self.s1 += w * n
        self.s2 += w * n * n
        self.t0 += w * t
        self.t1 += w * n * t

    def decay(self, keep: float) -> None:
        self.s0 *= keep
        self.s1 *= keep
        self.s2 *= keep
        self.t0 *= keep
        self.t1 *= keep


class SourceEstimator:
    """Thread-safe per-source latency/bandwidth estimates. ``forget`` is the weight an old
    transfer loses per new one: 0.1 means the last ~10 transfers dominate."""

    def __init__(self, forget: float = 0.1) -> None:
        if not 0.0 < forget < 1.0:
            raise ValueError(f"forget must be in (0, 1), got {forget}")
        self.keep = 1.0 - forget
        self._fits: dict[str, _Fit] = {}
        self._lock = threading.Lock()

    def observe(self, source: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not seconds > 0:  # also drops NaN
            return
        seconds = min(seconds, _CLIP * self.expected_s(source, nbytes))
        with self._lock:
            f = self._fits.get(source)
            if f is None:
                f = self._fits[source] = _Fit()
            f.decay(self.keep)
            f.add(float(nbytes), seconds, 1.0)
            f.samples += 1

    def estimate(self, source: str) -> Estimate:
        lat0, bw0 = PRIORS.get(kind_of(source), PRIORS["peer"])
        with self._lock:
            f = self._fits.get(source)
            s0, s1, s2, t0, t1, samples = (
                (f.s0, f.s1, f.s2, f.t0, f.t1, f.samples) if f else (0.0, 0.0, 0.0, 0.0, 0.0, 0)
            )
        for n in _ANCHORS_BY_KIND.get(kind_of(source), _ANCHORS):  # the priors, faintly
            t = lat0 + n / bw0
            s0 += _ANCHOR_WEIGHT
            s1 += _ANCHOR_WEIGHT * n
            s2 += _ANCHOR_WEIGHT * n * n
            t0 += _ANCHOR_WEIGHT * t
            t1 += _ANCHOR_WEIGHT * n * t
        det = s0 * s2 - s1 * s1
        b = (s0 * t1 - s1 * t0) / det if det > 0 else 1 / bw0
        a = (t0 - b * s1) / s0
        if a < 0:  # no negative latency: refit through the origin
            a, b = 0.0, t1 / s2
        b = max(b, _MIN_SECONDS_PER_BYTE)
        return Estimate(latency_s=a, bandwidth_bps=1.0 / b, samples=samples)

    def expected_s(self, source: str, nbytes: int) -> float:
        return self.estimate(source).expected_s(nbytes)

    def rank(self, sources: list[str], nbytes: int) -> list[str]:
        """``sources`` fastest first for a chunk of ``nbytes``; ties keep the given order."""
        cost = {s: self.expected_s(s, nbytes) for s in sources}
        return sorted(sources, key=lambda s: cost[s])

    def snapshot(self) -> dict[str, Estimate]:
        with self._lock:
            names = list(self._fits)
        return {s: self.estimate(s) for s in names}
