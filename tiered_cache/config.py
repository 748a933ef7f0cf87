"""Configuration schema (pydantic): unknown keys and bad values are errors naming the key.

Sizes accept integers (bytes) or strings with units: ``512MiB``, ``4GiB``, ``1.5GB``.
String values in a YAML file may reference the environment: ``${VAR}``, ``${VAR:-default}``
(``$${`` for a literal ``${``), expanded after parsing (``EnvSubstitution``).
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from tiered_cache.at_rest import CodecName
from tiered_cache.config_values import Size, check_secret, parse_duration, parse_size
from tiered_cache.private_dir import default_runtime_dir
from tiered_cache.tenancy import RouterConfig, TenantName, TenantQuota

__all__ = ["Size", "parse_duration", "parse_size"]  # re-exported: their old home


def _slot_size(v: Any) -> int:
    if isinstance(v, str) and v.strip().lower() == "auto":
        return 0
    return parse_size(v)


EvictionName = str
WriteMode = Literal["write_through", "write_back"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TierPolicy(_Strict):
    # s3prefix: best or near-best prefix-hit ratio on every trace studied (docs/policies.md)
    eviction: EvictionName = "s3prefix"
    admission: str = "always"
    admission_k: int = Field(2, ge=1)
    pin_budget_fraction: float = Field(0.5, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _known_policies(self) -> TierPolicy:
        from policies import ADMISSION_POLICIES, EVICTION_POLICIES

        if self.eviction.lower() not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction policy {self.eviction!r}; valid: "
                + ", ".join(sorted(EVICTION_POLICIES))
            )
        if self.admission.lower() not in ADMISSION_POLICIES:
            raise ValueError(
                f"unknown admission policy {self.admission!r}; valid: "
                + ", ".join(sorted(ADMISSION_POLICIES))
            )
        return self


class DramConfig(TierPolicy):
    enabled: bool = True
    capacity: Size = parse_size("1GiB")
    # The pool's allocation unit: a chunk takes a run of ceil(size / slot_bytes) slots, so
    # chunks of any size fit. auto (0): capacity / 65536, at least 64 KiB.
    slot_bytes: Annotated[int, BeforeValidator(_slot_size)] = 0
    shm_name: str | None = None
    verify_reads: bool = False
    # A clean stop (SIGTERM) leaves the pool for the next agent to adopt (a warm restart);
    # false (or `tiered-cache agent --drop-dram`) removes it.
    keep_on_stop: bool = True


class AtRestPolicy(TierPolicy):
    """The settings of a tier whose bytes outlive the node's memory (NVMe, S3)."""

    enabled: bool = False
    # At rest (tiered_cache.at_rest, docs/operations.md "At rest"): how this tier's writes
    # are stored; a reader opens every codec whatever its own.
    codec: CodecName = "none"
    # Seal every chunk with AES-256-GCM under its tenant's key, derived from the key ring in
    # $TIERED_CACHE_AT_REST_KEYS or the file $TIERED_CACHE_AT_REST_KEY_FILE names (never
    # from this file). A sealing reader takes plaintext copies for misses.
    encrypt: bool = False


class NvmeConfig(AtRestPolicy):
    path: str = Field(default_factory=lambda: os.path.join(default_runtime_dir(), "nvme"))
    capacity: Size = parse_size("10GiB")
    write_mode: WriteMode = "write_back"
    o_direct: bool = False
    max_concurrency: int = Field(8, ge=1, le=256)


class S3Config(AtRestPolicy):
    url: str = ""  # s3://bucket/prefix
    endpoint_url: str | None = None
    region: str | None = None
    capacity: Size | None = None  # None = unbounded
    write_mode: WriteMode = "write_back"
    max_concurrency: int = Field(16, ge=1, le=512)
    connect_timeout_s: float = Field(2.0, gt=0)
    read_timeout_s: float = Field(10.0, gt=0)
    max_attempts: int = Field(4, ge=1, le=20)
    # Without a capacity, the most objects the local index remembers (least recently
    # written or read go first; a forgotten object is found again by a HEAD). With one,
    # every object is indexed: each counts against the budget.
    index_max_entries: int = Field(100_000, ge=1)

    @model_validator(mode="after")
    def _url(self) -> S3Config:
        if self.enabled and not re.match(
            r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$", self.url
        ):
            raise ValueError(f"s3.url must look like s3://bucket/prefix, got {self.url!r}")
        return self


class AgentConfig(_Strict):
    socket: str | None = None  # default: <runtime dir>/<node_id>.sock (private_dir.py)
    peer_host: str = "127.0.0.1"  # the address the peer port binds
    peer_port: int | None = Field(None, ge=0, le=65535)
    # The address other nodes reach the peer port at, published in the directory. Default:
    # ``peer_host``, unless that is a wildcard (0.0.0.0, ::): then the address of this
    # node's interface towards the Redis directory (see ``tiered_cache.netaddr``).
    advertise_host: str | None = None
    metrics_port: int | None = Field(None, ge=0, le=65535)
    # The address Prometheus' /metrics binds: loopback unless exposed on purpose (0.0.0.0,
    # or this node's address on the monitoring network).
    metrics_host: str = Field("127.0.0.1", min_length=1)
    # Admin ops (pin add/rm, evict, flush, warm, clear) need it when set; placeholders and
    # anything under 16 characters are refused. Set it from the environment:
    # ``${TC_ADMIN_TOKEN}``.
    auth_token: str | None = None
    # Local uids besides the agent's own and root that may write chunks and run admin ops
    # over the socket (the kernel names a client's uid: SO_PEERCRED).
    allowed_uids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    usage_log_interval_s: float = Field(60.0, gt=0)
    pin_sync_interval_s: float = Field(2.0, gt=0)
    # Bytes that queued background copies (write-through, promotions) may hold; a copy
    # over it is skipped and counted (tiered_cache_background_dropped_total).
    max_background_bytes: Size = Field(parse_size("256MiB"), ge=1)
    # A pin list (the YAML `tiered-cache pin export` writes) the agent imports at start-up
    # and on SIGHUP, as `tiered-cache pin import FILE` does (without --prune).
    pin_file: str | None = None
    # The peer port (docs/operations.md, "Peer port security"): a secret shared by every
    # node (set it from the environment: ``${TC_PEER_SECRET}``) makes each connection
    # start with a mutual HMAC handshake; without one the port serves anyone reaching it.
    peer_secret: SecretStr | None = None
    peer_handshake_timeout_s: float = Field(5.0, gt=0)
    peer_idle_timeout_s: float = Field(30.0, gt=0)  # no complete request for this long
    peer_max_connections: int = Field(256, ge=1)
    # A peer's reply (the chunk included) not in within this is a failed fetch: it opens
    # that peer's breaker and reads go elsewhere (docs/operations.md, "Slow or hung peers").
    peer_fetch_timeout_s: float = Field(10.0, gt=0)

    @field_validator("peer_secret")
    @classmethod
    def _peer_secret(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None:
            return None
        s = v.get_secret_value()
        unset = re.fullmatch(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", s.strip())
        if unset:  # a loader that leaves an unset variable as written (LMCache's)
            raise ValueError(
                f"environment variable {unset.group(1)} is not set (export the cluster's"
                " shared secret on every node, or remove peer_secret)"
            )
        if len(s) < 16:  # a short key falls to an offline guess from one handshake
            raise ValueError("must be at least 16 characters (e.g. `openssl rand -hex 32`)")
        return v

    @field_validator("auth_token")
    @classmethod
    def _auth_token(cls, v: str | None) -> str | None:
        return None if v is None else check_secret(v, "admin token", "TC_ADMIN_TOKEN")

    @field_validator("pin_file")
    @classmethod
    def _pin_file(cls, v: str | None) -> str | None:
        # ${VAR} is expanded by EnvSubstitution (file values); ~ here.
        if v is not None and not v.strip():
            raise ValueError("must be a path to a pin file (or leave it out)")
        return os.path.expanduser(v) if v is not None else None


class KVEventsConfig(_Strict):
    """vLLM-format KV events of this node's tiers, for external routers (llm-d, Dynamo):
    ``tiered_cache.kv_events``, docs/operations.md "KV events"."""

    enabled: bool = False
    # PUB socket (vLLM's ``endpoint``). Loopback by default, and not vLLM's 5557, which an
    # engine on the same host may hold; ``tcp://*:5567`` serves other hosts.
    endpoint: str = "tcp://127.0.0.1:5567"
    # Bind the PUB socket at ``endpoint`` (consumers connect: llm-d's pod discovery), or
    # connect it to a consumer that binds there (llm-d's indexer at a fixed address).
    bind: bool = True
    # ROUTER socket for replays (vLLM's ``replay_endpoint``); null: no replay.
    replay_endpoint: str | None = "tcp://127.0.0.1:5568"
    # ZMQ topic; {node_id} and {model} (the served model name of the chunk's writer) are
    # filled in. llm-d reads pod and model from topics like "kv@{node_id}@{model}".
    topic: str = ""
    buffer_steps: int = Field(10_000, ge=1)  # batches kept for replay
    hwm: int = Field(100_000, ge=1)  # PUB high-water mark (messages per subscriber)
    batch_events: int = Field(512, ge=1, le=100_000)  # a batch goes out at this many events
    flush_s: float = Field(0.005, gt=0, le=10)  # or once its first event waited this long
    # Descriptions of chunks no tier holds yet (they arrive before the chunk): kept LRU.
    max_pending_descriptions: int = Field(4096, ge=0)
    # Where descriptions of resident chunks are kept across restarts (default: the
    # runtime directory, "<node_id>.kvevents").
    state_path: str | None = None

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(tcp|ipc|inproc)://.+", v):
            raise ValueError(f"must be a ZMQ endpoint (tcp://host:port, ipc://path), got {v!r}")
        return v

    @field_validator("topic")
    @classmethod
    def _topic(cls, v: str) -> str:
        try:
            v.format(node_id="n", model="m")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"only {{node_id}} and {{model}} may be filled in ({e})") from None
        return v


class CacheConfig(_Strict):
    node_id: str = Field(default_factory=lambda: socket.gethostname())
    chunk_size: int = Field(256, ge=1)
    # Whether the connector stores a prompt's last, partial chunk (LMCache's
    # save_unfull_chunk); kv_connector_extra_config.save_unfull_chunk overrides it.
    save_unfull_chunk: bool = True
    # Part of the model fingerprint (so of every chunk key): bump it to retire all KV
    # cached so far, e.g. after new weights whose files look unchanged.
    # kv_connector_extra_config.cache_epoch overrides it.
    cache_epoch: str = Field("", max_length=64)
    # How the fingerprint identifies a local checkpoint's files: "stat" (names, sizes,
    # mtimes), "size" (names and sizes: for nodes whose copies differ only in mtime), "off".
    weights_identity: Literal["stat", "size", "off"] = "stat"
    redis_url: str | None = None
    location_ttl_s: float = Field(3600.0, gt=0)
    heartbeat_ttl_s: float = Field(15.0, gt=0)
    dram: DramConfig = Field(default_factory=lambda: DramConfig())
    nvme: NvmeConfig = Field(default_factory=lambda: NvmeConfig())
    s3: S3Config = Field(default_factory=lambda: S3Config())
    agent: AgentConfig = Field(default_factory=lambda: AgentConfig())
    router: RouterConfig = Field(default_factory=lambda: RouterConfig())
    kv_events: KVEventsConfig = Field(default_factory=lambda: KVEventsConfig())
    # Per-tenant byte quotas per tier (docs/operations.md, "Tenancy"), by tenant name.
    tenants: dict[TenantName, TenantQuota] = Field(default_factory=dict)

    @field_validator("cache_epoch", mode="before")
    @classmethod
    def _epoch(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise ValueError("must be a string or an integer")
        return str(v).strip()

    @model_validator(mode="after")
    def _some_tier(self) -> CacheConfig:
        if not (self.dram.enabled or self.nvme.enabled or self.s3.enabled):
            raise ValueError("enable at least one tier (dram, nvme or s3)")
        if self.redis_url and not re.match(r"^(rediss?|unix|redis\+cluster)://", self.redis_url):
            # Quote only a real scheme: text before the first ':' of a scheme-less value
            # may be a user name or a password (e.g. from ${REDIS_URL}).
            m = re.match(r"^([A-Za-z][A-Za-z0-9+.\-]*)://", self.redis_url)
            got = f"got scheme {m.group(1)!r}" if m else "got no scheme"
            raise ValueError(
                "redis_url must start with redis://, rediss://, unix:// or redis+cluster://"
                f" ({got})"
            )
        return self

    @property
    def socket_path(self) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.node_id)
        return self.agent.socket or os.path.join(default_runtime_dir(), f"{safe}.sock")

    @property
    def kv_events_state_path(self) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.node_id)
        return self.kv_events.state_path or os.path.join(default_runtime_dir(), f"{safe}.kvevents")

    @property
    def dram_shm_name(self) -> str:
        safe = re.sub(r"[^A-Za-z0-9_]", "_", self.node_id)
        return self.dram.shm_name or f"tiered_cache_{safe}"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""


def format_validation_error(
    e: ValidationError, prefix: str = "", env: EnvSubstitution | None = None
) -> str:
    """``loc: message`` per error; ``prefix`` names where the validated mapping sits.
    ``env``: the substitution that produced the input, whose values are redacted."""
    parts = []
    for err in e.errors():
        loc = ".".join([prefix] * bool(prefix) + [str(x) for x in err["loc"]]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        if env is not None:
            msg = env.redact(msg, err["loc"])
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


# ${NAME} or ${NAME:-default}; $${ escapes. The body is checked apart, so that anything else
# in ${...} is an error rather than text left as it is.
_REF_RE = re.compile(r"\$(\$?)\{([^}]*)(\}?)")
_BODY_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


# A well-formed reference as written in the file. Its default holds no quote or backslash:
# those are YAML escapes, so such a reference is left to YAML and read after parsing.
_TEXT_REF_RE = re.compile(r"\$?\$\{[A-Za-z_][A-Za-z0-9_]*(?::-[^}\n'\"\\]*)?\}")


def _parse_yaml(text: str, where: str) -> Any:
    """``text`` parsed with its ``${...}`` references kept as written. Each is masked by a
    plain word of its own length while YAML parses, so one may stand unquoted in a flow
    mapping (``{url: ${URL}}``, where ``{`` would be structure), then put back in keys and
    values; a YAML error quotes the file's text with the same columns."""
    masks: dict[str, str] = {}

    def mask(m: re.Match[str]) -> str:
        # "z" first: no YAML scalar type (bool, null, number, date) starts with it.
        while True:
            word = "z" + secrets.token_hex(len(m.group(0)))[: len(m.group(0)) - 1]
            if word not in text and not any(word in w or w in word for w in masks):
                masks[word] = m.group(0)
                return word

    masked = _TEXT_REF_RE.sub(mask, text)
    # (?!) matches nothing: without masks an empty pattern would match every "".
    found = re.compile("|".join(map(re.escape, sorted(masks, key=len, reverse=True))) or "(?!)")

    def unmask(v: Any) -> Any:
        if isinstance(v, str):
            return found.sub(lambda m: masks[m.group(0)], v)
        if isinstance(v, list):
            return [unmask(x) for x in v]
        if isinstance(v, dict):
            return {unmask(k): unmask(x) for k, x in v.items()}
        return v

    try:
        return unmask(yaml.safe_load(masked))
    except yaml.YAMLError as e:
        if isinstance(e, yaml.MarkedYAMLError):
            for mark in (e.context_mark, e.problem_mark):
                if mark is not None and mark.buffer is not None:
                    mark.buffer = text + "\0"  # the snippet from the file as written
        raise ConfigError(f"{where}: invalid YAML: {unmask(str(e))}") from None


class EnvSubstitution:
    """``${VAR}`` references in the string values of a parsed config tree, replaced from
    ``os.environ`` (``data``). Substituting after parsing keeps an environment value one
    string (never YAML structure); the schema coerces it (``"8080"`` to an int field).

    ``errors`` lists unset variables and malformed references by key path; ``redact``
    takes substituted values back out of an error message."""

    def __init__(self, tree: Any, environ: Mapping[str, str] | None = None) -> None:
        self._env = os.environ if environ is None else environ
        self.errors: list[str] = []
        # key path -> (text that may be quoted, what to show instead), per substituted value
        self._secrets: list[tuple[tuple[str, ...], str, str]] = []
        self.data = self._walk(tree, ())

    def _walk(self, v: Any, path: tuple[str, ...]) -> Any:
        if isinstance(v, str):
            return self._string(v, path) if "${" in v else v
        if isinstance(v, list):
            return [self._walk(x, (*path, str(i))) for i, x in enumerate(v)]
        if isinstance(v, dict):
            return {k: self._walk(x, (*path, str(k))) for k, x in v.items()}
        return v

    def _string(self, text: str, path: tuple[str, ...]) -> str:
        where = ".".join(path) or "(top level)"
        used: list[tuple[str, str]] = []

        def one(m: re.Match[str]) -> str:
            if m.group(1):  # $${...}: the literal ${...}
                return m.group(0)[1:]
            ref = _BODY_RE.fullmatch(m.group(2))
            if not m.group(3) or not ref:
                self.errors.append(
                    f"{where}: bad reference {m.group(0)!r}: use ${{VAR}} or ${{VAR:-default}}"
                    " ($${ for a literal ${)"
                )
                return m.group(0)
            name, default = ref.group(1), ref.group(2)
            value = self._env.get(name)
            if value is None or (value == "" and default is not None):
                if default is None:
                    self.errors.append(f"{where}: environment variable {name} is not set")
                    return m.group(0)
                return default
            used.append((value, f"${{{name}}}"))
            return value

        out = _REF_RE.sub(one, text)
        if used:
            for secret, shown in [(out, text), *used]:
                self._secrets += [
                    (path, form, shown) for form in {secret, repr(secret)[1:-1]} if form
                ]
        return out

    def redact(self, msg: str, loc: tuple[int | str, ...] = ()) -> str:
        """``msg`` (an error at key path ``loc``) with each environment value substituted
        at, above or below ``loc`` replaced by its reference: a validator may quote its
        own input, or a whole model's. Longest first, so a value is never half-replaced."""
        at = tuple(str(x) for x in loc)
        near = [
            (form, shown)
            for path, form, shown in self._secrets
            if path[: len(at)] == at or at[: len(path)] == path
        ]
        for form, shown in sorted(near, key=lambda fs: -len(fs[0])):
            msg = msg.replace(form, shown)
        return msg


FORMATS_GROUP = "tiered_cache.config_formats"


class ConfigFormat(Protocol):
    """Another YAML format an adapter maps onto ``CacheConfig``."""

    name: str

    def detect(self, data: Mapping[str, Any], where: str) -> bool:
        """Whether ``data`` (a parsed file) is in this format; ConfigError if it mixes."""
        ...

    def load(self, path: Path) -> CacheConfig: ...


def config_formats() -> list[ConfigFormat]:
    """The formats adapters plug in through the ``tiered_cache.config_formats`` entry
    point group: the core names no adapter module (LMCache's lives in ``connectors``)."""
    return [ep.load() for ep in entry_points(group=FORMATS_GROUP)]


def load_config(source: str | os.PathLike[str] | dict[str, Any] | None = None) -> CacheConfig:
    """Load from a YAML path or a dict. ``None`` gives the file named by
    ``LMCACHE_CONFIG_FILE`` if set (LMCache's way to name its YAML), else the embedded
    defaults. A file in another format is read by the adapter that claims it
    (``config_formats``: LMCache's YAML is mapped by ``connectors.lmcache_config``)."""
    if source is None and os.environ.get("LMCACHE_CONFIG_FILE"):
        source = os.environ["LMCACHE_CONFIG_FILE"]
        if not Path(source).is_file():
            raise ConfigError(f"config file not found: {source} (from LMCACHE_CONFIG_FILE)")
    env: EnvSubstitution | None = None  # a dict (inline or an adapter's) is taken as it is
    if source is None:
        data: Any = {}
        where = "defaults"
    elif isinstance(source, dict):
        data, where = source, "config"
    else:
        p = Path(source)
        where = str(p)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        # Parsed as written: ${VAR} is substituted below, into string values only, so an
        # environment value (a secret) is never YAML and never quoted in a YAML error.
        data = _parse_yaml(text, where) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
        for fmt in config_formats():
            if fmt.detect(data, where):
                return fmt.load(p)
        if "tiered_cache" in data and isinstance(data["tiered_cache"], dict):
            data = data["tiered_cache"]
        env = EnvSubstitution(data)
        if env.errors:
            raise ConfigError(f"{where}: " + "; ".join(env.errors))
        data = env.data
    try:
        return CacheConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{where}: {format_validation_error(e, env=env)}") from None
