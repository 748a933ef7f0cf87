"""Fixtures for the end-to-end tests: the tiny model, a shared chunk store, server logs.

``_store_config`` is the store part of ``kv_connector_extra_config`` that every server of
a module shares. Switching the suite from the provisional directory store to the real
configuration is that one line, e.g. ``return {"config_file": str(write_yaml(tmp))}`` with
the YAML's NVMe path under ``tmp`` (``SharedStore.corrupt`` damages files there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.vllm_harness import REPO, SharedStore


def _store_config(tmp: Path) -> dict[str, Any]:
    return {"store_dir": str(tmp / "store")}  # the store part of kv_connector_extra_config


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Marked, never skipped: without vllm these tests fail (the e2e suite is part of
    # `make test`, and CI installs the vllm extra).
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny float32 Llama, built once by scripts/make_tiny_model.py and cached
    (``TC_TINY_MODEL_DIR`` overrides where)."""
    out = Path(
        os.environ.get("TC_TINY_MODEL_DIR")
        or Path(tempfile.gettempdir()) / "tiered-cache-models" / "tiny-float32"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(out),
         "--preset", "tiny", "--dtype", "float32"],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        timeout=300,
    )
    return str(out)


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedStore]:
    root = tmp_path_factory.mktemp("tc-store")
    st = SharedStore(root, _store_config(root))
    yield st
    st.close()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = os.environ.get("TC_E2E_LOG_DIR")
    if d:
        p = Path(d)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.mktemp("vllm-logs")
