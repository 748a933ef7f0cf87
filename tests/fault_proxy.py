"""A small fault-injecting HTTP reverse proxy for S3 tests.

Sits on a free loopback port in front of the moto server and forwards every request
unchanged (method, path, headers including Host, body), buffering bodies in memory. It can
be told to fail the next N requests with an HTTP error (500 InternalError, 503 SlowDown),
to delay them and then answer (a slow but working S3), to stall before answering (longer than the client's read timeout), to stall half way
through a response body, or to hold requests until the test releases them (a tier as slow
as the test needs, with no timing involved). Faults can be limited to some HTTP methods.

moto does not verify SigV4 signatures, and the client signs for the proxy's host anyway,
so plain forwarding is enough.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}

_ERROR_CODES = {500: "InternalError", 503: "SlowDown"}

Headers = list[tuple[str, str]]
ResponseHook = Callable[[str, Message, int, Headers, bytes], tuple[int, Headers, bytes]]


@dataclass
class _Fault:
    kind: str  # "error", "delay", "stall", "stall_body" or "hold"
    remaining: int  # requests left to fault; -1: until cleared
    status: int = 500
    code: str = "InternalError"
    seconds: float = 0.0
    methods: frozenset[str] | None = None

    def applies(self, method: str) -> bool:
        return self.remaining != 0 and (self.methods is None or method in self.methods)


class FaultProxy:
    """Reverse proxy to ``upstream_url``. Use as a context manager or call ``close``."""

    def __init__(self, upstream_url: str) -> None:
        u = urlsplit(upstream_url)
        self.upstream_host = u.hostname or "127.0.0.1"
        self.upstream_port = u.port or 80
        self._lock = threading.Lock()
        self._fault: _Fault | None = None
        self._stop = threading.Event()
        self.requests = 0  # requests seen
        self.faults_injected = 0
        self.methods_seen: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0  # most requests open at once (checks bounded concurrency)
        self.held = 0  # requests held now (hold_next)
        self._held_cv = threading.Condition()
        self._release = threading.Event()
        # Called as hook(method, path, headers) before each request is forwarded (in the
        # handler thread), e.g. to change the bucket behind the client's back.
        self.on_request: Callable[[str, str, Message], None] | None = None
        # Called as hook(method, request headers, status, headers, body) with upstream's
        # answer; returns the (status, headers, body) sent instead: a server that lies.
        # Content-Length follows the body returned.
        self.on_response: ResponseHook | None = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- fault control -------------------------------------------------------------------

    def fail_next(
        self,
        n: int,
        status: int = 500,
        code: str | None = None,
        methods: Iterable[str] | None = None,
    ) -> None:
        """Answer the next ``n`` matching requests with ``status`` (n=-1: until cleared)."""
        self._set(
            _Fault(
                "error",
                n,
                status,
                code or _ERROR_CODES.get(status, "InternalError"),
                methods=_methods(methods),
            )
        )

    def slow_down_next(self, n: int, methods: Iterable[str] | None = None) -> None:
        """S3 throttling: 503 SlowDown for the next ``n`` matching requests."""
        self.fail_next(n, 503, "SlowDown", methods)

    def delay_next(self, n: int, seconds: float, methods: Iterable[str] | None = None) -> None:
        """Wait ``seconds``, then forward and answer as usual: slow, not failing."""
        self._set(_Fault("delay", n, seconds=seconds, methods=_methods(methods)))

    def stall_next(self, n: int, seconds: float, methods: Iterable[str] | None = None) -> None:
        """Sleep ``seconds`` before answering (then drop the connection)."""
        self._set(_Fault("stall", n, seconds=seconds, methods=_methods(methods)))

    def stall_body_next(self, n: int, seconds: float, methods: Iterable[str] | None = None) -> None:
        """Send the headers and half the body, then sleep ``seconds`` and drop the
        connection: a read timeout in the middle of a response body."""
        self._set(_Fault("stall_body", n, seconds=seconds, methods=_methods(methods)))

    def hold_next(self, n: int, methods: Iterable[str] | None = None) -> None:
        """Hold the next ``n`` matching requests (n=-1: until cleared) before forwarding
        them, until ``release``."""
        self._release.clear()
        self._set(_Fault("hold", n, methods=_methods(methods)))

    def wait_held(self, n: int, timeout: float = 30.0) -> bool:
        """Whether ``n`` requests came to be held at once within ``timeout``."""
        with self._held_cv:
            return self._held_cv.wait_for(lambda: self.held >= n, timeout)

    def release(self) -> None:
        """Forward the held requests; later ones are not held."""
        self.clear()
        self._release.set()

    def clear(self) -> None:
        self._set(None)

    def _set(self, fault: _Fault | None) -> None:
        with self._lock:
            self._fault = fault

    def _take_fault(self, method: str) -> _Fault | None:
        with self._lock:
            self.requests += 1
            self.methods_seen.append(method)
            f = self._fault
            if f is None or not f.applies(method):
                return None
            if f.remaining > 0:
                f.remaining -= 1
            self.faults_injected += 1
            return f

    def close(self) -> None:
        self._stop.set()  # wakes stalled handlers
        self._release.set()  # and held ones
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request handling ----------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like real S3

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def _read_body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    parts: list[bytes] = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self) -> None:
                with proxy._lock:
                    proxy.in_flight += 1
                    proxy.max_in_flight = max(proxy.max_in_flight, proxy.in_flight)
                try:
                    self._serve()
                except OSError:  # client gave up (timeout, reset): drop the connection
                    self.close_connection = True
                finally:
                    with proxy._lock:
                        proxy.in_flight -= 1

            def _serve(self) -> None:
                body = self._read_body()
                if proxy.on_request is not None:
                    proxy.on_request(self.command, self.path, self.headers)
                fault = proxy._take_fault(self.command)
                if fault is not None and fault.kind == "error":
                    self._send_error(fault.status, fault.code)
                    return
                if fault is not None and fault.kind == "stall":
                    proxy._stop.wait(fault.seconds)
                    self.close_connection = True
                    return
                if fault is not None and fault.kind == "delay":
                    proxy._stop.wait(fault.seconds)
                if fault is not None and fault.kind == "hold":
                    with proxy._held_cv:
                        proxy.held += 1
                        proxy._held_cv.notify_all()
                    proxy._release.wait()
                    with proxy._held_cv:
                        proxy.held -= 1
                status, reason, headers, data = self._forward(body)
                if proxy.on_response is not None:
                    status, headers, data = proxy.on_response(
                        self.command, self.headers, status, headers, data
                    )
                self.send_response_only(status, reason)
                for k, v in headers:
                    self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if fault is not None and fault.kind == "stall_body" and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    proxy._stop.wait(fault.seconds)
                    self.close_connection = True
                    return
                self.wfile.write(data)

            def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(
                    proxy.upstream_host, proxy.upstream_port, timeout=30
                )
                try:
                    # skip_host/skip_accept_encoding: send the client's headers verbatim.
                    conn.putrequest(
                        self.command, self.path, skip_host=True, skip_accept_encoding=True
                    )
                    for k, v in self.headers.items():
                        # Expect: the 100-continue dance was already done with the client.
                        if k.lower() in _HOP_BY_HOP or k.lower() in ("content-length", "expect"):
                            continue
                        conn.putheader(k, v)
                    if body or self.command in ("PUT", "POST"):
                        conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body or None)
                    resp = conn.getresponse()
                    data = resp.read()
                    headers = [
                        (k, v)
                        for k, v in resp.getheaders()
                        if k.lower() not in _HOP_BY_HOP
                        and (self.command == "HEAD" or k.lower() != "content-length")
                    ]
                    return resp.status, resp.reason, headers, data
                finally:
                    conn.close()

            def _send_error(self, status: int, code: str) -> None:
                payload = (
                    '<?xml version="1.0" encoding="UTF-8"?>\n'
                    f"<Error><Code>{code}</Code><Message>injected fault</Message>"
                    "<RequestId>fault-proxy</RequestId></Error>"
                ).encode()
                self.send_response_only(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        return Handler


def _methods(methods: Iterable[str] | None) -> frozenset[str] | None:
    return None if methods is None else frozenset(m.upper() for m in methods)


@contextmanager
def fault_proxy(upstream_url: str) -> Iterator[FaultProxy]:
    p = FaultProxy(upstream_url)
    try:
        yield p
    finally:
        p.close()
