"""What the connector decides about a GPU deployment at start-up and per step, checked on
a CPU (issue 24): fp8 formats keyed apart, context parallelism refused, piecewise CUDA
graphs asked for, forward timings from the device that never price a recompute at zero."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from connectors.kv_device import KVDevice, Timing
from connectors.vllm_plan import RecomputeRate, choose_prefix
from tiered_cache.api import MemoryChunkStore

pytest.importorskip("vllm")

from test_model_identity import fingerprint, make_connector


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryChunkStore]:
    st = MemoryChunkStore()
    import tiered_cache.client as client

    monkeypatch.setattr(client, "open_store", lambda extra: st)
    yield st


def test_each_fp8_format_has_its_own_fingerprint(store: MemoryChunkStore) -> None:
    """vLLM keeps every fp8 cache in uint8 tensors: the tensor dtype alone would let a
    chunk written as fp8_e5m2 load into an fp8_e4m3 cache."""
    fps = {
        fmt: fingerprint("m", cache={"cache_dtype": fmt}, spec_dtype=torch.uint8)
        for fmt in ("fp8_e4m3", "fp8_e5m2", "fp8")
    }
    assert len(set(fps.values())) == 3
    plain = fingerprint("m", spec_dtype=torch.float32)
    assert plain == fingerprint("m", cache={"cache_dtype": "float32"}, spec_dtype=torch.float32)
    assert plain not in fps.values()


@pytest.mark.parametrize("setting", ["decode_context_parallel_size",
                                     "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_naming_the_setting(
    setting: str, store: MemoryChunkStore
) -> None:
    with pytest.raises(ValueError, match=f"{setting}=2") as e:
        make_connector("m", "scheduler", "kv_consumer", parallel={setting: 2})
    assert "\n" not in str(e.value)


def test_layerwise_saves_ask_vllm_for_piecewise_cuda_graphs() -> None:
    from connectors.vllm import TieredCacheConnector

    assert TieredCacheConnector.requires_piecewise_for_cudagraph({}) is True
    assert TieredCacheConnector.requires_piecewise_for_cudagraph({"layerwise_save": "false"}) is False


class _LateTimer(KVDevice):
    """A device whose forward timings finish later, as CUDA events do."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[Timing] = []

    def start_timer(self) -> Any:
        return None

    def stop_timer(self, start: Any) -> Timing:
        t = Timing(None)
        self.pending.append(t)
        return t


def test_forward_timings_are_reported_once_the_device_has_run_them(
    store: MemoryChunkStore,
) -> None:
    from connectors.vllm_metadata import TieredCacheConnectorMetadata

    c = make_connector("m", "worker", "kv_both")
    w = c.worker
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(64, 2, 16, 16)
                          for i in range(2)})  # fmt: skip
    dev = w._dev = _LateTimer()
    c.bind_connector_metadata(TieredCacheConnectorMetadata(step_tokens=100))
    c.wait_for_save()
    c.clear_connector_metadata()
    assert c.build_connector_worker_meta() is None  # queued, not yet run: nothing to report
    dev.pending[0]._s = 0.25
    meta = c.build_connector_worker_meta()
    assert meta is not None and meta.steps == [(100, 0.25)]
    assert c.build_connector_worker_meta() is None  # reported once


def test_launch_only_timings_never_turn_a_load_into_a_recompute() -> None:
    """Host clocks around a CUDA forward time its kernel launches: the same few ms whatever
    the tokens. Fitted, that says recomputing costs nothing; it must read as unmeasured
    (load what was found), not as a reason to recompute everything."""
    rate = RecomputeRate()
    for tokens in (16, 512, 2048, 8192, 64, 4096) * 4:
        rate.observe(tokens, 0.004)
    spt = rate.seconds_per_token()
    assert spt is None
    choice = choose_prefix([256, 256, 256], [0.002, 0.002, 0.002], 0, spt)
    assert choice.decision == "load" and choice.chunks == 3
    real = RecomputeRate()  # device time grows with the tokens: a real rate
    for tokens in (16, 512, 2048, 8192, 64, 4096) * 4:
        real.observe(tokens, 0.002 + tokens * 50e-6)
    assert real.seconds_per_token() == pytest.approx(50e-6, rel=0.2)


class _SlotStore(MemoryChunkStore):
    """A dict store that reserves slots (bytearrays), recording which thread asked."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.reserved_on: list[str] = []
        self.reserved = threading.Event()

    def reserve_payloads(self, payload_sizes: Any) -> Any:
        import threading

        from tiered_cache.api import SlotReservation

        self.reserved_on.append(threading.current_thread().name)
        self.reserved.set()
        bufs = [bytearray(n) for n in payload_sizes]
        return SlotReservation(list(range(len(bufs))), [memoryview(b) for b in bufs],
                               list(payload_sizes), 0)  # fmt: skip

    def commit_payloads(self, res: Any, metas: Any, *, wait: bool = False) -> None:
        self.put_many(list(zip(metas, res.views, strict=True)))


def test_on_a_gpu_the_slot_round_trip_runs_before_the_forward_not_inside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reserving the step's slots is a round trip to the agent; on a GPU it starts when the
    step's metadata is bound, on a helper thread, instead of blocking kernel launches
    between layer 0 and layer 1."""
    from gpu.fakes import RecordingDevice
    from test_model_identity import BLOCKS, LAYERS, schedule_prompt

    import tiered_cache.client as client

    st = _SlotStore()
    monkeypatch.setattr(client, "open_store", lambda extra: st)
    sched = make_connector("m", "scheduler", "kv_producer")
    worker = make_connector("m", "worker", "kv_producer")
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(64, 2, 16, 16, generator=g) for _ in range(LAYERS)]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker.register_kv_caches(dict(zip(names, layers, strict=True)))
    worker.worker._dev = RecordingDevice()  # not a CPU: kernels would run ahead
    req, so = schedule_prompt(sched)
    worker.bind_connector_metadata(sched.build_connector_meta(so))
    assert st.reserved.wait(10)  # before any layer ran
    assert st.reserved_on == ["tc-save-prep_0"]
    with torch.inference_mode():
        for name, t in zip(names, layers, strict=True):
            worker.save_kv_layer(name, t, None)
        worker.wait_for_save()
    worker.drain_saves()
    worker.clear_connector_metadata()
    assert len(st.reserved_on) == 1
    _, params = sched.request_finished(req, BLOCKS)
    assert params["tiered_cache"]["keys"] and all(k in st._data for k in params["tiered_cache"]["keys"])
    worker.shutdown()


def test_an_agent_that_cannot_start_costs_vllm_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed embedded start (a bad pool size, a full /dev/shm) must not escape
    register_kv_caches and stop vLLM: the worker runs on, recomputing."""
    import tiered_cache.client as client

    def refuse(extra: Any) -> Any:
        raise RuntimeError("embedded agent did not start")

    monkeypatch.setattr(client, "open_store", refuse)
    c = make_connector("m", "worker", "kv_both")
    c.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(64, 2, 16, 16)
                          for i in range(2)})  # fmt: skip
    assert c.worker._guard.down  # an outage: later calls skip the cache at once
