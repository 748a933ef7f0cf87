"""vLLM V1 KV connector: prompt KV in chunks through the tiered cache.

Load it with::

    --kv-transfer-config '{"kv_connector": "TieredCacheConnector",
                           "kv_connector_module_path": "connectors.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {"store_dir": "/path"}}'

Roles: a producer (prefill) saves every prompt's full chunks and its partial tail chunk;
a consumer (decode) loads the longest cached prefix, at most all of the prompt but its
last token; ``kv_both`` does both (offload and reuse its own prefixes). Saving is decided
per request: a consumer also saves what it computes of a P/D request whose prefill did
not save it (the router skipped the prefill), so the next turn finds this turn's tail.

``kv_connector_extra_config`` keys (all optional):

``chunk_size`` (the cache config's, 256)
    tokens per chunk; a multiple of vLLM's KV block size.
``save_unfull_chunk`` (the cache config's, true)
    a producer also saves a prompt's last, partial chunk.
``save_computed`` (true)
    a consumer saves the chunks it computes of a request that carries the router's
    ``tiered_cache`` hint, past those the hint says its prefill saved (all of them when
    the router skipped the prefill); false: a consumer never saves.
``block_aliases`` (true)
    a producer also names the block-aligned prefixes of each whole chunk it saves (one
    fire-and-forget frame to its agent), so a prompt that diverges inside that chunk
    loads the blocks it shares; off with TP > 1 (docs/architecture.md, "Prompts that
    share part of a chunk").
``load_wait_timeout_s`` (5.0)
    the most a consumer waits for chunks on their way (its prefill's, or a copy into
    DRAM); the actual bound is what recomputing the waited-for tokens costs this engine.
``fetch_policy`` ("auto")
    ``auto``: load the prefix of the found chunks whose load is expected to beat this
    engine's measured recompute (``connectors.vllm_plan``); ``always``: every found chunk.
``agent_timeout_s`` (10)
    how long a call may wait for the node agent; an agent that does not answer counts as
    down (the connector serves without the cache and retries with backoff).
``wait_for_prefill`` ("auto")
    ``auto``: wait for exactly the chunks the request's ``kv_transfer_params`` say its
    prefill saved (the router passes them on; none when it skipped the prefill);
    ``true``: without such a list, wait for every chunk; ``false``: never wait.
``async_load`` ("auto")
    auto: chunks in this node's DRAM or NVMe load synchronously before the forward pass
    (milliseconds); chunks on a peer or in S3 are first copied into its DRAM by the agent
    while the request waits in the queue (holding no KV blocks), then load the same way
    (without a DRAM tier they load between steps). true: every load between scheduler
    steps (the request waits in ``WAITING_FOR_REMOTE_KVS``); false: every load
    synchronously.
``layerwise_save`` (true)
    with a node agent, copy each layer's blocks into reserved DRAM slots as vLLM reports
    the layer done, overlapping the rest of the forward pass; false copies every layer at
    the end of the pass. Either way checksum + commit run on a helper thread afterwards.
``save_copy_thread`` (false)
    KV in host memory (vLLM's CPU backend): each layer's copy runs inline in the hook,
    since a helper thread would overlap nothing and its copy would start a second OpenMP
    team on the engine's cores; true moves it to a helper thread. On an accelerator the
    copy always runs on a side stream from a helper thread.
``peer_tp_sizes`` (none)
    the TP sizes of other pools whose chunks this one loads, e.g. ``[1]`` on a TP 2
    decode behind a TP 1 prefill (``2`` or ``"1,2"`` also work). A chunk is looked up
    under this pool's keys first, then under each peer's, and its ranks take the KV heads
    they hold of the peer's shards (``connectors.vllm_tp``). Full attention only, and
    every size must divide the model's KV heads (refused at start-up otherwise); MLA
    needs none (its pools share keys at any TP size).
``model_id``
    model identity in the chunk fingerprint (default: vLLM's model path/name); set it
    when prefill and decode nodes name the same model differently.
``load_batch_chunks`` (16), ``max_staging_mb`` (256)
    bound host memory per store call.

Metrics (``tiered_cache_connector_*``) appear on vLLM's own ``/metrics``; see
``connectors.vllm_metrics``. The connector registers its fingerprint with the node agent
so that ``tiered-cache pin add --model`` names the keys it writes.
Anything else (``store_dir``, ``config_file``, ...) goes to ``tiered_cache.client.open_store``.

Invariants: a chunk is loaded only after the store verified it (key, model fingerprint,
checksum) and its header matches this node's KV layout, dtype, block size and shape;
anything else is reported through ``get_block_ids_with_load_errors`` so vLLM recomputes
(``kv_load_failure_policy="recompute"``, recommended) or fails the request cleanly
(``"fail"``, vLLM 0.32's default: HTTP 500, no token sampled from bad KV).

Layout (as vLLM's own offloading connector): this class is a facade that builds the
scheduler half (``connectors.vllm_scheduler``: bookkeeping, decisions) or the worker half
(``connectors.vllm_worker``: bytes) and forwards to it; what they tell each other is in
``connectors.vllm_metadata``, what they share in ``connectors.vllm_common``, the pure
decisions in ``connectors.vllm_plan``, the block copies in ``connectors.vllm_kvio`` and the
metrics in ``connectors.vllm_metrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from connectors.vllm_common import ConnectorArgs, _as_bool
from connectors.vllm_metrics import TieredCacheConnectorStats, TieredCachePromMetrics
from connectors.vllm_scheduler import SchedulerSide
from connectors.vllm_worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["TieredCacheConnector"]


class TieredCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """Cache-mediated KV handoff through ``tiered_cache`` (see the module docstring).

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on for models with several
    KV cache groups (sliding-window and full-attention layers), so a decode holds only a
    sliding window's blocks; the connector stores every layer of a chunk and loads each
    group into its own blocks (``connectors.vllm_kvio.GroupedPagedKV``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        ktc = self._kv_transfer_config
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        args = ConnectorArgs(vllm_config, role, kv_cache_config, ktc)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(args)
        else:
            self.worker = WorkerSide(args)

    @property
    def _s(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler-side call on a worker connector"
        return self.scheduler

    @property
    def _w(self) -> WorkerSide:
        assert self.worker is not None, "a worker-side call on a scheduler connector"
        return self.worker

    # ---------------------------------------------------------------- scheduler side

    def on_new_request(self, request: Request) -> None:
        self._s.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._s.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._s.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        return self._s.get_external_cache_hit_sources(request, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s.update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s.request_finished(request, block_ids[0] if block_ids else [])

    # ------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker is not None:
            self.worker.clear_connector_metadata()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._w.build_connector_worker_meta()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._w.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._w.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._w.wait_for_save()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        return self._w.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._w.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w.get_block_ids_with_load_errors()

    def drain_saves(self, timeout: float | None = None) -> None:
        """Wait for saves handed to the commit thread (shutdown, tests)."""
        self._w.drain_saves(timeout)

    # ------------------------------------------- metrics (both sides) and lifecycle

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.scheduler or self.worker
        return side.get_kv_connector_stats() if side is not None else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise saves run in ``save_kv_layer`` between a layer's kernels and the
        next's; a full CUDA graph replays the kernels without that Python hook, so nothing
        would be saved. vLLM then captures piecewise graphs instead."""
        return _as_bool((extra_config or {}).get("layerwise_save", True))

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return TieredCacheConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return TieredCachePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.shutdown()
