"""Values the config schemas share: sizes, durations, and the check that a secret set
in a config (admin token, tenant API keys and salts) is one: set, not a placeholder, long
enough. Apart from ``config`` so that other schemas (``tenancy``) use them without a cycle.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(v: Any) -> int:
    """``4GiB`` -> 4294967296. Raises ValueError with the offending text."""
    if isinstance(v, bool):
        raise ValueError(f"not a size: {v!r}")
    if isinstance(v, int):
        if v < 0:
            raise ValueError(f"size must be >= 0, got {v}")
        return v
    if isinstance(v, float):
        return parse_size(str(v))
    m = _SIZE_RE.match(str(v))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {v!r} (use bytes or units like 512MiB, 4GiB, 1GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_duration(v: Any) -> float | None:
    """``90s``, ``15m``, ``24h``, ``7d``, a number of seconds, or none/null -> None."""
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "null", "0")):
        return None
    if isinstance(v, int | float) and not isinstance(v, bool):
        if v <= 0:
            raise ValueError(f"duration must be > 0, got {v}")
        return float(v)
    m = re.match(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|h|d)?\s*$", str(v))
    if not m:
        raise ValueError(f"not a duration: {v!r} (use e.g. 90s, 15m, 24h, 7d, or none)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"]


Size = Annotated[int, BeforeValidator(parse_size)]


# Tokens that example configs and tutorials ship (compared lower-case, letters and digits
# only): an agent guarded by one of them is not guarded.
_PLACEHOLDER_TOKENS = frozenset(
    {"", "changeme", "changemeplease", "secret", "password", "token", "admin", "admintoken",
     "authtoken", "yourtoken", "yourtokenhere", "example", "test", "none", "null"}
)  # fmt: skip


def check_secret(v: str, what: str, env_var: str) -> str:
    """``v``, a secret from a config; ValueError when it is unset, a placeholder or short.
    The value is never quoted: it may be the real secret, one typo away. ``what`` names
    it in errors and ``env_var`` is where the message suggests keeping it."""
    unset = re.fullmatch(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", v.strip())
    if unset:  # a loader that leaves an unset variable as written (LMCache's)
        raise ValueError(
            f"environment variable {unset.group(1)} is not set (export the {what},"
            " or remove the setting)"
        )
    if not v.strip():
        raise ValueError(f"is empty: set the {what} (or remove the setting)")
    if re.sub(r"[^a-z0-9]", "", v.lower()) in _PLACEHOLDER_TOKENS:
        raise ValueError(
            "a placeholder value (change-me, secret, ...) guards nothing: set a real"
            f" {what} (`openssl rand -hex 32`, exported as {env_var} and read as"
            f" ${{{env_var}}})"
        )
    if len(v) < 16:
        raise ValueError("must be at least 16 characters (e.g. `openssl rand -hex 32`)")
    return v
