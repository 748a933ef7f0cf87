"""S3 tier: chunks as objects ``<prefix>/<key[:2]>/<key>.kvc`` in one bucket.

boto3 is synchronous, so every request runs in a private thread pool whose size equals the
client's connection pool: concurrency is bounded by ``max_concurrency`` and connections are
reused. botocore's "standard" retry mode retries 5xx, throttling (SlowDown) and
connect/read timeouts with jittered exponential backoff; a failure while *reading a
response body* happens after botocore has returned, so this module retries those itself.
Every retry is counted in ``metrics.s3_retries``.

Large objects: uploads above ``multipart_threshold`` go up as a multipart upload with
parts in parallel (one copy of each part, made in the worker thread). Reads ask for the
first ``part_size`` bytes; the response headers give the total size, so for a larger object
the remaining ranges are fetched in parallel (pinned to the first response's ETag) while
the first body is still streaming, straight into one preallocated ``bytearray``. Objects
up to ``part_size`` (the common case) cost one GET, and a reader need not know the size up
front (a decode node reads chunks another node wrote). Reads split at ``part_size`` rather
than ``multipart_threshold``: a ranged GET costs no extra requests, while a multipart
upload costs two (create, complete), so only uploads wait for the higher threshold.
On moto (a Python server) one stream is fastest; the split pays off against real S3,
where a single connection tops out well below the NIC.

Credentials come only from boto3's default chain (env, config files, instance role); they
are never accepted as arguments, put in URLs, logged or shown in ``repr``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from tiered_cache.breaker import Breaker
from tiered_cache.keys import is_valid_key
from tiered_cache.metrics import Metrics
from tiered_cache.tiers.base import Tier, TierError, TierFull, TierUsage

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

T = TypeVar("T")

MIN_PART_SIZE = 5 * 2**20  # S3: every multipart part but the last must be >= 5 MiB
MAX_PARTS = 10_000
_SUFFIX = ".kvc"
# Loose on purpose (S3-compatible stores allow more than AWS); rejects URLs and userinfo.
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
# A response body that broke off: botocore has already returned, so nothing retried it.
_BODY_ERRORS = (HTTPClientError, IncompleteReadError, BotoConnectionError, OSError)


class _ObjectChanged(Exception):
    """The object was replaced between the ranged GETs of one read."""


class _BadRange(Exception):
    """A ranged GET answered with other bytes than asked for (Content-Range or length):
    the read is a miss, never data."""


_CONTENT_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def _error_code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _is_outage(e: BaseException) -> bool:
    """S3 itself is unavailable (no connection, timeouts, 5xx), as opposed to an answer
    about one object (404, 403, a precondition)."""
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return int(status) >= 500
    return isinstance(e, BotoCoreError | OSError)


def _describe(e: BaseException) -> str:
    # ClientError/BotoCoreError messages hold the operation, code and endpoint, never
    # credentials (signing material is not part of any exception text).
    return f"{type(e).__name__}: {e}"


def _normalise_prefix(prefix: str) -> str:
    parts = [p for p in prefix.split("/") if p]
    return "/".join(parts) + "/" if parts else ""


class S3Tier(Tier):
    name = "s3"
    counts_write_errors = frozenset({"io"})
    # A size a server claims above this is refused before any buffer is allocated for it
    # (chunks are tens of MiB; a lying Content-Range must not cost a huge allocation).
    max_object_bytes = 4 * 2**30

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        capacity_bytes: int | None = None,
        max_concurrency: int = 16,
        connect_timeout: float = 2.0,
        read_timeout: float = 10.0,
        max_attempts: int = 4,
        multipart_threshold: int = 16 * 2**20,
        part_size: int = 8 * 2**20,
        index_max_entries: int = 100_000,
        metrics: Metrics | None = None,
        client: S3Client | None = None,
    ) -> None:
        if not _BUCKET_RE.match(bucket):
            raise ValueError("bucket must be a bare bucket name")  # not echoed: may be a URL
        if endpoint_url is not None and "@" in endpoint_url:
            # Don't echo the URL: it holds the secret we refuse to carry.
            raise ValueError("endpoint_url must not contain credentials; use the boto3 chain")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        if max_concurrency < 1 or max_attempts < 1:
            raise ValueError("max_concurrency and max_attempts must be >= 1")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be >= {MIN_PART_SIZE} (S3 multipart minimum)")
        if multipart_threshold < 1:
            raise ValueError("multipart_threshold must be >= 1")
        if index_max_entries < 1:
            raise ValueError("index_max_entries must be >= 1")
        self.bucket = bucket
        self.prefix = _normalise_prefix(prefix)
        self.endpoint_url = endpoint_url
        self.region = region
        self.capacity_bytes = capacity_bytes
        self.max_concurrency = max_concurrency
        self.max_attempts = max_attempts
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.index_max_entries = index_max_entries
        self.metrics = metrics

        self._owns_client = client is None
        if client is None:
            cfg = Config(
                max_pool_connections=max_concurrency,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                # botocore's "max_attempts" counts retries only; total_max_attempts is the
                # AWS-wide meaning (first try included), which is what ours means too.
                retries={"mode": "standard", "total_max_attempts": max_attempts},
                user_agent_extra="tiered-cache",
            )
            # A private Session: the default one is not safe to share across threads.
            client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, region_name=region, config=cfg
            )
        self._client: S3Client = client
        self._client.meta.events.register(
            "before-send.s3", self._on_before_send, unique_id=f"tiered-cache-{id(self)}"
        )
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="s3tier")
        self._closed = False

        # Local index of this node's writes (plus the listing, when a budget is set).
        # Only touched from the event loop thread, so it needs no lock. Without a budget
        # it is a cache, least recently written or read first out beyond
        # ``index_max_entries`` (a forgotten object is found again by a HEAD); with one
        # it holds every object, as each counts against the budget.
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._reserved = 0  # bytes of puts in flight, so concurrent puts respect the budget
        self._opened = False
        self._open_lock: asyncio.Lock | None = None

        self._retry_lock = threading.Lock()
        self.retries = 0  # also without a Metrics, for tests and stats
        self.head_errors = 0
        # While S3 is down, lookups answer "not here" and reads and writes fail at once
        # instead of each paying botocore's retries; a background HEAD probes for its
        # return on a backoff schedule, so no request pays for the probe either.
        self.guard = Breaker(f"s3 bucket {bucket}", log)
        self._probe: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Tier:
        """``S3Tier.from_url("s3://bucket/some/prefix", endpoint_url=..., ...)``."""
        if "@" in url:  # userinfo; checked on the raw string, as a secret may hold a "/"
            raise ValueError("s3 URL must not contain credentials; use the boto3 chain")
        u = urlsplit(url)
        if u.scheme != "s3" or not u.netloc:
            raise ValueError("expected an s3://bucket[/prefix] URL")
        if "prefix" in kwargs:
            raise ValueError("give the prefix in the URL, not as an argument")
        return cls(u.netloc, prefix=u.path, **kwargs)

    def __repr__(self) -> str:
        ep = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return (
            f"S3Tier(bucket={self.bucket!r}, prefix={self.prefix!r}{ep}, "
            f"region={self.region!r}, capacity_bytes={self.capacity_bytes!r})"
        )

    # -- plumbing ------------------------------------------------------------------------

    def object_key(self, key: str) -> str:
        if not is_valid_key(key):
            raise ValueError(f"invalid chunk key {key!r}")
        return f"{self.prefix}{key[:2]}/{key}{_SUFFIX}"

    def _key_of(self, object_key: str) -> str | None:
        rest = object_key[len(self.prefix) :]
        shard, _, name = rest.partition("/")
        if not name.endswith(_SUFFIX):
            return None
        key = name[: -len(_SUFFIX)]
        return key if is_valid_key(key) and shard == key[:2] else None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise TierError("s3 tier is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    def _on_before_send(self, request: Any = None, **_: Any) -> None:
        # botocore bumps context["retries"]["attempt"] before each resend.
        ctx = getattr(request, "context", None) or {}
        if ctx.get("retries", {}).get("attempt", 1) > 1:
            self._count_retry()

    def _count_retry(self) -> None:
        with self._retry_lock:
            self.retries += 1
        if self.metrics is not None:
            self.metrics.s3_retries.inc()

    def _backoff(self, attempt: int) -> None:
        # Same shape as botocore's standard mode: full jitter, 50 ms base, capped.
        time.sleep(random.random() * min(0.05 * 2 ** (attempt - 1), 5.0))

    def _read_error(self, what: str, okey: str, e: BaseException) -> TierError:
        if self.metrics is not None:
            self.metrics.read_errors.labels(tier=self.name).inc()
        log.warning("s3 %s %s failed: %s", what, okey, _describe(e))
        return TierError(f"s3 {what} {okey}: {_describe(e)}")

    def _write_error(self, okey: str, e: BaseException) -> TierError:
        if self.metrics is not None:
            self.metrics.write_errors.labels(tier=self.name, reason="io").inc()
        log.warning("s3 put %s failed: %s", okey, _describe(e))
        return TierError(f"s3 put {okey}: {_describe(e)}")

    # -- sync workers (run in the pool) --------------------------------------------------

    def _head(self, okey: str) -> bool | BaseException:
        """True/False, or the error when the HEAD itself failed."""
        try:
            self._client.head_object(Bucket=self.bucket, Key=okey)
            return True
        except ClientError as e:
            if _error_code(e) in _NOT_FOUND:
                return False
            if not _is_outage(e):
                log.warning("s3 head %s failed: %s", okey, _describe(e))
            return e
        except BotoCoreError as e:
            return e

    def _up(self) -> bool:
        """Whether to call S3 now (see ``guard``). Call from the event loop."""
        if not self.guard.down:
            return True
        if self.guard.allow() and (self._probe is None or self._probe.done()):
            self._probe = asyncio.ensure_future(self._probe_s3())
        return False

    async def _probe_s3(self) -> None:
        r = await self._run(self._head, f"{self.prefix}tiered-cache-probe")
        self._note(r if isinstance(r, BaseException) else None)

    def _note(self, err: BaseException | None) -> None:
        """Feed the breaker with the outcome of a call that reached for S3."""
        if err is None:
            self.guard.ok()
        elif _is_outage(err):
            self.guard.failed(err)

    def _get_object(self, okey: str, rng: str | None = None, etag: str | None = None) -> Any:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": okey}
        if rng is not None:
            kw["Range"] = rng
        if etag is not None:
            kw["IfMatch"] = etag
        return self._client.get_object(**kw)

    @staticmethod
    def _read_exact(body: Any, view: memoryview) -> None:
        got = 0
        n = view.nbytes
        try:
            while got < n:
                r = body.readinto(view[got:])
                if not r:
                    raise IncompleteReadError(actual_bytes=got, expected_bytes=n)
                got += r
        finally:
            body.close()

    def _read_all(self, okey: str, body: Any) -> bytes:
        """Whole small object; a broken body is refetched (botocore does not retry it)."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return bytes(body.read())
            except _BODY_ERRORS:
                body.close()
                if attempt == self.max_attempts:
                    raise
                self._count_retry()
                self._backoff(attempt)
                body = self._get_object(okey)["Body"]
        raise AssertionError("unreachable")

    def _fetch_into(
        self,
        okey: str,
        view: memoryview,
        start: int,
        etag: str,
        total: int,
        body: Any = None,
        attempt: int = 1,
    ) -> None:
        """Fill ``view`` with bytes [start, start+len) of the object; retries broken bodies."""
        while True:
            try:
                if body is None:
                    resp = self._get_object(okey, f"bytes={start}-{start + view.nbytes - 1}", etag)
                    try:
                        got = _checked_range(resp, start, view.nbytes, self.max_object_bytes)
                    except _BadRange:
                        resp["Body"].close()
                        raise
                    if got != total:
                        resp["Body"].close()
                        raise _ObjectChanged(okey)
                    body = resp["Body"]
                self._read_exact(body, view)
                return
            except _BODY_ERRORS:
                if attempt >= self.max_attempts:
                    raise
                self._count_retry()
                self._backoff(attempt)
                attempt += 1
                body = None

    def _put_single(self, okey: str, data: bytes | memoryview) -> None:
        # bytes go as is; anything else is copied once (botocore takes no memoryview), which
        # also snapshots a bytearray the caller might reuse.
        body = data if isinstance(data, bytes) else bytes(data)
        self._client.put_object(Bucket=self.bucket, Key=okey, Body=body)

    def _upload_part(self, okey: str, upload_id: str, number: int, part: memoryview) -> str:
        # botocore takes bytes or a file, not a memoryview: copy here, off the event loop.
        resp = self._client.upload_part(
            Bucket=self.bucket, Key=okey, UploadId=upload_id, PartNumber=number, Body=bytes(part)
        )
        return resp["ETag"]

    def _abort(self, okey: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=okey, UploadId=upload_id)
        except (ClientError, BotoCoreError) as e:  # parts left behind expire by lifecycle
            log.warning("s3 abort multipart %s failed: %s", okey, _describe(e))

    def _list(self) -> dict[str, int]:
        found: dict[str, int] = {}
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix
        )
        for page in pages:
            for obj in page.get("Contents", []):
                key = self._key_of(obj["Key"])
                if key is not None:
                    found[key] = int(obj["Size"])
        return found

    # -- Tier API ------------------------------------------------------------------------

    async def open(self) -> None:
        """With a budget, rebuild usage from a listing of the prefix (once)."""
        if self.capacity_bytes is None or self._opened:
            return
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if not self._opened:
                await self.rebuild_index()
                self._opened = True

    async def rebuild_index(self) -> None:
        """Merge a listing of the prefix into the local index (keeps writes made meanwhile)."""
        try:
            found = await self._run(self._list)
        except (ClientError, BotoCoreError) as e:
            raise self._read_error("list", self.prefix or "/", e) from e
        self._index.update(found)
        self._used = sum(self._index.values())
        self._update_gauges()

    async def contains_many(self, keys: Sequence[str]) -> list[bool]:
        okeys = [self.object_key(k) for k in keys]
        # Keys not written here may have been written by another node: ask S3 (once each).
        if not self._up():  # down: nothing here can be read now
            return [False] * len(keys)
        unknown = {k: ok for k, ok in zip(keys, okeys, strict=True) if k not in self._index}
        found: dict[str, bool] = {}
        if unknown:
            results = await asyncio.gather(*(self._run(self._head, ok) for ok in unknown.values()))
            err: BaseException | None = None
            for k, r in zip(unknown, results, strict=True):
                if isinstance(r, BaseException):
                    err = err or r
                    self.head_errors += 1
                    if self.metrics is not None:
                        self.metrics.read_errors.labels(tier=self.name).inc()
                found[k] = r is True
            self._note(err)
        return [k in self._index or found[k] for k in keys]

    async def longest_prefix(self, keys: Sequence[str]) -> int:
        # Probe in windows of max_concurrency: parallel, but a miss early in a long prompt
        # doesn't cost a HEAD for every later chunk.
        n = 0
        while n < len(keys):
            window = keys[n : n + self.max_concurrency]
            hits = await self.contains_many(window)
            for hit in hits:
                if not hit:
                    return n
                n += 1
        return n

    async def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when absent. Objects larger than ``part_size`` come
        back as a ``bytearray`` (bytes-like) filled in place, to avoid copying them."""
        okey = self.object_key(key)
        if not self._up():
            raise TierError(f"s3 get {okey}: S3 unavailable (retrying in the background)")
        try:
            data = await self._get(okey)
        except TierError:
            raise
        except Exception as e:  # anything unexpected from the wire is a miss, not a crash
            self._note(e)
            raise self._read_error("get", okey, e) from e
        self._note(None)
        if data is None:
            if self._index.pop(key, None) is not None:  # deleted by someone else
                self._recount()
                if self.on_forget is not None:
                    self.on_forget(key)
            return None
        if key in self._index:
            self._index.move_to_end(key)
        if self.metrics is not None:
            self.metrics.bytes_read.labels(tier=self.name).inc(len(data))
        return data

    async def _get(self, okey: str) -> bytes | None:
        for restart in (True, False):  # one restart if the object changes mid-read
            try:
                return await self._get_once(okey)
            except ClientError as e:
                code = _error_code(e)
                if code in _NOT_FOUND:
                    return None
                if code == "InvalidRange":  # zero-length object: ranges don't apply
                    resp = await self._run(self._get_object, okey)
                    return await self._run(self._read_all, okey, resp["Body"])
                if not (restart and code in ("PreconditionFailed", "412")):
                    raise
            except _ObjectChanged:
                if not restart:
                    raise
        raise AssertionError("unreachable")

    async def _get_once(self, okey: str) -> bytes | None:
        ps = self.part_size
        resp = await self._run(self._get_object, okey, f"bytes=0-{ps - 1}")
        body = resp["Body"]
        try:
            total = _checked_range(resp, 0, ps, self.max_object_bytes)
        except _BadRange:
            body.close()
            raise
        if total <= ps or not resp.get("ContentRange"):  # whole object (or Range ignored)
            data = await self._run(self._read_all, okey, body)
            if len(data) != total:  # checked: the range ends at the object's end
                raise _BadRange(f"{len(data)} B received, {total} B announced")
            return data
        etag = resp["ETag"]
        buf = bytearray(total)
        mv = memoryview(buf)
        jobs = [self._run(self._fetch_into, okey, mv[:ps], 0, etag, total, body)]
        jobs += [
            self._run(self._fetch_into, okey, mv[a : a + ps], a, etag, total)
            for a in range(ps, total, ps)
        ]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            # Prefer the errors that change the outcome (gone, replaced) over plain I/O.
            for err in errors:
                if isinstance(err, ClientError) and _error_code(err) in _NOT_FOUND:
                    raise err
            for err in errors:
                if isinstance(err, _ObjectChanged) or (
                    isinstance(err, ClientError) and _error_code(err) == "PreconditionFailed"
                ):
                    raise err
            raise errors[0]
        return buf  # type: ignore[return-value]  # bytes-like; see the docstring

    async def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        okey = self.object_key(key)
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        if self.capacity_bytes is not None:
            await self.open()
            old = self._index.get(key, 0)
            if self._used + self._reserved - old + n > self.capacity_bytes:
                raise TierFull(
                    f"s3 budget: {self._used + self._reserved} used + {n} > {self.capacity_bytes}"
                )
        if not self._up():
            raise TierError(f"s3 put {okey}: S3 unavailable (retrying in the background)")
        self._reserved += n
        try:
            if n > self.multipart_threshold:
                await self._put_multipart(okey, mv)
            else:
                await self._run(self._put_single, okey, data if isinstance(data, bytes) else mv)
        except TierError:
            raise
        except Exception as e:
            self._note(e)
            raise self._write_error(okey, e) from e
        finally:
            self._reserved -= n
        self._used += n - self._index.pop(key, 0)
        self._index[key] = n  # newest last
        self._trim_index()
        self._update_gauges()
        if self.metrics is not None:
            self.metrics.bytes_written.labels(tier=self.name).inc(n)

    async def _put_multipart(self, okey: str, mv: memoryview) -> None:
        n = mv.nbytes
        ps = max(self.part_size, -(-n // MAX_PARTS))
        created = await self._run(
            functools.partial(self._client.create_multipart_upload, Bucket=self.bucket, Key=okey)
        )
        upload_id = created["UploadId"]
        try:
            offsets = range(0, n, ps)
            results = await asyncio.gather(
                *(
                    self._run(self._upload_part, okey, upload_id, i + 1, mv[a : a + ps])
                    for i, a in enumerate(offsets)
                ),
                return_exceptions=True,  # wait for all, so the abort below finds no stragglers
            )
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            parts = [{"PartNumber": i + 1, "ETag": str(e)} for i, e in enumerate(results)]
            await self._run(
                functools.partial(
                    self._client.complete_multipart_upload,
                    Bucket=self.bucket,
                    Key=okey,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},  # type: ignore[typeddict-item]
                )
            )
        except BaseException:
            # Unfinished parts are billed until aborted. Fire and forget: also on cancel.
            with contextlib.suppress(RuntimeError):  # pool already shut down
                self._pool.submit(self._abort, okey, upload_id)
            raise

    async def delete(self, key: str) -> bool:
        okey = self.object_key(key)
        try:
            # S3 DELETE answers 204 whether or not the object existed; HEAD to tell.
            existed = key in self._index or (await self._run(self._head, okey)) is True
            if existed:
                await self._run(
                    functools.partial(self._client.delete_object, Bucket=self.bucket, Key=okey)
                )
        except (ClientError, BotoCoreError) as e:
            if self.metrics is not None:
                self.metrics.write_errors.labels(tier=self.name, reason="io").inc()
            log.warning("s3 delete %s failed: %s", okey, _describe(e))
            raise TierError(f"s3 delete {okey}: {_describe(e)}") from e
        if self._index.pop(key, None) is not None:
            self._recount()
        return existed

    def usage(self) -> TierUsage:
        return TierUsage(self._used, self.capacity_bytes, len(self._index))

    def entries(self) -> Iterator[tuple[str, int]]:
        return iter(list(self._index.items()))

    def size_of(self, key: str) -> int | None:
        return self._index.get(key)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        # Let in-flight requests finish (bounded by the client timeouts) off the loop.
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        self._client.meta.events.unregister("before-send.s3", unique_id=f"tiered-cache-{id(self)}")
        if self._owns_client:
            self._client.close()

    def _trim_index(self) -> None:
        if self.capacity_bytes is not None:
            return
        while len(self._index) > self.index_max_entries:
            key, size = self._index.popitem(last=False)
            self._used -= size
            if self.on_forget is not None:
                self.on_forget(key)

    def _recount(self) -> None:
        self._used = sum(self._index.values())
        self._update_gauges()

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.used_bytes.labels(tier=self.name).set(self._used)
            if self.capacity_bytes is not None:
                self.metrics.capacity_bytes.labels(tier=self.name).set(self.capacity_bytes)


def _checked_range(resp: Any, start: int, n: int, limit: int) -> int:
    """The object's size from the answer to ``Range: bytes=start-(start+n-1)``, once the
    answer is checked to carry exactly those bytes: its Content-Range must name that range
    (cut at the object's end) and its length match; with no Content-Range (the server
    ignored the Range) the whole object comes, so only a request from byte 0 may accept
    it. Anything else raises ``_BadRange``: the server (or something on the way) is not
    sending what was asked, so nothing it sends is used."""
    length = int(resp.get("ContentLength", -1))
    cr = resp.get("ContentRange")
    if not cr:
        if start != 0 or not 0 <= length <= limit:
            raise _BadRange(f"no Content-Range for bytes {start}+{n}, length {length}")
        return length
    m = _CONTENT_RANGE_RE.fullmatch(str(cr))
    if m is None:
        raise _BadRange(f"unusable Content-Range {str(cr)[:80]!r}")
    first, last, total = (int(g) for g in m.groups())
    if total > limit:
        raise _BadRange(f"Content-Range claims a {total} B object (limit {limit} B)")
    if first != start or last != min(start + n, total) - 1 or length != last - first + 1:
        raise _BadRange(f"asked for bytes {start}-{start + n - 1}, got {cr!r} with {length} B")
    return total
