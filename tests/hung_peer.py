"""A peer port that accepts, authenticates, and then hangs mid-reply: it answers each fetch
with a reply frame announcing the chunk and half of the chunk's bytes, then nothing. A line
``heal`` on stdin makes it a healthy peer: stuck connections are closed and later fetches
served in full. Prints ``listening``, then ``fetch <key>`` for every fetch it receives.

Run by tests/test_peer_breaker.py inside a network namespace:
``python tests/hung_peer.py PORT SECRET CHUNK_DIR`` (CHUNK_DIR holds ``<key>`` files)."""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import msgpack

from tiered_cache.agent.peers import NONCE_BYTES, SERVER, peer_mac
from tiered_cache.ipc import _recv_exact, pack

healed = threading.Event()
out_lock = threading.Lock()


def say(line: str) -> None:
    with out_lock:
        print(line, flush=True)


def frame(s: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack("!I", _recv_exact(s, 4))  # ConnectionLost (an OSError) at EOF
    msg: dict[str, Any] = msgpack.unpackb(_recv_exact(s, n))
    return msg


def serve(s: socket.socket, secret: bytes, chunks: Path) -> None:
    with s:
        try:
            hello = frame(s)
            nc, ns = hello["nonce"], os.urandom(NONCE_BYTES)
            s.sendall(pack({"ok": True, "nonce": ns, "mac": peer_mac(secret, SERVER, nc, ns)}))
            frame(s)  # the client's proof: this test peer trusts it
            while True:
                key = frame(s)["key"]
                say(f"fetch {key}")
                f = chunks / key
                data = f.read_bytes() if f.exists() else None
                if healed.is_set():
                    s.sendall(pack({"ok": True, "len": -1 if data is None else len(data)}))
                    if data is not None:
                        s.sendall(data)
                    continue
                data = data or b"\0" * (1 << 20)
                s.sendall(pack({"ok": True, "len": len(data)}) + data[: len(data) // 2])
                healed.wait()  # hung mid-reply; healing drops the stuck connection
                return
        except (EOFError, OSError):
            return


def wait_for_heal() -> None:
    for line in sys.stdin:
        if line.strip() == "heal":
            healed.set()


def main() -> None:
    port, secret, chunks = int(sys.argv[1]), sys.argv[2].encode(), Path(sys.argv[3])
    srv = socket.create_server(("0.0.0.0", port), backlog=64)
    threading.Thread(target=wait_for_heal, daemon=True).start()
    say("listening")
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn, secret, chunks), daemon=True).start()


if __name__ == "__main__":
    main()
