"""Open a ChunkStore for a connector from its ``kv_connector_extra_config``.

PROVISIONAL: until the embedded hierarchy and agent client land, ``open_store`` serves a
plain directory of encoded chunks (``store_dir``). The signature is the stable contract.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tiered_cache import codec
from tiered_cache.api import ChunkStore, PayloadLike
from tiered_cache.codec import ChunkMeta


class _DirStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _p(self, key: str) -> Path:
        return self.root / f"{key}.kvc"

    def lookup(self, keys: Sequence[str]) -> list[str]:
        out: list[str] = []
        for k in keys:
            if not self._p(k).exists():
                break
            out.append("nvme")
        return out

    def get_many(
        self, keys: Sequence[str], fingerprint: bytes
    ) -> list[tuple[ChunkMeta, memoryview] | None]:
        res: list[tuple[ChunkMeta, memoryview] | None] = []
        for k in keys:
            try:
                raw = self._p(k).read_bytes()
                res.append(codec.decode(raw, expect_key=k, expect_fingerprint=fingerprint))
            except (OSError, codec.ChunkError):
                res.append(None)
        return res

    def put_many(self, items: Sequence[tuple[ChunkMeta, PayloadLike]]) -> None:
        for meta, payload in items:
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(codec.pack_header(meta, payload))
                f.write(payload)
            os.replace(tmp, self._p(meta.key))

    def close(self) -> None:
        pass


def open_store(extra_config: Mapping[str, Any]) -> ChunkStore:
    """ChunkStore for a connector. Keys: ``store_dir`` (provisional)."""
    d = extra_config.get("store_dir")
    if not d:
        raise ValueError("kv_connector_extra_config needs 'store_dir' (provisional store)")
    return _DirStore(d)
