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
    monkeypatch.setenv("TC_PEER_SECRET", "0123456789abcdef")  # multi-node files
    monkeypatch.setenv("TC_ADMIN_TOKEN", "fedcba9876543210")
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


# ${VAR} substitution happens after parsing, into string values only (issue 15, item 12).
SECRET = "Hunter2_s3cr3t"  # not a valid bucket name either


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def _setenv(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_yaml_error_quotes_the_reference_not_the_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TC_TOKEN", SECRET)
    p = _write(tmp_path, "agent: {auth_token: ${TC_TOKEN}, socket: /s\n")  # unclosed
    with pytest.raises(ConfigError, match="invalid YAML") as e:
        load_config(p)
    assert SECRET not in str(e.value)
    assert "agent: {auth_token: ${TC_TOKEN}, socket: /s" in str(e.value)


def test_env_value_is_one_string_never_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _setenv(monkeypatch, TC_NODE="a\nchunk_size: 7", TC_TOKEN="{admin: true, x: 123456}", TC_SOCK="#x")
    p = _write(tmp_path, "node_id: ${TC_NODE}\nagent: {auth_token: ${TC_TOKEN}}\n")
    cfg = load_config(p)
    assert cfg.node_id == "a\nchunk_size: 7"
    assert cfg.chunk_size == 256
    assert cfg.agent.auth_token == "{admin: true, x: 123456}"
    p = _write(tmp_path, "agent:\n  socket: ${TC_SOCK}\n")
    assert load_config(p).agent.socket == "#x"


def test_unset_variable_is_an_error_naming_it_and_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TC_REDIS_URL", raising=False)
    monkeypatch.delenv("TC_ADMIN_TOKEN", raising=False)
    p = _write(tmp_path, "redis_url: ${TC_REDIS_URL}\nagent: {auth_token: ${TC_ADMIN_TOKEN}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "redis_url: environment variable TC_REDIS_URL is not set" in str(e.value)
    assert "agent.auth_token: environment variable TC_ADMIN_TOKEN is not set" in str(e.value)


@pytest.mark.parametrize(
    ("text", "secret", "key"),
    [
        ("redis_url: ${TC_SECRET}\n", SECRET, "redis_url must start with"),
        ("s3: {enabled: true, url: 's3://${TC_SECRET}'}\n", SECRET, "s3.url must look like"),
        ("dram: {capacity: ${TC_SECRET}}\n", SECRET, "dram.capacity: not a size"),
        # a backslash: repr() doubles it, and that form is redacted too
        ("nvme: {capacity: '${TC_SECRET}'}\n", "hunter\\2", "nvme.capacity: not a size"),
    ],
)
def test_validation_error_does_not_quote_env_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, secret: str, key: str
) -> None:
    monkeypatch.setenv("TC_SECRET", secret)
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    msg = str(e.value)
    assert key in msg
    assert secret not in msg and repr(secret)[1:-1] not in msg


def test_env_strings_coerce_to_schema_types(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before parsing-first, `${PORT}` became a YAML int; the schema coerces the string now.
    _setenv(monkeypatch, TC_PORT="8080", TC_ON="true", TC_CAP="2GiB", TC_TTL="90")
    p = _write(
        tmp_path,
        "location_ttl_s: ${TC_TTL}\nagent: {peer_port: ${TC_PORT}}\n"
        "nvme: {enabled: ${TC_ON}, capacity: ${TC_CAP}, path: '${TC_TTL}/x'}\n",
    )
    cfg = load_config(p)
    assert (cfg.agent.peer_port, cfg.nvme.enabled) == (8080, True)
    assert (cfg.nvme.capacity, cfg.location_ttl_s, cfg.nvme.path) == (2 * 2**30, 90.0, "90/x")


def test_env_defaults_and_escape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TC_UNSET", raising=False)
    _setenv(monkeypatch, TC_EMPTY="", TC_SET="set")
    p = _write(
        tmp_path,
        "node_id: ${TC_UNSET:-n1}\n"
        "agent: {socket: '${TC_EMPTY:-/run/s.sock}', pin_file: $${TC_SET},"
        " advertise_host: ${TC_SET:-x}}\n",
    )
    cfg = load_config(p)
    assert (cfg.node_id, cfg.agent.socket) == ("n1", "/run/s.sock")
    assert (cfg.agent.pin_file, cfg.agent.advertise_host) == ("${TC_SET}", "set")
    # an empty string in a file without references is kept as it is
    with pytest.raises(ConfigError, match=r"agent\.pin_file: must be a path to a pin file"):
        load_config(_write(tmp_path, "agent: {pin_file: ''}\n"))
    p = _write(tmp_path, "agent: {auth_token: '${TC_SET-x}'}\n")
    with pytest.raises(ConfigError, match=r"agent.auth_token: bad reference '\$\{TC_SET-x\}'"):
        load_config(p)
