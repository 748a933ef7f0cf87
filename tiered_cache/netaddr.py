"""Which address an agent publishes for its peer port.

An agent that binds its peer port on a wildcard (``0.0.0.0``) must not publish that: other
nodes would connect to themselves. Nor may it publish a loopback address when the
directory is shared with other hosts: only this host could reach it. The address it
publishes is ``agent.advertise_host`` when set, else ``peer_host`` when that is a concrete
address, else the source address this host uses to reach the Redis directory (the
interface on the network the other nodes share).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from tiered_cache.config import CacheConfig, ConfigError

_WILDCARDS = {"", "0.0.0.0", "::", "*"}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(str(info[4][0])).is_loopback
                for info in socket.getaddrinfo(host, None)
            )
        except OSError:
            return False


def directory_host(cfg: CacheConfig) -> tuple[str, int] | None:
    """(host, port) of the Redis directory over TCP; None for none or a unix socket."""
    if not cfg.redis_url or cfg.redis_url.startswith("unix://"):
        return None
    u = urlsplit(cfg.redis_url)
    return (u.hostname or "127.0.0.1", u.port or 6379)


def directory_is_shared(cfg: CacheConfig) -> bool:
    """Whether other hosts can use this node's directory (Redis on a non-loopback host)."""
    d = directory_host(cfg)
    return d is not None and not _is_loopback(d[0])


def route_source(host: str, port: int) -> str:
    """This host's source address towards ``host`` (no packet is sent)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    infos = socket.getaddrinfo(host, port, fam if ":" in host else 0, socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def advertise_host(cfg: CacheConfig) -> str:
    """The address to publish for the peer port; ConfigError when it would be unusable."""
    a = cfg.agent
    host = a.advertise_host or a.peer_host
    how = "agent.advertise_host" if a.advertise_host else "agent.peer_host"
    if host in _WILDCARDS:
        if a.advertise_host:
            raise ConfigError(
                f"agent.advertise_host {host!r} is a wildcard: give this node's address"
            )
        d = directory_host(cfg)
        if d is None:
            return "127.0.0.1"  # no shared directory: no other node can look us up anyway
        try:
            host = route_source(*d)
        except OSError as e:
            raise ConfigError(
                f"agent.peer_host is {a.peer_host!r} and this node's address could not be "
                f"detected (no route to the directory {d[0]}:{d[1]}: {e}); set "
                f"agent.advertise_host to the address other nodes reach this node at"
            ) from None
        how = f"detected (route to the directory {d[0]})"
    d = directory_host(cfg)
    if d is not None and directory_is_shared(cfg) and _is_loopback(host):
        raise ConfigError(
            f"{how} is {host!r}, a loopback address, but the directory ({d[0]}) is "
            f"shared with other hosts: they could not reach this agent. Set agent.peer_host to 0.0.0.0 (or this node's address), or "
            f"agent.advertise_host to the address other nodes reach this node at"
        )
    return host
