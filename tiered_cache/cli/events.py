"""``tiered-cache events``: follow an agent's KV events (vLLM's format) and print them, a
line each: what a router subscribed to the agent would learn."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from tiered_cache.cli.common import CliError, _cfg_opt, _load, friendly


def _reachable(endpoint: str) -> str:
    """A bound wildcard endpoint as a local subscriber connects to it."""
    return endpoint.replace("://*:", "://127.0.0.1:").replace("://0.0.0.0:", "://127.0.0.1:")


def _show(seq: int, ev: Any, as_json: bool) -> str:
    from tiered_cache.kv_events.wire import BlockRemoved, BlockStored

    kind = type(ev).__name__
    if as_json:
        d: dict[str, Any] = {"seq": seq, "type": kind}
        if isinstance(ev, BlockStored | BlockRemoved):
            d.update(hashes=[h.hex() if isinstance(h, bytes) else h for h in ev.block_hashes],
                     medium=ev.medium, locality=ev.locality, ownership=ev.ownership)  # fmt: skip
        if isinstance(ev, BlockStored):
            d.update(block_size=ev.block_size, tokens=len(ev.token_ids))
        return json.dumps(d)
    if isinstance(ev, BlockStored | BlockRemoved):
        first = ev.block_hashes[0] if ev.block_hashes else None
        first_s = first.hex()[:16] if isinstance(first, bytes) else f"{first}"
        extra = f" {len(ev.token_ids)} tokens" if isinstance(ev, BlockStored) else ""
        return (f"{seq:>8} {kind:<13} {ev.ownership} ({ev.medium}, {ev.locality}) "
                f"{len(ev.block_hashes)} blocks from {first_s}{extra}")  # fmt: skip
    return f"{seq:>8} {kind}"


@click.command("events")
@_cfg_opt
@click.option("--endpoint", help="PUB endpoint (default: the config's kv_events.endpoint).")
@click.option("--replay", "replay", help="Replay endpoint (default: the config's).")
@click.option("--from-start", is_flag=True, help="First replay from seq 0 (a snapshot "
              "once the agent's buffer has rotated), then follow.")  # fmt: skip
@click.option("--count", type=int, default=0, help="Stop after this many events (0: never).")
@click.option("--timeout", "timeout_s", type=float, default=0.0,
              help="Stop after this many seconds without an event (0: never).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event.")
@friendly
def events(
    config: str | None,
    endpoint: str | None,
    replay: str | None,
    from_start: bool,
    count: int,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Print an agent's KV events as they come (Ctrl-C to stop)."""
    import zmq

    from tiered_cache.kv_events.index import END_SEQ
    from tiered_cache.kv_events.wire import decode_batch

    if endpoint is None:
        cfg = _load(config)
        if not cfg.kv_events.enabled:
            raise CliError("this config has kv_events.enabled false: give --endpoint")
        endpoint = _reachable(cfg.kv_events.endpoint)
        if replay is None and cfg.kv_events.replay_endpoint:
            replay = _reachable(cfg.kv_events.replay_endpoint)
    if from_start and replay is None:
        raise CliError("--from-start needs a replay endpoint (--replay)")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        sub.connect(endpoint)
    except zmq.ZMQError as e:
        sub.close(linger=0)
        ctx.term()
        raise CliError(f"bad endpoint {endpoint!r} ({e.strerror}): e.g. tcp://host:5567") from None
    shown = 0
    last = -1
    socks = [sub]  # all closed before the context ends (term() waits for open ones)

    def emit(seq: int, payload: bytes) -> bool:
        nonlocal shown, last
        last = max(last, seq)
        for ev in decode_batch(payload).events:
            click.echo(_show(seq, ev, as_json))
            shown += 1
            if count and shown >= count:
                return False
        return True

    try:
        if from_start and replay is not None:
            req = ctx.socket(zmq.DEALER)
            socks.append(req)
            try:
                req.connect(replay)
            except zmq.ZMQError as e:
                raise CliError(f"bad replay endpoint {replay!r} ({e.strerror})") from None
            req.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                if not req.poll(10_000):
                    raise CliError(f"no replay answer from {replay} within 10 s")
                frames = req.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                if not emit(int.from_bytes(frames[2], "big"), frames[3]):
                    return
        idle_since = time.monotonic()
        while True:
            if not sub.poll(200):
                if timeout_s and time.monotonic() - idle_since > timeout_s:
                    return
                continue
            idle_since = time.monotonic()
            _, seq_b, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq <= last:
                continue  # already shown by the replay
            if not emit(seq, payload):
                return
    except KeyboardInterrupt:
        pass
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
