"""Hardware as the planner prices it: an ``Engine`` per server size (what a vLLM step
costs), ``Link``s (what a byte costs per tier and between nodes), capacities, and presets
for common clusters. An engine comes from a calibration run of the user's own vLLM
(``tiered_cache.plan.calibrate``), or from a roofline of the model on a known GPU."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tiered_cache.plan.model import ModelSpec, PlanError

GiB = 2**30


@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    latency_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Engine:
    """One vLLM step: ``step_s`` + ``per_seq_s`` a running decode + ``per_ctx_s`` a
    context token those decodes attend to (the KV read) + ``per_token_s`` a prefill
    token + ``per_pair_s`` a (query, key) pair of prefill attention. ``overlap``: the
    prefill's compute hides the step's memory time (a GPU; max of the two) rather than
    adding to it (vLLM's CPU backend, as calibrated). ``overhead_s``: what a request's
    first token pays once besides its steps (HTTP, tokenizing, detokenizing)."""

    step_s: float
    per_seq_s: float = 0.0
    per_ctx_s: float = 0.0
    per_token_s: float = 0.0
    per_pair_s: float = 0.0
    overhead_s: float = 0.0
    overlap: bool = False

    def parts(self, decodes: int, ctx: int, prefill: int, pairs: float) -> tuple[float, float]:
        """A step's memory-bound seconds (weights, decodes, their KV) and compute-bound
        ones (the prefill tokens and their attention)."""
        mem = self.step_s + self.per_seq_s * decodes + self.per_ctx_s * ctx
        return mem, self.per_token_s * prefill + self.per_pair_s * pairs

    def combine(self, mem: float, comp: float) -> float:
        return max(mem, comp) if self.overlap else mem + comp

    def step(self, decodes: int, ctx: int, prefill: int, pairs: float) -> float:
        return self.combine(*self.parts(decodes, ctx, prefill, pairs))

    def prefill_s(self, n: int) -> float:
        return self.step(0, 0, n, n * n / 2)

    def prefill_tps(self, n: int = 1024) -> float:
        return n / self.prefill_s(n)


@dataclass(frozen=True)
class Gpu:
    hbm_bytes: float
    hbm_bps: float
    flops: float  # dense bf16


GPUS = {
    "h100": Gpu(80e9, 3.35e12, 989e12),
    "h200": Gpu(141e9, 4.8e12, 989e12),
    "a100": Gpu(80e9, 2.0e12, 312e12),
    "l40s": Gpu(48e9, 0.864e12, 362e12),
}
MFU = 0.5  # prefill: the share of peak FLOPs vLLM reaches on long prompts
MBU = 0.7  # decode: the share of HBM bandwidth a step reaches
STEP_FLOOR_S = 0.004  # a step's CPU-side floor (scheduling, sampling, launches)


def roofline_engine(model: ModelSpec, gpu: Gpu, tp: int) -> Engine:
    flops = gpu.flops * MFU * tp * (0.9 if tp > 1 else 1.0)  # TP's all-reduces
    hbm = gpu.hbm_bps * MBU * tp
    return Engine(
        step_s=STEP_FLOOR_S + model.weight_bytes / hbm,
        per_seq_s=2e-5,
        per_ctx_s=model.kv_bytes_per_token / hbm,
        per_token_s=2 * model.params / flops,
        per_pair_s=4 * max(model.layers * model.attn_dim, 1) / flops,
        overhead_s=0.01,
        overlap=True,
    )


@dataclass
class Hardware:
    """A cluster: ``units`` (GPUs, or cores here) in nodes of ``units_per_node``; an
    ``Engine`` and a KV space (tokens) per server size in units; per-node DRAM and NVMe
    and a shared S3, and the links a chunk crosses to each (``dram``: GPU<->host, PCIe;
    ``net``: between nodes, the P/D handoff's when they differ; None on one node)."""

    name: str
    units: int
    units_per_node: int
    engines: dict[int, Engine]
    kv_tokens: dict[int, int]
    dram_bytes: float
    nvme_bytes: float
    s3_bytes: float
    dram: Link
    nvme: Link
    s3: Link
    net: Link | None = None
    tp: int = 1
    unit_name: str = "GPU"
    save_blocks: bool = False  # a save stalls the step (vLLM CPU: the copy is synchronous)
    load_blocks: bool = False  # a load stalls the step (else only its own request waits)
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    block_tokens: int = 16
    chunk_tokens: int = 256
    hop_s: float = 0.002  # the router's second request of a split (tokenize, HTTP)
    router_s: float = 0.0  # what the router adds to a request it proxies (lookup, HTTP)
    # A step slows by these shares while another server of its node prefills, or only
    # decodes (shared memory bandwidth and caches: cores of one CPU; 0: GPUs of their own).
    neighbour_prefill: float = 0.0
    neighbour_decode: float = 0.0
    notes: list[str] = field(default_factory=list)

    def engine(self, units: int) -> Engine:
        if units not in self.engines:
            raise PlanError(f"{self.name}: no engine for a {units}-{self.unit_name} server "
                            f"(have {sorted(self.engines)})")  # fmt: skip
        return self.engines[units]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["engines"] = {str(k): v for k, v in d["engines"].items()}
        d["kv_tokens"] = {str(k): v for k, v in d["kv_tokens"].items()}
        return d


def _link(gbps: float, latency_us: float) -> Link:
    return Link(gbps * 1e9 / 8, latency_us * 1e-6)


# name: (gpu, GPUs, GPUs a node, network between nodes or None)
PRESETS: dict[str, tuple[str, int, int, Link | None, str]] = {
    "h100x8": ("h100", 8, 8, None, "one node, 8xH100 NVLink; P/D inside the node"),
    "h100x16-rdma400": ("h100", 16, 8, _link(400, 5), "two nodes, 400 Gb/s RDMA per GPU"),
    "h100x16-tcp100": ("h100", 16, 8, _link(100 * 0.7, 50), "two nodes, 100 Gb/s TCP"),
    "h100x16-tcp25": ("h100", 16, 8, _link(25 * 0.7, 80), "two nodes, 25 Gb/s TCP"),
    "h200x8": ("h200", 8, 8, None, "one node, 8xH200 NVLink"),
}


def gpu_hardware(
    model: ModelSpec, preset: str, tp: int, dram_gib: float = 1024, nvme_gib: float = 8192,
    s3_gib: float = 1e6, net_gbps: float | None = None,
) -> Hardware:  # fmt: skip
    if preset not in PRESETS:
        raise PlanError(f"unknown preset {preset!r} ({', '.join([*PRESETS, 'cpu-here'])})")
    gname, units, per_node, net, note = PRESETS[preset]
    if net_gbps is not None:
        net = _link(net_gbps, 20)
    gpu = GPUS[gname]
    if tp <= 0 or per_node % tp:
        raise PlanError(f"--tp {tp} does not divide a node's {per_node} GPUs")
    engines, kv = {}, {}
    u = tp
    while u <= per_node:
        free = u * gpu.hbm_bytes * 0.9 - model.weight_bytes
        if free > 0:
            engines[u] = roofline_engine(model, gpu, u)
            kv[u] = int(free / model.kv_bytes_per_token)
        u *= 2
    if tp not in engines:
        raise PlanError(f"{model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) does "
                        f"not fit {tp}x{gname.upper()}: raise --tp")  # fmt: skip
    return Hardware(
        name=preset, units=units, units_per_node=per_node, engines=engines, kv_tokens=kv,
        dram_bytes=dram_gib * GiB, nvme_bytes=nvme_gib * GiB, s3_bytes=s3_gib * GiB,
        dram=_link(8 * 25 * 8 * 0.8, 10),  # PCIe 5 x16, ~25 GB/s a GPU, 8 at once
        nvme=_link(8 * 6.5 * 8, 100), s3=_link(8 * 10, 30_000), net=net, tp=tp,
        notes=[note, f"roofline engines: {MFU:.0%} of peak FLOPs, {MBU:.0%} of HBM bandwidth"],
    )  # fmt: skip


def host_hardware(calibration: dict[str, Any], kv_tokens: int = 4096, dram_mib: int = 1024,
                  disk_mib: int = 4096) -> Hardware:  # fmt: skip
    """This machine as ``bench/serve.py`` runs it: servers of 1 or 2 cores, vLLM's KV
    space cut to ``kv_tokens``, the agent's DRAM and NVMe, synchronous copies (CPU)."""
    engines = {int(k): Engine(**v) for k, v in calibration["engines"].items()}
    links = calibration.get("links", {})
    dram = Link(**links.get("dram", {"bytes_per_s": 4e9, "latency_s": 2e-4}))
    nvme = Link(**links.get("nvme", {"bytes_per_s": 1e9, "latency_s": 5e-4}))
    return Hardware(
        name="cpu-here", units=max(engines), units_per_node=max(engines), engines=engines,
        kv_tokens={u: kv_tokens for u in engines}, dram_bytes=dram_mib * 2**20,
        nvme_bytes=disk_mib * 2**20, s3_bytes=0, dram=dram, nvme=nvme, s3=Link(1e8, 0.03),
        tp=1, unit_name="core", save_blocks=True, load_blocks=True, max_num_seqs=8,
        max_batched_tokens=2048, block_tokens=32, chunk_tokens=256,
        hop_s=float(calibration.get("hop_s", 0.01)),
        router_s=float(calibration.get("router_s", 0.0)),
        neighbour_prefill=float(calibration.get("neighbour", {}).get("prefill", 0.0)),
        neighbour_decode=float(calibration.get("neighbour", {}).get("decode", 0.0)),
        notes=["vLLM CPU on this machine, calibrated " + str(calibration.get("when", ""))],
    )  # fmt: skip


def load_calibration(path: str | Path) -> dict[str, Any]:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"--calibration: cannot read {path} ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("engines"), dict) or not d["engines"]:
        raise PlanError(f"--calibration: {path} has no engines (from --calibrate)")
    try:
        for v in d["engines"].values():
            Engine(**v)
        {int(k) for k in d["engines"]}
    except (TypeError, ValueError) as e:
        raise PlanError(f"--calibration: {path}: bad engine ({e})") from None
    return d


def with_engine(hw: Hardware, units: int, engine: Engine) -> Hardware:
    return replace(hw, engines={**hw.engines, units: engine})
