"""The directory API (``Directory``) and the checks every backend shares."""

from __future__ import annotations

import abc
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tiered_cache.api import TIERS
from tiered_cache.directory.records import Location, ModelRegistration, Pin
from tiered_cache.keys import is_valid_key

log = logging.getLogger(__name__)

TIER_RANK = {t: i for i, t in enumerate(TIERS)}
SEP = "\x1f"  # member separator: cannot appear in node ids (validated) or tier names


def check_node(node_id: str) -> None:
    if not node_id or SEP in node_id:
        raise ValueError(f"invalid node id {node_id!r}")


def check_tier(tier: str) -> None:
    if tier not in TIER_RANK:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")


def check_keys(keys: Sequence[str]) -> None:
    # Keys end up inside a Redis hash tag; a stray "}" would move them to another slot.
    for k in keys:
        if not is_valid_key(k):
            raise ValueError(f"invalid chunk key {k!r}")


def sorted_locs(locs: list[Location]) -> list[Location]:
    """Nearest tier first, then node id, so callers get a stable order."""
    return sorted(locs, key=lambda loc: (TIER_RANK.get(loc.tier, 99), loc.node_id))


def node_view(info: Mapping[str, Any], last_seen: float, expires_at: float) -> dict[str, Any]:
    return {**info, "last_seen": last_seen, "expires_at": expires_at}


class Directory(abc.ABC):
    """Async directory API used by the node agent's event loop."""

    @abc.abstractmethod
    async def publish(self, node_id: str, tier: str, keys: Sequence[str], ttl_s: float) -> None:
        """Advertise that ``node_id`` holds ``keys`` in ``tier`` for ``ttl_s`` seconds."""

    @abc.abstractmethod
    async def unpublish(self, node_id: str, tier: str, keys: Sequence[str]) -> None: ...

    @abc.abstractmethod
    async def locate(self, keys: Sequence[str]) -> list[list[Location]]:
        """Live locations of each key (nearest tier first); one round trip for the batch."""

    @abc.abstractmethod
    async def heartbeat(self, node_id: str, info: Mapping[str, Any], ttl_s: float) -> None: ...

    @abc.abstractmethod
    async def nodes(self) -> dict[str, dict[str, Any]]:
        """Live nodes -> their info plus ``last_seen`` and ``expires_at`` (epoch s)."""

    @abc.abstractmethod
    async def add_pin(self, pin: Pin) -> None: ...

    @abc.abstractmethod
    async def remove_pin(self, pin_id: str) -> bool: ...

    @abc.abstractmethod
    async def get_pin(self, pin_id: str) -> Pin | None: ...

    @abc.abstractmethod
    async def list_pins(self) -> list[Pin]:
        """Unexpired pins, oldest first; expired TTL pins are removed on the way."""

    @abc.abstractmethod
    async def pins_version(self) -> int:
        """Counter bumped on every pin change, including TTL expiry; cheap to poll."""

    @abc.abstractmethod
    async def incr_counters(self, node_id: str, deltas: Mapping[str, int]) -> None: ...

    @abc.abstractmethod
    async def counters(self) -> dict[str, dict[str, int]]: ...

    @abc.abstractmethod
    async def register_models(self, node_id: str, regs: Sequence[ModelRegistration]) -> None:
        """Record (or refresh) fingerprints that ``node_id``'s vLLM connectors use."""

    @abc.abstractmethod
    async def models(self) -> list[ModelRegistration]:
        """Registered fingerprints seen within ``MODEL_KEEP_S``, most recent first."""

    async def check(self) -> None:  # noqa: B027 - a local backend is always reachable
        """Raise ``DirectoryUnavailable`` if the backend cannot be reached."""

    async def flush(self) -> bool:
        """Replay queued updates now; True when nothing is left queued."""
        return True

    @property
    def pending_updates(self) -> int:
        """Updates queued while the backend was unreachable."""
        return 0

    @property
    def degraded(self) -> bool:
        """True while answers may be incomplete because the backend is unreachable."""
        return False

    async def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release resources. Safe to call twice."""

    async def __aenter__(self) -> Directory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
