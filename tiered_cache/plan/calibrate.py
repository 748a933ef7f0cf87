"""A short calibration run against the user's own vLLM: the ``Engine`` the planner
prices steps with, fitted from what that server answers.

- prefill: unique prompts of a few lengths, one token each; the time fitted as
  ``a + b n + c n^2/2`` (a step, per token, per attention pair) with non-negative
  coefficients;
- decode: one stream and four at once (the per-sequence cost of a step), and one stream
  over a long context (the per-context-token cost: the KV read).

About a minute on a small model. Prompts are token ids (``/v1/completions`` takes them),
so no tokenizer is needed, and random, so no prefix cache or connector serves them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np

from tiered_cache.plan.hardware import Engine
from tiered_cache.plan.model import PlanError
from tiered_cache.plan.workloads import tokens

_PREFILL_LENGTHS = (32, 128, 256, 512, 768, 1024, 1536, 2048)


class Calibrator:
    def __init__(self, url: str, timeout_s: float = 300.0, max_len: int | None = None,
                 say: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout_s)
        self.rng = random.Random(20261206)
        self.say = say or (lambda _m: None)
        try:
            models = self.http.get(self.url + "/v1/models").json()["data"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise PlanError(f"--calibrate {url}: not a vLLM server ({e})") from None
        if not models:
            raise PlanError(f"--calibrate {url}: serves no model")
        self.model = str(models[0]["id"])
        self.max_len = int(max_len or models[0].get("max_model_len") or 4096)

    def _complete(self, n: int, out: int) -> float:
        body = {"model": self.model, "prompt": tokens(self.rng, n), "max_tokens": out,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        t = time.perf_counter()
        r = self.http.post(self.url + "/v1/completions", json=body)
        if r.status_code != 200:
            raise PlanError(f"--calibrate: {self.url} answered {r.status_code}: {r.text[:200]}")
        return time.perf_counter() - t

    def prefill(self, repeats: int = 5) -> list[tuple[int, float]]:
        lengths = [n for n in _PREFILL_LENGTHS if n + 8 <= self.max_len]
        for n in lengths:  # a length's first prefill is slow (vLLM CPU's kernels warm up)
            self._complete(n, 1)
        pts = []
        for n in lengths:
            ts = [self._complete(n, 1) for _ in range(repeats)]
            pts.append((n, statistics.median(ts)))
            self.say(f"prefill {n} tokens: {1e3 * pts[-1][1]:.0f} ms")
        return pts

    def _stream(self, n: int, out: int) -> list[float]:
        """Arrival times of a streamed completion's chunks (a chunk a step)."""
        body = {"model": self.model, "prompt": tokens(self.rng, n), "max_tokens": out,
                "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
        ts: list[float] = []
        with self.http.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise PlanError(f"--calibrate: {self.url} answered {r.status_code}")
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    ts.append(time.perf_counter())
        return ts

    def decode(self, streams: int, prompt: int = 32, out: int = 96) -> float:
        """One step's seconds with ``streams`` decodes running, each over a ``prompt``-token
        context: the streams' chunks while every one of them decodes (after the last
        first token, before the first last one), so no prefill is in the window."""
        with concurrent.futures.ThreadPoolExecutor(streams) as ex:
            runs = list(ex.map(lambda _: self._stream(prompt, out), range(streams)))
        lo, hi = max(r[0] for r in runs), min(r[-1] for r in runs)
        steps = [(hi - lo) / k for r in runs if (k := sum(1 for t in r if lo < t <= hi)) > 0]
        if not steps:
            raise PlanError(f"--calibrate: {self.url} streamed no tokens to time")
        step = statistics.median(steps)
        self.say(f"decode, {streams} stream(s), {prompt}-token context: {1e3 * step:.1f} ms a step")
        return max(step, 1e-5)

    def engine(self) -> tuple[Engine, dict[str, Any]]:
        self._complete(64, 2)  # warm
        pts = self.prefill()
        a, b, c = fit_prefill(pts)
        # The best of two: a server's first decodes run cold, and a noisy neighbour only
        # ever slows a step (a cold d1 once fitted per_seq to 0).
        d1 = min(self.decode(1), self.decode(1))
        d4 = min(self.decode(4), self.decode(4))
        long_ctx = min(1024, self.max_len - 300)
        # Two streams: batched, as a busy server reads its KV, and both held at once by a
        # small KV space; long enough to outlast the second one's prefill.
        dl = self.decode(2, prompt=long_ctx, out=256)
        per_seq = max(0.0, (d4 - d1) / 3)
        step = max(1e-4, d1 - per_seq)
        per_ctx = max(0.0, (dl - (d1 + per_seq)) / (2 * (long_ctx - 32)))
        eng = Engine(step_s=step, per_seq_s=per_seq, per_ctx_s=per_ctx, per_token_s=b,
                     per_pair_s=c, overhead_s=max(0.0, a - step))  # fmt: skip
        raw = {"prefill_s": [[n, t] for n, t in pts], "decode_step_s": {"1": d1, "4": d4},
               f"decode_step_s_2x_ctx{long_ctx}": dl}  # fmt: skip
        return eng, raw


def neighbour_slowdown(alone: Engine, urls: Sequence[str],
                       say: Callable[[str], None] | None = None) -> dict[str, float]:  # fmt: skip
    """How much slower a server's steps get while the servers beside it (other cores of
    the same host: shared memory bandwidth, caches, the CPU time of every API server) are
    busy: each of ``urls`` calibrated at the same time, their prefill of 1,024 tokens and
    their decode step against ``alone``'s, minus one. The runs keep in step, so a
    prefill meets the neighbours' prefills and a decode their decodes."""
    with concurrent.futures.ThreadPoolExecutor(len(urls)) as ex:
        busy = [e for e, _ in ex.map(lambda u: Calibrator(u).engine(), urls)]
    pre = statistics.fmean(e.prefill_s(1024) / alone.prefill_s(1024) for e in busy) - 1
    dec = statistics.fmean(e.step(1, 32, 0, 0) / alone.step(1, 32, 0, 0) for e in busy) - 1
    out = {"prefill": round(max(0.0, pre), 3), "decode": round(max(0.0, dec), 3)}
    if say:
        say(f"busy neighbours slow a prefill by {out['prefill']:.0%}, a decode step by "
            f"{out['decode']:.0%}")  # fmt: skip
    return out


def fit_prefill(pts: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """Least squares of ``t = a + b n + c n^2/2`` with a, b, c >= 0 (a negative term
    dropped and the rest refitted: three unknowns, so every subset is tried)."""
    if len(pts) < 3:
        raise PlanError("calibration needs prefill times at 3 lengths or more")
    n = np.array([p[0] for p in pts], dtype=float)
    t = np.array([p[1] for p in pts], dtype=float)
    cols = [np.ones_like(n), n, n * n / 2]
    best: tuple[float, tuple[float, float, float]] | None = None
    for mask in ((1, 1, 1), (1, 1, 0), (0, 1, 1), (1, 0, 1), (0, 1, 0), (1, 0, 0)):
        idx = [i for i in range(3) if mask[i]]
        x, *_ = np.linalg.lstsq(np.stack([cols[i] for i in idx], axis=1), t, rcond=None)
        if (x < 0).any():
            continue
        coef = [0.0, 0.0, 0.0]
        for i, v in zip(idx, x, strict=True):
            coef[i] = float(v)
        err = float(((coef[0] + coef[1] * n + coef[2] * n * n / 2 - t) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, (coef[0], coef[1], coef[2]))
    assert best is not None  # (1, 0, 0) fits a mean, which is > 0
    return best[1]


def memcpy_link(nbytes: int = 64 * 2**20) -> dict[str, float]:
    """The DRAM tier's copy on this host (what a save and a load do on vLLM CPU): a copy
    and the chunk checksum's pass, the raw memcpy reference of the benches."""
    import xxhash

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        xxhash.xxh3_64_digest(dst.data)
        ts.append(time.perf_counter() - t)
    return {"bytes_per_s": nbytes / min(ts), "latency_s": 2e-4}


def calibrate(targets: dict[int, str], say: Callable[[str], None] | None = None,
              max_len: int | None = None) -> dict[str, Any]:  # fmt: skip
    """{units: URL} -> the ``--calibration`` file's content."""
    engines: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    for units, url in sorted(targets.items()):
        eng, r = Calibrator(url, say=say, max_len=max_len).engine()
        engines[str(units)] = dataclasses.asdict(eng)
        raw[str(units)] = r
    return {"engines": engines, "raw": raw, "links": {"dram": memcpy_link()},
            "when": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip


def parse_targets(specs: Sequence[str]) -> dict[int, str]:
    """``--calibrate URL`` (a 1-unit server) or ``UNITS=URL``, repeatable."""
    out: dict[int, str] = {}
    for s in specs:
        units, sep, url = s.partition("=")
        if not sep:
            units, url = "1", s
        if not units.isdigit() or int(units) <= 0 or not url.startswith("http"):
            raise PlanError(f"--calibrate takes URL or UNITS=URL, got {s!r}")
        out[int(units)] = url
    return out
