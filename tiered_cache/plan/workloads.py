"""The serving bench's workloads, shared by ``bench/serve.py`` (which sends them to vLLM)
and the planner (which predicts them): one definition, so a prediction and a measurement
see the same prompts.

A ``Request`` is token ids; the planner reduces it to chained block keys
(``block_keys``), the form a Mooncake trace already has.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = (6, 500)  # token ids the random prompts use (ids < 6 are special)
WORKLOADS = ("chat", "trace", "mixed", "jsonl")


@dataclass
class Request:
    prompt: list[int]
    output_len: int
    kind: str = ""  # "long"/"short" in the mixed workload


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def chat_workload(n: int, seed: int, users: int = 12, systems: int = 6,
                  system_tokens: int = 800, answer_tokens: int = 32) -> list[Request]:  # fmt: skip
    """Growing conversations over shared system prompts, users taking turns at random."""
    rng = random.Random(seed)
    sys_prompts = [tokens(rng, system_tokens) for _ in range(systems)]
    convs = [list(sys_prompts[u % systems]) for u in range(users)]
    out: list[Request] = []
    while len(out) < n:
        u = rng.randrange(users)
        convs[u] += tokens(rng, rng.randrange(40, 120))  # the user's new question
        out.append(Request(list(convs[u]), answer_tokens))
        convs[u] += tokens(rng, answer_tokens)  # the answer, as the next turn sees it
    return out


def trace_workload(
    path: Path, n: int, block_tokens: int, max_output: int, max_len: int
) -> list[Request]:
    """The first ``n`` requests of a Mooncake-format trace. Each ``hash_id`` becomes a
    deterministic block of ``block_tokens`` tokens (seeded by the id), so equal ids are
    equal prefixes; lengths are scaled from the trace's 512-token blocks, and prompts
    longer than the model takes are cut (their prefix structure stays)."""
    out: list[Request] = []
    blocks: dict[int, list[int]] = {}
    with open(path) as f:
        for line in f:
            if len(out) >= n:
                break
            rec = json.loads(line)
            ids = list(rec["hash_ids"])
            want = max(1, round(rec["input_length"] * block_tokens / 512))
            toks: list[int] = []
            for h in ids:
                if h not in blocks:
                    blocks[h] = tokens(random.Random(h * 7919 + 1), block_tokens)
                toks += blocks[h]
            out_len = max(1, min(max_output, rec["output_length"]))
            out.append(Request(toks[: min(want, max_len - out_len - 16)], out_len))
    return out


def mixed_workload(n: int, seed: int, long_tokens: int = 1400, short_tokens: int = 64,
                   short_output: int = 48) -> list[Request]:  # fmt: skip
    """One long unique prompt (a short answer) for every two short prompts (a longer
    answer): the long prefills land in the middle of the short requests' decoding."""
    rng = random.Random(seed)
    out: list[Request] = []
    for i in range(n):
        if i % 3 == 0:
            out.append(Request(tokens(rng, long_tokens), 4, "long"))
        else:
            out.append(Request(tokens(rng, short_tokens), short_output, "short"))
    return out


def jsonl_workload(path: Path, n: int, tokenizer: Any) -> list[Request]:
    out: list[Request] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if len(out) >= n:
                break
            try:
                rec = json.loads(line)
                p = rec["prompt"]
                toks = list(p) if isinstance(p, list) else tokenizer.encode(p)
                out.append(Request([int(t) for t in toks], int(rec.get("output_len", 32))))
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{i + 1}: not a prompt line ({e})") from None
    return out


def fresh_chat(n: int, seed: int = 11) -> list[Request]:
    users = max(12, n // 2)
    return chat_workload(n, seed=seed, users=users, systems=users // 2, system_tokens=1000)


def bench_workload(
    name: str, n: int, level: int, trace: Path | None = None, block_tokens: int = 32,
    max_len: int = 4032,
) -> list[Request]:  # fmt: skip
    """``bench/serve.py``'s load ``name`` at load level ``level`` (``n`` requests asked):
    each level gets conversations of its own (another seed), since replaying the same ones
    would find them cached by the level before."""
    if name == "chat":
        # Two turns a user on average; a system prompt shared by two users.
        users = max(12, n // 2)
        return chat_workload(n, seed=1 + 100 * level, users=users, systems=users // 2,
                             system_tokens=1000)  # fmt: skip
    if name == "trace":  # the trace's own order (little reuse at this scale)
        if trace is None:
            raise ValueError("the trace workload needs a trace file")
        return trace_workload(trace, n, block_tokens, 32, max_len)
    if name == "mixed":
        return mixed_workload(max(9, n * 3 // 8), seed=2 + 100 * level)
    raise ValueError(f"unknown workload {name!r} (chat, trace, mixed)")


def block_keys(prompt: Sequence[int], block: int) -> list[int]:
    """Chained keys of the prompt's whole ``block``-token blocks: equal keys, equal
    prefixes (a trace's ``hash_ids``, computed)."""
    keys: list[int] = []
    h = 0
    for i in range(0, len(prompt) - block + 1, block):
        h = hash((h, tuple(prompt[i : i + block])))
        keys.append(h)
    return keys


def unique_prefix_tokens(reqs: Sequence[Request], block: int = 32) -> int:
    """Distinct prompt blocks (by their full prefix), in tokens: the working set."""
    return len({k for r in reqs for k in block_keys(r.prompt, block)}) * block
