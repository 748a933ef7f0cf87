"""Eviction and admission policies, chosen per tier by name."""

from __future__ import annotations

from typing import Any

from policies.admission import AlwaysAdmit, FrequencyThreshold, TinyLFU
from policies.arc import ARC
from policies.base import AdmissionPolicy, EntryInfo, EvictionPolicy
from policies.cost_aware import CostAware
from policies.lfu import LFU
from policies.lru import LRU
from policies.prefix_aware import PrefixAware
from policies.s3fifo import S3FIFO
from policies.s3prefix import S3Prefix
from policies.sieve import SIEVE
from policies.wtinylfu import WTinyLFU

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (LRU, LFU, ARC, S3FIFO, S3Prefix, SIEVE, PrefixAware, CostAware, WTinyLFU)
}
ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (AlwaysAdmit, FrequencyThreshold, TinyLFU)
}


def make_eviction(name: str, **kwargs: Any) -> EvictionPolicy:
    cls = EVICTION_POLICIES.get(name.lower())
    if cls is None:
        raise ValueError(
            f"unknown eviction policy {name!r}; valid: {', '.join(sorted(EVICTION_POLICIES))}"
        )
    return cls(**kwargs)


def make_admission(name: str, **kwargs: Any) -> AdmissionPolicy:
    cls = ADMISSION_POLICIES.get(name.lower())
    if cls is None:
        raise ValueError(
            f"unknown admission policy {name!r}; valid: {', '.join(sorted(ADMISSION_POLICIES))}"
        )
    return cls(**kwargs)


__all__ = [
    "ADMISSION_POLICIES",
    "ARC",
    "EVICTION_POLICIES",
    "LFU",
    "LRU",
    "S3FIFO",
    "SIEVE",
    "AdmissionPolicy",
    "AlwaysAdmit",
    "CostAware",
    "EntryInfo",
    "EvictionPolicy",
    "FrequencyThreshold",
    "PrefixAware",
    "S3Prefix",
    "TinyLFU",
    "WTinyLFU",
    "make_admission",
    "make_eviction",
]
