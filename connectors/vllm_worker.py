"""The worker half of the vLLM connector: moves KV bytes between vLLM's paged blocks
and the node's cache (layer-wise saves into reserved DRAM slots, verified loads), and
times each forward pass for the scheduler's recompute-cost estimate."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from connectors import vllm_tp
from connectors.kv_copy import KVCopier, SaveCopy
from connectors.kv_device import KVDevice, Timing, device_for
from connectors.vllm_common import (
    ConnectorArgs,
    ConnectorBase,
    _as_bool,
    logger,
)
from connectors.vllm_kvio import (
    GroupedPagedKV,
    HostStaging,
    PagedKV,
    dtype_name,
    payload_tensor,
)
from connectors.vllm_metadata import (
    LoadChunk,
    LoadJob,
    SaveChunk,
    TieredCacheConnectorMetadata,
    TieredCacheWorkerMeta,
    blocks,
)
from connectors.vllm_metrics import farthest
from tiered_cache.api import SlotReservation, SlotStore
from tiered_cache.codec import ChunkMeta

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata


@dataclass
class _StepSave:
    """One step's save: chunks (save, key, parent), and, on the zero-copy path, their
    reserved slots and the layer copies into them."""

    todo: list[tuple[SaveChunk, str, str | None]]
    res: SlotReservation | None
    copy: SaveCopy | None = None
    t0: float = 0.0
    skipped: bool = False  # the agent is down: this step saves nothing


@dataclass(frozen=True)
class _Part:
    """One fetch of a chunk's load: ``key``, verified against fingerprint ``digest``, is a
    payload of ``shape`` whose heads ``src`` go to heads ``dst`` of the chunk's blocks
    (None: all of them, a chunk of this rank's own shard)."""

    key: str
    digest: bytes
    shape: tuple[int, ...]
    src: tuple[int, int] | None
    dst: tuple[int, int] | None


class WorkerSide(ConnectorBase):
    def __init__(self, args: ConnectorArgs) -> None:
        super().__init__(args)
        self._kv: PagedKV | None = None
        self._pinned_store: SlotStore | None = None
        self._dev: KVDevice = KVDevice()
        self._copier: KVCopier | None = None
        self._save_staging: HostStaging | None = None
        self._loader: ThreadPoolExecutor | None = None
        # Saves: layer copies into reserved DRAM slots overlap the forward pass; checksum +
        # commit run after it on another thread.
        self._layerwise = _as_bool(self._extra.get("layerwise_save", True))
        self._copy_thread = _as_bool(self._extra.get("save_copy_thread", False))
        self._step_save: _StepSave | None = None
        self._finish_pool: ThreadPoolExecutor | None = None
        self._prep_pool: ThreadPoolExecutor | None = None
        self._save_prep: Future[_StepSave] | None = None
        self._pending_commits: list[Future[None]] = []
        self._inflight: dict[str, Future[set[int]]] = {}
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # async loads that failed (several KV groups)
        # Forward timing for the scheduler's rate: device timers (CUDA events: host clocks
        # would time kernel launches), resolved once the device has run them.
        self._timing = False
        self._step_timer: Any = None
        self._step_tokens = 0
        self._sync_load_s = 0.0
        self._timings: list[tuple[int, Timing, float]] = []
        self._steps: list[tuple[int, float]] = []

        self._meta: KVConnectorMetadata | None = None  # this step's, bound by vLLM

    def has_connector_metadata(self) -> bool:
        return self._meta is not None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._meta is not None
        return self._meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups = self._groups
        names = [n for n in groups.layer_names if n in kv_caches] or list(kv_caches)
        missing = [n for n in kv_caches if n not in names]
        if missing:
            logger.warning("TieredCacheConnector: layers outside the KV groups ignored: %s",
                           missing)  # fmt: skip
        layers = [kv_caches[n] for n in names]
        # Views may count kernel blocks (FlashInfer, FlashMLA, CUTLASS MLA split vLLM's
        # blocks): PagedKV regroups them into blocks of --block-size tokens.
        if groups.grouped:
            of = dict(zip(groups.layer_names, groups.layer_group, strict=True))
            kv: PagedKV = GroupedPagedKV(layers, names, [of.get(n, 0) for n in names],
                                         len(groups.windows), block_size=self._block_size)
        else:
            kv = PagedKV(layers, names, block_size=self._block_size)
        if dtype_name(kv.dtype) != self._id.tensor_dtype:
            raise ValueError(
                f"TieredCacheConnector: KV tensors are {dtype_name(kv.dtype)} but the "
                f"cache spec says {self._id.tensor_dtype}"
            )
        if len(kv.block_shape) == 3 and kv.block_shape[1] != self._block_size:
            raise ValueError(
                f"TieredCacheConnector: KV blocks hold {kv.block_shape[1]} tokens (views "
                f"{tuple(layers[0].shape)}), not --block-size {self._block_size}: unsupported "
                "KV cache layout"
            )
        self._kv = kv
        self._dev = device_for(layers[0])
        self._copier = KVCopier(kv, self._dev, copy_thread=self._copy_thread)
        self._save_staging = HostStaging(pin=self._dev.needs_pinned)
        logger.info(
            "TieredCacheConnector: %d layers, %d blocks of %s %s (%d B/block/layer, kernel "
            "blocks of %s tokens) on %s",
            kv.num_layers,
            kv.num_blocks,
            kv.block_shape,
            dtype_name(kv.dtype),
            kv.block_bytes,
            kv.kernel_block_tokens or self._block_size,
            kv.device,
        )
        try:
            self._open_store()
        except Exception as e:  # an agent that cannot start costs vLLM nothing: recompute
            self._guard.failed(e if isinstance(e, OSError) else OSError(repr(e)))
            self._log_once("open", "tiered cache unavailable (%r): vLLM recomputes", e)

    def _open_store(self) -> SlotStore:
        store = super()._open_store()
        if store is not self._pinned_store and self._kv is not None:
            self._pinned_store = store  # a new store (first open, or after close_store)
            self._pin_pool(store)
        return store

    def _pin_pool(self, store: SlotStore) -> None:
        """Page-lock this process's mapping of the DRAM pool (CUDA only), so loads and saves
        DMA straight to and from it; the agent and the scheduler never pin it. A pool left
        pageable makes every non-blocking save copy block the engine's thread until its
        layer is computed: layer copies then move to the helper thread."""
        pin = getattr(store, "pin_pool", None)
        if not self._dev.needs_pinned or pin is None:
            return
        try:
            ok = bool(pin(self._dev.pin_host, self._dev.unpin_host))
        except Exception as e:  # pageable copies are slower, not wrong
            self._log_once("pin", "tiered cache: DRAM pool not page-locked: %r", e)
            ok = False
        if self._copier is not None and not ok:
            self._copier.copy_thread = True
        logger.info("TieredCacheConnector: DRAM pool %s", "page-locked" if ok else "pageable")

    def _worker_keys(self, chunks: Sequence[LoadChunk], tokens: Sequence[int] | None,
                     salt: str | None) -> list[str]:
        """The keys this rank loads: rank 0's are in the metadata; another rank's KV is
        its own (its fingerprint names its rank), so it derives them from the tokens."""
        if self._tp_rank == 0 or tokens is None:
            return [c.key for c in chunks]
        ks = self._req_keys(tokens, salt)
        return [self._rank_key(ks, tokens, salt, c.index, c.num_tokens)[0] for c in chunks]

    def _parts(self, job: LoadJob, keys: Sequence[str], kv: PagedKV) -> list[list[_Part]]:
        """What this rank fetches for each chunk of ``job``: its own shard's chunk, or
        for a chunk a pool at another TP size wrote, the heads it needs of each writer
        shard (``connectors.vllm_tp``), their keys derived from the tokens."""
        own = self._fp.digest
        out: list[list[_Part]] = []
        derived: dict[tuple[int, int], list[str]] = {}  # (shards, shard) -> its keys
        for c, key in zip(job.chunks, keys, strict=True):
            if not c.shards:
                out.append([_Part(key, own, kv.payload_shape(c.n_blocks), None, None)])
                continue
            total = kv.block_shape[0] * self._tp_world
            parts: list[_Part] = []
            for hp in vllm_tp.head_parts(total, self._tp_world, self._fp.tp_rank, c.shards):
                fp = vllm_tp.shard_fingerprint(self._fp, hp.shard, c.shards)
                k = c.key
                if hp.shard:
                    if job.token_ids is None:
                        raise RuntimeError("a chunk of another TP size came without tokens")
                    ks = derived.get((c.shards, hp.shard))
                    if ks is None:
                        ks = self._req_keys(job.token_ids, job.cache_salt, fp)
                        derived[(c.shards, hp.shard)] = ks
                    k = self._rank_key(ks, job.token_ids, job.cache_salt, c.index,
                                       c.num_tokens, fp)[0]  # fmt: skip
                shape = kv.payload_shape(c.n_blocks, total // c.shards)
                parts.append(_Part(k, fp.digest, shape, hp.src, hp.dst))
            out.append(parts)
        return out

    # -- loading

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._meta = connector_metadata
        self._dev.bind_compute()  # the engine's stream, as this (its) thread sees it
        # The forward pass runs from here to wait_for_save: timed on the device for the
        # scheduler's recompute-cost estimate (sync loads inside it are subtracted).
        tokens = getattr(connector_metadata, "step_tokens", 0)
        self._timing = bool(tokens) and self._tp_rank == 0
        self._step_timer = self._dev.start_timer() if self._timing else None
        self._step_tokens = int(tokens)
        self._sync_load_s = 0.0
        # On a GPU the forward's kernels are launched ahead of the device: reserving the
        # step's DRAM slots (a round trip to the agent) starts now on a helper thread
        # rather than blocking those launches between layer 0 and layer 1.
        self._save_prep = None
        meta = connector_metadata
        if (self._layerwise and self._dev.kind != "cpu" and self._kv is not None
                and self._id.writes
                and isinstance(meta, TieredCacheConnectorMetadata) and meta.saves
                and self._cache_up()):  # fmt: skip
            if self._prep_pool is None:
                self._prep_pool = ThreadPoolExecutor(1, thread_name_prefix="tc-save-prep")
            self._save_prep = self._prep_pool.submit(self._begin_save, meta)

    def _prepared_save(self, meta: TieredCacheConnectorMetadata) -> _StepSave:
        """The step's save: reserved ahead by ``bind_connector_metadata``, or now."""
        prep, self._save_prep = self._save_prep, None
        if prep is not None:
            return prep.result()
        return self._begin_save(meta)

    def _collect_timings(self) -> None:
        """Move forward timings the device has finished into ``_steps`` (never blocks)."""
        pending: list[tuple[int, Timing, float]] = []
        for tokens, timing, minus in self._timings:
            sec = timing.seconds()
            if sec is None:
                pending.append((tokens, timing, minus))
            elif sec - minus > 0:
                self._steps.append((tokens, sec - minus))
        self._timings = pending[-64:]
        del self._steps[:-64]  # a scheduler that never collects must not grow us

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self._collect_timings()
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
        # Async loads copy from the loader thread: they wait for the compute stream up to
        # here (recorded on this, the engine's, thread), not for whatever that thread sees.
        after = self._dev.record() if any(j.is_async for j in meta.loads) else None
        for job in meta.loads:
            if job.is_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="tc-load")
                self._inflight[job.req_id] = self._loader.submit(self._run_load, job, after)
            else:
                self._load_errors |= self._run_load(job)
        self._sync_load_s += time.perf_counter() - t0

    def _run_load(self, job: LoadJob, after: Any = None) -> set[int]:
        """Load one request's chunks. Returns the block ids that were not loaded (all of
        them at once while the agent is down: vLLM recomputes them)."""
        every = {b for c in job.chunks for b in c.block_ids}
        if not self._cache_up():
            self._stats.inc("recompute_fallbacks", "unavailable")
            return every
        try:
            failed = self._load_job(job, after)
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

    def _check_meta(
        self, meta: ChunkMeta, c: LoadChunk, kv: PagedKV, want_shape: tuple[int, ...]
    ) -> str | None:
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

    def _load_job(self, job: LoadJob, after: Any = None) -> set[int]:
        kv = self._kv
        store = self._open_store()
        if kv is None:
            raise RuntimeError("KV caches were not registered")
        t0 = time.perf_counter()
        keys = self._worker_keys(job.chunks, job.token_ids, job.cache_salt)
        plan = self._parts(job, keys, kv)
        copier = self._copier
        assert copier is not None
        dev = self._dev
        reasons: dict[int, str] = {}
        kinds: dict[int, str] = {}  # recompute_fallbacks reason of a refused chunk
        nbytes: dict[int, int] = {}
        chunks: list[LoadChunk] = []  # the batch being fetched
        parts: list[tuple[int, _Part]] = []  # its fetches: (chunk in the batch, part)

        def sink_of(group: list[int]) -> Callable[[int, ChunkMeta, memoryview], None]:
            def sink(j: int, meta: ChunkMeta, payload: memoryview) -> None:
                i, p = parts[group[j]]
                c = chunks[i]
                used = payload.nbytes  # a head slice: only its share counts as loaded
                if p.src is not None:
                    used = used * (p.src[1] - p.src[0]) // p.shape[2]
                nbytes[i] = nbytes.get(i, 0) + used
                if reasons and min(reasons) < i:
                    reasons.setdefault(i, "an earlier chunk failed")
                    return
                try:
                    bad = self._check_meta(meta, c, kv, p.shape)
                    if bad is not None:
                        reasons[i], kinds[i] = bad, "layout_mismatch"
                        return
                    src = payload_tensor(payload, kv.dtype, p.shape)
                    src = src[:, c.lo : c.lo + len(c.block_ids)]
                    if p.src is not None:  # the heads this rank holds of another TP's shard
                        src = src[:, :, p.src[0] : p.src[1]]
                    # The payload is valid only during this call: a page-locked pool is
                    # copied from directly (and waited for), anything else (a head slice
                    # too: strided) through pinned staging.
                    pinned = dev.needs_pinned and p.src is None and src.is_pinned()
                    copier.load_chunk(blocks(c), src, src_pinned=pinned, heads=p.dst)
                except Exception as e:  # never let a bad chunk take the engine down
                    reasons[i], kinds[i] = f"copy failed: {e!r}", "copy_error"

            return sink

        served: list[str] = []  # the tier that served each loaded chunk
        failed_at: int | None = None
        for b0 in range(0, len(job.chunks), self._load_batch):
            chunks[:] = job.chunks[b0 : b0 + self._load_batch]
            parts[:] = [(i, p) for i, ps in enumerate(plan[b0 : b0 + self._load_batch])
                        for p in ps]  # fmt: skip
            groups: dict[bytes, list[int]] = {}  # one store call per fingerprint
            for g, (_, p) in enumerate(parts):
                groups.setdefault(p.digest, []).append(g)
            ok = [True] * len(chunks)
            sources = [""] * len(chunks)
            refused: dict[int, str] = {}
            copier.reserve_staging(sum(kv.payload_nbytes(len(c.block_ids)) for c in chunks))
            copier.load_begin(after)
            try:
                for digest, group in groups.items():
                    got, srcs, why = _fetch(
                        store, [parts[g][1].key for g in group], digest, sink_of(group)
                    )
                    for j, g in enumerate(group):
                        i = parts[g][0]
                        if not got[j]:
                            ok[i] = False
                            if j in why:
                                refused.setdefault(i, why[j])
                        elif not sources[i]:
                            sources[i] = srcs[j]
            finally:
                copier.load_end()
            for i, c in enumerate(chunks):
                if ok[i] and i not in reasons:
                    tier = c.origin or sources[i] or c.source or "unknown"
                    served.append(tier)
                    if self._id.writes:  # as stored_*: once per copy (MLA: rank 0's)
                        self._stats.inc("loaded_chunks", tier)
                        self._stats.inc("loaded_bytes", tier, nbytes.get(i, 0))
                    if self._tp_rank == 0:  # every rank loads the same tokens
                        self._stats.inc("hit_tokens", tier, c.tokens)
                    continue
                kind = kinds.get(i) or _REFUSED.get(refused.get(i, ""), "missing")
                why_not = reasons.get(i) or _WHY[kind]
                self._stats.inc("recompute_fallbacks", kind)
                if kind == "layout_mismatch":
                    self._stats.inc("layout_mismatches")
                self._log_once(
                    f"loadfail:{why_not[:40]}",
                    "tiered cache: chunk %s (req %s, #%d) not loaded: %s; vLLM recomputes it",
                    c.key, job.req_id, c.index, why_not,
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
                bad = fut.result()
                if bad and self._groups.grouped:
                    # Block ids name a block per group (or the shared null block): vLLM
                    # takes only whole requests.
                    self._failed_loads.add(rid)
                else:
                    self._load_errors |= bad
                done.add(rid)
        return None, (done or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_loads = self._failed_loads, set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

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
        if not self._layerwise or kv is None or not self._id.writes:
            return
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, TieredCacheConnectorMetadata) or not meta.saves:
            return
        st = self._step_save
        if st is None:
            if not self._cache_up():
                self._step_save = _StepSave([], None, skipped=True)
                return
            try:
                st = self._step_save = self._prepared_save(meta)
            except OSError as e:  # the agent is unreachable: no saves this step
                self._guard.failed(e)
                self._step_save = _StepSave([], None, skipped=True)
                return
            except Exception as e:  # wait_for_save retries the whole save
                self._log_once(f"begin:{type(e).__name__}", "layer-wise save off: %r", e)
                self._step_save = _StepSave([], None)
                return
        li = kv.layer_index(layer_name)
        if st.copy is None or li is None:
            return
        assert self._copier is not None
        self._copier.save_layer(st.copy, li)

    def _finisher(self) -> ThreadPoolExecutor:
        if self._finish_pool is None:
            self._finish_pool = ThreadPoolExecutor(1, thread_name_prefix="tc-save-commit")
        return self._finish_pool

    def wait_for_save(self) -> None:
        if self._timing:  # the forward pass was just queued
            timing = self._dev.stop_timer(self._step_timer)
            self._timings.append((self._step_tokens, timing, self._sync_load_s))
            self._timing, self._step_timer = False, None
        st, self._step_save = self._step_save, None
        if st is None and self._save_prep is not None:  # no layer reported: take it now
            with contextlib.suppress(Exception):  # a failed one is retried below
                st = self._prepared_save(self._get_connector_metadata())  # type: ignore[arg-type]
        self._save_prep = None
        if not self.has_connector_metadata() or not self._id.writes:
            return  # a rank whose KV a lower rank saves (replicated KV: MLA)
        meta = self._get_connector_metadata()
        if not isinstance(meta, TieredCacheConnectorMetadata) or not meta.saves:
            return
        if (st is not None and st.skipped) or (st is None and not self._cache_up()):
            self._stats.inc("saves_skipped", "unavailable", len(meta.saves))
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
                        self._open_store().abort_reservation(st.res)
                    self._stats.inc("store_errors", "save")
                    self._log_once(
                        f"zerocopy:{type(e).__name__}",
                        "tiered cache zero-copy save failed (%r); using staged saves", e,
                    )
                    logger.debug("zero-copy save failure", exc_info=True)
                    st.res = None
                    st.copy = None
            self._save_staged(st)
        except OSError as e:  # the agent went away: later steps skip saving until it is back
            self._guard.failed(e)
            self._stats.inc("store_errors", "save")
            self._stats.inc("saves_skipped", "unavailable", len(meta.saves))
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
        req_keys: dict[str, list[str]] = {}  # this rank's keys of each prompt, once
        for s in meta.saves:
            key, parent = s.key, s.parent
            if self._tp_rank != 0 and s.req_id in meta.save_tokens:
                toks, salt = meta.save_tokens[s.req_id]
                if s.req_id not in req_keys:
                    req_keys[s.req_id] = self._req_keys(toks, salt)
                key, parent = self._rank_key(req_keys[s.req_id], toks, salt, s.index,
                                             s.num_tokens)  # fmt: skip
            if key not in seen:
                seen.add(key)
                todo.append((s, key, parent))
        st = _StepSave(todo, None, t0=time.perf_counter())
        if not todo:
            return st
        sizes = [kv.payload_nbytes(len(s.block_ids)) for s, _, _ in todo]
        res = store.reserve_payloads(sizes)
        if res is None:
            return st  # no room for all of them in DRAM: the staged path copes
        try:
            dests = [
                payload_tensor(v, kv.dtype, kv.payload_shape(len(s.block_ids)))
                for v, (s, _, _) in zip(res.views, todo, strict=True)
            ]
            assert self._copier is not None
            st.copy = self._copier.begin_save([blocks(s) for s, _, _ in todo], dests)
        except BaseException:  # the slots go back; the staged path saves the chunks
            with contextlib.suppress(Exception):
                store.abort_reservation(res)
            raise
        st.res = res
        return st

    def _finish_copies(self, st: _StepSave) -> None:
        """Join the layer copies (copying any layer the model never reported), then hand
        checksum + commit to a helper thread: vLLM may reuse the blocks once this returns."""
        assert st.res is not None and st.copy is not None and self._copier is not None
        self._copier.finish_save(st.copy)
        store = self._open_store()
        metas = [self._chunk_meta(s, key, parent) for s, key, parent in st.todo]
        nbytes = sum(v.nbytes for v in st.res.views)
        res = st.res

        def commit() -> None:
            try:
                store.commit_payloads(res, metas)
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

    def _chunk_meta(self, s: SaveChunk, key: str, parent: str | None) -> ChunkMeta:
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
            parent=parent or "",
            position=s.index,
            tenant=s.tenant,
        )

    def _saved(self, n: int, nbytes: int, dt: float) -> None:
        self._stats.inc("stored_chunks", "", n)
        self._stats.inc("stored_bytes", "", nbytes)
        self._stats.observe("store_seconds", "", dt)
        logger.debug("saved %d chunks (%.1f MiB) in %.1f ms", n, nbytes / 2**20, dt * 1000)

    def _save_staged(self, st: _StepSave) -> None:
        """Gather into host staging, then ``put_many`` (any SlotStore), synchronously."""
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
            for s, key, parent in batch:
                nb = len(s.block_ids)
                n = kv.payload_nbytes(nb)
                flat = buf[off : off + n]
                assert self._copier is not None
                self._copier.gather(blocks(s), flat.view(kv.dtype).view(kv.payload_shape(nb)))
                items.append((self._chunk_meta(s, key, parent), flat.numpy().data))
                off += n
            # put_many returns once the bytes are copied out of staging.
            store.put_many(items)
            nbytes_total += off
        self._saved(len(st.todo), nbytes_total, time.perf_counter() - st.t0)

    def shutdown(self) -> None:
        self.drain_saves(timeout=60)
        if self._copier is not None:
            self._copier.close()
        for pool in (self._finish_pool, self._prep_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._finish_pool = self._prep_pool = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        self.close_store()


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
    store: SlotStore,
    keys: Sequence[str],
    fingerprint: bytes,
    sink: Callable[[int, ChunkMeta, memoryview], None],
) -> tuple[list[bool], list[str], dict[int, str]]:
    """Hand each verified chunk to ``sink``. Returns which keys were delivered, the source
    that served each ("" when the store does not say) and why returned chunks were refused."""
    rep = store.load_report(keys, fingerprint, sink)
    return list(rep.ok), list(rep.sources), dict(rep.failures)


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
