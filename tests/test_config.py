from __future__ import annotations

from pathlib import Path

import pytest

from tiered_cache.config import ConfigError, load_config, parse_duration, parse_size

# LMCache-format files need the lmcache extra: tests/test_lmcache_config.py loads them.
CONFIGS = sorted(
    p
    for p in (Path(__file__).parents[1] / "configs").glob("*.yaml")
    if not p.name.startswith("lmcache-")
)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    cfg = load_config(path)
    assert cfg.dram.enabled or cfg.nvme.enabled or cfg.s3.enabled
    if cfg.redis_url:
        assert "${" not in cfg.redis_url


def test_sizes_and_durations() -> None:
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(512) == 512
    assert parse_duration("24h") == 86400
    assert parse_duration("none") is None
    for bad in ("lots", "-1", True):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        parse_duration("soon")


@pytest.mark.parametrize(
    ("data", "msg"),
    [
        ({"dram": {"capacity": "lots"}}, "dram.capacity"),
        ({"nvme": {"colour": "blue"}}, "nvme.colour: unknown key"),
        ({"dram": {"eviction": "random"}}, "unknown eviction policy 'random'; valid:"),
        ({"redis_url": "http://x"}, "redis_url must start with"),
        ({"s3": {"enabled": True, "url": "bucket"}}, "s3.url must look like"),
        ({"dram": {"enabled": False}}, "enable at least one tier"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"agent": {"pin_file": " "}}, "agent.pin_file: must be a path to a pin file"),
    ],
)
def test_bad_config_names_the_key(data: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        load_config(data)
    assert msg in str(e.value)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("dram: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_pin_file_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIN_DIR", "/srv/git/pins")
    monkeypatch.setenv("HOME", str(tmp_path))
    p = tmp_path / "c.yaml"
    p.write_text("agent: {pin_file: ${PIN_DIR}/prod.yaml}\n")
    assert load_config(p).agent.pin_file == "/srv/git/pins/prod.yaml"
    assert load_config({"agent": {"pin_file": "~/pins.yaml"}}).agent.pin_file == str(
        tmp_path / "pins.yaml"
    )
    assert load_config({}).agent.pin_file is None
