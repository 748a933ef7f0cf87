"""The node agent: owns a node's DRAM pool, NVMe directory and S3 client.

- Local vLLM processes talk to it over a unix socket (``tiered_cache.protocol``, one typed
  message per operation) and move chunk bytes through the shared-memory DRAM pool; the
  agent only hands out slot numbers and leases (``local``).
- Peers pull chunks from its DRAM and NVMe over TCP (``peers``).
- Background loops keep the directory current (heartbeat, location refresh, pin sync,
  per-tier counters) and log one usage line a minute (``sync``); operators' requests
  (pins, stats, ls, evict, warm, clear) are ``admin``.
- SIGTERM: stop accepting, write back dirty DRAM chunks, flush lower-tier writes, exit 0.
- ``agent.pin_file``: imported at start-up (a file that cannot be used is a start-up error)
  and again on SIGHUP, as ``tiered-cache pin import FILE`` does.

``NodeAgent`` (``node``) is the node: its tiers and lifecycle, with the four roles above
mixed in; ``embedded`` runs one inside a process or starts one as a child process.
"""

from tiered_cache.agent.embedded import EmbeddedAgent, spawn_agent, wait_for_socket
from tiered_cache.agent.node import NodeAgent, build_directory, build_tiers

__all__ = [
    "EmbeddedAgent",
    "NodeAgent",
    "build_directory",
    "build_tiers",
    "spawn_agent",
    "wait_for_socket",
]
