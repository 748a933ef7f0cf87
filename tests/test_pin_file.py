"""``agent.pin_file``: the node agent imports a pin list (the YAML `tiered-cache pin export`
writes) at start-up and on SIGHUP, as `tiered-cache pin import FILE` does."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from helpers_agent import FP, Output, cli, meta, payload, start_agent, write_cfg

from tiered_cache.client import AgentClient
from tiered_cache.keys import chunk_keys
from tiered_cache.pinfile import PinFileError, derived_pin_id, plan_pin_import, read_pin_file

KEYS = chunk_keys(np.arange(32 * 4), FP)
GIVEN_ID = "sysprompt01"


def pin_doc(note: str = "system prompt") -> dict[str, Any]:
    """An exported pin (with id) and a hand-written one (without)."""
    return {
        "version": 1,
        "pins": [
            {"id": GIVEN_ID, "note": note, "tiers": ["dram"], "fingerprint": FP.hex,
             "keys": KEYS[:2]},
            {"note": "hand-written", "tiers": ["dram", "nvme"], "fingerprint": FP.hex,
             "keys": KEYS[2:3]},
        ],
    }  # fmt: skip


def write_pins(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def pin_ls(cfg: Path) -> list[dict[str, Any]]:
    r = cli("pin", "ls", "-c", str(cfg), "--json")
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout))


def ids(cfg: Path) -> set[str]:
    return {r["id"] for r in pin_ls(cfg)}


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return out


HAND_ID = derived_pin_id(FP.hex, KEYS[2:3])


# ------------------------------------------------------------------ the shared reader


def test_read_pin_file_dedupes_by_id(tmp_path: Path) -> None:
    p = write_pins(tmp_path / "pins.yaml", pin_doc())
    a, b = read_pin_file(p), read_pin_file(p)
    assert [x.id for x in a] == [x.id for x in b] == [GIVEN_ID, HAND_ID]
    plan = plan_pin_import(b, a)  # importing the same file again changes nothing
    assert plan.changes == [] and plan.summary() == "0 added, 0 updated, 2 unchanged"
    edited = pin_doc(note="v2")
    plan = plan_pin_import(read_pin_file(write_pins(tmp_path / "e.yaml", edited)), a)
    assert [(w, x.id) for w, x in plan.changes] == [("updated", GIVEN_ID)]
    # Two id-less entries for the same prefix would be one pin: an error, not a silent merge.
    twice = {"pins": [pin_doc()["pins"][1], pin_doc()["pins"][1]]}
    with pytest.raises(PinFileError, match="duplicate pin ids: pins #1 and #2"):
        read_pin_file(write_pins(tmp_path / "twice.yaml", twice))


# ------------------------------------------------------------------ the agent


def test_agent_imports_pin_file_and_honours_it(tmp_path: Path) -> None:
    pins = write_pins(tmp_path / "pins.yaml", pin_doc())
    cfg = write_cfg(tmp_path, agent={"socket": str(tmp_path / "a.sock"), "pin_file": str(pins)})
    proc = start_agent(cfg)
    output = Output(proc)
    try:
        rows = pin_ls(cfg)
        assert {r["id"]: r["note"] for r in rows} == {
            GIVEN_ID: "system prompt", HAND_ID: "hand-written",
        }  # fmt: skip
        # Honoured: the pinned chunks stay in DRAM while 40 other chunks flood it (16 slots).
        c = AgentClient(str(tmp_path / "a.sock"))
        try:
            c.put_many([(meta(k), payload(i)) for i, k in enumerate(KEYS[:2])])
            others = chunk_keys(np.arange(32 * 40) + 10_000, FP)
            c.put_many([(meta(k), payload(100 + i)) for i, k in enumerate(others)])
            assert c.lookup(KEYS[:2]) == ["dram", "dram"]
            assert set(c.lookup(others)) == {"dram", "nvme"}  # the rest were evicted down
            ls = c.admin("ls", prefix="")["entries"]
            assert {e["key"] for e in ls if e["pinned"] and e["tier"] == "dram"} == set(KEYS[:2])
        finally:
            c.close()
        # SIGHUP re-imports: an edited note is updated, pins dropped from the file stay.
        write_pins(pins, {"pins": [pin_doc(note="v2")["pins"][0]]})
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while {r["id"]: r["note"] for r in pin_ls(cfg)}[GIVEN_ID] != "v2":
            assert time.monotonic() < deadline, "SIGHUP did not re-import the pin file"
            time.sleep(0.1)
        assert ids(cfg) == {GIVEN_ID, HAND_ID}
        # A file broken now is one error line; the agent keeps its pins and runs on.
        pins.write_text("pins: [unclosed\n")
        proc.send_signal(signal.SIGHUP)
        output.wait_for("invalid YAML")  # the agent has read the broken file
        assert proc.poll() is None
        assert ids(cfg) == {GIVEN_ID, HAND_ID}
    finally:
        out = output.stop()
    assert proc.returncode == 0, out
    errors = [ln for ln in out.splitlines() if " ERROR " in ln]
    assert len(errors) == 1, out
    assert f"agent.pin_file: {pins}: invalid YAML" in errors[0] and "pins unchanged" in errors[0]
    assert "Traceback" not in out


def test_restart_and_second_agent_do_not_duplicate_pins(tmp_path: Path, redis_server: Any) -> None:
    pins = write_pins(tmp_path / "pins.yaml", pin_doc())
    cfgs = []
    for name in ("pa", "pb"):
        d = tmp_path / name
        d.mkdir()
        agent = {"socket": str(d / "a.sock"), "pin_file": str(pins)}
        cfgs.append(write_cfg(d, redis_url=redis_server.url, agent=agent))
    a = start_agent(cfgs[0])
    b = start_agent(cfgs[1])
    try:
        want = [HAND_ID, GIVEN_ID]  # the same created_at: sorted by id
        assert [r["id"] for r in pin_ls(cfgs[0])] == want
        assert [r["id"] for r in pin_ls(cfgs[1])] == want
        out_a = stop(a)
        assert "agent.pin_file" in out_a and "2 added" in out_a
        a = start_agent(cfgs[0])
        assert [r["id"] for r in pin_ls(cfgs[0])] == want
    finally:
        out_a, out_b = stop(a), stop(b)
    assert "agent.pin_file" in out_a and "0 added, 0 updated, 2 unchanged" in out_a
    assert "0 added, 0 updated, 2 unchanged" in out_b


@pytest.mark.parametrize(
    ("content", "msg"),
    [
        (None, "agent.pin_file: pin file not found: {file}"),
        ("pins: [unclosed\n", "agent.pin_file: {file}: invalid YAML"),
        ("pins:\n- {id: x, keys: [nothex], fingerprint: ab}\n",
         "agent.pin_file: {file}: pin #1: keys"),
        ("just: text\n", "agent.pin_file: {file}: expected a mapping with a `pins:` list"),
    ],
)  # fmt: skip
def test_bad_pin_file_stops_the_start_with_one_line(
    tmp_path: Path, content: str | None, msg: str
) -> None:
    pins = tmp_path / "pins.yaml"
    if content is not None:
        pins.write_text(content)
    cfg = write_cfg(tmp_path, agent={"socket": str(tmp_path / "a.sock"), "pin_file": str(pins)})
    r = cli("agent", "-c", str(cfg))
    assert r.returncode != 0
    assert r.stderr.startswith("error: agent.pin_file: ") and msg.format(file=pins) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not (tmp_path / "a.sock").exists()


def test_import_waits_for_redis(tmp_path: Path, redis_server: Any) -> None:
    """Redis down at start-up: the agent starts, logs one error, imports once Redis is back."""
    pins = write_pins(tmp_path / "pins.yaml", pin_doc())
    agent = {"socket": str(tmp_path / "a.sock"), "pin_file": str(pins), "pin_sync_interval_s": 0.5}
    cfg = write_cfg(tmp_path, redis_url=redis_server.url, agent=agent)
    redis_server.stop()
    proc = start_agent(cfg)
    try:
        redis_server.restart()
        deadline = time.monotonic() + 15
        while True:
            r = cli("pin", "ls", "-c", str(cfg), "--json")
            if r.returncode == 0 and {x["id"] for x in json.loads(r.stdout)} == {GIVEN_ID, HAND_ID}:
                break
            assert time.monotonic() < deadline, r.stdout + r.stderr
            time.sleep(0.2)
    finally:
        out = stop(proc)
    errors = [ln for ln in out.splitlines() if " ERROR " in ln and "agent.pin_file" in ln]
    assert len(errors) == 1 and "cannot import its pins yet" in errors[0], out
    assert "2 added" in out
