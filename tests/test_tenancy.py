"""Tenancy (docs/operations.md, "Tenancy"), with real agents and a real router app.

- The router takes a tenant's API key (401 without a known one), drops the client's
  ``cache_salt`` and sends the tenant's secret one to prefill and decode, and computes its
  own cache-aware keys with it: two tenants' same prompt has different keys, and a client
  that sends another tenant's salt finds nothing of theirs.
- Chunks carry their writer's tenant; the agent keeps each tenant within its byte quota
  per tier by evicting that tenant's own chunks only, by the zero-copy and the inline put
  path alike, and its accounts survive a restart (DRAM pool adoption, NVMe index rebuild).
- ``stats --tenant``, ``ls --tenant`` and ``pin ls --tenant`` show one tenant's figures.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers_agent import FP, N, meta, payload, socket_of, start_agent, write_cfg
from helpers_router import Rig, router_rig

from tiered_cache import codec
from tiered_cache.cli import main
from tiered_cache.client import AgentClient
from tiered_cache.config import ConfigError, load_config
from tiered_cache.directory import Pin
from tiered_cache.keys import chunk_keys
from tiered_cache.tenancy import TenantSpec, tenant_of_salt, tenant_salt

ACME_KEY, ACME_SALT = "acme-key-0123456789abcdef", "acme-salt-0123456789abcdef"
BETA_KEY, BETA_SALT = "beta-key-0123456789abcdef", "beta-salt-0123456789abcdef"
TENANTS = [
    TenantSpec.model_validate({"name": "acme", "api_key": ACME_KEY, "salt": ACME_SALT}),
    TenantSpec.model_validate({"name": "beta", "api_key": BETA_KEY, "salt": BETA_SALT}),
]
CHUNK_BYTES = codec.HEADER_SIZE + N  # one test chunk as stored


def _cli(*args: str) -> Any:
    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.fixture
def quota_agent(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """A 2 MiB DRAM pool (16 slots) over write-back NVMe; acme may hold 3 chunks in DRAM
    and 4 in NVMe, beta has no quota."""
    cfg = write_cfg(
        tmp_path,
        tenants={"acme": {"dram": 3 * CHUNK_BYTES, "nvme": 4 * CHUNK_BYTES}},
        **_lru_tiers(tmp_path),
    )
    proc = start_agent(cfg)
    yield cfg, proc
    _stop(proc)


def _lru_tiers(tmp: Path) -> dict[str, Any]:
    """LRU in both tiers: which chunk is a tenant's least valuable is then plain."""
    return {
        "dram": {"capacity": "2MiB", "slot_bytes": "128KiB", "eviction": "lru"},
        "nvme": {
            "enabled": True,
            "path": str(tmp / "nvme"),
            "capacity": "64MiB",
            "write_mode": "write_back",
            "eviction": "lru",
        },
    }


def _tenant_meta(key: str, tenant: str) -> codec.ChunkMeta:
    return replace(meta(key), tenant=tenant)


def _key(i: int, tenant: str) -> str:
    return f"{i:02x}{tenant.encode().hex()}".ljust(32, "0")


def _ls(cfg: Path, tenant: str | None = None) -> set[tuple[str, str]]:
    args = ["ls", "-c", str(cfg), "--limit", "1000", "--json"]
    if tenant is not None:
        args += ["--tenant", tenant]
    return {(e["key"], e["tier"]) for e in _cli(*args)["entries"]}


def _tenant_stats(cfg: Path, tenant: str) -> dict[str, dict[str, Any]]:
    got = _cli("stats", "-c", str(cfg), "--tenant", tenant, "--json")
    assert got["tenant"] == tenant
    return dict(got["tiers"])


def _check_accounts(cfg: Path, keys: dict[str, list[str]]) -> None:
    """Each tenant's ``ls`` and ``stats`` agree with the node's unscoped ``ls``."""
    everything = _ls(cfg)
    for tenant, theirs in keys.items():
        want = {(k, t) for k, t in everything if k in theirs}
        assert _ls(cfg, tenant) == want
        st = _tenant_stats(cfg, tenant)
        for tier in ("dram", "nvme"):
            n = sum(1 for _, t in want if t == tier)
            assert st[tier]["chunks"] == n, (tenant, tier, st)
            assert st[tier]["used_bytes"] == n * CHUNK_BYTES, (tenant, tier, st)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["commit", "put"])
def test_quota_evicts_only_the_tenants_own_chunks(
    quota_agent: tuple[Path, subprocess.Popen[str]], zero_copy: bool
) -> None:
    cfg, _ = quota_agent
    client = AgentClient(socket_of(cfg), attach_pool=zero_copy)
    try:
        beta = [_key(i, "beta") for i in range(2)]
        client.put_many(
            [(_tenant_meta(k, "beta"), payload(i)) for i, k in enumerate(beta)], wait=True
        )
        # Written one at a time: acme's oldest are its least valuable (the pool's LRU).
        acme = [_key(i, "acme") for i in range(6)]
        for i, k in enumerate(acme):
            client.put_many([(_tenant_meta(k, "acme"), payload(10 + i))], wait=True)
        untagged = _key(0, "none")
        client.put_many([(meta(untagged), payload(99))], wait=True)
    finally:
        client.close()

    everything = _ls(cfg)
    # acme holds its quota's 3 chunks in DRAM, the last three it wrote; the other three
    # went down to NVMe (write-back), within its NVMe quota.
    assert {k for k, t in everything if t == "dram" and k in acme} == set(acme[3:])
    assert {k for k, t in everything if t == "nvme" and k in acme} == set(acme[:3])
    # Nothing of beta's (nor the untagged chunk) was evicted for acme's quota.
    assert {k for k, t in everything if t == "dram"} >= {*beta, untagged}
    st = _tenant_stats(cfg, "acme")
    assert st["dram"] == {
        "used_bytes": 3 * CHUNK_BYTES,
        "chunks": 3,
        "quota_bytes": 3 * CHUNK_BYTES,
    }
    assert st["nvme"]["quota_bytes"] == 4 * CHUNK_BYTES
    assert _tenant_stats(cfg, "beta")["dram"]["quota_bytes"] is None
    _check_accounts(cfg, {"acme": acme, "beta": beta})


def test_nvme_quota_and_accounts_survive_a_restart(tmp_path: Path) -> None:
    cfg = write_cfg(
        tmp_path,
        tenants={"acme": {"dram": 2 * CHUNK_BYTES, "nvme": 3 * CHUNK_BYTES}},
        **_lru_tiers(tmp_path),
    )
    proc = start_agent(cfg)
    acme = [_key(i, "acme") for i in range(8)]
    beta = [_key(i, "beta") for i in range(3)]
    try:
        client = AgentClient(socket_of(cfg))
        try:
            client.put_many(
                [(_tenant_meta(k, "beta"), payload(i)) for i, k in enumerate(beta)], wait=True
            )
            for i, k in enumerate(acme):
                client.put_many([(_tenant_meta(k, "acme"), payload(20 + i))], wait=True)
        finally:
            client.close()
        st = _tenant_stats(cfg, "acme")
        # DRAM 2 chunks, NVMe 3: the 3 oldest of the 6 demoted were evicted from NVMe.
        assert (st["dram"]["chunks"], st["nvme"]["chunks"]) == (2, 3), st
        everything = _ls(cfg)
        assert {k for k, t in everything if t == "nvme" and k in acme} == set(acme[3:6])
        _check_accounts(cfg, {"acme": acme, "beta": beta})
    finally:
        _stop(proc)
    # A restart adopts the DRAM pool and rebuilds the NVMe index from the chunks' headers.
    proc = start_agent(cfg)
    try:
        _check_accounts(cfg, {"acme": acme, "beta": beta})
        assert _tenant_stats(cfg, "acme")["dram"]["chunks"] == 2
    finally:
        _stop(proc)


def test_chunk_header_carries_the_tenant() -> None:
    m = _tenant_meta(_key(1, "acme"), "acme")
    got, _ = codec.decode(codec.encode(m, payload(1)))
    assert got.tenant == "acme"
    mac_key = codec.chunk_mac_key(b"k" * 32)
    got, _ = codec.decode(codec.encode(m, payload(1), mac_key=mac_key), mac_key=mac_key)
    assert got.tenant == "acme"
    assert codec.decode(codec.encode(meta(_key(1, "x")), payload(1)))[0].tenant == ""
    # The connector reads the tenant from the salt the router set, whatever follows it.
    salt = tenant_salt("acme", ACME_SALT)
    assert tenant_of_salt(salt) == tenant_of_salt(salt + "|lora=x") == "acme"
    assert tenant_of_salt("clients-own-salt") == ""


def test_pin_ls_scoped_to_a_tenant(tmp_path: Path) -> None:
    # A router's config: its tenants' salts key `pin add --tenant`'s pins.
    cfg = write_cfg(
        tmp_path,
        chunk_size=32,
        router={"tenants": [{"name": "acme", "api_key": ACME_KEY, "salt": ACME_SALT}]},
    )
    proc = start_agent(cfg)
    try:
        toks = ",".join(str(i) for i in range(64))
        args = ["pin", "add", "-c", str(cfg), "--tokens", toks, "--json"]
        mine = _cli(*args, "--tenant", "acme")["id"]
        other = _cli(*args, "--salt", "something-else")["id"]
        assert [
            r["id"] for r in _cli("pin", "ls", "-c", str(cfg), "--tenant", "acme", "--json")
        ] == [mine]
        ids = {r["id"] for r in _cli("pin", "ls", "-c", str(cfg), "--json")}
        assert ids == {mine, other}
    finally:
        _stop(proc)


def test_router_tenants_config_refuses_placeholders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACME_KEY", "change-me")
    with pytest.raises(ConfigError, match="placeholder"):
        load_config(
            {"router": {"tenants": [{"name": "acme", "api_key": "change-me", "salt": ACME_SALT}]}}
        )
    with pytest.raises(ConfigError, match="share one api_key"):
        load_config(
            {"router": {"tenants": [
                {"name": "a", "api_key": ACME_KEY, "salt": ACME_SALT},
                {"name": "b", "api_key": ACME_KEY, "salt": BETA_SALT},
            ]}}
        )  # fmt: skip
    with pytest.raises(ConfigError, match="tenant name"):
        load_config({"tenants": {"no spaces": {"dram": "1MiB"}}})


# ---------------------------------------------------------------- router


@pytest.fixture
async def rig(agent: tuple[Path, subprocess.Popen[str]]) -> AsyncIterator[Rig]:
    async with router_rig(agent[0], tenants=TENANTS) as r:
        yield r


@pytest.fixture
async def open_rig(agent: tuple[Path, subprocess.Popen[str]]) -> AsyncIterator[Rig]:
    async with router_rig(agent[0]) as r:  # built as before tenancy existed
        yield r


PROMPT = list(range(1000, 1065))  # 65 tokens: two whole 32-token chunks before the last


def _cache_prompt(rig: Rig, salt: str) -> None:
    """Store the prompt's chunks as a prefill under ``salt`` would have."""
    client = AgentClient(rig.cache.socket_path)
    try:
        keys = chunk_keys(PROMPT[:-1], FP, cache_salt=salt)
        client.put_many([(replace(meta(k), tenant="acme"), payload(i)) for i, k in enumerate(keys)])
    finally:
        client.close()


async def test_router_applies_the_tenants_salt(rig: Rig) -> None:
    # A first request teaches the router the model's fingerprint.
    assert (await rig.complete([1, 2, 3], ACME_KEY))[0] == 200
    _cache_prompt(rig, tenant_salt("acme", ACME_SALT))

    # acme's prompt is cached under acme's keys: the router skips the prefill, and the
    # decode gets acme's salt, not the one the client sent.
    n_p = len(rig.p.seen)
    status, body = await rig.complete(PROMPT, ACME_KEY, salt="my-own-salt")
    assert (status, body["choices"][0]["text"]) == (200, "from decode")
    assert len(rig.p.seen) == n_p and rig.router.stats.prefill_skipped == 1
    assert rig.d.seen[-1]["cache_salt"] == tenant_salt("acme", ACME_SALT)

    # beta's same prompt has other keys: prefilled, with beta's salt at both stages.
    status, _ = await rig.complete(PROMPT, BETA_KEY)
    assert status == 200 and rig.router.stats.prefill_skipped == 1
    assert (
        rig.p.seen[-1]["cache_salt"]
        == rig.d.seen[-1]["cache_salt"]
        == tenant_salt("beta", BETA_SALT)
    )

    # beta sending acme's salt (and acme's kind of salt) finds nothing of acme's.
    for stolen in (tenant_salt("acme", ACME_SALT), ACME_SALT):
        status, _ = await rig.complete(PROMPT, BETA_KEY, salt=stolen)
        assert status == 200 and rig.router.stats.prefill_skipped == 1
        assert rig.p.seen[-1]["cache_salt"] == tenant_salt("beta", BETA_SALT)
    # The API key stays with the router.
    assert all("Authorization" not in h for h in rig.p.headers + rig.d.headers)


@pytest.mark.parametrize(
    "key",
    [None, "", "wrong-key-0123456789abcdef", ACME_KEY[:-1]],
    ids=["none", "empty", "wrong", "prefix"],
)
async def test_router_refuses_a_missing_or_wrong_api_key(rig: Rig, key: str | None) -> None:
    status, body = await rig.complete(PROMPT, key)
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key", body
    assert "API key" in body["error"]["message"]
    assert rig.p.seen == [] and rig.d.seen == []
    assert rig.router.stats.unauthorized == 1
    # The same goes for another scheme, and for the model list.
    async with rig.http.post(
        rig.url + "/v1/completions",
        json={"prompt": "x"},
        headers={"Authorization": f"Basic {ACME_KEY}"},
    ) as r:
        assert r.status == 401
    async with rig.http.get(rig.url + "/v1/models") as r:
        assert r.status == 401


async def test_router_without_tenants_passes_the_clients_salt(open_rig: Rig) -> None:
    status, _ = await open_rig.complete(PROMPT, None, salt="clients-own-salt")
    assert status == 200
    assert (
        open_rig.p.seen[-1]["cache_salt"] == open_rig.d.seen[-1]["cache_salt"] == "clients-own-salt"
    )


def test_pin_records_tenant_default() -> None:
    # Pins written before tenancy load as nobody's.
    p = Pin.model_validate({"keys": [], "fingerprint": "f" * 32})
    assert p.tenant == ""
