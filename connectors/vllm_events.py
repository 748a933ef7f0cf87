"""What vLLM calls the blocks of the chunks the scheduler saves and loads: the request's own
block hashes (as vLLM publishes them in its KV events), their parent, tokens and extra
keys, sent to the agent (``Describe``) so its KV events for our tiers name vLLM's blocks
(``tiered_cache.kv_events``). A consumer joins them with vLLM's GPU events by hash."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.request import Request

from tiered_cache.protocol import Describe


def describe_chunks(
    request: Request, chunks: Sequence[tuple[str, int, int]], block_size: int, model: str
) -> Describe | None:
    """The description of ``chunks`` (key, first token, tokens) of ``request``: their full
    blocks only (vLLM hashes no partial block: a chunk of less than one holds none). None when there is nothing to say, or when
    vLLM hashes blocks of another size than the KV cache's (hybrid models)."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    if len(hashes) != len(tokens) // block_size:
        return None  # hash blocks of another size than KV blocks: not one hash per block
    keys: list[str] = []
    hs: list[list[int | bytes]] = []
    parents: list[int | bytes | None] = []
    toks: list[bytes] = []
    extras: list[list[object] | None] = []
    for key, start, n in chunks:
        b0, nb = start // block_size, n // block_size
        if start % block_size or b0 + nb > len(hashes):
            continue  # (nb == 0: a tail of less than a block, described as holding none)
        keys.append(key)
        hs.append([maybe_convert_block_hash(h) for h in hashes[b0 : b0 + nb]])
        parents.append(maybe_convert_block_hash(hashes[b0 - 1]) if b0 else None)
        toks.append(array("I", tokens[start : start + nb * block_size]).tobytes())
        ek = to_event_extra_keys(
            generate_block_hash_extra_keys(request, (b0 + i) * block_size,
                                           (b0 + i + 1) * block_size, 0)[0]
            for i in range(nb)
        )  # fmt: skip
        extras.append(list(ek) if ek is not None and any(e is not None for e in ek) else None)
    if not keys:
        return None
    lora = request.lora_request
    return Describe(
        keys, hs, parents, toks, block_size, model,
        lora.adapter_id if lora is not None else None,
        lora.name if lora is not None else None,
        extras if any(e is not None for e in extras) else None,
    )  # fmt: skip
