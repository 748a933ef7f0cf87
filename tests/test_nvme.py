"""NVMe tier against real files: layout, capacity, restart scan, O_DIRECT, disk full,
kill -9 mid-stream and same-key races."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import mmap
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path

import pytest
from helpers_nvme import FINGERPRINT, chunk_key, make_chunk, payload, writer_size

from tiered_cache import codec
from tiered_cache.metrics import Metrics
from tiered_cache.tiers import nvme as nvme_mod
from tiered_cache.tiers.base import TierError, TierFull
from tiered_cache.tiers.nvme import NVMeTier

HELPER = str(Path(__file__).with_name("helpers_nvme.py"))
H = codec.HEADER_SIZE


def kvc(root: Path, key: str) -> Path:
    return root / key[:2] / f"{key}.kvc"


def tmp_files(root: Path) -> list[str]:
    return os.listdir(root / ".tmp")


def disk_sizes(root: Path) -> dict[str, int]:
    return {p.stem: p.stat().st_size for p in root.glob("??/*.kvc")}


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


async def test_round_trip_layout_and_index(nvme_dir: Path, metrics: Metrics) -> None:
    tier = NVMeTier(nvme_dir, 10 << 20, metrics=metrics)
    chunks = [make_chunk(i, 1000 + 4096 * i) for i in range(3)]
    for key, blob in chunks:
        await tier.put(key, blob)

    for key, blob in chunks:
        assert kvc(nvme_dir, key).read_bytes() == blob
        got = await tier.get(key)
        assert got == blob
        meta, _ = codec.decode(got, expect_key=key, expect_fingerprint=FINGERPRINT)
        assert meta.key == key
    assert tmp_files(nvme_dir) == []

    keys = [k for k, _ in chunks]
    absent = chunk_key(99)
    assert await tier.contains_many([*keys, absent]) == [True, True, True, False]
    assert await tier.longest_prefix([keys[0], keys[1], absent, keys[2]]) == 2
    total = sum(len(b) for _, b in chunks)
    u = tier.usage()
    assert (u.used_bytes, u.capacity_bytes, u.num_chunks) == (total, 10 << 20, 3)
    assert dict(tier.entries()) == {k: len(b) for k, b in chunks}
    assert tier.size_of(keys[1]) == len(chunks[1][1])
    assert await tier.get(absent) is None

    out = bytearray(len(chunks[2][1]) + 10)
    n = await tier.get_into(keys[2], memoryview(out))
    assert n == len(chunks[2][1]) and bytes(out[:n]) == chunks[2][1]
    with pytest.raises(ValueError, match="too small"):
        await tier.get_into(keys[2], memoryview(bytearray(100)))
    assert await tier.get_into(absent, memoryview(out)) is None

    assert metrics.value("tiered_cache_written_bytes_total", tier="nvme") == total
    read = sum(len(b) for _, b in chunks) + len(chunks[2][1])
    assert metrics.value("tiered_cache_read_bytes_total", tier="nvme") == read
    assert metrics.value("tiered_cache_used_bytes", tier="nvme") == total

    assert await tier.delete(keys[0]) is True
    assert await tier.delete(keys[0]) is False
    assert not kvc(nvme_dir, keys[0]).exists()
    assert await tier.get(keys[0]) is None
    assert await tier.contains_many(keys) == [False, True, True]
    assert tier.usage().used_bytes == total - len(chunks[0][1])
    assert tier.usage().num_chunks == 2
    await tier.close()


@pytest.mark.parametrize(
    "bad", ["../../../../etc/passwd", "A" * 32, "0" * 31, "0" * 33, "0" * 30 + "/x", ""]
)
async def test_invalid_keys_are_rejected(nvme_dir: Path, bad: str) -> None:
    tier = NVMeTier(nvme_dir, 1 << 20)
    _, blob = make_chunk(0, 100)
    before = sorted(p.relative_to(nvme_dir) for p in nvme_dir.rglob("*"))
    with pytest.raises(ValueError):
        await tier.put(bad, blob)
    with pytest.raises(ValueError):
        await tier.get(bad)
    with pytest.raises(ValueError):
        await tier.get_into(bad, memoryview(bytearray(1000)))
    with pytest.raises(ValueError):
        await tier.delete(bad)
    with pytest.raises(ValueError):
        await tier.contains_many([bad])
    assert sorted(p.relative_to(nvme_dir) for p in nvme_dir.rglob("*")) == before
    await tier.close()


async def test_capacity_and_replacement_accounting(nvme_dir: Path) -> None:
    cap = 10_000
    tier = NVMeTier(nvme_dir, cap)
    ka, a1 = make_chunk(1, 4000 - H)
    kb, b = make_chunk(2, 4000 - H)
    await tier.put(ka, a1)
    await tier.put(kb, b)
    kc, c = make_chunk(3, 2500 - H)
    with pytest.raises(TierFull):
        await tier.put(kc, c)  # 8000 + 2500 > 10000
    assert not kvc(nvme_dir, kc).exists() and tmp_files(nvme_dir) == []
    assert tier.usage().used_bytes == 8000

    # Replacing counts only the difference: 8000 - 4000 + 5000 = 9000 fits.
    a2 = codec.encode(codec.ChunkMeta(ka, FINGERPRINT, num_tokens=1), payload(11, 5000 - H))
    await tier.put(ka, a2)
    assert tier.usage().used_bytes == 9000 and tier.usage().num_chunks == 2
    assert await tier.get(ka) == a2
    # 9000 - 5000 + 7000 = 11000 does not; the old version stays.
    a3 = codec.encode(codec.ChunkMeta(ka, FINGERPRINT, num_tokens=1), payload(12, 7000 - H))
    with pytest.raises(TierFull):
        await tier.put(ka, a3)
    assert await tier.get(ka) == a2 and tier.usage().used_bytes == 9000
    # Shrinking always fits and frees space.
    await tier.put(ka, a1)
    assert tier.usage().used_bytes == 8000
    assert await tier.delete(kb)
    await tier.put(kc, c)
    assert tier.usage().used_bytes == 6500
    assert sum(disk_sizes(nvme_dir).values()) == 6500
    assert tier.fits(cap) and not tier.fits(cap + 1)
    await tier.close()


async def test_concurrent_puts_cannot_overbook(nvme_dir: Path) -> None:
    size = 8192
    tier = NVMeTier(nvme_dir, 5 * size, max_concurrency=8)
    blobs = [make_chunk(i, size - H) for i in range(12)]
    res = await asyncio.gather(*(tier.put(k, b) for k, b in blobs), return_exceptions=True)
    assert sum(r is None for r in res) == 5
    assert all(r is None or isinstance(r, TierFull) for r in res)
    assert tier.usage().used_bytes == 5 * size == sum(disk_sizes(nvme_dir).values())
    assert tmp_files(nvme_dir) == []
    await tier.close()


async def test_restart_rebuilds_index_and_discards_damage(nvme_dir: Path) -> None:
    tier = NVMeTier(nvme_dir, 10 << 20)
    chunks = [make_chunk(i, 3000 + 1000 * i) for i in range(8)]
    for k, b in chunks:
        await tier.put(k, b)
    await tier.close()

    good = dict(chunks[:5])
    # Interrupted writes.
    (nvme_dir / ".tmp" / f"{chunks[0][0]}.deadbeef").write_bytes(chunks[0][1][:1000])
    (nvme_dir / ".tmp" / "junk").write_bytes(b"x")
    # Truncated file (as a torn non-atomic write would leave).
    k_trunc, b_trunc = chunks[5]
    kvc(nvme_dir, k_trunc).write_bytes(b_trunc[: len(b_trunc) - 100])
    # Header damage: one flipped bit in the shape field breaks the header checksum.
    k_hdr, b_hdr = chunks[6]
    bad = bytearray(b_hdr)
    bad[80] ^= 0x01
    kvc(nvme_dir, k_hdr).write_bytes(bad)
    # A valid chunk stored under another key's name.
    k_misnamed = chunk_key(1000)
    shutil.copy(kvc(nvme_dir, chunks[0][0]), kvc(nvme_dir, k_misnamed))
    # Payload damage: header intact, so the scan keeps it; decode catches it at read.
    k_flip, b_flip = chunks[7]
    flipped = bytearray(b_flip)
    flipped[H + 500] ^= 0xFF
    kvc(nvme_dir, k_flip).write_bytes(flipped)

    m = Metrics()
    tier2 = NVMeTier(nvme_dir, 10 << 20, metrics=m)
    scan = tier2.last_scan
    assert (scan.discarded, scan.tmp_removed, scan.chunks) == (3, 2, 6)
    assert m.value("tiered_cache_verification_failures_total", tier="nvme") == 3
    assert tmp_files(nvme_dir) == []
    for k in (k_trunc, k_hdr, k_misnamed):
        assert not kvc(nvme_dir, k).exists()
        assert await tier2.get(k) is None
    for k, b in good.items():
        got = await tier2.get(k)
        assert got == b
        codec.decode(got, expect_key=k, expect_fingerprint=FINGERPRINT)
    got = await tier2.get(k_flip)
    assert got == bytes(flipped)
    with pytest.raises(codec.ChunkCorrupt, match="payload checksum"):
        codec.decode(got, expect_key=k_flip)
    expected = {**{k: len(b) for k, b in good.items()}, k_flip: len(flipped)}
    assert dict(tier2.entries()) == expected
    assert tier2.usage().used_bytes == sum(expected.values())
    await tier2.close()


async def test_one_owner_per_directory(nvme_dir: Path) -> None:
    tier = NVMeTier(nvme_dir, 1 << 20)
    with pytest.raises(TierError, match="already owned"):
        NVMeTier(nvme_dir, 1 << 20)
    await tier.close()
    with pytest.raises(TierError, match="closed"):
        await tier.get(chunk_key(0))
    tier2 = NVMeTier(nvme_dir, 1 << 20)
    await tier2.close()


def _fs_accepts_o_direct(d: Path) -> bool:
    p = d / "probe"
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        buf.close()
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


@pytest.mark.parametrize("read_bounce", [True, False])
async def test_o_direct_round_trip(tmp_path: Path, read_bounce: bool) -> None:
    root = tmp_path / "od"
    root.mkdir()
    expect_direct = _fs_accepts_o_direct(tmp_path)
    tier = NVMeTier(root, 10 << 20, o_direct=True, read_bounce=read_bounce)
    assert tier.o_direct_active is expect_direct
    sizes = [1, 4096 - H, 4096 * 3 - H + 17, 300_001]
    chunks = [make_chunk(i, s) for i, s in enumerate(sizes)]
    for k, b in chunks:
        await tier.put(k, b)
    for k, b in chunks:
        # The alignment padding is truncated away: the file is exactly the chunk.
        assert kvc(root, k).stat().st_size == len(b)
        assert await tier.get(k) == b
        # Aligned caller buffer (the read lands in place unless read_bounce) and an
        # unaligned one (always through the bounce buffer).
        aligned = mmap.mmap(-1, len(b) + 8192)
        with memoryview(aligned) as mv:
            assert await tier.get_into(k, mv) == len(b)
            assert mv[: len(b)] == b
        unaligned = bytearray(len(b) + 1)
        assert await tier.get_into(k, memoryview(unaligned)[1:]) == len(b)
        assert unaligned[1:] == b
        aligned.close()
    await tier.close()
    tier2 = NVMeTier(root, 10 << 20, o_direct=True)
    assert tier2.last_scan.chunks == len(chunks) and tier2.last_scan.discarded == 0
    for k, b in chunks:
        got = await tier2.get(k)
        assert got == b
        codec.decode(got, expect_key=k)
    await tier2.close()


async def test_o_direct_refused_falls_back_to_buffered_io(
    nvme_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = os.open
    direct_attempts = 0

    def refusing_open(path, flags, *args, **kw):  # type: ignore[no-untyped-def]
        nonlocal direct_attempts
        if flags & os.O_DIRECT:  # what tmpfs on older kernels, or FUSE, answer
            direct_attempts += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(nvme_mod.os, "open", refusing_open)
    with caplog.at_level(logging.WARNING, logger=nvme_mod.__name__):
        tier = NVMeTier(nvme_dir, 1 << 20, o_direct=True)
    assert tier.o_direct_active is False
    assert any("refused O_DIRECT" in r.getMessage() for r in caplog.records)
    probes = direct_attempts
    k, b = make_chunk(0, 5000)
    await tier.put(k, b)
    assert await tier.get(k) == b
    assert direct_attempts == probes == 1  # only the probe tried O_DIRECT
    await tier.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); EFBIG test covers it")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("o_direct", [False, True])
async def test_disk_full_is_tier_full_and_harmless(
    small_tmpfs: Path, o_direct: bool, metrics: Metrics
) -> None:
    root = small_tmpfs / "nvme"
    tier = NVMeTier(root, 100 << 20, o_direct=o_direct, metrics=metrics)  # disk < capacity
    stored = [make_chunk(i, 300_000) for i in range(3)]
    for k, b in stored:
        await tier.put(k, b)
    before = (sorted(tier.entries()), tier.usage())

    kbig, big = make_chunk(10, 400_000)
    with pytest.raises(TierFull, match="disk full"):
        await tier.put(kbig, big)
    assert tmp_files(root) == []
    assert (sorted(tier.entries()), tier.usage()) == before
    assert not kvc(root, kbig).exists()
    assert await tier.contains_many([kbig]) == [False]
    assert metrics.value("tiered_cache_write_errors_total", tier="nvme", reason="full") == 1

    ksmall, small = make_chunk(11, 50_000)
    await tier.put(ksmall, small)
    for k, b in [*stored, (ksmall, small)]:
        got = await tier.get(k)
        assert got == b
        codec.decode(got, expect_key=k)
    await tier.close()


def test_file_size_limit_efbig_is_tier_full(nvme_dir: Path) -> None:
    r = subprocess.run(
        [sys.executable, HELPER, "efbig", str(nvme_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["big_put"].startswith("TierFull") and "disk full" in out["big_put"]
    assert out["tmp_after"] == []
    assert out["index_unchanged"] is True
    assert out["big_on_disk"] is False
    assert out["small_ok"] is True


async def test_other_os_errors_are_tier_error(nvme_dir: Path, metrics: Metrics) -> None:
    tier = NVMeTier(nvme_dir, 1 << 20, metrics=metrics)
    k, b = make_chunk(0, 1000)
    # The rename target's directory is now a file: ENOTDIR, an I/O error, not "full".
    shutil.rmtree(nvme_dir / k[:2])
    (nvme_dir / k[:2]).write_bytes(b"")
    with pytest.raises(TierError) as ei:
        await tier.put(k, b)
    assert not isinstance(ei.value, TierFull)
    assert tmp_files(nvme_dir) == [] and tier.usage().used_bytes == 0
    assert metrics.value("tiered_cache_write_errors_total", tier="nvme", reason="io") == 1
    await tier.close()


def _write_until_killed(root: Path, start: int, fsync: str, n_acks: int) -> dict[str, int]:
    """Run the writer subprocess, SIGKILL it after ``n_acks`` acknowledged puts and return
    every acknowledged {key: index} (including lines printed before the kill landed)."""
    proc = subprocess.Popen(
        [sys.executable, HELPER, "writer", str(root), str(start), "4", fsync],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acked: dict[str, int] = {}
    assert proc.stdout is not None
    try:
        deadline = time.monotonic() + 30
        while len(acked) < n_acks and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            i, key = line.split()
            acked[key] = int(i)
    finally:
        proc.send_signal(signal.SIGKILL)
        rest, err = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL, err
    for line in rest.splitlines():
        parts = line.split()
        if len(parts) == 2 and len(parts[1]) == 32:
            acked[parts[1]] = int(parts[0])
    assert len(acked) >= n_acks, err
    return acked


@pytest.mark.parametrize("fsync", ["fsync", "nofsync"])
async def test_kill_9_mid_stream_keeps_every_acknowledged_chunk(nvme_dir: Path, fsync: str) -> None:
    # Several kill/reopen rounds on one directory, so some kills land mid-write (leftover
    # temp files); without fsync more of each put is spent in write(), which makes that
    # likelier. Process death does not need fsync: the page cache survives it.
    acked: dict[str, int] = {}
    for rnd in range(3):
        acked |= _write_until_killed(nvme_dir, rnd * 1000, fsync, 15)

        # Before any recovery, every visible .kvc is a complete, valid chunk (atomic rename).
        on_disk = list(nvme_dir.glob("??/*.kvc"))
        for p in on_disk:
            codec.decode(p.read_bytes(), expect_key=p.stem)
        leftovers = len(tmp_files(nvme_dir))

        m = Metrics()
        tier = NVMeTier(nvme_dir, None, metrics=m)
        assert tier.last_scan.discarded == 0
        assert m.value("tiered_cache_verification_failures_total", tier="nvme") == 0
        assert tier.last_scan.tmp_removed == leftovers
        assert tier.last_scan.chunks == len(on_disk) >= len(acked)
        assert tmp_files(nvme_dir) == []
        for key, i in acked.items():
            got = await tier.get(key)
            assert got is not None, f"acknowledged chunk {i} lost"
            _, pl = codec.decode(got, expect_key=key, expect_fingerprint=FINGERPRINT)
            assert pl == payload(i, writer_size(i))
        await tier.close()


async def test_concurrent_same_key_put_get_delete(nvme_dir: Path) -> None:
    tier = NVMeTier(nvme_dir, 10 << 20, max_concurrency=8)
    key = chunk_key(7)
    versions = [
        codec.encode(
            codec.ChunkMeta(key, FINGERPRINT, num_tokens=v), payload(v, 20_000 + 7_000 * v)
        )
        for v in range(4)
    ]
    await tier.put(key, versions[0])

    async def round_(r: int) -> list[object]:
        await asyncio.sleep(r * 0.0005)  # staggered, so rounds overlap each other's I/O
        buf = bytearray(50_000)
        ops: list[Awaitable[object]] = [
            tier.get(key),
            tier.get_into(key, memoryview(buf)),
            tier.put(key, versions[r % 4]),
        ]
        if r % 3 == 0:
            ops.append(tier.delete(key))
        got, n, *_ = await asyncio.gather(*ops)  # any exception fails the test
        return [got, bytes(buf[:n]) if isinstance(n, int) else None]

    results = [x for rr in await asyncio.gather(*(round_(r) for r in range(40))) for x in rr]

    seen = [x for x in results if isinstance(x, bytes)]
    assert seen, "no read observed a chunk"
    for got in seen:
        meta, _ = codec.decode(got, expect_key=key)  # whole chunk or None, never torn
        assert got == versions[meta.num_tokens]

    # Index, used bytes and disk agree after the dust settles.
    disk = disk_sizes(nvme_dir)
    assert dict(tier.entries()) == disk
    assert tier.usage().used_bytes == sum(disk.values())
    assert tmp_files(nvme_dir) == []
    if disk:
        got = await tier.get(key)
        assert got is not None and len(got) == disk[key]
        codec.decode(got, expect_key=key)
    await tier.close()


# ------------------------------------------------------------ permissions (issue 15, item 9)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


async def test_files_and_directories_are_private(tmp_path: Path) -> None:
    """Chunks are prompts' KV: the root, its directories and every file are the owner's
    alone (0700 / 0600), whatever the umask."""
    root = tmp_path / "new" / "nvme"
    old = os.umask(0o022)
    try:
        tier = NVMeTier(root, 10 << 20)
        key, chunk = make_chunk(1, 5000)
        await tier.put(key, chunk)
        await tier.close()
    finally:
        os.umask(old)
    assert _mode(root) == 0o700
    assert {_mode(d) for d in root.iterdir() if d.is_dir()} == {0o700}
    assert _mode(kvc(root, key)) == 0o600 and _mode(root / ".lock") == 0o600


async def test_an_open_root_is_narrowed(nvme_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    os.chmod(nvme_dir, 0o755)
    with caplog.at_level(logging.WARNING, logger="tiered_cache.tiers.nvme"):
        tier = NVMeTier(nvme_dir, 10 << 20)
    await tier.close()
    assert _mode(nvme_dir) == 0o700
    assert "was open to other users (mode 0755): made 0700" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_root_of_another_user_is_refused(nvme_dir: Path) -> None:
    from tiered_cache.private_dir import UnsafePath

    os.chown(nvme_dir, 65534, 65534)
    with pytest.raises(UnsafePath, match="belongs to uid 65534"):
        NVMeTier(nvme_dir, 10 << 20)
    assert os.listdir(nvme_dir) == []  # nothing written into it
