"""The fault suite's tests drive the phases of ``bench/soak.py`` (imported as ``soak``)
with small counts and assert the goals; peer-port tests put the agent in a network
namespace of its own (``node``) and attack it from the root namespace, as from another
host."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from tiered_cache.netns import NetNodes, unavailable_reason


@pytest.fixture(scope="module")
def node() -> Iterator[NetNodes]:
    """One node (``"agent"``) with its own address; skips where namespaces cannot be made."""
    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"peer-port tests need network namespaces: {why}")
    with NetNodes(["agent"]) as net:
        yield net
