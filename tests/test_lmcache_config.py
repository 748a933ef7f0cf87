"""LMCache's YAML (LMCACHE_CONFIG_FILE + LMCACHE_* overrides) loads as our CacheConfig.

The example YAMLs are LMCache's own, copied by hand from the LMCache repository
(github.com/LMCache/LMCache); each test names the file it comes from.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from connectors import lmcache_config
from tiered_cache.config import CacheConfig, ConfigError, load_config

pytestmark = pytest.mark.lmcache
pytest.importorskip("lmcache")

GIB = 2**30
CONFIGS = Path(__file__).parents[1] / "configs"
LOGGER = "connectors.lmcache_config"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # LMCache reads every LMCACHE_<KEY>; none may leak in from the caller's environment.
    for k in list(os.environ):
        if k.startswith("LMCACHE_"):
            monkeypatch.delenv(k)
    lmcache_config._warned.clear()
    yield
    lmcache_config._warned.clear()


def write(tmp_path: Path, text: str, name: str = "lmcache.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def ignored(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The single 'ignoring LMCache settings' warning, split into its items."""
    msgs = [
        r.getMessage() for r in caplog.records if r.name == LOGGER and "ignoring" in r.getMessage()
    ]
    assert len(msgs) <= 1, msgs
    if not msgs:
        return []
    body = msgs[0].split("does not support: ", 1)[1].removesuffix(". See docs/lmcache.md.")
    return [item.split(" (", 1)[0] for item in body.split(", ")]


# ------------------------------------------------------------- LMCache's own examples


def test_example_disk_offload(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # docs/source/kv_cache/storage_backends/local_storage.rst, "disk-offload.yaml".
    p = write(
        tmp_path,
        """\
chunk_size: 256
local_cpu: false
max_local_cpu_size: 5.0
local_disk: "file:///local/disk_test/local_disk/"
max_local_disk_size: 5.0
""",
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = load_config(p)
    # local_cpu: false = CPU memory as a staging buffer only: no DRAM tier.
    assert not cfg.dram.enabled
    assert cfg.nvme.enabled and cfg.nvme.path == "/local/disk_test/local_disk"
    assert cfg.nvme.capacity == 5 * GIB
    assert cfg.nvme.write_mode == "write_through"  # LMCache writes every chunk to each tier
    assert not cfg.s3.enabled
    assert cfg.chunk_size == 256 and cfg.save_unfull_chunk is False  # LMCache's default
    assert ignored(caplog) == []


def test_example_disk_with_odirect(tmp_path: Path) -> None:
    # docs/source/kv_cache/storage_backends/local_storage.rst, "Configuration File".
    p = write(
        tmp_path,
        """\
# 256 Tokens per KV Chunk
chunk_size: 256
# Enable Disk backend
local_disk: "file:///local/disk_test/local_disk/"
# 5GB of Disk memory
max_local_disk_size: 5.0

# Disable page cache
# This should be turned on for better performance if most local CPU memory is used
extra_config: {'use_odirect': True}
""",
    )
    cfg = load_config(p)
    assert cfg.dram.enabled and cfg.dram.capacity == 5 * GIB  # LMCache's default 5 GB
    assert cfg.nvme.enabled and cfg.nvme.o_direct is True
    assert cfg.dram.eviction == cfg.nvme.eviction == "lru"  # cache_policy's default


def test_example_s3(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # examples/kv_cache_reuse/remote_backends/s3/example.yaml, placeholders filled in.
    p = write(
        tmp_path,
        """\
chunk_size: 256
local_cpu: False
max_local_cpu_size: 10
save_unfull_chunk: False

remote_url: "s3://kv--use1-az4--x-s3.s3express-use1-az4.us-east-1.amazonaws.com"
remote_serde: "naive"

blocking_timeout_secs: 100

extra_config:
  s3_num_io_threads: 64
  s3_prefer_http2: True
  s3_region: "us-east-1"
  s3_enable_s3express: True
  aws_access_key_id: "AKIAEXAMPLE"
  aws_secret_access_key: "not-a-secret"
""",
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = load_config(p)
    assert not cfg.dram.enabled and not cfg.nvme.enabled
    assert cfg.s3.enabled and cfg.s3.url == "s3://kv--use1-az4--x-s3"
    assert cfg.s3.region == "us-east-1" and cfg.s3.endpoint_url is None  # AWS
    assert cfg.s3.read_timeout_s == 100.0  # blocking_timeout_secs
    assert cfg.s3.max_concurrency == 64  # s3_num_io_threads
    assert ignored(caplog) == [
        "extra_config.aws_access_key_id",
        "extra_config.aws_secret_access_key",
        "extra_config.s3_prefer_http2",
    ]
    assert "AWS credential chain" in caplog.text


def test_at_rest_settings_ride_in_extra_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # LMCache's remote_serde (its own CacheGen/serde path) means nothing to our tiers: it is
    # named with the keys that do the same here, and those pass through to each tier.
    p = write(
        tmp_path,
        f"""\
local_disk: "file://{tmp_path}/disk"
max_local_disk_size: 1
remote_url: "s3://kv-bucket/p"
remote_serde: "cachegen"
extra_config:
  tiered_cache:
    nvme: {{codec: zstd, encrypt: true}}
    s3: {{codec: zstd-planes, encrypt: true}}
""",
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = load_config(p)
    assert (cfg.nvme.codec, cfg.nvme.encrypt) == ("zstd", True)
    assert (cfg.s3.codec, cfg.s3.encrypt) == ("zstd-planes", True)
    assert ignored(caplog) == ["remote_serde"]
    assert "extra_config.tiered_cache.<nvme|s3>.codec" in caplog.text
    bad = write(tmp_path, "local_cpu: true\nextra_config: {tiered_cache: {s3: {codec: lz5}}}\n",
                "bad.yaml")  # fmt: skip
    with pytest.raises(ConfigError, match=r"extra_config\.tiered_cache\.s3\.codec"):
        load_config(bad)


def test_example_sglang_layerwise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # examples/sgl_integration/lmcache_config.yaml
    p = write(
        tmp_path,
        """\
# Basic configurations
chunk_size: 256

# CPU offloading configurations
local_cpu: true
use_layerwise: true
max_local_cpu_size: 20
save_unfull_chunk: false
""",
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = load_config(p)
    assert cfg.dram.enabled and cfg.dram.capacity == 20 * GIB
    assert not cfg.nvme.enabled and not cfg.s3.enabled
    assert ignored(caplog) == ["use_layerwise"]


def test_example_p2p_sharing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # examples/kv_cache_reuse/share_across_instances/p2p_sharing/example1.yaml
    p = write(
        tmp_path,
        """\
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5
enable_async_loading: True

# P2P configurations
enable_p2p: True
p2p_host: "localhost"
p2p_init_ports: 8200
p2p_lookup_ports: 8201
transfer_channel: "nixl"

# Controller configurations
enable_controller: True
lmcache_instance_id: "lmcache_instance_1"
controller_pull_url: "localhost:8300"
controller_reply_url: "localhost:8400"
lmcache_worker_ports: 8500

extra_config:
  lookup_backoff_time: 0.001
""",
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = load_config(p)
    assert cfg.dram.enabled and cfg.dram.capacity == 5 * GIB
    # Cross-node sharing is our directory + peer transfers, not LMCache's P2P/controller.
    assert sorted(ignored(caplog)) == sorted(
        [
            "controller_pull_url",
            "controller_reply_url",
            "enable_async_loading",
            "enable_controller",
            "enable_p2p",
            "lmcache_instance_id",
            "lmcache_worker_ports",
            "p2p_host",
            "p2p_init_ports",
            "p2p_lookup_ports",
            "transfer_channel",
            "extra_config.lookup_backoff_time",
        ]
    )


def test_example_blending(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # examples/blend_kv_v1/blending.yaml
    p = write(
        tmp_path,
        """\
chunk_size: 256
enable_blending: true
use_layerwise: true
local_cpu: true
max_local_cpu_size: 5
blend_special_str: " # # "
""",
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = load_config(p)
    # LMCache's own validation turns save_unfull_chunk on for blending; we see its result.
    assert cfg.save_unfull_chunk is True
    # blend_special_str is set to its default, so it changes nothing and is not listed.
    assert ignored(caplog) == ["enable_blending", "use_layerwise"]


def test_example_pd_prefiller(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # examples/disagg_prefill/1p1d/configs/lmcache-prefiller-config.yaml: a NIXL sender
    # that keeps nothing locally. Under tiered-cache the handoff goes through our tiers,
    # so it has nowhere to store: an error naming the keys, after the warning that lists
    # the PD keys dropped.
    p = write(
        tmp_path,
        """\
local_cpu: False
save_unfull_chunk: true  # Don't discard partial chunks (< 256 tokens)

enable_pd: True
transfer_channel: "nixl"
pd_role: "sender"
pd_proxy_host: "localhost"
pd_proxy_port: 7500
pd_buffer_size: 1073741824 # 1GB
pd_buffer_device: "cuda"
nixl_backends: [UCX]
""",
    )
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        pytest.raises(ConfigError, match="local_cpu, local_disk, remote_url: no tier"),
    ):
        load_config(p)
    assert sorted(ignored(caplog)) == sorted(
        [
            "enable_pd",
            "nixl_backends",
            "pd_buffer_device",
            "pd_buffer_size",
            "pd_proxy_host",
            "pd_proxy_port",
            "pd_role",
            "transfer_channel",
        ]
    )


def test_example_pd_decoder_with_lm_remote(tmp_path: Path) -> None:
    # examples/disagg_prefill/1p1d/configs/lmcache-decoder-pd-with-remote-config.yaml
    p = write(
        tmp_path,
        """\
local_cpu: True
max_local_cpu_size: 5

remote_url: "lm://localhost:6800"
remote_serde: "cachegen"

enable_pd: True
transfer_channel: "nixl"
pd_role: "receiver"
pd_retrieve_locations: ["PDBackend"]
pd_store_location: "RemoteBackend"
pd_peer_host: "localhost"
pd_peer_init_port: 7300
pd_peer_alloc_port: 7400
pd_buffer_size: 2147483648 # 2GB
pd_buffer_device: "cuda"
nixl_backends: [UCX]

save_decode_cache: true
save_unfull_chunk: true
""",
    )
    with pytest.raises(ConfigError, match=r"remote_url: tiered-cache's remote tier is S3") as e:
        load_config(p)
    assert "'lm'" in str(e.value)


# ------------------------------------------------------------------ shipped configs

SHIPPED = {
    "lmcache-single-node.yaml": dict(dram=8 * GIB, nvme=200 * GIB, s3=None, redis=False),
    "lmcache-prefill-node.yaml": dict(dram=16 * GIB, nvme=1024 * GIB, s3="write_through",
                                      redis=True),
    "lmcache-decode-node.yaml": dict(dram=16 * GIB, nvme=500 * GIB, s3="write_back",
                                     redis=True),
    "lmcache-multi-node.yaml": dict(dram=32 * GIB, nvme=2048 * GIB, s3="write_back",
                                    redis=True),
    "lmcache-mp-l2.yaml": dict(dram=None, nvme=1024 * GIB, s3="write_back", redis=True),
}  # fmt: skip


def test_every_shipped_lmcache_config_is_tested() -> None:
    assert sorted(p.name for p in CONFIGS.glob("lmcache-*.yaml")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_lmcache_configs_load(
    name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    monkeypatch.setenv("TC_PEER_SECRET", "0123456789abcdef")  # multi-node files
    monkeypatch.setenv("TC_ADMIN_TOKEN", "fedcba9876543210")
    want = SHIPPED[name]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = load_config(CONFIGS / name)
    assert ignored(caplog) == []  # shipped files use only what we support
    assert cfg.chunk_size == 256
    assert cfg.dram.enabled == (want["dram"] is not None)
    if want["dram"] is not None:
        assert cfg.dram.capacity == want["dram"]
    assert cfg.nvme.enabled and cfg.nvme.capacity == want["nvme"]
    assert cfg.nvme.path.startswith("/")
    assert cfg.s3.enabled == (want["s3"] is not None)
    if want["s3"]:
        assert cfg.s3.url == "s3://kv-cache/prod" and cfg.s3.region == "us-east-1"
        assert cfg.s3.write_mode == want["s3"]
    assert bool(cfg.redis_url) == want["redis"]
    if cfg.redis_url:
        assert "${" not in cfg.redis_url
    if name == "lmcache-multi-node.yaml":
        assert cfg.redis_url == "rediss://:s3cret@redis.internal:6380/0"
        assert cfg.nvme.o_direct and cfg.s3.max_concurrency == 32
        assert cfg.s3.read_timeout_s == 20.0 and cfg.agent.auth_token == "fedcba9876543210"
        assert cfg.s3.endpoint_url is None
    if name == "lmcache-single-node.yaml":
        assert cfg.nvme.admission == "frequency" and cfg.nvme.write_mode == "write_back"


def test_mp_l2_config_names_the_plugin_command() -> None:
    text = (CONFIGS / "lmcache-mp-l2.yaml").read_text()
    assert "lmcache server" in text and '"module_path":"connectors.lmcache_mp"' in text


# ------------------------------------------------------------ environment overrides


def test_env_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, "chunk_size: 256\nmax_local_cpu_size: 8\n")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "2")
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "512")
    monkeypatch.setenv("LMCACHE_LOCAL_DISK", "file:///srv/kv/")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_DISK_SIZE", "3")
    monkeypatch.setenv("LMCACHE_CACHE_POLICY", "lfu")
    cfg = load_config(p)
    assert cfg.chunk_size == 512 and cfg.dram.capacity == 2 * GIB
    assert cfg.nvme.path == "/srv/kv" and cfg.nvme.capacity == 3 * GIB
    assert cfg.dram.eviction == cfg.nvme.eviction == "lfu"


def test_env_extra_config_replaces_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # LMCache replaces extra_config wholesale from LMCACHE_EXTRA_CONFIG (JSON).
    p = write(tmp_path, "local_cpu: true\nextra_config: {tiered_cache: {node_id: from-file}}\n")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", '{"tiered_cache": {"node_id": "from-env"}}')
    assert load_config(p).node_id == "from-env"


def test_bad_extra_config_json_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # LMCache would log and drop it; silently losing extra_config.tiered_cache is worse.
    p = write(tmp_path, "max_local_cpu_size: 8\n")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", "{use_odirect: True}")
    with pytest.raises(ConfigError, match=r"extra_config \(from LMCACHE_EXTRA_CONFIG\): invalid"):
        load_config(p)


def test_bad_env_value_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, "max_local_cpu_size: 8\n")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "lots")
    with pytest.raises(
        ConfigError, match=r"max_local_cpu_size \(from LMCACHE_MAX_LOCAL_CPU_SIZE\): invalid"
    ):
        load_config(p)


# ------------------------------------------------------------ LMCACHE_CONFIG_FILE


def test_lmcache_config_file_is_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiered_cache.client import config_from_extra

    p = write(tmp_path, "chunk_size: 128\nmax_local_cpu_size: 1\n"
              "extra_config: {tiered_cache: {node_id: via-env}}\n")  # fmt: skip
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(p))
    for cfg in (load_config(None), config_from_extra({})):  # agent CLI, connector
        assert cfg.node_id == "via-env" and cfg.chunk_size == 128
        assert cfg.dram.capacity == 1 * GIB
    # An explicit config wins over the variable.
    assert load_config({"node_id": "explicit"}).node_id == "explicit"
    assert config_from_extra({"tiered_cache": {"node_id": "inline"}}).node_id == "inline"


def test_lmcache_config_file_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match=r"not found: .*nope.yaml \(from LMCACHE_CONFIG_FILE\)"):
        load_config(None)


def test_lmcache_config_file_may_hold_our_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = write(tmp_path, "node_id: ours\ndram: {capacity: 64MiB}\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(p))
    cfg = load_config(None)
    assert cfg.node_id == "ours" and cfg.dram.capacity == 64 * 2**20


# ------------------------------------------------------------------- the mapping


@pytest.mark.parametrize(
    ("local_disk", "want"),
    [
        ("file:///mnt/nvme0/", "/mnt/nvme0"),
        ("/mnt/nvme0", "/mnt/nvme0"),
        ("file://rel/dir/", "{cwd}/rel/dir"),  # LMCache's examples use file://local_disk/
        ("file://~/kv", "{home}/kv"),
    ],
)
def test_local_disk_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_disk: str, want: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/tc")
    p = write(tmp_path, f"local_disk: {local_disk!r}\nmax_local_disk_size: 1\n")
    cfg = load_config(p)
    assert cfg.nvme.path == want.format(cwd=os.getcwd(), home="/home/tc")


def test_sizes_are_gib(tmp_path: Path) -> None:
    p = write(tmp_path, "max_local_cpu_size: 1.5\nlocal_disk: /d\nmax_local_disk_size: 0.25\n")
    cfg = load_config(p)
    assert cfg.dram.capacity == int(1.5 * 2**30) and cfg.nvme.capacity == 2**28


@pytest.mark.parametrize(
    ("url", "extra", "want"),
    [
        ("s3://kv-cache/prod/v1", {"s3_endpoint": "http://minio:9000", "s3_region": "eu-west-1"},
         ("s3://kv-cache/prod/v1", "http://minio:9000", "eu-west-1")),
        ("s3://kv-cache", {"s3_endpoint": "minio:9000", "disable_tls": True},
         ("s3://kv-cache", "http://minio:9000", None)),
        ("s3://kv-cache", {"s3_endpoint": "minio:9000"},
         ("s3://kv-cache", "https://minio:9000", None)),
        # LMCache's own forms: BUCKET.HOST:PORT, and AWS virtual-host names.
        ("s3://kv-cache.minio.local:9000", {"disable_tls": True},
         ("s3://kv-cache", "http://minio.local:9000", None)),
        ("s3://kv-cache.s3.us-west-2.amazonaws.com", None,
         ("s3://kv-cache", None, "us-west-2")),
    ],
)  # fmt: skip
def test_remote_url_forms(
    tmp_path: Path, url: str, extra: dict[str, Any] | None, want: tuple[str, str | None, str | None]
) -> None:
    doc: dict[str, Any] = {"remote_url": url}
    if extra:
        doc["extra_config"] = extra
    cfg = load_config(write(tmp_path, yaml.safe_dump(doc)))
    assert cfg.s3.enabled
    assert (cfg.s3.url, cfg.s3.endpoint_url, cfg.s3.region) == want
    assert cfg.s3.write_mode == "write_through"


def test_cache_policy_fifo_runs_as_sieve(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = write(tmp_path, "cache_policy: fifo\nlocal_disk: /d\nmax_local_disk_size: 1\n")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = load_config(p)
        load_config(p)  # warned once per process, not per load
    assert cfg.dram.eviction == cfg.nvme.eviction == "sieve"
    notes = [r.getMessage() for r in caplog.records if "cache_policy FIFO" in r.getMessage()]
    assert len(notes) == 1 and "SIEVE" in notes[0]


def test_per_tier_policy_overrides_the_default_cache_policy(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "local_disk: /d\nmax_local_disk_size: 1\n"
        "extra_config:\n  tiered_cache:\n    dram: {eviction: arc}\n"
        "    nvme: {eviction: s3fifo, admission: tinylfu}\n",
    )
    cfg = load_config(p)
    assert (cfg.dram.eviction, cfg.nvme.eviction, cfg.nvme.admission) == (
        "arc", "s3fifo", "tinylfu",
    )  # fmt: skip


def test_pin_file_under_extra_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PIN_DIR", "/srv/git/pins")
    p = write(
        tmp_path,
        "local_cpu: true\n"
        "extra_config:\n  tiered_cache:\n"
        "    agent: {pin_file: '${PIN_DIR}/prod.yaml', auth_token: t0123456789abcdef, peer_port: 7480}\n",
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cfg = load_config(p)
    assert cfg.agent.pin_file == "/srv/git/pins/prod.yaml"
    assert (cfg.agent.auth_token, cfg.agent.peer_port) == ("t0123456789abcdef", 7480)
    assert ignored(caplog) == []


def test_unsupported_keys_are_one_warning_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p = write(
        tmp_path,
        "local_cpu: true\nenable_pd: false\nuse_layerwise: true\nremote_serde: cachegen\n"
        "save_decode_cache: true\npin_timeout_sec: 60\nnot_a_key: 1\n"
        "extra_config: {lookup_backoff_time: 0.1}\n",
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        load_config(p)
        load_config(p)
    # enable_pd: false is LMCache's default, so it changes nothing and is not listed.
    assert ignored(caplog) == [
        "pin_timeout_sec",
        "remote_serde",
        "use_layerwise",
        "save_decode_cache",
        "extra_config.lookup_backoff_time",
        "not_a_key",
    ]
    text = caplog.text
    assert "tiered-cache saves prompt KV only" in text and "unknown to LMCache" in text


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("body", "msg"),
    [
        ("local_disk: /d\n", "max_local_disk_size: must be > 0 when local_disk is set"),
        ("max_local_disk_size: 10\n", "max_local_disk_size: is set but local_disk is not"),
        ("local_cpu: true\nmax_local_cpu_size: 0\n", "max_local_cpu_size: is 0 but local_cpu"),
        ("max_local_cpu_size: -1\n", "max_local_cpu_size: must be a size in GB >= 0"),
        ("max_local_cpu_size: lots\n", "max_local_cpu_size: invalid value 'lots'"),
        ("local_cpu: true\nchunk_size: [1]\n", "chunk_size: invalid value"),
        ("local_cpu: true\nchunk_size: 0\n", "chunk_size: must be >= 1"),
        ("local_disk: true\nmax_local_disk_size: 1\n", "local_disk: expected a directory"),
        ("local_disk: /a,/b\nmax_local_disk_size: 1\n", "local_disk: tiered-cache takes one"),
        ("remote_url: redis://r:6379\n", "remote_url: tiered-cache's remote tier is S3"),
        ("remote_url: s3://Bad_Bucket/x\n", "remote_url: 'Bad_Bucket' is not a valid"),
        ("remote_url: s3://k:s@bucket/x\n", "remote_url: must not contain credentials"),
        ("remote_url: s3://bkt.s3.us-east-1.amazonaws.com\nextra_config: {s3_region: eu-west-1}\n",
         "extra_config: s3_region 'eu-west-1' contradicts remote_url's region 'us-east-1'"),
        ("remote_url: s3://bkt.h:9000\nextra_config: {s3_endpoint: http://h:9000}\n",
         "extra_config: s3_endpoint given, but remote_url already names the host"),
        ("remote_url: s3://bkt\nextra_config: {s3_endpoint: 'https://h', disable_tls: true}\n",
         "extra_config: disable_tls is true but s3_endpoint is 'https://h'"),
        ("remote_url: s3://bkt\nextra_config: {s3_num_io_threads: 0}\n",
         "extra_config: s3_num_io_threads must be 1..512"),
        ("remote_url: s3://bkt\nblocking_timeout_secs: 0\n", "blocking_timeout_secs: must be > 0"),
        ("cache_policy: MRU\n", "cache_policy: no tiered-cache policy evicts the most recent"),
        ("cache_policy: CLOCK\n", "cache_policy: unknown policy 'CLOCK'"),
        ("local_cpu: false\n", "local_cpu, local_disk, remote_url: no tier"),
        ("extra_config: {tiered_cache: {colour: blue}}\n",
         "extra_config.tiered_cache.colour: unknown key"),
        ("extra_config: {tiered_cache: {redis_url: 'http://x'}}\n",
         "extra_config.tiered_cache: redis_url must start with"),
        ("extra_config: {tiered_cache: {dram: {eviction: random}}}\n",
         "extra_config.tiered_cache.dram: unknown eviction policy 'random'; valid:"),
        ("extra_config: {tiered_cache: {dram: {capacity: 1GiB}}}\n",
         "extra_config.tiered_cache.dram.capacity: set by LMCache's max_local_cpu_size"),
        ("extra_config: {tiered_cache: {chunk_size: 64}}\n",
         "extra_config.tiered_cache.chunk_size: set by LMCache's chunk_size"),
        ("extra_config: {tiered_cache: {dram: lots}}\n",
         "extra_config.tiered_cache.dram: must be a mapping"),
        ("extra_config: {tiered_cache: [1]}\n", "extra_config: tiered_cache must be a mapping"),
        ("extra_config: {tiered_cache: {agent: {pin_file: ''}}}\n",
         "extra_config.tiered_cache.agent.pin_file: must be a path to a pin file"),
        ("cache_policy: LFU\nextra_config: {tiered_cache: {dram: {eviction: arc}}}\n",
         "extra_config.tiered_cache.dram.eviction: 'arc' contradicts cache_policy ('lfu')"),
        ("local_disk: /d\nmax_local_disk_size: 1\n"
         "extra_config: {use_odirect: true, tiered_cache: {nvme: {o_direct: false}}}\n",
         "extra_config.tiered_cache.nvme.o_direct: False contradicts extra_config.use_odirect"),
        ("local_cpu: true\ndram: {capacity: 1GiB}\n", "mixes tiered-cache keys (dram)"),
        ("enable_pd: true\npd_role: sender\n", "LMCache rejected it: failed check"),
    ],
)  # fmt: skip
def test_errors_name_the_key(tmp_path: Path, body: str, msg: str) -> None:
    p = write(tmp_path, body)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert msg in str(e.value)
    assert str(e.value).startswith(str(p))


def test_lmcache_assert_names_the_key(tmp_path: Path) -> None:
    # LMCache validates PD with bare asserts; the message quotes the failing check.
    p = write(tmp_path, "enable_pd: true\npd_role: sender\n")
    with pytest.raises(ConfigError, match=r"pd_buffer_size"):
        load_config(p)


def test_our_own_files_are_not_mistaken_for_lmcache(tmp_path: Path) -> None:
    # A typo in our format stays our "unknown key" error, not an LMCache load.
    p = write(tmp_path, "node_id: x\ncolour: blue\n")
    with pytest.raises(ConfigError, match="colour: unknown key"):
        load_config(p)
    assert isinstance(load_config(write(tmp_path, "chunk_size: 64\n", "c.yaml")), CacheConfig)


def test_without_lmcache_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lmcache.v1.config", None)  # import fails
    p = write(tmp_path, "local_cpu: true\nmax_local_cpu_size: 1\n")
    with pytest.raises(ConfigError, match="install the `lmcache` extra"):
        load_config(p)


# -------------------------------------------------------------- into the connector


def test_connector_takes_chunk_size_and_unfull_chunk_from_lmcache_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """chunk_size and save_unfull_chunk of LMCACHE_CONFIG_FILE reach the vLLM connector."""
    pytest.importorskip("vllm")
    from test_connector_unit import FakeBlocks, FakeRequest, sched_output  # type: ignore

    import tiered_cache.client as client
    from tiered_cache.api import MemoryChunkStore

    store = MemoryChunkStore()
    monkeypatch.setattr(client, "open_store", lambda extra: store)
    p = write(tmp_path, "chunk_size: 32\nsave_unfull_chunk: false\nmax_local_cpu_size: 1\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(p))
    sched = _scheduler_connector({})
    assert sched.scheduler._chunk_size == 32
    prompt = list(range(100, 250))  # 150 tokens: 4 chunks of 32 and a 22-token tail
    req = FakeRequest("p1", prompt)
    blocks = list(range(20, 30))
    sched.update_state_after_alloc(req, FakeBlocks(blocks), 0)
    meta = sched.build_connector_meta(sched_output([(req, blocks, 0, len(prompt))]))
    assert [s.num_tokens for s in meta.saves] == [32, 32, 32, 32]  # no tail chunk
    _, params = sched.request_finished(req, blocks)
    assert params["tiered_cache"]["chunks"] == 4 and params["tiered_cache"]["chunk_size"] == 32
    sched.shutdown()
    # kv_connector_extra_config still wins over the file.
    other = _scheduler_connector({"chunk_size": 64, "save_unfull_chunk": True})
    assert other.scheduler._chunk_size == 64 and other.scheduler._save_unfull
    other.shutdown()


def _scheduler_connector(extra: dict[str, Any]) -> Any:
    from types import SimpleNamespace

    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    import connectors.vllm as mod

    ktc = KVTransferConfig(
        kv_connector="TieredCacheConnector",
        kv_connector_module_path="connectors.vllm",
        kv_role="kv_producer",
        kv_connector_extra_config=extra,
    )
    cfg = SimpleNamespace(
        kv_transfer_config=ktc,
        model_config=SimpleNamespace(model="unit/tiny", dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout="LBHNC"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
    )
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    kcc = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    return mod.TieredCacheConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


def test_our_section_takes_env_values_as_strings_and_never_quotes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``extra_config.tiered_cache`` substitutes ``${VAR}`` as our own YAML does: an unset
    variable is an error naming it, and a bad value is reported without quoting it."""
    text = """\
chunk_size: 256
local_cpu: true
max_local_cpu_size: 1.0
extra_config:
  tiered_cache:
    redis_url: "${TC_TEST_REDIS}"
"""
    p = write(tmp_path, text)
    monkeypatch.delenv("TC_TEST_REDIS", raising=False)
    with pytest.raises(ConfigError, match="TC_TEST_REDIS is not set"):
        load_config(p)
    monkeypatch.setenv("TC_TEST_REDIS", "hunter2-secret-password")  # not a URL
    with pytest.raises(ConfigError, match="redis_url") as ei:
        load_config(p)
    assert "hunter2" not in str(ei.value)
