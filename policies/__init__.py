"""Eviction and admission policies, chosen per tier by name."""

from __future__ import annotations

from typing import Any

from policies.admission import AlwaysAdmit, FrequencyThreshold
from policies.base import AdmissionPolicy, EntryInfo, EvictionPolicy
from policies.lru import LRU

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {LRU.name: LRU}
ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    AlwaysAdmit.name: AlwaysAdmit,
    FrequencyThreshold.name: FrequencyThreshold,
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
    "EVICTION_POLICIES",
    "AdmissionPolicy",
    "EntryInfo",
    "EvictionPolicy",
    "make_admission",
    "make_eviction",
]
