"""tiered-cache: a tiered KV-cache layer for vLLM (DRAM -> NVMe -> S3, Redis directory)."""

__version__ = "0.1.0"
