"""vLLM V1 KV connector: prompt KV in chunks through the tiered cache.

Load it with::

    --kv-transfer-config '{"kv_connector": "TieredCacheConnector",
                           "kv_connector_module_path": "connectors.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {"store_dir": "/path"}}'

Roles: a producer (prefill) saves every prompt's full chunks and its partial tail chunk;
a consumer (decode) loads the longest cached prefix, at most all of the prompt but its
last token; ``kv_both`` does both (offload and reuse its own prefixes).

``kv_connector_extra_config`` keys (all optional):

``chunk_size`` (the cache config's, 256)
    tokens per chunk; a multiple of vLLM's KV block size.
``save_unfull_chunk`` (the cache config's, true)
    a producer also saves a prompt's last, partial chunk.
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from connectors.vllm_kvio import (
    ChunkSpan,
    HostStaging,
    PagedKV,
    dtype_name,
    load_block_ranges,
    loadable_spans,
    payload_tensor,
)
from connectors.vllm_kvio import chunk_spans as _chunk_spans
from connectors.vllm_metrics import (
    StatsRecorder,
    TieredCacheConnectorStats,
    TieredCachePromMetrics,
    farthest,
)
from connectors.vllm_plan import RecomputeRate, choose_prefix, wait_budget_s
from tiered_cache import keys as tc_keys
from tiered_cache.api import ChunkStore
from tiered_cache.breaker import Breaker
from tiered_cache.client import SlotReservation
from tiered_cache.codec import ChunkMeta

try:  # 0.32+: per-tier hit accounting
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

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

# Under the "vllm" logger so vLLM's handler and level apply.
logger = init_logger("vllm.connectors.tiered_cache")

T = TypeVar("T")
_SOURCE_TO_HIT = {"dram": "HOST", "nvme": "DISK", "peer": "P2P", "s3": "EXTERNAL_UNSPECIFIED"}


# ----------------------------------------------------------------------------- metadata


@dataclass
class SaveChunk:
    """Worker: copy blocks ``block_ids`` (the whole chunk) out and store under ``key``."""

    req_id: str
    index: int
    key: str
    num_tokens: int
    block_ids: list[int]
    parent: str | None = None  # previous chunk's key (prefix chain), for the store's policies
    # A block-aligned copy of the prompt's partial tail chunk: what a longer prompt that
    # extends this one (the next turn of a conversation) can find and load.
    aligned: bool = False


@dataclass
class LoadChunk:
    """Worker: fetch ``key`` (a payload of ``n_blocks`` blocks) and write its blocks
    [lo, lo + len(block_ids)) into ``block_ids``."""

    index: int
    key: str
    num_tokens: int
    n_blocks: int
    lo: int
    block_ids: list[int]
    source: str = ""  # where the scheduler's lookup found it
    tokens: int = 0  # prompt tokens this load provides to the request
    origin: str = ""  # where it came from, when prefetched into DRAM for this load


@dataclass
class LoadJob:
    req_id: str
    chunks: list[LoadChunk]
    is_async: bool
    num_tokens: int
    # Only with tensor parallelism > 1: ranks other than 0 derive their own keys.
    token_ids: list[int] | None = None
    cache_salt: str | None = None


@dataclass
class TieredCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveChunk] = field(default_factory=list)
    # Tensor parallelism > 1: prompt tokens and salt of the requests in ``saves``.
    save_tokens: dict[str, tuple[list[int], str | None]] = field(default_factory=dict)
    step_tokens: int = 0  # tokens this step computes: the worker times the forward


@dataclass
class TieredCacheWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: (tokens, forward seconds) of the engine's recent steps, from
    which the scheduler learns what recomputing a prompt costs (``RecomputeRate``)."""

    steps: list[tuple[int, float]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Tensor-parallel ranks run the same steps: the slowest rank sets each one's time.
        if not isinstance(other, TieredCacheWorkerMeta) or not other.steps:
            return self
        if len(other.steps) != len(self.steps):
            return self if self.steps else other
        return TieredCacheWorkerMeta(
            [(t, max(a, b)) for (t, a), (_, b) in zip(self.steps, other.steps, strict=True)]
        )


# ----------------------------------------------------------------------- scheduler state


@dataclass
class _Match:
    """What ``get_num_new_matched_tokens`` told vLLM, for ``update_state_after_alloc``."""

    num_computed: int
    sources: list[str]  # where each chunk is loaded from (its prefix up to the last loaded)
    origins: list[str]  # where each chunk came from (a prefetched peer chunk: "peer")
    hit_end: int
    is_async: bool  # decided once, from the chunks that will be loaded
    # The last chunk is an earlier prompt's partial chunk: (index, tokens, key).
    partial: tuple[int, int, str] | None = None


@dataclass
class _Wait:
    """A request the connector may answer "ask again" for (scheduler side)."""

    t0: float  # when the request arrived
    keys: list[str]  # its loadable chunks' keys
    coming: int  # leading chunks the prefill said it saved
    sources: list[str] = field(default_factory=list)
    costs: list[float] = field(default_factory=list)
    looked_at: float = -1.0
    gave_up: bool = False  # stopped waiting for the prefill's chunks
    decided: str = ""  # fetch-or-recompute decision, counted once
    fetch_t0: float | None = None  # prefetch of remote chunks into DRAM started
    fetch_budget: float = 0.0
    origin: dict[int, str] = field(default_factory=dict)  # chunk -> remote source seen
    requested: set[int] = field(default_factory=set)  # chunks asked to be prefetched
    probed: bool = False  # looked for an earlier prompt's partial chunk
    # That chunk, when found: (index, tokens, key, source, expected load seconds).
    partial: tuple[int, int, str, str, float] | None = None


@dataclass
class _StepSave:
    """One step's save: chunks (save, key, parent), and, on the zero-copy path, their
    reserved slots, destination tensors ([L, n, *block] over each slot) and block indexes."""

    todo: list[tuple[SaveChunk, str, str | None]]
    res: SlotReservation | None
    dests: list[torch.Tensor]
    idx: list[torch.Tensor]
    layers: set[int] = field(default_factory=set)  # layers whose copy was submitted
    copies: list[Future[None]] = field(default_factory=list)
    t0: float = 0.0
    skipped: bool = False  # the agent is down: this step saves nothing


@dataclass
class _ReqState:
    req_id: str
    prompt: list[int]
    salt: str | None
    keys: list[str]
    spans: list[ChunkSpan]
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0
    tail_key: str | None = None  # key of the block-aligned copy of the partial tail


@dataclass
class _Identity:
    fingerprint: tc_keys.ModelFingerprint
    kv_layout: str  # header field (<= 8 bytes)
    block_size: int
    dtype: str


# Sources a load reads in milliseconds: loaded inside the forward pass under "auto".
_LOCAL_SOURCES = frozenset({"dram", "nvme"})


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def _single_group_spec(kv_cache_config: KVCacheConfig) -> Any:
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ValueError(
            f"TieredCacheConnector supports models with exactly one KV cache group "
            f"(got {len(groups)}); hybrid/sliding-window models are not supported"
        )
    return groups[0]


def build_identity(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    extra: Mapping[str, Any],
    tp_rank: int = 0,
) -> _Identity:
    """Everything that must match between writer and reader, from the vLLM config.

    Both roles build it from the same inputs, so the scheduler's keys equal rank 0's.
    """
    group = _single_group_spec(kv_cache_config)
    spec = group.kv_cache_spec
    block_size = int(spec.block_size)
    chunk_size = int(extra.get("chunk_size", tc_keys.DEFAULT_CHUNK_SIZE))
    if chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(
            f"TieredCacheConnector: chunk_size={chunk_size} must be a positive multiple of "
            f"vLLM's KV block size ({block_size}); set kv_connector_extra_config.chunk_size "
            f"to a multiple of {block_size}, or change --block-size"
        )
    spec_dtype = getattr(spec, "dtype", None)
    if isinstance(spec_dtype, torch.dtype):
        dtype = dtype_name(spec_dtype)
    else:
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        dtype = (
            cache_dtype
            if cache_dtype != "auto"
            else dtype_name(vllm_config.model_config.dtype)  # type: ignore[arg-type]
        )
    layout = (
        getattr(kv_cache_config, "kv_cache_layout", None)
        or getattr(vllm_config.cache_config, "kv_cache_layout", None)
        or os.environ.get("VLLM_KV_CACHE_LAYOUT")
        or "unknown"
    )
    layout = str(layout)
    try:
        from vllm.platforms import current_platform

        device_type = str(current_platform.device_type)
    except Exception:  # pragma: no cover
        device_type = "unknown"
    pc = vllm_config.parallel_config
    if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
        raise ValueError("TieredCacheConnector does not support pipeline parallelism yet")
    tp_size = int(getattr(pc, "tensor_parallel_size", 1))
    model_id = str(extra.get("model_id") or vllm_config.model_config.model)
    kind = type(spec).__name__
    fp = tc_keys.ModelFingerprint(
        model_id=model_id,
        dtype=dtype,
        # The byte meaning of a block depends on the backend (CPU: all K then all V per
        # head; CUDA: K|V per token), so the device type is part of the identity.
        kv_layout=f"{layout}@{device_type}/{kind}",
        block_size=block_size,
        tp_rank=tp_rank,
        tp_world_size=tp_size,
        chunk_size=chunk_size,
    )
    return _Identity(fp, layout[:8], block_size, dtype)


class TieredCacheConnector(KVConnectorBase_V1):
    """Cache-mediated KV handoff through ``tiered_cache`` (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        ktc = self._kv_transfer_config
        self._extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {})
        # The cache config (config_file, inline tiered_cache, or LMCache's YAML through
        # LMCACHE_CONFIG_FILE) gives chunk_size and save_unfull_chunk unless set here.
        from tiered_cache.client import config_from_extra

        cache_cfg = config_from_extra(self._extra)
        self._extra.setdefault("chunk_size", cache_cfg.chunk_size)
        self._save_unfull = _as_bool(
            self._extra.get("save_unfull_chunk", cache_cfg.save_unfull_chunk)
        )
        self._save_enabled = bool(ktc.is_kv_producer)
        self._load_enabled = bool(ktc.is_kv_consumer)
        self._role_name = str(ktc.kv_role)
        # "auto": chunks in this node's DRAM or NVMe load synchronously inside the forward
        # pass (milliseconds). Chunks on a peer or in S3 are first copied into DRAM by the
        # agent while the request waits in the queue (holding no KV blocks), then load the
        # same way: no network I/O inside the forward pass, and no worker thread competing
        # with the engine's busy loop for the GIL.
        mode = str(self._extra.get("async_load", "auto")).strip().lower()
        if mode not in ("auto", "1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"async_load must be auto, true or false, got {mode!r}")
        self._async_mode = mode if mode == "auto" else str(_as_bool(mode)).lower()
        self._async_load = self._async_mode != "false"
        # The cap on any wait (for a prefill's chunks, for a prefetch); the actual bound is
        # what recomputing the waited-for tokens costs (connectors.vllm_plan).
        self._wait_timeout = float(self._extra.get("load_wait_timeout_s", 5.0))
        self._agent_timeout = float(self._extra.get("agent_timeout_s", 10.0))
        self._fetch_policy = str(self._extra.get("fetch_policy", "auto")).strip().lower()
        if self._fetch_policy not in ("auto", "always"):
            raise ValueError(f"fetch_policy must be auto or always, got {self._fetch_policy!r}")
        self._poll_s = float(self._extra.get("lookup_poll_s", 0.02))
        self._wait_mode = str(self._extra.get("wait_for_prefill", "auto")).lower()
        self._load_batch = max(1, int(self._extra.get("load_batch_chunks", 16)))
        self._max_staging = max(1, int(self._extra.get("max_staging_mb", 256))) << 20
        if kv_cache_config is None:
            raise ValueError("TieredCacheConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            tp_rank = _tp_rank()
        self._id = build_identity(vllm_config, kv_cache_config, self._extra, tp_rank)
        self._fp = self._id.fingerprint
        self._chunk_size = self._fp.chunk_size
        self._block_size = self._id.block_size
        self._tp_world = self._fp.tp_world_size
        self._tp_rank = tp_rank
        self._logged: set[str] = set()
        self._store: ChunkStore | None = None
        self._store_lock = threading.Lock()
        self._stats = StatsRecorder()
        # An agent that is down costs a request nothing: calls are skipped (a miss, a
        # skipped save) until a backed-off retry; one log line per outage.
        self._guard = Breaker(f"tiered cache agent ({role.name.lower()})", logger)
        self._probe: threading.Thread | None = None
        self._probe_lock = threading.Lock()

        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._matches: dict[str, _Match] = {}
        self._waits: dict[str, _Wait] = {}
        self._rate = RecomputeRate()  # this engine's prompt-token cost, from its steps
        self._chunk_bytes = _chunk_bytes(kv_cache_config, self._extra)
        self._first_seen: dict[str, float] = {}
        self._hit_sources: dict[str, dict[str, int]] = {}
        self._pending_loads: list[LoadJob] = []
        self._planned: dict[str, set[int]] = {}  # req -> blocks its load writes
        self._no_reload: set[str] = set()  # reqs whose load failed
        self._looked_up: set[str] = set()  # reqs counted in the lookups metric

        # worker side
        self._kv: PagedKV | None = None
        self._save_staging: HostStaging | None = None
        self._loader: ThreadPoolExecutor | None = None
        # Saves: layer copies into reserved DRAM slots overlap the forward pass; checksum +
        # commit run after it on another thread.
        self._layerwise = _as_bool(self._extra.get("layerwise_save", True))
        self._step_save: _StepSave | None = None
        self._copy_pool: ThreadPoolExecutor | None = None
        self._finish_pool: ThreadPoolExecutor | None = None
        self._pending_commits: list[Future[None]] = []
        self._save_stream: Any = None
        self._inflight: dict[str, Future[set[int]]] = {}
        self._load_errors: set[int] = set()
        self._step_t0: float | None = None  # forward timing for the scheduler's rate
        self._step_tokens = 0
        self._sync_load_s = 0.0
        self._steps: list[tuple[int, float]] = []

        logger.info(
            "TieredCacheConnector %s role=%s chunk_size=%d block_size=%d layout=%s dtype=%s "
            "async_load=%s wait=%s/%.1fs fingerprint=%s",
            role.name,
            self._role_name,
            self._chunk_size,
            self._block_size,
            self._fp.kv_layout,
            self._id.dtype,
            self._async_mode,
            self._wait_mode,
            self._wait_timeout,
            self._fp.hex,
        )
        if role == KVConnectorRole.SCHEDULER:
            policy = getattr(ktc, "kv_load_failure_policy", "recompute")
            if self._load_enabled and policy != "recompute":
                logger.warning(
                    "TieredCacheConnector: kv_load_failure_policy=%r, so a chunk that is "
                    "evicted or fails verification between lookup and load fails its request "
                    "(HTTP 500). Set \"kv_load_failure_policy\": \"recompute\" in "
                    "--kv-transfer-config to have vLLM recompute it instead.",
                    policy,
                )
            # A config that cannot work fails at startup; an agent that is not up yet
            # leaves the connector serving without the cache until it is.
            self._guarded("connect", lambda st: None, None)

    # ------------------------------------------------------------------ shared helpers

    def _open_store(self) -> ChunkStore:
        with self._store_lock:
            if self._store is None:
                from tiered_cache.client import open_store

                self._store = open_store({"agent_timeout_s": self._agent_timeout, **self._extra})
                self._register_fingerprint(self._store)
            return self._store

    def _cache_up(self) -> bool:
        """Whether to use the cache for this call. While the agent is down: no; once per
        backoff a probe runs on a helper thread, so no request waits for it."""
        g = self._guard
        if not g.down:
            return g.allow()
        if g.allow():
            with self._probe_lock:
                if self._probe is None or not self._probe.is_alive():
                    self._probe = threading.Thread(
                        target=self._probe_agent, name="tc-probe", daemon=True
                    )
                    self._probe.start()
        return False

    def _probe_agent(self) -> None:
        try:
            st = self._open_store()
            ping = getattr(st, "ping", None)
            if callable(ping):
                ping()
        except OSError as e:
            self._guard.failed(e)
            return
        except Exception as e:  # it answered: up, if unhappy
            logger.debug("tiered cache probe: %r", e)
        self._guard.ok()

    def _guarded(self, op: str, fn: Callable[[ChunkStore], T], default: T) -> T:
        """``fn(store)``, or ``default`` at once while the agent is down. An unreachable
        or unresponsive agent opens the breaker (one log line per outage); an error the
        agent answered with is counted and logged once by kind."""
        if not self._cache_up():
            return default
        try:
            out = fn(self._open_store())
        except OSError as e:  # unreachable, reset, timed out (ConnectionLost is one)
            self._stats.inc("store_errors", op)
            self._guard.failed(e)
            return default
        except Exception as e:
            self._stats.inc("store_errors", op)
            self._log_once(f"{op}:{type(e).__name__}", "tiered cache %s failed: %r", op, e)
            return default
        self._guard.ok()
        return out

    def _register_fingerprint(self, store: ChunkStore) -> None:
        """Tell the node agent (and through it the directory) which fingerprint this
        process writes under: `pin add --model` cannot guess the KV layout or block size."""
        register = getattr(store, "register_model", None)
        if not callable(register):
            return
        mc = self._vllm_config.model_config
        served = getattr(mc, "served_model_name", None)
        names = [served] if isinstance(served, str) else list(served or [])
        aliases = sorted({str(mc.model), *map(str, names)} - {self._fp.model_id})
        try:
            register(
                {
                    **dataclasses.asdict(self._fp),
                    "aliases": aliases,
                    "tokenizer": getattr(mc, "tokenizer", None),
                }
            )
        except Exception as e:  # pins by --model need it; serving does not
            self._log_once("register", "tiered cache: fingerprint not registered: %r", e)

    def _log_once(self, tag: str, msg: str, *args: Any) -> None:
        if tag not in self._logged:
            self._logged.add(tag)
            logger.warning(msg, *args)

    def _req_keys(
        self, prompt: Sequence[int], salt: str | None, fp: tc_keys.ModelFingerprint | None = None
    ) -> list[str]:
        return tc_keys.chunk_keys(prompt, fp or self._fp, salt, include_partial=True)

    @staticmethod
    def _salt(request: Request) -> str | None:
        salt = getattr(request, "cache_salt", None)
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            name = getattr(lora, "lora_name", None) or getattr(lora, "name", "")
            salt = f"{salt or ''}|lora={name}"
        return salt

    @staticmethod
    def _cacheable(request: Request) -> bool:
        if request.prompt_token_ids is None:
            return False  # prompt embeddings: tokens do not identify the KV
        return not getattr(request, "mm_features", None)

    # ================================================================ scheduler side

    def on_new_request(self, request: Request) -> None:
        if self._load_enabled:
            self._first_seen.setdefault(request.request_id, time.monotonic())

    def _coming(self, request: Request, keys: Sequence[str]) -> int:
        """How many leading chunks of ``keys`` are on their way: the ones the prefill said
        it saved (its ``kv_transfer_params``, passed on by the router). None are when the
        router skipped the prefill, and none without a hint unless ``wait_for_prefill``
        is ``true``."""
        if self._wait_timeout <= 0 or self._wait_mode in ("false", "0", "no", "never"):
            return 0
        params = getattr(request, "kv_transfer_params", None) or {}
        hint = params.get("tiered_cache") if isinstance(params, Mapping) else None
        if isinstance(hint, Mapping) and isinstance(hint.get("keys"), list):
            saved = set(hint["keys"])
            n = 0
            while n < len(keys) and keys[n] in saved:
                n += 1
            return n
        return len(keys) if self._wait_mode in ("true", "1", "yes", "always") else 0

    def _lookup(self, keys: Sequence[str]) -> list[str]:
        if not keys:
            return []
        return self._guarded("lookup", lambda st: list(st.lookup(keys)), [])

    def _lookup_priced(self, keys: Sequence[str]) -> tuple[list[str], list[float]]:
        def priced(st: ChunkStore) -> tuple[list[str], list[float]]:
            fn = getattr(st, "lookup_priced", None)  # an AgentClient; any store: unpriced
            if fn is None:
                found = list(st.lookup(keys))
                return found, [0.0] * len(found)
            found, costs = fn(keys, self._chunk_bytes)
            return list(found), list(costs)

        none: tuple[list[str], list[float]] = ([], [])
        return self._guarded("lookup", priced, none)

    def _in_dram(self, keys: Sequence[str]) -> list[bool]:
        """DRAM presence through the shared index (no round trip); the agent otherwise."""
        st = self._store
        direct = st.in_dram(keys) if st is not None and hasattr(st, "in_dram") else None
        if direct is not None:
            return list(direct)
        found = self._lookup(keys)
        return [i < len(found) and found[i] == "dram" for i in range(len(keys))]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Leading chunks to load, decided once the ones on their way have landed (or
        their wait ran out) and remote ones have been copied into this node's DRAM.
        ``None`` asks vLLM to ask again: the request waits in the queue holding no KV
        blocks. No side effects on vLLM; the connector keeps its own per-request state."""
        if not self._load_enabled or not self._cacheable(request):
            return 0, False
        rid = request.request_id
        prompt = request.prompt_token_ids or []
        n = len(prompt)
        spans = loadable_spans(n, self._chunk_size, self._block_size)
        if not spans or rid in self._no_reload:
            return 0, False
        first = next((s.index for s in spans if s.end > num_computed_tokens), len(spans))
        now = time.monotonic()
        w = self._waits.get(rid)
        if w is None:
            keys = self._req_keys(prompt, self._salt(request))[: len(spans)]
            coming = 0 if rid in self._planned else self._coming(request, keys)
            w = self._waits[rid] = _Wait(self._first_seen.setdefault(rid, now), keys, coming)
        if self._guard.down:
            self._cache_up()  # maybe probe, off this request's path
            self._count_once(rid, "unavailable")
            return 0, False  # the cache is down: recompute, never wait for it
        if w.looked_at < 0 or now - w.looked_at >= self._poll_s:
            w.sources, w.costs = self._lookup_priced(w.keys)
            w.looked_at = now
            for i, src in enumerate(w.sources):  # a staged chunk counts where it came from
                if src not in _LOCAL_SOURCES:
                    w.origin.setdefault(i, src)
            if self._guard.down:  # it just went down
                self._count_once(rid, "unavailable")
                return 0, False
        sources, costs = w.sources, w.costs
        hit = len(sources)

        # 1. Chunks the prefill saved that are not visible yet: wait, at most what
        #    recomputing them costs.
        if hit < w.coming and not w.gave_up:
            waited = sum(s.num_tokens for s in spans[hit : w.coming])
            if now - w.t0 < wait_budget_s(self._wait_timeout, self._rate.cost_s(waited)):
                return None, False
            w.gave_up = True
            self._count_once(rid, "deadline")
            logger.info(
                "req %s: %d of the %d chunks its prefill saved did not arrive within %.0f ms; "
                "recomputing from chunk %d", rid, w.coming - hit, w.coming,
                (now - w.t0) * 1e3, hit,
            )  # fmt: skip

        # 1b. The chunk after the found ones may exist as a shorter, block-aligned chunk
        #     an earlier prompt saved (the previous turn of this conversation).
        if not w.probed and hit < len(spans) and (hit >= w.coming or w.gave_up):
            w.probed = True
            w.partial = self._probe_partial(prompt, self._salt(request), w, spans[hit])
        keys = list(w.keys)
        if w.partial is not None and hit == w.partial[0]:
            idx, ptok, pkey, psrc, pcost = w.partial
            spans = [*spans[:hit], ChunkSpan(idx, spans[idx].start, spans[idx].start + ptok,
                                             self._block_size)]  # fmt: skip
            keys[idx] = pkey
            sources, costs = [*sources, psrc], [*costs, pcost]
            hit += 1

        # 2. Fetch or recompute: the prefix whose load saves the most time.
        toks = [0 if i < first else s.end - max(s.start, num_computed_tokens)
                for i, s in enumerate(spans[:hit])]  # fmt: skip
        spt = self._rate.seconds_per_token() if self._fetch_policy == "auto" else None
        choice = choose_prefix(toks, costs, first, spt)
        k = choice.chunks
        if not w.decided and hit > first:  # counted once, when there was a choice
            w.decided = choice.decision
            self._stats.inc("fetch_decisions", choice.decision)

        # 3. Chunks of that prefix on a peer or in S3: copied into this node's DRAM by the
        #    agent while the request waits in the queue, so no network I/O happens inside
        #    the forward pass. A chunk that lands on this node's NVMe instead (evicted by
        #    a busy DRAM) counts as arrived: local reads cost milliseconds.
        remote = [i for i in range(first, k) if sources[i] not in _LOCAL_SOURCES]
        if remote and self._prefetch_remote():
            ask = [keys[i] for i in remote if i not in w.requested]
            if ask:
                if w.fetch_t0 is None:
                    w.fetch_t0 = now
                    w.fetch_budget = wait_budget_s(
                        self._wait_timeout,
                        self._rate.cost_s(sum(toks[i] for i in remote)),
                        sum(costs[i] for i in remote),
                    )
                w.requested.update(remote)
                self._guarded("prefetch", lambda st: st.prefetch(ask, self._fp.digest), 0)  # type: ignore[attr-defined]
            here = self._in_dram([keys[i] for i in remote])
            for i, arrived in zip(remote, here, strict=True):
                if arrived:
                    sources[i] = "dram"
            late = [i for i in remote if sources[i] not in _LOCAL_SOURCES]
            if late:
                assert w.fetch_t0 is not None
                if now - w.fetch_t0 < w.fetch_budget:
                    return None, False
                k = late[0]  # load what arrived, recompute the rest
                self._count_once(rid, "fetch_deadline")
                logger.info(
                    "req %s: %d chunks (from %s) did not arrive in DRAM within %.0f ms; "
                    "recomputing from chunk %d", rid, len(late),
                    ",".join(sources[i] for i in late), w.fetch_budget * 1e3, k,
                )  # fmt: skip
        hit_end = min(spans[k - 1].end, n - 1) if k else 0
        ext = hit_end - num_computed_tokens
        if rid not in self._looked_up:  # once per request, not per poll or preemption
            self._looked_up.add(rid)
            self._stats.inc("lookups", "hit" if ext > 0 else "miss")
        if ext <= 0:
            return 0, False
        loaded = sources[first:k]
        is_async = self._async_mode == "true" or (
            self._async_mode == "auto" and any(src not in _LOCAL_SOURCES for src in loaded)
        )
        origins = [w.origin.get(i, sources[i]) for i in range(k)]
        partial = None
        if w.partial is not None and k == w.partial[0] + 1:
            partial = (w.partial[0], w.partial[1], w.partial[2])
        self._matches[rid] = _Match(
            num_computed_tokens, sources[:k], origins, hit_end, is_async, partial
        )
        return ext, is_async

    def _probe_partial(
        self, prompt: Sequence[int], salt: str | None, w: _Wait, span: ChunkSpan
    ) -> tuple[int, int, str, str, float] | None:
        """The longest block-aligned partial chunk at ``span`` that an earlier prompt
        saved and this prompt shares (one round trip for every candidate length)."""
        bs = self._block_size
        lengths = list(range(((span.num_tokens - 1) // bs) * bs, 0, -bs))
        if not lengths:
            return None
        parent = w.keys[span.index - 1] if span.index else None
        cands = tc_keys.partial_keys(prompt, self._fp, salt, parent, span.start, lengths)
        nbytes = self._chunk_bytes * lengths[0] // self._chunk_size

        def probe(st: ChunkStore) -> list[tuple[str, float] | None]:
            fn = getattr(st, "present", None)
            return list(fn(cands, nbytes)) if fn is not None else []

        none: list[tuple[str, float] | None] = []
        for n_tok, key, found in zip(lengths, cands, self._guarded("lookup", probe, none),
                                     strict=False):  # fmt: skip
            if found is not None:
                return span.index, n_tok, key, found[0], found[1]
        return None

    def _prefetch_remote(self) -> bool:
        """Remote chunks go through this node's DRAM (see ``async_load``)."""
        st = self._store
        return self._async_mode == "auto" and "dram" in (getattr(st, "tiers", None) or ())

    def _count_once(self, rid: str, reason: str) -> None:
        tag = f"fallback:{reason}:{rid}"
        if tag not in self._logged:
            self._logged.add(tag)
            self._stats.inc("recompute_fallbacks", reason)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if not self._cacheable(request):
            return
        st = self._reqs.get(rid)
        if st is None and (num_external_tokens > 0 or self._save_enabled):
            prompt = list(request.prompt_token_ids or [])
            salt = self._salt(request)
            st = _ReqState(
                rid,
                prompt,
                salt,
                self._req_keys(prompt, salt),
                _chunk_spans(len(prompt), self._chunk_size, self._block_size),
            )
            tail = st.spans[-1] if st.spans else None
            bs = self._block_size
            if tail is not None and tail.num_tokens < self._chunk_size and tail.num_tokens > bs:
                aligned = tail.num_tokens - tail.num_tokens % bs
                if aligned != tail.num_tokens:
                    parent = st.keys[tail.index - 1] if tail.index else None
                    st.tail_key = tc_keys.partial_keys(
                        prompt, self._fp, salt, parent, tail.start, [aligned]
                    )[0]
            self._reqs[rid] = st
            if self._save_enabled:
                # Chunks already in the cache need no second copy.
                st.next_save = len(self._lookup(st.keys))
        if st is None:
            return
        self._waits.pop(rid, None)  # scheduled: a preemption starts over (no waiting)
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        if block_ids:
            st.block_ids = block_ids
        if num_external_tokens <= 0:
            return
        m = self._matches.get(rid)
        if m is None:
            raise RuntimeError(f"req {rid}: external tokens allocated without a match")
        start = m.num_computed
        end = start + num_external_tokens
        n_hit = len(m.sources)
        spans, keys = st.spans[:n_hit], st.keys[:n_hit]
        if m.partial is not None:  # the last one is an earlier prompt's partial chunk
            idx, ptok, pkey = m.partial
            spans[idx] = ChunkSpan(idx, spans[idx].start, spans[idx].start + ptok,
                                   self._block_size)  # fmt: skip
            keys[idx] = pkey
        ranges = load_block_ranges(spans, start, end)
        chunks: list[LoadChunk] = []
        by_source: dict[str, int] = {}
        for r in ranges:
            s = r.span
            src, origin = m.sources[s.index], m.origins[s.index]
            ntok = max(0, min(s.end, end) - max(s.start, start))
            chunks.append(
                LoadChunk(
                    index=s.index,
                    key=keys[s.index],
                    num_tokens=s.num_tokens,
                    n_blocks=s.num_blocks,
                    lo=r.lo - s.first_block,
                    block_ids=st.block_ids[r.lo : r.hi],
                    source=src,
                    tokens=ntok,
                    origin=origin if origin != src else "",
                )
            )
            by_source[origin] = by_source.get(origin, 0) + ntok
        if ranges and len(st.block_ids) < ranges[-1].hi:
            # Cannot happen (vLLM allocates blocks for every token it schedules); a load
            # into missing blocks could not report its failure, so refuse loudly.
            raise RuntimeError(
                f"req {rid}: block table has {len(st.block_ids)} blocks, load needs "
                f"{ranges[-1].hi}"
            )
        self._hit_sources[rid] = by_source
        self._planned[rid] = {b for c in chunks for b in c.block_ids}
        # Loaded chunks need no saving; a partial one does (its full chunk is new).
        full = [c.index + 1 for c in chunks if m.partial is None or c.index != m.partial[0]]
        st.next_save = max(st.next_save, max(full, default=0))
        # Sync or async as get_num_new_matched_tokens told vLLM: a job vLLM waits for in
        # WAITING_FOR_REMOTE_KVS must be reported by get_finished, so it must run async.
        is_async = m.is_async
        job = LoadJob(
            rid,
            chunks,
            is_async,
            num_external_tokens,
            token_ids=st.prompt if self._tp_world > 1 else None,
            cache_salt=st.salt if self._tp_world > 1 else None,
        )
        self._pending_loads.append(job)
        logger.info(
            "req %s: loading %d of %d prompt tokens from the tiered cache (%s) in %d chunks, "
            "found in %s",
            rid,
            num_external_tokens,
            len(st.prompt),
            "async" if is_async else "sync",
            len(chunks),
            ",".join(f"{c.origin}->{c.source}" if c.origin else c.source for c in chunks),
        )

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        if num_external_tokens == 0 or CacheHitSource is None:
            return {}
        by_source = self._hit_sources.get(request.request_id) or {}
        out: dict[Any, int] = {}
        for src, n in by_source.items():
            hs = getattr(CacheHitSource, _SOURCE_TO_HIT.get(src, "EXTERNAL_UNSPECIFIED"))
            out[hs] = out.get(hs, 0) + n
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {k: v for k, v in out.items() if v}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, TieredCacheWorkerMeta):
            for tokens, seconds in wm.steps:
                self._rate.observe(tokens, seconds)
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad or not self._planned:
            return
        for rid, blocks in self._planned.items():
            if blocks & bad:
                self._no_reload.add(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TieredCacheConnectorMetadata(
            loads=self._pending_loads, step_tokens=scheduler_output.total_num_scheduled_tokens
        )
        self._pending_loads = []
        if not self._save_enabled or not self._reqs:
            return meta
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            if new.block_ids:
                st.block_ids = list(new.block_ids[0])
            done = new.num_computed_tokens + sched.get(new.req_id, 0)
            self._plan_saves(st, done, meta)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if nb:
                if rid in resumed:
                    st.block_ids = list(nb[0])
                else:
                    st.block_ids.extend(nb[0])
            done = cached.num_computed_tokens[i] + sched.get(rid, 0)
            self._plan_saves(st, done, meta)
        return meta

    def _plan_saves(self, st: _ReqState, computed: int, meta: TieredCacheConnectorMetadata) -> None:
        n = len(st.prompt)
        added = False
        while st.next_save < len(st.spans):
            s = st.spans[st.next_save]
            if s.end > min(computed, n) or s.end_block > len(st.block_ids):
                break
            if s.num_tokens < self._chunk_size and not self._save_unfull:
                break  # the partial tail chunk stays out of the cache
            parent = st.keys[s.index - 1] if s.index else None
            meta.saves.append(
                SaveChunk(
                    st.req_id,
                    s.index,
                    st.keys[s.index],
                    s.num_tokens,
                    st.block_ids[s.first_block : s.end_block],
                    parent,
                )
            )
            if st.tail_key is not None and s.index == len(st.spans) - 1:
                n_al = s.num_tokens - s.num_tokens % self._block_size
                meta.saves.append(SaveChunk(
                    st.req_id, s.index, st.tail_key, n_al,
                    st.block_ids[s.first_block : s.first_block + n_al // self._block_size],
                    parent, aligned=True,
                ))  # fmt: skip
            st.next_save += 1
            added = True
        if added and self._tp_world > 1:
            meta.save_tokens[st.req_id] = (st.prompt, st.salt)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self._matches.pop(rid, None)
        self._waits.pop(rid, None)
        self._first_seen.pop(rid, None)
        self._hit_sources.pop(rid, None)
        self._planned.pop(rid, None)
        self._no_reload.discard(rid)
        self._looked_up.discard(rid)
        for reason in ("unavailable", "deadline", "fetch_deadline"):
            self._logged.discard(f"fallback:{reason}:{rid}")
        params: dict[str, Any] | None = None
        if self._save_enabled and st is not None:
            # Tells a proxy, and through it the decode node, exactly which chunks this
            # prefill put in the cache: the decode waits for those and no others. None
            # while the agent is down (the saves were skipped).
            saved = 0 if self._guard.down else st.next_save
            params = {
                "tiered_cache": {
                    "chunks": saved,
                    "prompt_tokens": len(st.prompt),
                    "chunk_size": self._chunk_size,
                    "keys": st.keys[:saved],
                },
                # For a cache-aware router: the fingerprint the chunk keys chain from, and
                # the node whose cache holds them.
                "tc_fingerprint": dataclasses.asdict(self._fp),
                "tc_node_id": getattr(self._store, "node_id", None),
            }
        return False, params

    # =================================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group = _single_group_spec(self._kv_cache_config)
        names = [n for n in group.layer_names if n in kv_caches] or list(kv_caches)
        missing = [n for n in kv_caches if n not in names]
        if missing:
            logger.warning("TieredCacheConnector: layers outside the KV group ignored: %s", missing)
        layers = [kv_caches[n] for n in names]
        kv = PagedKV(layers, names)
        if dtype_name(kv.dtype) != self._id.dtype:
            raise ValueError(
                f"KV tensors are {dtype_name(kv.dtype)} but the fingerprint says {self._id.dtype}"
            )
        if len(kv.block_shape) >= 2 and kv.block_shape[-2] != self._block_size:
            self._log_once(
                "blockdim",
                "KV block shape %s: token dim %d != block size %d; copying whole blocks anyway",
                kv.block_shape,
                kv.block_shape[-2],
                self._block_size,
            )
        self._kv = kv
        self._save_staging = HostStaging(pin=not kv.on_host)
        if kv.device.type == "cuda":
            self._save_stream = torch.cuda.Stream(kv.device)
        self._open_store()
        logger.info(
            "TieredCacheConnector: %d layers, %d blocks of %s %s (%d B/block/layer) on %s",
            kv.num_layers,
            kv.num_blocks,
            kv.block_shape,
            dtype_name(kv.dtype),
            kv.block_bytes,
            kv.device,
        )

    def _worker_keys(self, indices: Sequence[int], tokens: Sequence[int] | None,
                     salt: str | None, given: Sequence[str]) -> list[str]:
        if self._tp_rank == 0 or tokens is None:
            return list(given)
        ks = self._req_keys(tokens, salt)
        return [ks[i] for i in indices]

    # -- loading

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # The forward pass runs from here to wait_for_save: timed for the scheduler's
        # recompute-cost estimate (sync loads inside it are subtracted).
        tokens = getattr(connector_metadata, "step_tokens", 0)
        self._step_t0 = time.perf_counter() if tokens else None
        self._step_tokens = int(tokens)
        self._sync_load_s = 0.0

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._steps:
            return None
        steps, self._steps = self._steps, []
        return TieredCacheWorkerMeta(steps)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, TieredCacheConnectorMetadata) or not meta.loads:
            return
        t0 = time.perf_counter()
        for job in meta.loads:
            if job.is_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="tc-load")
                self._inflight[job.req_id] = self._loader.submit(self._run_load, job)
            else:
                self._load_errors |= self._run_load(job)
        self._sync_load_s += time.perf_counter() - t0

    def _run_load(self, job: LoadJob) -> set[int]:
        """Load one request's chunks. Returns the block ids that were not loaded (all of
        them at once while the agent is down: vLLM recomputes them)."""
        every = {b for c in job.chunks for b in c.block_ids}
        if not self._cache_up():
            self._stats.inc("recompute_fallbacks", "unavailable")
            return every
        try:
            failed = self._load_job(job)
        except OSError as e:  # the agent went away mid-load
            self._guard.failed(e)
            self._stats.inc("store_errors", "load")
            self._stats.inc("recompute_fallbacks", "unavailable")
            return every
        except Exception as e:
            self._log_once(f"load:{type(e).__name__}", "req %s: tiered cache load failed: %r",
                           job.req_id, e)  # fmt: skip
            logger.debug("load failure", exc_info=True)
            self._stats.inc("store_errors", "load")
            self._stats.inc("recompute_fallbacks", "load_error")
            return every
        self._guard.ok()
        return failed

    def _check_meta(self, meta: ChunkMeta, c: LoadChunk, kv: PagedKV) -> str | None:
        want_shape = kv.payload_shape(c.n_blocks)
        if meta.kv_layout != self._id.kv_layout:
            return f"KV layout {meta.kv_layout!r} != this node's {self._id.kv_layout!r}"
        if meta.block_size != self._block_size:
            return f"block size {meta.block_size} != this node's {self._block_size}"
        if meta.dtype != dtype_name(kv.dtype):
            return f"dtype {meta.dtype} != this node's {dtype_name(kv.dtype)}"
        if tuple(meta.shape) != want_shape:
            return f"payload shape {tuple(meta.shape)} != expected {want_shape}"
        if meta.num_tokens != c.num_tokens:
            return f"chunk holds {meta.num_tokens} tokens, expected {c.num_tokens}"
        return None

    def _load_job(self, job: LoadJob) -> set[int]:
        kv = self._kv
        store = self._open_store()
        if kv is None:
            raise RuntimeError("KV caches were not registered")
        t0 = time.perf_counter()
        keys = self._worker_keys(
            [c.index for c in job.chunks], job.token_ids, job.cache_salt,
            [c.key for c in job.chunks],
        )
        digest = self._fp.digest
        stream = kv.side_stream()
        pinned = HostStaging(pin=True) if not kv.on_host else None
        reasons: dict[int, str] = {}
        kinds: dict[int, str] = {}  # recompute_fallbacks reason of a refused chunk
        nbytes: dict[int, int] = {}
        chunks: list[LoadChunk] = []  # the batch being fetched

        def sink(i: int, meta: ChunkMeta, payload: memoryview) -> None:
            c = chunks[i]
            nbytes[i] = payload.nbytes
            if reasons and min(reasons) < i:
                reasons[i] = "an earlier chunk failed"
                return
            try:
                bad = self._check_meta(meta, c, kv)
                if bad is not None:
                    reasons[i], kinds[i] = bad, "layout_mismatch"
                    return
                src = payload_tensor(payload, kv.dtype, kv.payload_shape(c.n_blocks))
                src = src[:, c.lo : c.lo + len(c.block_ids)]
                if pinned is not None:
                    flat = pinned.reserve(src.numel() * src.element_size())
                    host = flat[: src.numel() * src.element_size()].view(kv.dtype).view(src.shape)
                    host.copy_(src)
                    src = host
                if stream is not None:
                    with torch.cuda.stream(stream):
                        kv.scatter(c.block_ids, src)
                    stream.synchronize()  # the source buffer is released after we return
                else:
                    kv.scatter(c.block_ids, src)
            except Exception as e:  # never let a bad chunk take the engine down
                reasons[i], kinds[i] = f"copy failed: {e!r}", "copy_error"

        served: list[str] = []  # the tier that served each loaded chunk
        failed_at: int | None = None
        for b0 in range(0, len(job.chunks), self._load_batch):
            chunks[:] = job.chunks[b0 : b0 + self._load_batch]
            ok, sources, refused = _fetch(store, keys[b0 : b0 + self._load_batch], digest, sink)
            for i, c in enumerate(chunks):
                if ok[i] and i not in reasons:
                    tier = c.origin or sources[i] or c.source or "unknown"
                    served.append(tier)
                    self._stats.inc("loaded_chunks", tier)
                    self._stats.inc("loaded_bytes", tier, nbytes.get(i, 0))
                    if self._tp_rank == 0:  # every rank loads the same tokens
                        self._stats.inc("hit_tokens", tier, c.tokens)
                    continue
                kind = kinds.get(i) or _REFUSED.get(refused.get(i, ""), "missing")
                why = reasons.get(i) or _WHY[kind]
                self._stats.inc("recompute_fallbacks", kind)
                if kind == "layout_mismatch":
                    self._stats.inc("layout_mismatches")
                self._log_once(
                    f"loadfail:{why[:40]}",
                    "tiered cache: chunk %s (req %s, #%d) not loaded: %s; vLLM recomputes it",
                    c.key, job.req_id, c.index, why,
                )
                failed_at = b0 + i
                break
            reasons.clear()
            kinds.clear()
            nbytes.clear()
            if failed_at is not None:
                break
        failed: set[int] = set()
        if failed_at is not None:
            for c in job.chunks[failed_at:]:
                failed.update(c.block_ids)
        n_ok = len(job.chunks) if failed_at is None else failed_at
        dt = time.perf_counter() - t0
        if served:
            self._stats.observe("load_seconds", farthest(set(served)), dt)
        logger.info(
            "req %s: loaded %d/%d chunks (%d tokens planned) from %s in %.1f ms%s",
            job.req_id,
            n_ok,
            len(job.chunks),
            job.num_tokens,
            _tier_counts(served),
            dt * 1000,
            f"; {len(failed)} blocks to recompute" if failed else "",
        )
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        if not self._inflight:
            return None, None
        done: set[str] = set()
        for rid, fut in list(self._inflight.items()):
            if fut.done():
                del self._inflight[rid]
                self._load_errors |= fut.result()
                done.add(rid)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    # -- saving

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Copy this layer's blocks of the step's finished chunks straight into reserved
        DRAM slots on a helper thread, while the next layers compute."""
        kv = self._kv
        if not self._layerwise or kv is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, TieredCacheConnectorMetadata) or not meta.saves:
            return
        st = self._step_save
        if st is None:
            if not self._cache_up():
                self._step_save = _StepSave([], None, [], [], skipped=True)
                return
            try:
                st = self._step_save = self._begin_save(meta)
            except OSError as e:  # the agent is unreachable: no saves this step
                self._guard.failed(e)
                self._step_save = _StepSave([], None, [], [], skipped=True)
                return
            except Exception as e:  # wait_for_save retries the whole save
                self._log_once(f"begin:{type(e).__name__}", "layer-wise save off: %r", e)
                self._step_save = _StepSave([], None, [], [])
                return
        li = kv.layer_index(layer_name)
        if st.res is None or li is None or li in st.layers:
            return
        st.layers.add(li)
        ev: Any = None
        if not kv.on_host:  # the copy must follow this layer's kernels on the compute stream
            ev = torch.cuda.Event()
            ev.record()
        st.copies.append(self._copier().submit(self._copy_layer, st, li, ev))

    def _copier(self) -> ThreadPoolExecutor:
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(1, thread_name_prefix="tc-save-copy")
        return self._copy_pool

    def _finisher(self) -> ThreadPoolExecutor:
        if self._finish_pool is None:
            self._finish_pool = ThreadPoolExecutor(1, thread_name_prefix="tc-save-commit")
        return self._finish_pool

    def _copy_layer(self, st: _StepSave, li: int, ev: Any) -> None:
        # The destinations were made inside vLLM's inference mode; writing them from
        # another thread needs that mode there too.
        with torch.inference_mode():
            self._copy_layer_inner(st, li, ev)

    def _copy_layer_inner(self, st: _StepSave, li: int, ev: Any) -> None:
        kv = self._kv
        assert kv is not None
        stream = self._save_stream
        if stream is not None:
            with torch.cuda.stream(stream):
                stream.wait_event(ev)
                for idx, dst in zip(st.idx, st.dests, strict=True):
                    kv.gather_layer(li, idx, dst[li])
        else:
            for idx, dst in zip(st.idx, st.dests, strict=True):
                kv.gather_layer(li, idx, dst[li])

    def wait_for_save(self) -> None:
        if self._step_t0 is not None:  # the forward pass just ended
            dt = time.perf_counter() - self._step_t0 - self._sync_load_s
            if dt > 0 and self._tp_rank == 0:
                self._steps.append((self._step_tokens, dt))
                del self._steps[:-64]  # a scheduler that never collects must not grow us
            self._step_t0 = None
        st, self._step_save = self._step_save, None
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, TieredCacheConnectorMetadata) or not meta.saves:
            return
        if (st is not None and st.skipped) or (st is None and not self._cache_up()):
            self._stats.inc("saves_skipped", "", len(meta.saves))
            return
        try:
            if st is None or st.res is None:
                st = self._begin_save(meta)
            if st.res is not None:
                try:
                    self._finish_copies(st)
                    return
                except Exception as e:  # the staged path below still saves the chunks
                    with contextlib.suppress(Exception):
                        self._open_store().abort_reservation(st.res)  # type: ignore[attr-defined]
                    self._stats.inc("store_errors", "save")
                    self._log_once(
                        f"zerocopy:{type(e).__name__}",
                        "tiered cache zero-copy save failed (%r); using staged saves", e,
                    )
                    logger.debug("zero-copy save failure", exc_info=True)
                    st.res = None
            self._save_staged(st)
        except OSError as e:  # the agent went away: later steps skip saving until it is back
            self._guard.failed(e)
            self._stats.inc("store_errors", "save")
            self._stats.inc("saves_skipped", "", len(meta.saves))
        except Exception as e:  # a failed save is a future miss, not an engine crash
            self._stats.inc("store_errors", "save")
            self._log_once(f"save:{type(e).__name__}", "tiered cache save failed: %r", e)
            logger.debug("save failure", exc_info=True)
        else:
            self._guard.ok()

    def _begin_save(self, meta: TieredCacheConnectorMetadata) -> _StepSave:
        """The step's chunks to save (deduplicated), with DRAM slots reserved for them when
        the store takes zero-copy puts and they all fit."""
        kv = self._kv
        if kv is None:
            raise RuntimeError("KV caches were not registered")
        store = self._open_store()
        seen: set[str] = set()
        todo: list[tuple[SaveChunk, str, str | None]] = []
        for s in meta.saves:
            key, parent = s.key, s.parent
            if self._tp_rank != 0 and s.req_id in meta.save_tokens:
                toks, salt = meta.save_tokens[s.req_id]
                ks = self._req_keys(toks, salt)
                key, parent = ks[s.index], (ks[s.index - 1] if s.index else None)
                if s.aligned:
                    key = tc_keys.partial_keys(toks, self._fp, salt, parent,
                                               s.index * self._chunk_size, [s.num_tokens])[0]
            if key not in seen:
                seen.add(key)
                todo.append((s, key, parent))
        st = _StepSave(todo, None, [], [], t0=time.perf_counter())
        reserve = getattr(store, "reserve_payloads", None)
        if reserve is None or not todo:
            return st
        sizes = [kv.payload_nbytes(len(s.block_ids)) for s, _, _ in todo]
        res = reserve(sizes)
        if res is None:
            return st  # no room for all of them in DRAM: the staged path copes
        st.res = res
        st.dests = [
            payload_tensor(v, kv.dtype, kv.payload_shape(len(s.block_ids)))
            for v, (s, _, _) in zip(res.views, todo, strict=True)
        ]
        st.idx = [kv.index(s.block_ids) for s, _, _ in todo]
        return st

    def _finish_copies(self, st: _StepSave) -> None:
        """Join the layer copies (copying any layer the model never reported), then hand
        checksum + commit to a helper thread: vLLM may reuse the blocks once this returns."""
        kv = self._kv
        assert kv is not None and st.res is not None
        for f in st.copies:
            f.result()
        with torch.inference_mode():
            for li in range(kv.num_layers):
                if li not in st.layers:
                    for idx, dst in zip(st.idx, st.dests, strict=True):
                        kv.gather_layer(li, idx, dst[li])
        if self._save_stream is not None:
            self._save_stream.synchronize()
        kv.synchronize()
        store = self._open_store()
        metas = [self._chunk_meta(s, key) for s, key, _ in st.todo]
        parents = [p for _, _, p in st.todo]
        nbytes = sum(v.nbytes for v in st.res.views)
        res = st.res

        def commit() -> None:
            try:
                store.commit_payloads(res, metas, parents)  # type: ignore[attr-defined]
            except OSError as e:  # the agent went away: later steps skip saving
                self._stats.inc("store_errors", "save")
                self._guard.failed(e)
            except Exception as e:
                self._stats.inc("store_errors", "save")
                self._log_once(f"commit:{type(e).__name__}", "tiered cache save failed: %r", e)

        # Counted now, not in commit(): vLLM collects stats once per engine step, and a
        # prefill-only request has no later step to carry them (a failed commit is counted
        # in store_errors).
        self._saved(len(metas), nbytes, time.perf_counter() - st.t0)
        self._pending_commits = [f for f in self._pending_commits if not f.done()]
        self._pending_commits.append(self._finisher().submit(commit))

    def drain_saves(self, timeout: float | None = None) -> None:
        """Wait for saves handed to the commit thread (shutdown, tests)."""
        for f in list(self._pending_commits):
            with contextlib.suppress(Exception):
                f.result(timeout)
        self._pending_commits.clear()

    def _chunk_meta(self, s: SaveChunk, key: str) -> ChunkMeta:
        kv = self._kv
        assert kv is not None
        return ChunkMeta(
            key=key,
            fingerprint=self._fp.digest,
            num_tokens=s.num_tokens,
            dtype=dtype_name(kv.dtype),
            shape=kv.payload_shape(len(s.block_ids)),
            kv_layout=self._id.kv_layout,
            block_size=self._block_size,
        )

    def _saved(self, n: int, nbytes: int, dt: float) -> None:
        self._stats.inc("stored_chunks", "", n)
        self._stats.inc("stored_bytes", "", nbytes)
        self._stats.observe("store_seconds", "", dt)
        logger.debug("saved %d chunks (%.1f MiB) in %.1f ms", n, nbytes / 2**20, dt * 1000)

    def _save_staged(self, st: _StepSave) -> None:
        """Gather into host staging, then ``put_many`` (any ChunkStore), synchronously."""
        kv, staging = self._kv, self._save_staging
        if kv is None or staging is None:
            raise RuntimeError("KV caches were not registered")
        store = self._open_store()
        nbytes_total = 0
        for batch in _batches(st.todo, lambda t: kv.payload_nbytes(len(t[0].block_ids)),
                              self._max_staging):
            need = sum(kv.payload_nbytes(len(t[0].block_ids)) for t in batch)
            buf = staging.reserve(need)
            items: list[tuple[ChunkMeta, memoryview]] = []
            off = 0
            for s, key, _ in batch:
                nb = len(s.block_ids)
                n = kv.payload_nbytes(nb)
                flat = buf[off : off + n]
                kv.gather(s.block_ids, flat.view(kv.dtype).view(kv.payload_shape(nb)))
                items.append((self._chunk_meta(s, key), flat.numpy().data))
                off += n
            kv.synchronize()
            # put_many returns once the bytes are copied out of staging.
            if self._put_takes_parents(store):
                store.put_many(items, parents=[t[2] for t in batch])  # type: ignore[call-arg]
            else:
                store.put_many(items)
            nbytes_total += off
        self._saved(len(st.todo), nbytes_total, time.perf_counter() - st.t0)

    _parents_ok: bool | None = None

    def _put_takes_parents(self, store: ChunkStore) -> bool:
        """Whether the store's put_many accepts ``parents`` (an AgentClient extension)."""
        if self._parents_ok is None:
            try:
                params = inspect.signature(store.put_many).parameters
                self._parents_ok = "parents" in params
            except (TypeError, ValueError):
                self._parents_ok = False
        return self._parents_ok

    # -- metrics (both sides; vLLM aggregates them and exports them on its /metrics)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._stats.take()

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

    # -- lifecycle

    def shutdown(self) -> None:
        self.drain_saves(timeout=60)
        for pool in (self._copy_pool, self._finish_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._copy_pool = self._finish_pool = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        with self._store_lock:
            if self._store is not None:
                with contextlib.suppress(Exception):
                    self._store.close()
                self._store = None


# ---------------------------------------------------------------------------- helpers


def _chunk_bytes(kv_cache_config: KVCacheConfig | None, extra: Mapping[str, Any]) -> int:
    """Bytes of one full chunk on this rank (all layers), from vLLM's KV cache spec: what
    the agent prices a chunk of unknown size at. 0 when the spec does not say."""
    try:
        group = _single_group_spec(kv_cache_config)  # type: ignore[arg-type]
        spec = group.kv_cache_spec
        per_block = int(spec.page_size_bytes) * len(group.layer_names)
        chunk = int(extra.get("chunk_size", tc_keys.DEFAULT_CHUNK_SIZE))
        return per_block * (chunk // int(spec.block_size))
    except Exception:
        return 0


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit tests)
        return 0


# How a store's refusal ("mismatch", "verification": see client.LoadReport) is counted.
_REFUSED = {"mismatch": "layout_mismatch", "verification": "verification"}
_WHY = {
    "missing": "missing (evicted since the lookup, or failed verification in the store)",
    "verification": "failed verification (damaged payload)",
    "layout_mismatch": "written under another key or fingerprint",
}


def _tier_counts(tiers: Sequence[str]) -> str:
    """``dram`` or ``dram:2,nvme:1``: which tiers served a request's chunks."""
    counts: dict[str, int] = {}
    for t in tiers:
        counts[t] = counts.get(t, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return ",".join(f"{t}:{n}" for t, n in counts.items()) or "-"


def _fetch(
    store: ChunkStore,
    keys: Sequence[str],
    fingerprint: bytes,
    sink: Callable[[int, ChunkMeta, memoryview], None],
) -> tuple[list[bool], list[str], dict[int, str]]:
    """Hand each verified chunk to ``sink``. Returns which keys were delivered, the source
    that served each ("" when the store does not say) and why returned chunks were refused.

    Uses the store's zero-copy ``load_report``/``load_many`` when it has one, else
    ``get_many``.
    """
    load_report = getattr(store, "load_report", None)
    if callable(load_report):
        rep = load_report(keys, fingerprint, sink)
        return list(rep.ok), list(rep.sources), dict(rep.failures)
    none = [""] * len(keys)
    load_many = getattr(store, "load_many", None)
    if callable(load_many):
        return list(load_many(keys, fingerprint, sink)), none, {}
    got = store.get_many(keys, fingerprint)
    ok = [False] * len(keys)
    for i, item in enumerate(got):
        if item is None:
            break  # vLLM recomputes from the first failed block on: skip the rest
        sink(i, item[0], item[1])
        ok[i] = True
    return ok, none, {}


def _batches(items: Iterable[Any], size: Callable[[Any], int], limit: int) -> Iterable[list[Any]]:
    batch: list[Any] = []
    total = 0
    for it in items:
        n = size(it)
        if batch and total + n > limit:
            yield batch
            batch, total = [], 0
        batch.append(it)
        total += n
    if batch:
        yield batch
