"""LMCache's YAML (``LMCACHE_CONFIG_FILE`` plus ``LMCACHE_*`` overrides) as a ``CacheConfig``.

The file is read by LMCache's own loader (``LMCacheEngineConfig.from_file`` then
``update_config_from_env``, as LMCache's vLLM integration does), so defaults, aliases and
environment overrides mean exactly what they mean to LMCache. The result is then mapped:

=========================================  ===============================================
LMCache                                    tiered-cache
=========================================  ===============================================
``chunk_size``                             ``chunk_size``
``local_cpu``, ``max_local_cpu_size``      DRAM tier on/off, capacity (GB = 2**30 bytes)
``local_disk``, ``max_local_disk_size``    NVMe tier path, capacity (GB = 2**30 bytes)
``remote_url: s3://...``                   S3 tier (``extra_config.s3_region``,
                                           ``extra_config.s3_endpoint``)
``cache_policy``                           DRAM and NVMe eviction policy
``save_unfull_chunk``                      ``save_unfull_chunk`` (the connector's tail chunk)
``blocking_timeout_secs``                  ``s3.read_timeout_s``
``extra_config.use_odirect``               ``nvme.o_direct``
``extra_config.s3_num_io_threads``         ``s3.max_concurrency``
``extra_config.tiered_cache``              our own settings (CacheConfig schema, less the
                                           keys above), e.g. ``nvme.codec``, ``s3.encrypt``
=========================================  ===============================================

Every other LMCache key that the file or environment sets to a non-default value is
listed in one warning; contradictions and invalid values are ``ConfigError``s naming the key.
See docs/lmcache.md.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import ValidationError

from tiered_cache.config import (
    CacheConfig,
    ConfigError,
    EnvSubstitution,
    format_validation_error,
)

log = logging.getLogger(__name__)

# LMCache calls its sizes GB but allocates ``size * 1024**3`` bytes (LocalCPUBackend,
# LocalDiskBackend in lmcache 0.5.6), so a GB here is a GiB.
GIB = 2**30

# Top-level keys of our own schema (CacheConfig) and the ones both schemas share.
_OURS = frozenset(CacheConfig.model_fields) | {"tiered_cache"}
_SHARED = frozenset({"chunk_size", "save_unfull_chunk"})

# Enough of LMCache's keys to recognise its YAML without importing it (importing lmcache
# pulls in torch); the full list is added when lmcache is importable.
_LMCACHE_MARKERS = frozenset(
    {
        "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "remote_url",
        "remote_serde", "cache_policy", "save_decode_cache", "blocking_timeout_secs",
        "pin_timeout_sec", "pin_check_interval_sec", "extra_config", "use_layerwise",
        "enable_async_loading", "enable_blending", "enable_p2p", "enable_controller",
        "enable_pd", "pd_role", "enable_xpyd", "enable_nixl", "nixl_role", "transfer_channel",
        "storage_plugins", "remote_storage_plugins", "gds_path", "local_device",
        "pipelined_backend", "lmcache_instance_id", "pre_caching_hash_algorithm",
    }
)  # fmt: skip

# LMCache keys that the mapping consumes. Any other key set to a non-default value is
# reported as unsupported.
_MAPPED = frozenset(
    {
        "chunk_size", "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size",
        "remote_url", "cache_policy", "save_unfull_chunk", "save_decode_cache",
        "blocking_timeout_secs", "extra_config",
    }
)  # fmt: skip

# extra_config keys the mapping consumes (tiered_cache is ours; s3_enable_s3express needs
# nothing: boto3 recognises directory buckets by name).
_EXTRA_MAPPED = frozenset(
    {"tiered_cache", "s3_region", "s3_endpoint", "disable_tls", "s3_num_io_threads",
     "use_odirect", "s3_enable_s3express"}
)  # fmt: skip

# Why some unsupported keys do nothing here (shown in the warning).
_HINTS = {
    "save_decode_cache": "tiered-cache saves prompt KV only",
    "pin_timeout_sec": "tiered-cache lookups pin nothing",
    "pin_check_interval_sec": "tiered-cache lookups pin nothing",
    "remote_serde": "set extra_config.tiered_cache.<nvme|s3>.codec and .encrypt instead",
    "extra_config.aws_access_key_id": "use the AWS credential chain instead",
    "extra_config.aws_secret_access_key": "use the AWS credential chain instead",
}

# cache_policy (LMCache names, case-insensitive) -> (our eviction policy, note if approximate).
# LRU/LFU/FIFO/MRU are lmcache 0.5.6's; S3FIFO and COST_AWARE are newer LMCache's.
_POLICIES: dict[str, tuple[str, str | None]] = {
    "LRU": ("lru", None),
    "LFU": ("lfu", None),
    "FIFO": ("sieve", "SIEVE: FIFO order, but a chunk read since it was added gets a second pass"),
    "S3FIFO": ("s3fifo", None),
    "COST_AWARE": ("cost", None),
}

# Settings of extra_config.tiered_cache that LMCache's own keys own: one source of truth.
_OWNED: dict[tuple[str, ...], str] = {
    ("chunk_size",): "chunk_size",
    ("save_unfull_chunk",): "save_unfull_chunk",
    ("dram", "enabled"): "local_cpu",
    ("dram", "capacity"): "max_local_cpu_size",
    ("nvme", "enabled"): "local_disk",
    ("nvme", "path"): "local_disk",
    ("nvme", "capacity"): "max_local_disk_size",
    ("s3", "enabled"): "remote_url",
    ("s3", "url"): "remote_url",
    ("s3", "endpoint_url"): "extra_config.s3_endpoint",
    ("s3", "region"): "extra_config.s3_region",
}

_AWS_HOST = re.compile(
    r"^(?P<bucket>[a-z0-9][a-z0-9.\-]*?)\.s3(?:express-[a-z0-9-]+?)?"
    r"(?:[.-](?P<region>[a-z]{2}(?:-[a-z]+)+-\d))?\.amazonaws\.com$"
)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")

_warned: set[str] = set()
_MISSING = object()


def _warn_once(msg: str) -> None:
    # The connector and the store load the same file more than once per process.
    if msg not in _warned:
        _warned.add(msg)
        log.warning("%s", msg)


def _known_keys() -> frozenset[str]:
    try:
        from lmcache.v1.config import _CONFIG_ALIASES, _CONFIG_DEFINITIONS
    except ImportError:
        return _LMCACHE_MARKERS
    return _LMCACHE_MARKERS | frozenset(_CONFIG_DEFINITIONS) | frozenset(_CONFIG_ALIASES)


def is_lmcache_config(data: Mapping[str, Any], where: str) -> bool:
    """True when ``data`` (a parsed YAML file) is LMCache's format rather than ours.

    Raises ConfigError for a file that mixes both."""
    keys = set(data)
    ours = keys & (_OURS - _SHARED)
    others = keys - _OURS
    if not others:
        return False
    theirs = others & _LMCACHE_MARKERS
    if not theirs and not ours:
        # Only unknown keys: look them up in LMCache's full list (this imports lmcache,
        # so only for files that are not plainly ours).
        theirs = others & _known_keys()
    if theirs and ours:
        raise ConfigError(
            f"{where}: mixes tiered-cache keys ({', '.join(sorted(ours))}) with LMCache keys "
            f"({', '.join(sorted(theirs))}); in an LMCache file put ours under "
            "extra_config.tiered_cache"
        )
    return bool(theirs)


def _assert_text(e: AssertionError) -> str:
    """LMCache validates with bare asserts; the failing line names the key."""
    if str(e):
        return str(e)
    tb = traceback.extract_tb(e.__traceback__)
    line = (tb[-1].line or "").strip() if tb else ""
    return f"failed check `{line}`" if line else "failed a check"


class _Mapper:
    def __init__(self, path: Path, raw: Mapping[str, Any]) -> None:
        try:
            from lmcache.v1.config import (
                _CONFIG_ALIASES,
                _CONFIG_DEFINITIONS,
                LMCacheEngineConfig,
            )
            from lmcache.v1.config_base import _parse_quoted_string
        except ImportError:
            raise ConfigError(
                f"{path} is an LMCache config: install the `lmcache` extra "
                "(pip install 'tiered-cache[lmcache]') to load it"
            ) from None
        self.where = str(path)
        self.defs: dict[str, dict[str, Any]] = _CONFIG_DEFINITIONS
        aliases: dict[str, str] = _CONFIG_ALIASES
        self.unknown = sorted(k for k in raw if k not in self.defs and k not in aliases)
        # Where each key was set: the file, or an LMCACHE_* variable (which wins, as in
        # LMCache).
        self.origin: dict[str, str] = {aliases.get(k, k): aliases.get(k, k) for k in raw}
        for name in [*self.defs, *aliases]:
            env = f"LMCACHE_{name.upper()}"
            if env in os.environ:
                self.origin[aliases.get(name, name)] = env
        self.user_set = {k for k in self.origin if k in self.defs}
        self._precheck(raw, aliases, _parse_quoted_string)
        try:
            lm = LMCacheEngineConfig.from_file(str(path))
            lm.update_config_from_env()  # also runs LMCache's validate()
        except AssertionError as e:
            raise ConfigError(f"{self.where}: LMCache rejected it: {_assert_text(e)}") from None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{self.where}: LMCache rejected it: {e}") from None
        self.lm: Any = lm
        self.tc: dict[str, Any] = {}

    def key(self, name: str) -> str:
        src = self.origin.get(name, name)
        return name if src == name else f"{name} (from {src})"

    def err(self, name: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.where}: {self.key(name)}: {msg}")

    def _precheck(self, raw: Mapping[str, Any], aliases: dict[str, str], unquote: Any) -> None:
        # LMCache turns a value its converter rejects into None (file) or keeps the old
        # value (env), with a log line; for the keys we map that is an error here.
        values: dict[str, Any] = {aliases.get(k, k): v for k, v in raw.items()}
        for name in _MAPPED:
            env = f"LMCACHE_{name.upper()}"
            v = unquote(os.environ[env]) if env in os.environ else values.get(name)
            if v is None:
                continue
            if name == "local_disk" and not isinstance(v, str):
                raise self.err(name, f"expected a directory like file:///path/, got {v!r}")
            try:
                self.defs[name]["env_converter"](v)
            except (ValueError, TypeError) as e:
                raise self.err(name, f"invalid value {v!r} ({e})") from None

    # ------------------------------------------------------------------ mapping

    def build(self) -> CacheConfig:
        lm = self.lm
        extra = lm.extra_config if lm.extra_config is not None else {}
        if not isinstance(extra, Mapping):
            raise self.err("extra_config", "must be a mapping")
        tc_raw = extra.get("tiered_cache") or {}
        if not isinstance(tc_raw, Mapping):
            raise self.err("extra_config", "tiered_cache must be a mapping")
        # ${VAR} inside our own section, as load_config does for our YAML (LMCache itself
        # expands nothing, so its keys are left alone).
        env = EnvSubstitution(copy.deepcopy(dict(tc_raw)))
        if env.errors:
            raise ConfigError(
                f"{self.where}: " + "; ".join(f"extra_config.tiered_cache.{x}" for x in env.errors)
            )
        tc: dict[str, Any] = env.data
        for path, owner in _OWNED.items():
            node: Any = tc
            for part in path:
                node = node.get(part, _MISSING) if isinstance(node, Mapping) else _MISSING
            if node is not _MISSING:
                raise ConfigError(
                    f"{self.where}: extra_config.tiered_cache.{'.'.join(path)}: set by "
                    f"LMCache's {owner}; remove it here"
                )
        for sect in ("dram", "nvme", "s3", "agent"):
            if sect in tc and not isinstance(tc[sect], Mapping):
                raise ConfigError(
                    f"{self.where}: extra_config.tiered_cache.{sect}: must be a mapping"
                )
            tc[sect] = dict(tc.get(sect) or {})

        if lm.chunk_size is None or int(lm.chunk_size) < 1:
            raise self.err("chunk_size", f"must be >= 1, got {lm.chunk_size!r}")
        tc["chunk_size"] = int(lm.chunk_size)
        tc["save_unfull_chunk"] = bool(lm.save_unfull_chunk)
        self.tc = tc
        dram_on = self._dram(tc["dram"])
        nvme_on = self._nvme(tc["nvme"], extra)
        s3_on = self._s3(tc["s3"], extra)
        self._report(extra)  # before the errors below: it explains what was dropped
        if not (dram_on or nvme_on or s3_on):
            raise ConfigError(
                f"{self.where}: local_cpu, local_disk, remote_url: no tier to store chunks in "
                "(LMCache's local_cpu: false keeps CPU memory as a staging buffer only); "
                "enable local_cpu, or set local_disk or an s3:// remote_url"
            )
        self._policy()
        try:
            return CacheConfig.model_validate(tc)
        except ValidationError as e:
            # Everything LMCache-derived was checked above, so what is left is ours.
            raise ConfigError(
                f"{self.where}: {format_validation_error(e, 'extra_config.tiered_cache', env=env)}"
            ) from None

    def _size(self, name: str) -> float:
        v = getattr(self.lm, name)
        if v is None or not math.isfinite(float(v)) or float(v) < 0:
            raise self.err(name, f"must be a size in GB >= 0, got {v!r}")
        return float(v)

    def _dram(self, dram: dict[str, Any]) -> bool:
        size = self._size("max_local_cpu_size")
        if self.lm.local_cpu and size == 0 and "local_cpu" in self.user_set:
            raise self.err("max_local_cpu_size", "is 0 but local_cpu is true; give it a size")
        # LMCache creates no CPU cache when either is off (local_cpu: false = staging only).
        on = bool(self.lm.local_cpu) and size > 0
        dram["enabled"] = on
        if on:
            dram["capacity"] = int(size * GIB)
        return on

    def _nvme(self, nvme: dict[str, Any], extra: Mapping[str, Any]) -> bool:
        size = self._size("max_local_disk_size")
        disk = (self.lm.local_disk or "").strip()
        if not disk:
            if size > 0:
                raise self.err("max_local_disk_size", "is set but local_disk is not")
            nvme["enabled"] = False
            return False
        if size == 0:
            raise self.err(
                "max_local_disk_size",
                f"must be > 0 when local_disk is set (LMCache's default is 0, which "
                f"would silently disable the disk at {disk})",
            )
        paths = [p for p in disk.split(",") if p.strip()]
        if len(paths) > 1:
            raise self.err("local_disk", f"tiered-cache takes one directory, got {len(paths)}")
        # LMCache already stripped file://; file:///abs and file://rel both land here.
        # Relative paths are relative to the working directory, as in LMCache.
        nvme.update(
            enabled=True,
            path=os.path.abspath(os.path.expanduser(paths[0].strip())),
            capacity=int(size * GIB),
        )
        # LMCache writes every stored chunk to every tier.
        nvme.setdefault("write_mode", "write_through")
        if "use_odirect" in extra:
            self._set("nvme", "o_direct", bool(extra["use_odirect"]), "extra_config.use_odirect")
        return True

    def _s3(self, s3: dict[str, Any], extra: Mapping[str, Any]) -> bool:
        url = self.lm.remote_url
        timeout = self.lm.blocking_timeout_secs
        if timeout is None or not int(timeout) > 0:
            raise self.err("blocking_timeout_secs", f"must be > 0, got {timeout!r}")
        if not url or str(url).strip().lower() in ("none", "null"):
            s3["enabled"] = False
            return False
        url = str(url).strip()
        u = urlsplit(url)
        if u.scheme != "s3":
            raise self.err(
                "remote_url",
                f"tiered-cache's remote tier is S3 (s3://bucket/prefix); {u.scheme or url!r} "
                "remotes are LMCache's own and not supported",
            )
        if "@" in url:
            raise self.err("remote_url", "must not contain credentials")
        tls_off = bool(extra.get("disable_tls", False))
        host = u.netloc
        region: str | None = None
        endpoint: str | None = None
        aws = _AWS_HOST.match(host)
        if aws:  # LMCache's AWS form: s3://BUCKET.s3[express-AZ].REGION.amazonaws.com
            bucket, region = aws["bucket"], aws["region"]
        elif ":" in host:  # LMCache's virtual-host form for other stores: s3://BUCKET.HOST:PORT
            bucket, _, rest = host.partition(".")
            if not rest:
                raise self.err("remote_url", f"expected s3://bucket/prefix, got {url!r}")
            endpoint = f"{'http' if tls_off else 'https'}://{rest}"
        else:
            bucket = host
        if not _BUCKET.match(bucket):
            raise self.err("remote_url", f"{bucket!r} is not a valid S3 bucket name")
        if extra.get("s3_region") is not None:
            r = str(extra["s3_region"])
            if region and r != region:
                raise self.err(
                    "extra_config", f"s3_region {r!r} contradicts remote_url's region {region!r}"
                )
            region = r
        if extra.get("s3_endpoint") is not None:
            ep = str(extra["s3_endpoint"]).strip()
            if endpoint or aws:
                raise self.err(
                    "extra_config", "s3_endpoint given, but remote_url already names the host"
                )
            if "://" not in ep:
                ep = f"{'http' if tls_off else 'https'}://{ep}"
            elif tls_off and ep.startswith("https://"):
                raise self.err("extra_config", f"disable_tls is true but s3_endpoint is {ep!r}")
            endpoint = ep
        s3.update(
            enabled=True,
            url=f"s3://{bucket}{u.path if u.path not in ('', '/') else ''}",
            endpoint_url=endpoint,
            region=region,
        )
        s3.setdefault("write_mode", "write_through")
        self._set("s3", "read_timeout_s", float(timeout), "blocking_timeout_secs")
        if "s3_num_io_threads" in extra:
            n = extra["s3_num_io_threads"]
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 512:
                raise self.err("extra_config", f"s3_num_io_threads must be 1..512, got {n!r}")
            self._set("s3", "max_concurrency", n, "extra_config.s3_num_io_threads")
        return True

    def _set(self, tier: str, field: str, value: Any, lm_key: str) -> None:
        """An LMCache value that our own section may also give: the two must agree when
        both were set explicitly; ours wins over an LMCache default."""
        sect = self.tc[tier]
        top = lm_key.split(".", 1)[0]
        explicit = top == "extra_config" or top in self.user_set
        if field not in sect:
            sect[field] = value
        elif explicit and str(sect[field]).lower() != str(value).lower():
            named = lm_key if top == "extra_config" else self.key(top)
            raise ConfigError(
                f"{self.where}: extra_config.tiered_cache.{tier}.{field}: {sect[field]!r} "
                f"contradicts {named} ({value!r}); set one of them"
            )

    def _policy(self) -> None:
        name = str(self.lm.cache_policy or "").strip().upper()
        if name not in _POLICIES:
            hint = (
                "no tiered-cache policy evicts the most recent chunk"
                if name == "MRU"
                else f"unknown policy {self.lm.cache_policy!r}"
            )
            raise self.err(
                "cache_policy",
                f"{hint}; use one of {', '.join(_POLICIES)}, or choose per tier with "
                "extra_config.tiered_cache.<dram|nvme|s3>.eviction",
            )
        ours, note = _POLICIES[name]
        for tier in ("dram", "nvme"):
            self._set(tier, "eviction", ours, "cache_policy")
        if note and "cache_policy" in self.user_set:
            _warn_once(f"{self.where}: cache_policy {name} runs as tiered-cache's {note}")

    def _report(self, extra: Mapping[str, Any]) -> None:
        lm = self.lm
        ignored: list[str] = []
        for name in sorted(self.user_set - _MAPPED):
            if getattr(lm, name) != self.defs[name]["default"]:
                ignored.append(name)
        if lm.save_decode_cache:
            ignored.append("save_decode_cache")
        ignored += [f"extra_config.{k}" for k in sorted(extra) if k not in _EXTRA_MAPPED]
        ignored += [f"{k} (unknown to LMCache)" for k in self.unknown]
        if ignored:
            items = [f"{k} ({_HINTS[k]})" if k in _HINTS else k for k in ignored]
            _warn_once(
                f"{self.where}: ignoring LMCache settings tiered-cache does not support: "
                + ", ".join(items)
                + ". See docs/lmcache.md."
            )


def load_lmcache_config(path: str | os.PathLike[str]) -> CacheConfig:
    """CacheConfig from an LMCache YAML file, with ``LMCACHE_*`` environment overrides."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{p}: top level must be a mapping")
    m = _Mapper(p, raw)
    return m.build()


class _LMCacheFormat:
    """LMCache's YAML as a config format ``tiered_cache.config.load_config`` reads (the
    ``tiered_cache.config_formats`` entry point)."""

    name = "lmcache"

    def detect(self, data: Mapping[str, Any], where: str) -> bool:
        return is_lmcache_config(data, where)

    def load(self, path: Path) -> CacheConfig:
        return load_lmcache_config(path)


FORMAT = _LMCacheFormat()
