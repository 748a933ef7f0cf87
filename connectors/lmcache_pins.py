"""Pins on LMCache MP prefixes: the keys an LMCache MP server stores for a token prefix,
computed with LMCache's own hasher, as a pin on our tiers (which never evict pinned
chunks). ``python -m connectors.lmcache_pins pin|keys`` is the operator's command; the L2
adapter that stores those keys is ``connectors.lmcache_mp``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache.v1.distributed.api import ObjectKey

from connectors.lmcache_mp import model_fingerprint, object_key_to_key
from tiered_cache import client as tc_client

if TYPE_CHECKING:
    from tiered_cache.directory import Pin


def prefix_object_keys(
    tokens: Sequence[int],
    model_name: str,
    *,
    world_size: int = 1,
    chunk_size: int = 256,
    hash_algorithm: str = "blake3",
    cache_salt: str = "",
) -> list[ObjectKey]:
    """The ``ObjectKey``s an LMCache MP server stores for the whole chunks of ``tokens``
    (object group 0, every kv rank), computed with LMCache's own hasher. ``chunk_size``
    and ``hash_algorithm`` must match the server's (``--chunk-size``, ``--hash-algorithm``);
    ``model_name`` is the name vLLM's ``LMCacheMPConnector`` reports (the ``--model``)."""
    from lmcache.v1.multiprocess.cache_control.key_resolver import resolve_object_keys
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    keys, _ = resolve_object_keys(
        TokenHasher(chunk_size, hash_algorithm), model_name, world_size, list(tokens), cache_salt
    )
    return list(keys)


def prefix_pin(
    tokens: Sequence[int],
    model_name: str,
    *,
    tiers: Sequence[str] = ("nvme",),
    ttl_s: float | None = None,
    note: str = "",
    owner: str = "",
    world_size: int = 1,
    chunk_size: int = 256,
    hash_algorithm: str = "blake3",
    cache_salt: str = "",
) -> Pin:
    """A pin on the chunks an LMCache MP server stores for ``tokens``; add it with
    ``AgentClient.admin("pin_add", pin=pin.model_dump(), ...)`` (or the CLI below)."""
    from tiered_cache.directory import Pin

    okeys = prefix_object_keys(
        tokens,
        model_name,
        world_size=world_size,
        chunk_size=chunk_size,
        hash_algorithm=hash_algorithm,
        cache_salt=cache_salt,
    )
    if not okeys:
        raise ValueError(f"{len(tokens)} tokens are fewer than one chunk ({chunk_size})")
    now = time.time()
    return Pin(
        id=uuid.uuid4().hex[:12],
        note=note or f"lmcache-mp prefix of {model_name}",
        keys=[object_key_to_key(k) for k in okeys],
        tiers=list(tiers),
        ttl_s=ttl_s,
        owner=owner,
        created_at=now,
        fingerprint=model_fingerprint(model_name).hex(),
        num_tokens=len(tokens),
        # `pin warm --server URL` prefills these through that vLLM; pointed at one using
        # LMCacheMPConnector, LMCache stores the chunks and this adapter lands them here.
        tokens=list(tokens),
    )


def _parse_tokens(spec: str) -> list[int]:
    text = open(spec[1:]).read() if spec.startswith("@") else spec  # noqa: SIM115
    text = text.strip()
    if text.startswith("["):
        return [int(t) for t in json.loads(text)]
    return [int(t) for t in text.replace("\n", ",").split(",") if t.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m connectors.lmcache_pins pin|keys``: pin an LMCache MP prefix."""
    from tiered_cache.config import load_config, parse_duration

    ap = argparse.ArgumentParser(prog="python -m connectors.lmcache_pins")
    ap.add_argument("command", choices=["pin", "keys"])
    ap.add_argument("-c", "--config", help="tiered-cache YAML (agent socket)")
    ap.add_argument("--socket", help="node agent socket (overrides the config)")
    ap.add_argument("--model", required=True, help="model name as vLLM reports it")
    ap.add_argument("--tokens", required=True, help="token ids: '1,2,3', a JSON list or @file")
    ap.add_argument("--tiers", default="nvme")
    ap.add_argument("--ttl", default="none")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--hash-algorithm", default="blake3")
    ap.add_argument("--salt", default="")
    ap.add_argument("--note", default="")
    ap.add_argument("--token", help="admin token of the agent")
    a = ap.parse_args(argv)
    pin = prefix_pin(
        _parse_tokens(a.tokens),
        a.model,
        tiers=[t.strip() for t in a.tiers.split(",") if t.strip()],
        ttl_s=parse_duration(a.ttl),
        note=a.note,
        world_size=a.world_size,
        chunk_size=a.chunk_size,
        hash_algorithm=a.hash_algorithm,
        cache_salt=a.salt,
    )
    if a.command == "keys":
        print("\n".join(pin.keys))
        return 0
    sock = a.socket or load_config(a.config).socket_path
    c = tc_client.AgentClient(sock, attach_pool=False)
    try:
        pid = c.admin("pin_add", pin=pin.model_dump(), chunk_bytes=0, token=a.token)["id"]
    finally:
        c.close()
    print(json.dumps({"id": pid, "chunks": len(pin.keys), "tiers": pin.tiers}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
