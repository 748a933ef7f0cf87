"""Synthetic request traces in the Mooncake format, for policy tests and simulations.

Each record is ``{"timestamp", "input_length", "output_length", "hash_ids"}``: arrival
time in ms (Poisson arrivals), prompt and output lengths in tokens, and one id per
512-token prompt block where equal ids mean an equal prefix up to that block (the
Mooncake FAST'25 trace convention). ``len(hash_ids) == ceil(input_length / 512)``.

Kinds:

- ``zipf``: a pool of shared system prompts picked by a Zipf law, each followed by a
  unique user suffix. Reuse is concentrated on a few hot prefixes.
- ``multiturn``: interleaved chat sessions; each turn's prompt is the previous turn's
  prompt plus the answer and a new user message, so it extends the previous turn's
  blocks (the previous last block, if partial, changes and gets a new id). Sessions start
  from one of a few shared system prompts.
- ``scan``: a hot set of prefixes re-read at random, mixed with one-hit-wonder requests of
  fresh blocks that are never seen again (what scan-resistant policies must absorb).

``generate_trace(kind, n_requests, seed)`` is deterministic for a given seed. Run
``python -m tiered_cache.tools.tracegen KIND N SEED [OUT]`` to write JSONL.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 512
KINDS = ("zipf", "multiturn", "scan")

Record = dict[str, Any]


class _Ids:
    def __init__(self) -> None:
        self._next = itertools.count()

    def take(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def _zipf_cum_weights(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (r**s) for r in range(1, n + 1)))


def _record(hash_ids: list[int], last_fill: int, output_length: int) -> Record:
    """``last_fill`` tokens (1..512) in the final block."""
    input_length = (len(hash_ids) - 1) * BLOCK_TOKENS + last_fill
    return {
        "timestamp": 0,  # set by generate_trace
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": list(hash_ids),
    }


def _zipf(rng: random.Random, n: int, ids: _Ids, p: dict[str, Any]) -> Iterator[Record]:
    n_prefixes = int(p.get("n_prefixes", 200))
    cum = _zipf_cum_weights(n_prefixes, float(p.get("zipf_s", 1.0)))
    lo, hi = p.get("prefix_blocks", (2, 24))
    slo, shi = p.get("suffix_blocks", (1, 12))
    prefixes: dict[int, list[int]] = {}
    for _ in range(n):
        rank = rng.choices(range(n_prefixes), cum_weights=cum)[0]
        if rank not in prefixes:
            prefixes[rank] = ids.take(rng.randint(lo, hi))
        blocks = prefixes[rank] + ids.take(rng.randint(slo, shi))
        yield _record(blocks, rng.randint(1, BLOCK_TOKENS), rng.randint(1, 512))


def _multiturn(rng: random.Random, n: int, ids: _Ids, p: dict[str, Any]) -> Iterator[Record]:
    n_system = int(p.get("n_system", 8))
    concurrent = int(p.get("concurrent_sessions", 32))
    mean_turns = float(p.get("mean_turns", 5.0))
    tlo, thi = p.get("turn_blocks", (1, 6))
    systems = [ids.take(rng.randint(2, 8)) for _ in range(n_system)]

    def new_session() -> dict[str, Any]:
        turns = 1 + int(rng.expovariate(1.0 / max(mean_turns - 1.0, 1e-9)))
        return {"blocks": list(rng.choice(systems)), "fill": BLOCK_TOKENS, "left": turns}

    sessions = [new_session() for _ in range(concurrent)]
    for _ in range(n):
        i = rng.randrange(concurrent)
        s = sessions[i]
        blocks: list[int] = s["blocks"]
        if s["fill"] < BLOCK_TOKENS:  # the partial last block changes when extended
            blocks = blocks[:-1]
        blocks = blocks + ids.take(rng.randint(tlo, thi))
        fill = rng.randint(1, BLOCK_TOKENS)
        yield _record(blocks, fill, rng.randint(16, 1024))
        s["blocks"], s["fill"], s["left"] = blocks, fill, s["left"] - 1
        if s["left"] <= 0:
            sessions[i] = new_session()


def _scan(rng: random.Random, n: int, ids: _Ids, p: dict[str, Any]) -> Iterator[Record]:
    n_hot = int(p.get("n_hot", 64))
    scan_fraction = float(p.get("scan_fraction", 0.5))
    lo, hi = p.get("hot_blocks", (2, 16))
    clo, chi = p.get("scan_blocks", (8, 64))
    hot = [ids.take(rng.randint(lo, hi)) for _ in range(n_hot)]
    for _ in range(n):
        if rng.random() < scan_fraction:
            blocks = ids.take(rng.randint(clo, chi))
        else:
            blocks = rng.choice(hot) + ids.take(rng.randint(0, 2))
        yield _record(blocks, rng.randint(1, BLOCK_TOKENS), rng.randint(1, 512))


_GENERATORS = {"zipf": _zipf, "multiturn": _multiturn, "scan": _scan}


def generate_trace(
    kind: str, n_requests: int, seed: int = 0, rate_per_s: float = 20.0, **params: Any
) -> list[Record]:
    """``n_requests`` Mooncake-format records of the given kind (see module doc).

    ``rate_per_s`` sets the Poisson arrival rate; ``params`` override a kind's shape
    (e.g. ``n_prefixes``, ``zipf_s`` for zipf; ``concurrent_sessions``, ``mean_turns``
    for multiturn; ``n_hot``, ``scan_fraction`` for scan).
    """
    gen = _GENERATORS.get(kind)
    if gen is None:
        raise ValueError(f"unknown trace kind {kind!r}; valid: {', '.join(KINDS)}")
    if n_requests < 0:
        raise ValueError("n_requests must be >= 0")
    rng = random.Random(seed)
    out: list[Record] = []
    ts = 0.0
    for rec in gen(rng, n_requests, _Ids(), params):
        rec["timestamp"] = int(ts)
        out.append(rec)
        ts += rng.expovariate(rate_per_s) * 1000.0
    return out


def write_jsonl(records: Iterable[Record], path: str | Path) -> None:
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def read_jsonl(path: str | Path) -> list[Record]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def blocks_of(rec: Record) -> int:
    return math.ceil(int(rec["input_length"]) / BLOCK_TOKENS)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (3, 4):
        print(
            "usage: python -m tiered_cache.tools.tracegen KIND N_REQUESTS SEED [OUT.jsonl]", file=sys.stderr
        )
        return 2
    try:
        records = generate_trace(args[0], int(args[1]), int(args[2]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(args) == 4:
        write_jsonl(records, args[3])
    else:
        for rec in records:
            sys.stdout.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
