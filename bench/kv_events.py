"""KV events (issue 25): what publishing them costs the put path, and how many the agent
can publish, each against a reference measured in the same run.

- Put overhead: DRAM puts (``bench/tiers.py``'s client path, one chunk per call) into an
  agent without events against the same puts of described chunks into an agent that
  publishes events to a live subscriber (another process, decoding with vLLM's classes
  when vLLM is installed), and into a third that publishes to nobody. Interleaved call by
  call; the figure is the median of each call's time with events / without, less 1. The descriptions are sent before, as the scheduler sends them
  when it plans a step's saves; their cost (the sender's) is reported apart.
- Publish rate: ``BlockBook`` + ``EventPublisher`` on one event loop announcing described
  chunks (a 256-token chunk: 2 blocks of 128 tokens as on vLLM CPU, 16 of 16 as on GPU),
  to a subscriber process that counts them, against vLLM's own ``ZmqEventPublisher``
  sending the same events in batches of the same size to the same kind of subscriber.

``--quick --json`` ends with one JSON line; figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import MiB, agent_process, free_port
from _common import bench_keys as _keys
from _common import chunk_meta as _meta
from _common import time_interleaved as _interleaved

CHUNK_TOKENS = 256
GiB = 1024 * MiB


def _subscriber(endpoint: str, want: int, ready: Any, done: Any) -> None:
    """Count events until ``want`` arrived (``want`` 0: until 3 s pass without one); decode each batch with
    vLLM's classes when importable, else ours."""
    import zmq

    decode: Callable[[bytes], Any]
    try:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    except ImportError:
        from tiered_cache.kv_events.wire import decode_batch

        decode = decode_batch
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    ready.set()
    n, last = 0, 0.0
    cpu0 = time.process_time()
    while not want or n < want:
        if not sub.poll(60_000 if want else 3_000):
            break
        _, _, payload = sub.recv_multipart()
        n += len(decode(payload).events)
        last = time.time()
    # How many, when the last one was decoded (wall clock), and the CPU seconds it took.
    done.put((n, last, time.process_time() - cpu0))


def _describe(keys: list[str], block: int) -> Any:
    from tiered_cache.protocol import Describe

    nb = CHUNK_TOKENS // block
    toks = array("I", range(CHUNK_TOKENS)).tobytes()
    return Describe(keys, [[(hash((k, j)) & (2**64 - 1)) for j in range(nb)] for k in keys],
                    [None] * len(keys), [toks] * len(keys), block, "bench")  # fmt: skip


def bench_put(size: int, iters: int, tmp: Path) -> dict[str, Any]:
    from tiered_cache.client import AgentClient

    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    mv = memoryview(payload.data)
    slot = size + 256
    # At most ~1 GiB of pool per agent: later puts evict earlier chunks (in both agents
    # alike; with events, each eviction is a BlockRemoved), and two pools of every chunk
    # would crowd a small host's memory.
    cap = slot * min(iters + 16, max(8, GiB // slot)) + 8 * MiB
    pub, quiet = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"

    def events(ep: str, name: str) -> dict[str, Any]:
        return {
            "dram": {"capacity": cap, "slot_bytes": slot, "keep_on_stop": False},
            "kv_events": {"enabled": True, "endpoint": ep, "replay_endpoint": None,
                          "state_path": str(tmp / f"{name}.state")},
        }  # fmt: skip

    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Queue()
    with (
        agent_process(tmp, cap, slot) as off_sock,
        agent_process(tmp, cap, slot, events(pub, "on")) as on_sock,
        agent_process(tmp, cap, slot, events(quiet, "quiet")) as quiet_sock,
    ):
        sub = ctx.Process(target=_subscriber, args=(pub, 0, ready, done))
        sub.start()
        ready.wait(60)
        off, on, qu = AgentClient(off_sock), AgentClient(on_sock), AgentClient(quiet_sock)
        assert on.takes_descriptions and not off.takes_descriptions
        keys = {n: _keys(iters + 2, f"{n}{size}") for n in ("off", "on", "quiet")}
        try:
            # The scheduler describes a step's chunks when it plans their saves, on its
            # own connection, before the worker puts them: not in the put's time.
            qu.describe(_describe(keys["quiet"], 128))
            t0 = time.perf_counter()
            for i in range(0, len(keys["on"]), 8):  # as one step's 8 chunks
                on.describe(_describe(keys["on"][i : i + 8], 128))
            describe_s = (time.perf_counter() - t0) / len(keys["on"])
            runs = _interleaved(
                {
                    "off": lambda i: off.put_many([(_meta(keys["off"][i], size), mv)]),
                    "on": lambda i: on.put_many([(_meta(keys["on"][i], size), mv)]),
                    "quiet": lambda i: qu.put_many([(_meta(keys["quiet"][i], size), mv)]),
                },
                iters,
            )
        finally:
            for c in (off, on, qu):
                c.close()
        got, _, sub_cpu = done.get(timeout=60)
        sub.join(10)
    med = {k: statistics.median(v) for k, v in runs.items()}

    def over(name: str) -> float:
        # Interleaved calls: the median of each call's ratio to its neighbour without
        # events is robust to drift in the machine.
        return statistics.median(a / b for a, b in zip(runs[name], runs["off"], strict=True)) - 1

    return {
        "size_mib": size / MiB,
        "put_ms_without": med["off"] * 1e3,
        "put_ms_with": med["on"] * 1e3,
        "put_ms_unheard": med["quiet"] * 1e3,
        "overhead": over("on"),  # a subscriber decoding every event
        "overhead_unheard": over("quiet"),  # events on, nobody subscribed
        "describe_us_per_chunk": describe_s * 1e6,  # the scheduler's send, no reply
        "events_received": got,
        # The subscriber's CPU per put: on this 2-core host it runs beside client and agent.
        "subscriber_cpu_us_per_put": sub_cpu / (iters + 2) * 1e6,
    }


async def _publish(n: int, block: int, endpoint: str) -> tuple[float, int, float]:
    from tiered_cache.kv_events import BlockBook, Blocks, EventPublisher, tier_media

    pub = EventPublisher(endpoint, None, lambda: [], buffer_steps=64)
    await pub.start()
    await asyncio.sleep(0.5)  # the subscriber's connection (ZMQ's slow joiner)
    book = BlockBook(tier_media("bench", ["dram"]), lambda k: [], pub.emit, max_pending=n)
    toks = array("I", range(CHUNK_TOKENS)).tobytes()
    nb = CHUNK_TOKENS // block
    for i in range(n):
        book.describe(f"{i:032x}", Blocks(list(range(i * nb, i * nb + nb)), None, toks, block))
    wall0, t0 = time.time(), time.perf_counter()
    for i in range(n):
        book.added("dram", f"{i:032x}")
        if i % 4096 == 0:
            await asyncio.sleep(0)  # the loop serves clients in between, as in the agent
    pub.flush()
    dt = time.perf_counter() - t0
    batches = pub.next_seq
    await asyncio.sleep(0.5)
    await pub.close()
    return dt, batches, wall0


def bench_rate(n: int, block: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"events": n, "blocks_per_event": CHUNK_TOKENS // block}
    # Ours, end to end: book -> publisher -> subscriber.
    ep = f"tcp://127.0.0.1:{free_port()}"
    ready, done = ctx.Event(), ctx.Queue()
    sub = ctx.Process(target=_subscriber, args=(ep, n, ready, done))
    sub.start()
    ready.wait(60)
    dt, batches, wall0 = asyncio.run(_publish(n, block, ep))
    got, last, _ = done.get(timeout=120)
    recv_s = last - wall0  # from the first emit to the last event decoded
    sub.join(10)
    # The reference: vLLM's own publisher, the same events in batches of the same size.
    from vllm.distributed.kv_events import BlockStored as VStored
    from vllm.distributed.kv_events import KVEventBatch as VBatch
    from vllm.distributed.kv_events import ZmqEventPublisher

    nb = CHUNK_TOKENS // block
    toks = list(range(CHUNK_TOKENS))

    def ev(i: int) -> Any:  # built per event, as an engine builds its own
        return VStored(block_hashes=list(range(i * nb, i * nb + nb)), parent_block_hash=None,
                       token_ids=list(toks), block_size=block, lora_id=None, medium="CPU",
                       lora_name=None, locality="LOCAL", ownership="tiered-cache:bench:dram")

    per = max(1, n // max(1, batches))
    port = free_port()
    ready2, done2 = ctx.Event(), ctx.Queue()
    sub2 = ctx.Process(target=_subscriber,
                       args=(f"tcp://127.0.0.1:{port}", per * batches, ready2, done2))  # fmt: skip
    sub2.start()
    ready2.wait(60)
    vpub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", buffer_steps=64)
    time.sleep(0.5)
    wall1 = time.time()
    for b in range(batches):
        vpub.publish(VBatch(ts=time.time(), events=[ev(b * per + j) for j in range(per)]))
    vgot, vlast, _ = done2.get(timeout=120)
    vdt = vlast - wall1
    vpub.shutdown()
    sub2.join(10)
    out.update(
        publish_events_per_s=n / dt,
        received=got,
        received_events_per_s=got / max(recv_s, 1e-9),
        batches=batches,
        vllm_publisher_events_per_s=vgot / vdt,
        received_vs_vllm_publisher=(got / max(recv_s, 1e-9)) / (vgot / vdt),
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (<1 min)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--sizes", default="2,8,32", help="comma list of MiB per put")
    ap.add_argument("--put-iters", type=int, default=None, help="puts per size (default 200)")
    ap.add_argument("--no-rate", action="store_true", help="only the put overhead")
    a = ap.parse_args()
    iters = a.put_iters or (20 if a.quick else 200)
    n = 20_000 if a.quick else 100_000
    res: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "put": [], "rate": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tc-kvev-") as tmp:
        for mib in (int(x) for x in a.sizes.split(",")):
            d = Path(tmp) / f"s{mib}"
            d.mkdir()
            r = bench_put(mib * MiB, iters, d)
            res["put"].append(r)
            print(f"put {mib:3} MiB: {r['put_ms_without']:.3f} ms -> {r['put_ms_with']:.3f} ms"
                  f" with events heard ({r['overhead'] * 100:+.2f} %), "
                  f"{r['put_ms_unheard']:.3f} ms unheard ({r['overhead_unheard'] * 100:+.2f} %);"
                  f" {r['events_received']} received, subscriber "
                  f"{r['subscriber_cpu_us_per_put']:.0f} us CPU/put", flush=True)  # fmt: skip
    for block in () if a.no_rate else (128, 16):
        r = bench_rate(n, block)
        res["rate"].append(r)
        print(f"rate, {r['blocks_per_event']:2} blocks/event: published "
              f"{r['publish_events_per_s']:,.0f}/s, received {r['received_events_per_s']:,.0f}/s"
              f" ({r['received']} of {n}); vLLM's publisher {r['vllm_publisher_events_per_s']:,.0f}/s "
              f"(ours {r['received_vs_vllm_publisher']:.2f}x)", flush=True)  # fmt: skip
    res["put_overhead_worst"] = max(r["overhead"] for r in res["put"])
    res["put_overhead_unheard_worst"] = max(r["overhead_unheard"] for r in res["put"])
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
