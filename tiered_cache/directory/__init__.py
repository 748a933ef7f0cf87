"""Cluster directory: which node holds which chunk in which tier, live nodes, pins, counters.

Two implementations of one async API:

* ``LocalDirectory``: in-process dicts, for a single node with no Redis configured.
* ``RedisDirectory``: shared through Redis (standalone, TLS, unix socket or Redis Cluster).

The directory is advisory. A wrong answer costs a recompute, never wrong KV (every chunk is
verified on load), so ``RedisDirectory`` degrades instead of raising when Redis is down:
lookups return nothing, reads return the last known values, updates are queued and
replayed. Only admin writes (pins) raise, so the CLI can say why it failed.

Redis key schema (``ns`` = namespace, default ``tc``)::

    ns:loc:{<chunk>}       ZSET  member "node\\x1ftier", score = expiry (epoch s); PEXPIRE = max TTL
    {ns}:alive             ZSET  member node, score = heartbeat expiry (epoch s)
    {ns}:nodes             HASH  node -> JSON {"info": {...}, "last_seen": t, "expires_at": t}
    {ns}:pins              HASH  pin id -> Pin JSON
    {ns}:pinexp            ZSET  pin id -> expires_at (TTL pins only; finds expired pins cheaply)
    {ns}:pinver            INT   bumped on every pin change
    {ns}:pins:events       pub/sub channel, message "<op> <pin id>" on every pin change
    {ns}:stats:<node>      HASH  counter name -> int (HINCRBY)
    {ns}:statnodes         SET   nodes that have counters
    {ns}:models            HASH  fingerprint hex -> ModelRegistration JSON (vLLM connectors)

Chunk keys are hash-tagged by chunk so a batch spreads over a cluster; global keys share
the ``{ns}`` tag so multi-key work on them stays in one slot. All pipelines are
non-transactional so a cross-slot batch works on Redis Cluster. Requires Redis >= 7.0
(``PEXPIRE ... NX|GT``).

Expiry uses the writer's wall clock (scores are epoch seconds), so nodes need roughly
synchronised clocks (NTP); skew shorter than the TTLs only shifts expiry a little.
"""

from tiered_cache.directory.base import Directory
from tiered_cache.directory.local import LocalDirectory
from tiered_cache.directory.records import (
    MODEL_KEEP_S,
    DirectoryUnavailable,
    Location,
    ModelRegistration,
    Pin,
)
from tiered_cache.directory.redis_backend import RedisDirectory, redact_url

__all__ = [
    "MODEL_KEEP_S",
    "Directory",
    "DirectoryUnavailable",
    "LocalDirectory",
    "Location",
    "ModelRegistration",
    "Pin",
    "RedisDirectory",
    "redact_url",
]
