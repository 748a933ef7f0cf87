"""What both halves of the vLLM connector share: the model identity (fingerprint), the
settings read from ``kv_connector_extra_config``, and guarded access to the node agent
(a circuit breaker: an agent that is down costs requests nothing).

``connectors.vllm`` is the facade vLLM loads; ``connectors.vllm_scheduler`` and
``connectors.vllm_worker`` are its two halves, each a ``ConnectorBase``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.logger import init_logger

from connectors import vllm_tp
from connectors.vllm_kvio import dtype_name
from connectors.vllm_metrics import StatsRecorder
from tiered_cache import keys as tc_keys
from tiered_cache.api import SlotStore
from tiered_cache.breaker import Breaker

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under the "vllm" logger so vLLM's handler and level apply.
logger = init_logger("vllm.connectors.tiered_cache")

T = TypeVar("T")


@dataclass
class _Identity:
    fingerprint: tc_keys.ModelFingerprint
    kv_layout: str  # header field (<= 8 bytes)
    block_size: int
    dtype: str  # the cache's format, as keyed: "bfloat16", "uint8/fp8_e5m2"
    tensor_dtype: str  # what vLLM's KV tensors hold (payload headers name this)
    # Whether this rank writes its shard's chunks: of the ranks holding one shard (MLA's
    # latent KV is one shard on every rank) only the lowest saves; all of them load.
    writes: bool = True


def kv_shards(spec: Any, tp_size: int, kv_tp_replicas: int | None = None) -> int:
    """Distinct KV shards across ``tp_size`` ranks, as vLLM states them: its
    ``kv_tp_replicas`` (consecutive ranks holding identical KV for every layer), else the
    spec's ``max_tp_shards`` (1 for MLA: every rank holds the same latent KV), else one
    per rank (vLLM: "unknown, treated as not replicated"). Ranks ``r`` with equal
    ``r // (tp_size // shards)`` hold the same KV."""
    shards: Any = getattr(spec, "max_tp_shards", None)
    if isinstance(kv_tp_replicas, int) and kv_tp_replicas > 1 and tp_size % kv_tp_replicas == 0:
        shards = tp_size // kv_tp_replicas
    if not isinstance(shards, int) or shards <= 0 or shards >= tp_size or tp_size % shards:
        return tp_size
    return shards


# Sources a load reads in milliseconds: loaded inside the forward pass under "auto".


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


@dataclass(frozen=True)
class KVGroups:
    """The model's KV cache groups as the connector sees them. One chunk holds every
    layer of every group, in model order, so a hit is a hit for all groups at once; each
    group has its own block ids (vLLM's hybrid allocator), and a sliding-window group's
    blocks before its window are vLLM's null block.

    ``spec``: the KV cache spec whose layout every layer shares (block size, heads, dtype;
    a full-attention group's where there is one);
    ``layer_names``: every layer, in model order (the payload's layer order);
    ``layer_group``: each layer's group; ``windows``: each group's sliding window in
    tokens (None: full attention)."""

    spec: Any
    layer_names: tuple[str, ...]
    layer_group: tuple[int, ...]
    windows: tuple[int | None, ...]

    @property
    def grouped(self) -> bool:
        """Whether blocks are copied group by group (``GroupedPagedKV``): with several
        groups, whose block ids each name another block, or a sliding window, whose
        freed blocks are vLLM's null block. vLLM then takes a failed load only per
        request, so loads are async (``failed_recving``)."""
        return len(self.windows) > 1 or self.windowed

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.windows)

    def first_live_block(self, computed: int, block_size: int) -> int:
        """The first block every group still holds once ``computed`` tokens are computed
        (vLLM's ``SlidingWindowManager.get_num_skipped_tokens``): earlier blocks of a
        sliding-window group are freed, so a chunk before it can no longer be saved."""
        skipped = max((max(0, computed - w + 1) for w in self.windows if w is not None),
                      default=0)  # fmt: skip
        return skipped // block_size


def _layer_order(name: str) -> tuple[int, int, str]:
    """A layer's place in the payload: by layer index, then name. The same in either of
    vLLM's modes (groups listed group by group, or one group in model order), so the
    chunks of both hold the same bytes."""
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return 0, extract_layer_index(name), name
    except Exception:
        return 1, 0, name


def kv_groups(kv_cache_config: KVCacheConfig) -> KVGroups:
    """The model's KV cache groups, validated: full attention (MLA included) and sliding
    window, each layer with the same block layout. Anything else is refused at start-up
    with one line: a Mamba state is one per request, not one per block, and a chunked-
    local layer's KV is reset at each attention chunk, so neither can be cut into prefix
    chunks; non-causal layers' prefix KV depends on later tokens."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    kinds = [type(getattr(g, "kv_cache_spec", None)).__name__ for g in groups]
    if not groups:
        raise ValueError("TieredCacheConnector: the model has no KV cache (attention-free)")
    try:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    except ImportError:  # pragma: no cover - vLLM is installed wherever this runs
        names = tuple(groups[0].layer_names)
        return KVGroups(groups[0].kv_cache_spec, names, (0,) * len(names), (None,))
    windows: list[int | None] = []
    for g in groups:
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            windows.append(int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens",
                                                                  0) or 0))  # fmt: skip
        elif isinstance(spec, FullAttentionSpec):
            windows.append(None)
        else:
            raise ValueError(
                f"TieredCacheConnector supports full-attention and sliding-window KV caches "
                f"(MLA included); this model's groups are {', '.join(kinds)}: Mamba, "
                f"linear-attention and chunked-local caches cannot be cut into prefix chunks"
            )
        if getattr(spec, "non_causal", False):
            # A prefix LM's prefix KV depends on the tokens after it: a prefix's chunk would
            # be another prompt's KV (vLLM turns its own prefix cache off for the same reason).
            raise ValueError(
                "TieredCacheConnector supports causal attention only; this model has "
                "non-causal (prefix LM) attention layers, whose KV of a prefix depends on the "
                "tokens after it, so no prefix chunk can be reused"
            )
    # The layout every layer shares: a full-attention group's where there is one.
    rep = next((g for g, w in zip(groups, windows, strict=True) if w is None), groups[0])
    shape = _block_layout(rep.kv_cache_spec)
    for g, kind in zip(groups, kinds, strict=True):
        if _block_layout(g.kv_cache_spec) != shape:
            raise ValueError(
                f"TieredCacheConnector needs one block layout across KV cache groups; this "
                f"model's {kind} group has {_block_layout(g.kv_cache_spec)}, another "
                f"{shape} (block size, KV heads, head size, dtype)"
            )
    order = sorted(((n, gi) for gi, g in enumerate(groups) for n in g.layer_names),
                   key=lambda t: _layer_order(t[0]))  # fmt: skip
    return KVGroups(
        rep.kv_cache_spec, tuple(n for n, _ in order), tuple(gi for _, gi in order), tuple(windows)
    )


def _block_layout(spec: Any) -> tuple[Any, ...]:
    return tuple(getattr(spec, f, None) for f in ("block_size", "num_kv_heads", "head_size",
                                                 "dtype"))  # fmt: skip


# Files whose change means other weights (or another architecture) at the same path.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_NAMES = ("config.json", "params.json")


def _is_weights_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_NAMES or name.endswith(".index.json")


def weights_identity(
    model: str, revision: str | None = None, mode: str = "stat", hub_cache: str | None = None
) -> str:
    """What says which checkpoint ``model`` names, cheaply (no file is read): "" if unknown.

    A local directory (or file): a digest of each weights/config file's name and size,
    and (``mode`` "stat") its mtime, or for a symlink (a Hugging Face snapshot) the blob
    it points to, which is named by its content hash and is the same on every node. A hub
    id: the commit its revision resolves to in the local Hugging Face cache. Only the top
    level of a directory is listed (vLLM loads from there)."""
    if mode not in ("stat", "size", "off"):
        raise ValueError(f"weights_identity must be stat, size or off, got {mode!r}")
    if mode == "off" or not model:
        return ""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if _is_weights_file(n))
    elif os.path.isfile(path):
        path, names = os.path.dirname(path), [os.path.basename(path)]
    else:
        return _hub_commit(model, revision, hub_cache)
    h = hashlib.sha256(f"weights/v1|{mode}".encode())
    for n in names:
        fp = os.path.join(path, n)
        try:
            st = os.stat(fp)
        except OSError:
            continue  # a dangling link: not part of what loads
        h.update(f"|{n}:{st.st_size}".encode())
        if os.path.islink(fp):
            h.update(b":" + os.path.basename(os.readlink(fp)).encode())
        elif mode == "stat":
            h.update(f":{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def _hub_commit(model: str, revision: str | None, hub_cache: str | None) -> str:
    """The commit a hub id's revision resolves to in the local cache (no network)."""
    rev = revision or "main"
    if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev):
        return rev  # a commit already
    if hub_cache is None:
        try:
            from huggingface_hub import constants

            hub_cache = str(constants.HF_HUB_CACHE)
        except Exception:  # pragma: no cover - vLLM depends on huggingface_hub
            return ""
    ref = os.path.join(hub_cache, "models--" + model.replace("/", "--"), "refs", rev)
    try:
        with open(ref) as f:
            return f.read().strip()
    except OSError:
        return ""


def _overrides(vllm_config: VllmConfig) -> str:
    """Settings besides the checkpoint that change what the model computes, as canonical
    JSON ("" when none is set)."""
    mc = vllm_config.model_config
    out: dict[str, Any] = {}
    for name in ("hf_overrides", "model_class_overrides", "hf_config_path", "config_format",
                 "model_impl", "quantization_config"):  # fmt: skip
        v = getattr(mc, name, None)
        if callable(v) and not isinstance(v, type):
            v = f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', repr(v))}"
        if v not in (None, "", {}, [], "auto"):
            out[name] = v
    model_dtype = getattr(mc, "dtype", None)
    if model_dtype is not None:  # the KV dtype may be fp8 whatever the weights' dtype
        out["model_dtype"] = str(model_dtype).removeprefix("torch.")
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", ""))
    if load_format == "dummy":  # random weights: their KV is nobody else's
        out["load_format"] = load_format
    return json.dumps(out, sort_keys=True, default=str, separators=(",", ":")) if out else ""


def build_identity(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    extra: Mapping[str, Any],
    tp_rank: int = 0,
) -> _Identity:
    """Everything that must match between writer and reader, from the vLLM config.

    Both roles build it from the same inputs, so the scheduler's keys equal rank 0's.
    """
    spec = kv_groups(kv_cache_config).spec
    block_size = int(spec.block_size)
    chunk_size = int(extra.get("chunk_size", tc_keys.DEFAULT_CHUNK_SIZE))
    if chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(
            f"TieredCacheConnector: chunk_size={chunk_size} must be a positive multiple of "
            f"vLLM's KV block size ({block_size}); set kv_connector_extra_config.chunk_size "
            f"to a multiple of {block_size}, or change --block-size"
        )
    spec_dtype = getattr(spec, "dtype", None)
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if isinstance(spec_dtype, torch.dtype):
        tensor_dtype = dtype_name(spec_dtype)
    else:
        tensor_dtype = (
            cache_dtype
            if cache_dtype != "auto"
            else dtype_name(vllm_config.model_config.dtype)  # type: ignore[arg-type]
        )
    # Every fp8 format is stored as uint8 tensors: the format itself must be keyed, or a
    # chunk written as fp8_e5m2 would load into an fp8_e4m3 cache.
    dtype = tensor_dtype
    if cache_dtype not in ("auto", tensor_dtype):
        dtype = f"{tensor_dtype}/{cache_dtype}"
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
    # Under context parallelism a block holds block_size x CP tokens interleaved across
    # ranks: neither the chunk keys nor the block math describe that.
    for setting in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, setting, 1) or 1) > 1:
            raise ValueError(
                f"TieredCacheConnector does not support context parallelism "
                f"({setting}={getattr(pc, setting)}); set it to 1"
            )
    tp_size = int(getattr(pc, "tensor_parallel_size", 1))
    # Chunks are keyed by KV shard, not by rank: ranks holding the same KV share one copy,
    # and a pool at another TP size whose shards are the same (MLA at any TP) reads it.
    shards = kv_shards(spec, tp_size, getattr(kv_cache_config, "kv_tp_replicas", None))
    replicas = tp_size // shards
    mc = vllm_config.model_config
    model_id = str(extra.get("model_id") or mc.model)
    # A sliding window's blocks hold the same bytes as full attention's (vLLM turns them
    # into full attention where its hybrid allocator is off): one name, chunks in common.
    kind = "FullAttentionSpec" if type(spec).__name__ == "SlidingWindowSpec" else type(spec).__name__
    # New weights at the same path must not meet the old weights' KV: the revisions, the
    # checkpoint files' identity, the overrides and the operator's epoch are all keyed.
    revision = getattr(mc, "revision", None)
    code_revision = getattr(mc, "code_revision", None)
    revs = "/".join(str(r or "") for r in (revision, code_revision)).strip("/")
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    weights = weights_identity(
        str(getattr(mc, "model_weights", None) or mc.model),
        revision,
        str(extra.get("weights_identity", "stat")),
        hub_cache=download_dir,
    )
    fp = tc_keys.ModelFingerprint(
        model_id=model_id,
        dtype=dtype,
        # The byte meaning of a block depends on the backend (CPU: all K then all V per
        # head; CUDA: K|V per token), so the device type is part of the identity.
        kv_layout=f"{layout}@{device_type}/{kind}",
        block_size=block_size,
        tp_rank=tp_rank // replicas,
        tp_world_size=shards,
        chunk_size=chunk_size,
        revision=revs,
        quantization=str(getattr(mc, "quantization", None) or ""),
        overrides=_overrides(vllm_config),
        weights=weights,
        cache_epoch=str(extra.get("cache_epoch") or ""),
    )
    return _Identity(fp, layout[:8], block_size, dtype, tensor_dtype, tp_rank % replicas == 0)

def _chunk_bytes(kv_cache_config: KVCacheConfig | None, extra: Mapping[str, Any]) -> int:
    """Bytes of one full chunk on this rank (all layers), from vLLM's KV cache spec: what
    the agent prices a chunk of unknown size at. 0 when the spec does not say."""
    try:
        groups = kv_groups(kv_cache_config)  # type: ignore[arg-type]
        spec = groups.spec
        per_block = int(spec.page_size_bytes) * len(groups.layer_names)
        chunk = int(extra.get("chunk_size", tc_keys.DEFAULT_CHUNK_SIZE))
        return per_block * (chunk // int(spec.block_size))
    except Exception:
        return 0


def _total_kv_heads(vllm_config: VllmConfig) -> int | None:
    """The model's KV heads over all ranks (None where vLLM's config does not say)."""
    get = getattr(vllm_config.model_config, "get_total_num_kv_heads", None)
    try:
        return int(get()) if callable(get) else None
    except Exception:
        return None


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit tests)
        return 0


@dataclass(frozen=True)
class ConnectorArgs:
    """What vLLM gives a connector, for either half."""

    vllm_config: VllmConfig
    role: KVConnectorRole
    kv_cache_config: KVCacheConfig | None
    ktc: KVTransferConfig


class ConnectorBase:
    """State and agent access both halves need."""

    def __init__(self, args: ConnectorArgs) -> None:
        vllm_config, role, kv_cache_config, ktc = (
            args.vllm_config, args.role, args.kv_cache_config, args.ktc
        )
        self._vllm_config = vllm_config
        self._kv_transfer_config = ktc
        self._extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {})
        # The cache config (config_file, inline tiered_cache, or LMCache's YAML through
        # LMCACHE_CONFIG_FILE) gives chunk_size and save_unfull_chunk unless set here.
        from tiered_cache.client import config_from_extra

        cache_cfg = config_from_extra(self._extra)
        self._extra.setdefault("chunk_size", cache_cfg.chunk_size)
        self._extra.setdefault("cache_epoch", cache_cfg.cache_epoch)
        self._extra.setdefault("weights_identity", cache_cfg.weights_identity)
        self._save_unfull = _as_bool(
            self._extra.get("save_unfull_chunk", cache_cfg.save_unfull_chunk)
        )
        # Saving is decided per request (``SchedulerSide._save_from``): a producer saves
        # every prompt; a consumer saves what it computes of a P/D request whose prefill
        # did not save it (the router skipped the prefill), unless ``save_computed`` is off.
        self._save_enabled = bool(ktc.is_kv_producer)
        self._load_enabled = bool(ktc.is_kv_consumer)
        self._save_computed = _as_bool(self._extra.get("save_computed", True))
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
        self._kv_cache_config: KVCacheConfig = kv_cache_config
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            tp_rank = _tp_rank()
        self._id = build_identity(vllm_config, kv_cache_config, self._extra, tp_rank)
        self._fp = self._id.fingerprint
        self._chunk_size = self._fp.chunk_size
        self._block_size = self._id.block_size
        self._tp_world = self._fp.tp_world_size
        self._tp_rank = tp_rank
        # Writer shard counts of the pools at other TP sizes whose chunks this one reads
        # (``peer_tp_sizes``; connectors.vllm_tp): none by default.
        self._groups = kv_groups(kv_cache_config)
        spec = self._groups.spec
        self._peer_shards = vllm_tp.peer_shards(
            vllm_tp.parse_sizes(self._extra.get("peer_tp_sizes")),
            tp_size=int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)),
            shards=self._tp_world,
            rank_heads=int(getattr(spec, "num_kv_heads", 1)),
            total_heads=_total_kv_heads(vllm_config),
            shards_at=lambda n: kv_shards(spec, n),
        )
        # Whole chunks saved also name their block-aligned prefixes (the agent's aliases:
        # a prompt diverging inside a chunk loads its shared blocks). Off with TP > 1:
        # other ranks compute their keys from the tokens, which give no alias.
        self._aliases = _as_bool(self._extra.get("block_aliases", True)) and self._tp_world == 1
        self._logged: set[str] = set()
        self._store: SlotStore | None = None
        self._store_lock = threading.Lock()
        self._stats = StatsRecorder()
        # An agent that is down costs a request nothing: calls are skipped (a miss, a
        # skipped save) until a backed-off retry; one log line per outage.
        self._guard = Breaker(f"tiered cache agent ({role.name.lower()})", logger)
        self._probe: threading.Thread | None = None
        self._probe_lock = threading.Lock()

        logger.info(
            "TieredCacheConnector %s role=%s chunk_size=%d block_size=%d layout=%s dtype=%s "
            "async_load=%s wait=%s/%.1fs fingerprint=%s (revision=%r weights=%s epoch=%r)",
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
            self._fp.revision,
            self._fp.weights or "unknown",
            self._fp.cache_epoch,
        )

    def _open_store(self) -> SlotStore:
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
            self._open_store().ping()
        except OSError as e:
            self._guard.failed(e)
            return
        except Exception as e:  # it answered: up, if unhappy
            logger.debug("tiered cache probe: %r", e)
        self._guard.ok()

    def _guarded(self, op: str, fn: Callable[[SlotStore], T], default: T) -> T:
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

    def _register_fingerprint(self, store: SlotStore) -> None:
        """Tell the node agent (and through it the directory) which fingerprint this
        process writes under: `pin add --model` cannot guess the KV layout or block size."""
        mc = self._vllm_config.model_config
        served = getattr(mc, "served_model_name", None)
        names = [served] if isinstance(served, str) else list(served or [])
        aliases = sorted({str(mc.model), *map(str, names)} - {self._fp.model_id})
        try:
            store.register_model(
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

    def _rank_key(self, ks: Sequence[str], tokens: Sequence[int], salt: str | None,
                  index: int, num_tokens: int,
                  fp: tc_keys.ModelFingerprint | None = None) -> tuple[str, str | None]:
        """This rank's key (or, with ``fp``, that shard's) and parent key of the chunk at
        ``index`` of ``num_tokens`` tokens (``ks``: its keys of the prompt): a whole chunk,
        or a partial one (the prompt's tail, or the block-aligned copy of an earlier,
        shorter prompt's)."""
        parent = ks[index - 1] if index else None
        if num_tokens < self._chunk_size:
            start = index * self._chunk_size
            return tc_keys.partial_keys(tokens, fp or self._fp, salt, parent, start,
                                        [num_tokens])[0], parent  # fmt: skip
        return ks[index], parent

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

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._stats.take()

    def close_store(self) -> None:
        with self._store_lock:
            if self._store is not None:
                try:
                    self._store.close()
                except Exception as e:  # shutting down: nothing left to protect
                    logger.debug("tiered cache store close: %r", e)
                self._store = None
