"""``RedisDirectory``: the directory shared through Redis (key schema and degradation in
``tiered_cache.directory``'s docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from tiered_cache.api import SHARED_TIERS
from tiered_cache.directory import records
from tiered_cache.directory.base import (
    SEP,
    Directory,
    check_keys,
    check_node,
    check_tier,
    node_view,
    sorted_locs,
)
from tiered_cache.directory.records import (
    DirectoryUnavailable,
    Location,
    ModelRegistration,
    Pin,
    newest_first,
)
from tiered_cache.metrics import Metrics

log = logging.getLogger(__name__)

# fullmatch: "$" would also accept a trailing newline.
_NS_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# Dead nodes stay listed in {ns}:nodes / {ns}:alive this long before being pruned.
_PRUNE_AFTER_S = 3600.0
_REPLAY_BATCH = 64  # queued updates per replay pipeline


# S3 is shared storage: a chunk there stays readable when the node that wrote it dies,
# so heartbeat filtering applies only to node-local tiers.
def redact_url(url: str) -> str:
    """``url`` without password and query string (which may carry ``password=``)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port else ""
        user = f"{unquote(parts.username)}@" if parts.username else ""
        return f"{parts.scheme}://{user}{host}{port}{parts.path}"
    except ValueError:
        return "<unparseable redis url>"


def _url_secrets(url: str) -> list[str]:
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = []
    if parts.password:
        found += [parts.password, unquote(parts.password)]
    for m in re.finditer(r"(?:^|&)[^=&]*pass[^=&]*=([^&]+)", parts.query):
        found += [m.group(1), unquote(m.group(1))]
    return [s for s in found if s]


@dataclass
class _Update:
    """A write that could not reach Redis, replayed in order once it is back.

    Times are absolute (epoch) so a replay does not extend a TTL past the original."""

    op: str  # publish | unpublish | heartbeat | incr_counters | register_models
    node_id: str
    tier: str = ""
    keys: tuple[str, ...] = ()
    expires_at: float = 0.0
    last_seen: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    deltas: dict[str, int] = field(default_factory=dict)


def _is_transport_error(e: Exception) -> bool:
    """True for "Redis unreachable or cluster in flux" (retry later), False for a command
    rejected by a healthy server."""
    from redis.exceptions import ClusterDownError, ResponseError, TryAgainError

    return not isinstance(e, ResponseError) or isinstance(e, (ClusterDownError, TryAgainError))


def _lapsed(u: _Update, now: float) -> bool:
    """A queued publish/heartbeat whose TTL ran out while waiting: nothing to replay."""
    return u.op in ("publish", "heartbeat") and u.expires_at <= now


class _Degraded(Exception):
    """Internal: Redis is in its back-off window or the call just failed."""


class RedisDirectory(Directory):
    """Directory shared through Redis; see the module docstring for keys and degradation."""

    def __init__(
        self,
        client: Any,
        *,
        display_url: str,
        namespace: str = "tc",
        metrics: Metrics | None = None,
        max_pending: int = 10000,
        retry_interval_s: float = 1.0,
        op_timeout_s: float = 2.0,
        secrets_to_scrub: Sequence[str] = (),
        cluster: bool = False,
    ) -> None:
        if not _NS_RE.fullmatch(namespace):
            raise ValueError(f"namespace must match {_NS_RE.pattern}")
        # `client` is redis.asyncio.Redis or RedisCluster; typed Any because their
        # pipeline/command return types are unions that would need a cast on every call.
        self._r = client
        self.url = display_url
        self.cluster = cluster
        self.metrics = metrics or Metrics()
        self._secrets = [s for s in secrets_to_scrub if s]
        self._retry_interval = retry_interval_s
        self._op_timeout = op_timeout_s
        self._max_pending = max_pending
        self._pending: deque[_Update] = deque()
        self._down_until = 0.0  # monotonic; calls before this fail fast
        self._down = False
        self._replay_task: asyncio.Task[None] | None = None
        self._closed = False
        # Last known values, served while Redis is unreachable.
        self._last_nodes: dict[str, dict[str, Any]] = {}
        self._last_pins: list[Pin] = []
        self._last_pinver = 0
        self._last_counters: dict[str, dict[str, int]] = {}
        self._last_models: list[ModelRegistration] = []

        ns = namespace
        g = f"{{{ns}}}"
        self._loc_prefix = f"{ns}:loc:"
        self.k_alive = f"{g}:alive"
        self.k_nodes = f"{g}:nodes"
        self.k_pins = f"{g}:pins"
        self.k_pinexp = f"{g}:pinexp"
        self.k_pinver = f"{g}:pinver"
        self.k_statnodes = f"{g}:statnodes"
        self.k_models = f"{g}:models"
        self._k_stats = f"{g}:stats:"
        self.pins_channel = f"{g}:pins:events"

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "tc",
        socket_timeout: float = 0.5,
        connect_timeout: float = 0.5,
        metrics: Metrics | None = None,
        max_pending: int = 10000,
        cluster: bool | None = None,
        retry_interval_s: float = 1.0,
    ) -> RedisDirectory:
        """``redis://[user:pw@]host:port/db``, ``rediss://``, ``unix:///path?db=N`` or
        ``redis+cluster://host:port`` (also ``rediss+cluster://``, or ``cluster=True``)."""
        scheme, sep, rest = url.partition("://")
        if not sep:
            raise ValueError(f"not a redis url: {redact_url(url)}")
        is_cluster_scheme = scheme.endswith("+cluster")
        if is_cluster_scheme:
            if cluster is False:
                raise ValueError("cluster=False conflicts with a +cluster url")
            scheme = scheme.removesuffix("+cluster")
        use_cluster = bool(cluster) or is_cluster_scheme
        plain_url = f"{scheme}://{rest}"
        display = redact_url(url)
        # No client-side retries: we back off ourselves, and retries would add latency to
        # every request while Redis is down.
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        common: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
            "decode_responses": True,
            "retry": Retry(NoBackoff(), 0),
        }
        if use_cluster:
            if scheme == "unix":
                raise ValueError("Redis Cluster does not support unix sockets")
            from redis.asyncio.cluster import RedisCluster

            client: Any = RedisCluster.from_url(plain_url, **common)
        else:
            from redis.asyncio import Redis

            client = Redis.from_url(plain_url, **common)
        # Whole-call ceiling: covers connect + write + read of a large pipeline and
        # cluster re-discovery, so a hung Redis cannot stall the agent's loop.
        op_timeout = max(1.0, 2 * (connect_timeout + socket_timeout))
        return cls(
            client,
            display_url=display,
            namespace=namespace,
            metrics=metrics,
            max_pending=max_pending,
            retry_interval_s=retry_interval_s,
            op_timeout_s=op_timeout,
            secrets_to_scrub=_url_secrets(url),
            cluster=use_cluster,
        )

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "standalone"
        return f"RedisDirectory(url={self.url!r}, {kind}, pending={len(self._pending)})"

    # -- plumbing ---------------------------------------------------------------------

    def _loc_key(self, chunk: str) -> str:
        return f"{self._loc_prefix}{{{chunk}}}"

    def _stats_key(self, node_id: str) -> str:
        return self._k_stats + node_id

    def _scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def _reason(self, exc: BaseException) -> str:
        msg = str(exc).strip()
        return self._scrub(f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__)

    def _mark_down(self, op: str, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self._retry_interval
        if not self._down:
            self._down = True
            # Logged on the transition only: a dead Redis must not flood the log.
            log.warning(
                "directory: Redis at %s unavailable during %s (%s); degrading, retry in %.1fs",
                self.url,
                op,
                self._reason(exc),
                self._retry_interval,
            )

    def _mark_up(self) -> None:
        if self._down:
            self._down = False
            log.info("directory: Redis at %s reachable again", self.url)
        if self._pending:
            self._ensure_replay()

    async def _execute(
        self, op: str, build: Callable[[Any], None], *, force: bool = False
    ) -> list[Any]:
        """Run one non-transactional pipeline. Raises ``_Degraded`` (already counted)."""
        if not force and time.monotonic() < self._down_until:
            self.metrics.directory_errors.labels(op=op).inc()
            raise _Degraded(op)
        try:
            pipe = self._r.pipeline(transaction=False)
            build(pipe)
            res: list[Any] = await asyncio.wait_for(
                pipe.execute(raise_on_error=False), self._op_timeout
            )
            errs = [r for r in res if isinstance(r, Exception)]
            fatal = next((e for e in errs if _is_transport_error(e)), None)
            if fatal is not None:
                raise fatal
        except Exception as e:  # anything from the client means "directory unavailable"
            self.metrics.directory_errors.labels(op=op).inc()
            self._mark_down(op, e)
            raise _Degraded(self._reason(e)) from e
        self._mark_up()
        if errs:
            # A command-level error (WRONGTYPE, OOM) is not an outage: retrying it would
            # fail the same way and block the queue, so count it and carry on without it.
            self.metrics.directory_errors.labels(op=op).inc()
            log.debug("directory: %s: %d command error(s): %s", op, len(errs), errs[0])
            res = [None if isinstance(r, Exception) else r for r in res]
        return res

    async def _admin(self, op: str, build: Callable[[Any], None]) -> list[Any]:
        """Admin writes always try Redis (ignoring back-off) and raise a clear error."""
        try:
            return await self._execute(op, build, force=True)
        except _Degraded as e:
            raise DirectoryUnavailable(self.url, str(e)) from None

    async def check(self) -> None:
        # A keyed read, not PING: cluster pipelines refuse keyless commands.
        await self._admin("check", lambda p: p.exists(self.k_pinver))

    # -- queued writes ----------------------------------------------------------------

    def _enqueue(self, upd: _Update) -> None:
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.metrics.directory_dropped_updates.inc()
        self._pending.append(upd)
        self._ensure_replay()

    def _ensure_replay(self) -> None:
        if self._closed or (self._replay_task is not None and not self._replay_task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._replay_task = loop.create_task(self._replay_loop())

    async def _replay_loop(self) -> None:
        while self._pending and not self._closed:
            delay = self._down_until - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.flush()

    def _add_update(self, p: Any, u: _Update, now: float) -> None:
        """Queue ``u``'s commands on pipeline ``p`` (``u`` must not have lapsed)."""
        if u.op == "publish":
            ttl_ms = max(1, math.ceil((u.expires_at - now) * 1000))
            member = f"{u.node_id}{SEP}{u.tier}"
            for k in u.keys:
                key = self._loc_key(k)
                p.zadd(key, {member: u.expires_at})
                p.zremrangebyscore(key, "-inf", now)  # prune other nodes' stale entries
                # NX sets the first TTL, GT only extends: the key lives as long as its
                # longest-lived member.
                p.pexpire(key, ttl_ms, nx=True)
                p.pexpire(key, ttl_ms, gt=True)
        elif u.op == "unpublish":
            member = f"{u.node_id}{SEP}{u.tier}"
            for k in u.keys:
                p.zrem(self._loc_key(k), member)
        elif u.op == "heartbeat":
            doc = {"info": u.info, "last_seen": u.last_seen, "expires_at": u.expires_at}
            p.hset(self.k_nodes, u.node_id, json.dumps(doc, default=str))
            p.zadd(self.k_alive, {u.node_id: u.expires_at})
        elif u.op == "incr_counters":
            sk = self._stats_key(u.node_id)
            for name, v in u.deltas.items():
                p.hincrby(sk, name, v)
            p.sadd(self.k_statnodes, u.node_id)
        elif u.op == "register_models":
            p.hset(self.k_models, mapping=u.info)
        else:  # pragma: no cover - internal invariant
            raise AssertionError(u.op)

    async def _submit(self, u: _Update) -> None:
        # Anything already queued must land first, so later writes queue behind it.
        down = time.monotonic() < self._down_until
        if down or self._pending:
            if down:
                self.metrics.directory_errors.labels(op=u.op).inc()
            self._enqueue(u)
            return
        now = time.time()
        if _lapsed(u, now):
            return
        try:
            await self._execute(u.op, lambda p: self._add_update(p, u, now))
        except _Degraded:
            self._enqueue(u)

    async def flush(self) -> bool:
        """Replay queued updates in order, in batches; stops at the first failure."""
        while self._pending and not self._closed:
            batch = list(itertools.islice(self._pending, _REPLAY_BATCH))
            now = time.time()
            live = [u for u in batch if not _lapsed(u, now)]

            def build(p: Any, live: list[_Update] = live, now: float = now) -> None:
                for u in live:
                    self._add_update(p, u, now)

            if live:
                try:
                    await self._execute("replay", build)
                except _Degraded:
                    return False
            # Overflow may have dropped some of `batch` meanwhile; pop only what is
            # still at the head (identity, order preserved).
            for u in batch:
                if self._pending and self._pending[0] is u:
                    self._pending.popleft()
        return not self._pending

    @property
    def pending_updates(self) -> int:
        return len(self._pending)

    @property
    def degraded(self) -> bool:
        """True while Redis is unreachable (answers are local fallbacks)."""
        return time.monotonic() < self._down_until or bool(self._pending)

    # -- locations --------------------------------------------------------------------

    async def publish(self, node_id: str, tier: str, keys: Sequence[str], ttl_s: float) -> None:
        check_node(node_id)
        check_tier(tier)
        check_keys(keys)
        if not keys:
            return
        exp = time.time() + ttl_s
        await self._submit(_Update("publish", node_id, tier, tuple(keys), expires_at=exp))

    async def unpublish(self, node_id: str, tier: str, keys: Sequence[str]) -> None:
        check_node(node_id)
        check_tier(tier)
        check_keys(keys)
        if keys:
            await self._submit(_Update("unpublish", node_id, tier, tuple(keys)))

    async def locate(self, keys: Sequence[str]) -> list[list[Location]]:
        check_keys(keys)
        if not keys:
            return []
        now = time.time()

        def build(p: Any) -> None:
            p.zrangebyscore(self.k_alive, now, "+inf")
            for k in keys:
                p.zrangebyscore(self._loc_key(k), now, "+inf")

        try:
            res = await self._execute("locate", build)
        except _Degraded:
            return [[] for _ in keys]
        alive = set(res[0] or ())
        out: list[list[Location]] = []
        for members in res[1:]:
            locs = []
            for m in members or ():
                node, _, tier = m.partition(SEP)
                if node in alive or tier in SHARED_TIERS:
                    locs.append(Location(node, tier))
            out.append(sorted_locs(locs))
        return out

    # -- nodes ------------------------------------------------------------------------

    async def heartbeat(self, node_id: str, info: Mapping[str, Any], ttl_s: float) -> None:
        check_node(node_id)
        now = time.time()
        u = _Update("heartbeat", node_id, info=dict(info), last_seen=now, expires_at=now + ttl_s)
        await self._submit(u)

    async def nodes(self) -> dict[str, dict[str, Any]]:
        try:
            (raw,) = await self._execute("nodes", lambda p: p.hgetall(self.k_nodes))
        except _Degraded:
            return {n: dict(v) for n, v in self._last_nodes.items()}
        now = time.time()
        live: dict[str, dict[str, Any]] = {}
        stale: list[str] = []
        for node, blob in (raw or {}).items():
            try:
                doc = json.loads(blob)
                exp = float(doc["expires_at"])
                view = node_view(doc.get("info") or {}, float(doc["last_seen"]), exp)
            except (ValueError, KeyError, TypeError):
                stale.append(node)  # unreadable entry: drop it
                continue
            if exp > now:
                live[node] = view
            elif exp < now - _PRUNE_AFTER_S:
                stale.append(node)
        if stale:
            with contextlib.suppress(_Degraded):

                def prune(p: Any) -> None:
                    p.hdel(self.k_nodes, *stale)
                    p.zrem(self.k_alive, *stale)

                await self._execute("nodes", prune)
        self._last_nodes = live
        return {n: dict(v) for n, v in live.items()}

    # -- pins -------------------------------------------------------------------------

    async def _notify(self, op: str, pin_id: str) -> None:
        """Best-effort pub/sub nudge after a pin change (pollers of ``pins_version`` do not
        need it). Sent outside the pipeline: cluster pipelines refuse PUBLISH."""
        try:
            await asyncio.wait_for(
                self._r.publish(self.pins_channel, f"{op} {pin_id}"), self._op_timeout
            )
        except Exception:
            self.metrics.directory_errors.labels(op="pin_notify").inc()

    async def add_pin(self, pin: Pin) -> None:
        blob = pin.to_json()

        def build(p: Any) -> None:
            p.hset(self.k_pins, pin.id, blob)
            if pin.expires_at is not None:
                p.zadd(self.k_pinexp, {pin.id: pin.expires_at})
            else:
                p.zrem(self.k_pinexp, pin.id)
            p.incr(self.k_pinver)

        await self._admin("add_pin", build)
        self._last_pins = [q for q in self._last_pins if q.id != pin.id] + [pin]
        await self._notify("add", pin.id)

    async def remove_pin(self, pin_id: str) -> bool:
        def build(p: Any) -> None:
            p.hdel(self.k_pins, pin_id)
            p.zrem(self.k_pinexp, pin_id)

        removed, _ = await self._admin("remove_pin", build)
        self._last_pins = [q for q in self._last_pins if q.id != pin_id]
        if removed:
            # Second round trip only when something changed, so the version does not move
            # for a no-op.
            await self._admin("remove_pin", lambda p: p.incr(self.k_pinver))
            await self._notify("remove", pin_id)
        return bool(removed)

    async def _drop_expired_pins(self, ids: Sequence[str]) -> None:
        def build(p: Any) -> None:
            p.hdel(self.k_pins, *ids)
            p.zrem(self.k_pinexp, *ids)

        with contextlib.suppress(_Degraded):
            removed, _ = await self._execute("expire_pins", build)
            if removed:  # only the node that actually removed them bumps the version
                await self._execute("expire_pins", lambda p: p.incr(self.k_pinver))
                await self._notify("expire", ids[0])

    async def get_pin(self, pin_id: str) -> Pin | None:
        try:
            (blob,) = await self._execute("get_pin", lambda p: p.hget(self.k_pins, pin_id))
        except _Degraded:
            return next((q for q in self._last_pins if q.id == pin_id), None)
        if blob is None:
            return None
        pin = self._parse_pin(pin_id, blob)
        if pin is None or pin.expired():
            return None
        return pin

    def _parse_pin(self, pin_id: str, blob: str) -> Pin | None:
        try:
            return Pin.from_json(blob)
        except ValueError as e:
            log.warning("directory: ignoring unreadable pin %s: %s", pin_id, e)
            return None

    async def list_pins(self) -> list[Pin]:
        try:
            (raw,) = await self._execute("list_pins", lambda p: p.hgetall(self.k_pins))
        except _Degraded:
            return list(self._last_pins)
        now = time.time()
        pins: list[Pin] = []
        expired: list[str] = []
        for pid, blob in (raw or {}).items():
            pin = self._parse_pin(pid, blob)
            if pin is None:
                continue
            if pin.expired(now):
                expired.append(pid)
            else:
                pins.append(pin)
        if expired:
            await self._drop_expired_pins(expired)
        pins.sort(key=lambda p: (p.created_at, p.id))
        self._last_pins = pins
        return list(pins)

    async def pins_version(self) -> int:
        now = time.time()

        def build(p: Any) -> None:
            p.get(self.k_pinver)
            p.zrangebyscore(self.k_pinexp, "-inf", now, start=0, num=100)

        try:
            ver, expired = await self._execute("pins_version", build)
            expired = expired or []
        except _Degraded:
            return self._last_pinver
        if expired:
            # A TTL pin lapsed: remove it so the version moves and pollers reload.
            await self._drop_expired_pins(expired)
            try:
                (ver,) = await self._execute("pins_version", lambda p: p.get(self.k_pinver))
            except _Degraded:
                return self._last_pinver
        # A non-integer is someone else's value in our key: keep the last good one.
        with contextlib.suppress(ValueError):
            self._last_pinver = int(ver or 0)
        return self._last_pinver

    # -- counters ---------------------------------------------------------------------

    async def incr_counters(self, node_id: str, deltas: Mapping[str, int]) -> None:
        check_node(node_id)
        d = {str(k): int(v) for k, v in deltas.items() if int(v)}
        if d:
            await self._submit(_Update("incr_counters", node_id, deltas=d))

    async def counters(self) -> dict[str, dict[str, int]]:
        try:
            (members,) = await self._execute("counters", lambda p: p.smembers(self.k_statnodes))
            nodes = sorted(members or ())

            def build(p: Any) -> None:
                for n in nodes:
                    p.hgetall(self._stats_key(n))

            res = await self._execute("counters", build) if nodes else []
        except _Degraded:
            return {n: dict(c) for n, c in self._last_counters.items()}
        out = {
            n: {k: int(v) for k, v in (h or {}).items()} for n, h in zip(nodes, res, strict=True)
        }
        self._last_counters = out
        return {n: dict(c) for n, c in out.items()}

    # -- model fingerprints -----------------------------------------------------------

    async def register_models(self, node_id: str, regs: Sequence[ModelRegistration]) -> None:
        check_node(node_id)
        if not regs:
            return
        now = time.time()
        docs = {
            r.hex: r.model_copy(update={"node_id": node_id, "last_seen": now}).model_dump_json()
            for r in regs
        }
        await self._submit(_Update("register_models", node_id, info=docs, last_seen=now))

    async def models(self) -> list[ModelRegistration]:
        try:
            (raw,) = await self._execute("models", lambda p: p.hgetall(self.k_models))
        except _Degraded:
            return list(self._last_models)
        cutoff = time.time() - records.MODEL_KEEP_S
        regs: list[ModelRegistration] = []
        stale: list[str] = []
        for h, blob in (raw or {}).items():
            try:
                r = ModelRegistration.model_validate_json(blob)
            except ValueError:
                stale.append(h)  # unreadable entry: drop it
                continue
            if r.last_seen >= cutoff:
                regs.append(r)
            else:
                stale.append(h)
        if stale:
            with contextlib.suppress(_Degraded):
                await self._execute("models", lambda p: p.hdel(self.k_models, *stale))
        self._last_models = newest_first(regs)
        return list(self._last_models)

    # -- lifecycle --------------------------------------------------------------------

    async def close(self) -> None:
        if self._closed:
            return
        task, self._replay_task = self._replay_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._pending:
            await self.flush()  # one last try, bounded by the op timeout
        self._closed = True
        if self._pending:
            n = len(self._pending)
            self.metrics.directory_dropped_updates.inc(n)
            log.warning("directory: dropping %d queued updates on close (Redis at %s)", n, self.url)
            self._pending.clear()
        with contextlib.suppress(Exception):
            await self._r.aclose()
