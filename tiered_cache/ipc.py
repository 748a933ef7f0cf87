"""Length-prefixed msgpack frames over a stream (unix socket locally, TCP between peers).

Control messages are small; bulk chunk bytes travel through shared memory locally. Between
peers a chunk follows its reply frame as raw bytes (``{"len": n}`` then ``n`` bytes), read
straight into one buffer: no msgpack copy of a multi-MiB payload on either side.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack

_LEN = struct.Struct("!I")
MAX_FRAME = 1 << 31


class IPCError(Exception):
    """The peer answered with an error, or the connection broke."""


class FrameTooLarge(IPCError):
    """A frame announced more bytes than the reader accepts: refused before reading it."""


class ConnectionLost(IPCError, ConnectionError):
    """The peer went away mid-conversation (restart, crash), or did not answer in time
    (``timed_out``). Either way the stream is out of step: the caller must close it."""

    def __init__(self, msg: str, *, timed_out: bool = False) -> None:
        super().__init__(msg)
        self.timed_out = timed_out


def pack(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


async def read_msg(
    reader: asyncio.StreamReader, max_frame: int = MAX_FRAME
) -> dict[str, Any] | None:
    """One frame, or None at end of stream; ``max_frame`` bounds what a frame may announce
    (the peer server's requests are small: a larger one is refused unread)."""
    try:
        head = await reader.readexactly(4)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    (n,) = _LEN.unpack(head)
    if n > max_frame:
        raise FrameTooLarge(f"frame of {n} bytes exceeds limit of {max_frame}")
    body = await reader.readexactly(n)
    msg = msgpack.unpackb(body, raw=False)
    if not isinstance(msg, dict):
        raise IPCError("frame is not a mapping")
    return msg


async def sock_recv_exact(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int
) -> bytearray:
    """``n`` bytes from a non-blocking socket, received in place (no stream buffer)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = await loop.sock_recv_into(sock, view[got:])
        if r == 0:
            raise EOFError("connection closed mid-frame")
        got += r
    return buf


async def sock_read_msg(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, max_frame: int = MAX_FRAME
) -> dict[str, Any]:
    """One frame from a non-blocking socket (the peer puller's side of ``read_msg``)."""
    (n,) = _LEN.unpack(await sock_recv_exact(loop, sock, 4))
    if n > max_frame:
        raise FrameTooLarge(f"frame of {n} bytes exceeds limit of {max_frame}")
    msg = msgpack.unpackb(await sock_recv_exact(loop, sock, n), raw=False)
    if not isinstance(msg, dict):
        raise IPCError("frame is not a mapping")
    return msg


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            r = sock.recv_into(view[got:], n - got)
        except TimeoutError as e:  # a late reply would answer the next request: give up
            raise ConnectionLost("no reply from the agent in time", timed_out=True) from e
        except OSError as e:
            raise ConnectionLost(f"agent connection broken: {e}") from e
        if r == 0:
            raise ConnectionLost("connection closed by the agent")
        got += r
    return buf


def send_only(sock: socket.socket, msg: dict[str, Any]) -> None:
    """A request the agent does not answer (it carries ``noreply``)."""
    try:
        sock.sendall(pack({**msg, "noreply": True}))
    except OSError as e:
        raise ConnectionLost(f"agent connection broken: {e}") from e


def call_sync(sock: socket.socket, msg: dict[str, Any]) -> dict[str, Any]:
    """One blocking request/response on a connected socket."""
    try:
        sock.sendall(pack(msg))
    except OSError as e:
        raise ConnectionLost(f"agent connection broken: {e}") from e
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    reply = msgpack.unpackb(_recv_exact(sock, n), raw=False)
    if not isinstance(reply, dict):
        raise IPCError("malformed reply")
    if not reply.get("ok", False):
        raise IPCError(str(reply.get("error", "unknown error")))
    return reply
