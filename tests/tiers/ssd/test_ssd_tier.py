"""Tests of the SSD tier (tiers/ssd/tier.py) on real files, over both I/O backends (the backends
themselves and the native helper are tested in test_ssd_io.py).

Every test runs on the io_uring backend (skipped, with the reason, only if the
native module cannot be built or the kernel refuses io_uring) and on the pure-Python
one, each with O_DIRECT and with buffered I/O forced (``direct=False``: the path a
filesystem without O_DIRECT support takes). On io_uring, reads are verified in C when
the helper was built with xxHash; the ``uring-pyverify`` modes turn that off, so the
Python verification behind the native backend is tested too.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import flip_byte
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent
from tiers.base import Tier
from tiers.ssd.tier import (
    ALIGNMENT,
    HEADER_BYTES,
    NotRecoveredError,
    SsdFormatError,
    SsdIndexDamagedError,
    SsdLocation,
    SsdRecord,
    SsdTier,
    UringUnavailableError,
)

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
import ssd_crash_writer  # noqa: E402

MiB = 1 << 20


MODES = [("python", True, False), ("python", False, False), ("uring", True, False),
         ("uring", False, False), ("uring", True, True), ("uring", False, True)]


@pytest.fixture(params=MODES, ids=[f"{io}{'-pyverify' if pv else ''}-"
                                   f"{'direct' if d else 'buffered'}" for io, d, pv in MODES])
def mode(request: pytest.FixtureRequest, uring_status: tuple[bool, str | None]) -> dict:
    io, direct, py_verify = request.param
    if io == "uring" and not uring_status[0]:
        pytest.skip(f"io_uring backend unavailable: {uring_status[1]}")
    return {"io": io, "direct": direct, "py_verify": py_verify}


def open_tier(path: Path, capacity: int, mode: dict, **kw: object) -> SsdTier:
    args = {k: v for k, v in mode.items() if k != "py_verify"}
    tier = SsdTier(path / "data.img", capacity, **args, **kw)  # type: ignore[arg-type]
    if mode.get("py_verify"):
        tier._backend.verifies = False  # type: ignore[union-attr]  # as a build without xxHash
    assert tier.io_backend == mode["io"]
    if mode["io"] == "python" or mode.get("py_verify"):
        assert not tier.verifies_in_c  # reads are checked in Python
    if mode["direct"]:
        # tmp_path may sit on a filesystem without O_DIRECT: then the tier must say why.
        assert tier.o_direct or "EINVAL" in (tier.o_direct_fallback or "")
    else:
        assert not tier.o_direct
    return tier


def key_of(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "big") + b"\xa5" * 8)


def payload(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def read_back(tier: SsdTier, locs: list[SsdLocation]) -> tuple[list[bool], list[bytes]]:
    outs = [bytearray(loc.nbytes) for loc in locs]
    ok = tier.read_blocks_into(locs, [memoryview(o) for o in outs])
    return ok, [bytes(o) for o in outs]


@contextlib.contextmanager
def aligned(n: int) -> Iterator[memoryview]:
    """A page-aligned writable buffer of n bytes (anonymous mmap)."""
    m = mmap.mmap(-1, max(n, 1))
    mv = memoryview(m)[:n]
    try:
        yield mv
    finally:
        mv.release()
        m.close()


# --------------------------------------------------------------------------- round trips


def test_round_trip_random_sizes_batched(tmp_path: Path, mode: dict) -> None:
    rng = random.Random(7)
    sizes = [0, 1, 4095, 4096, 4097, 65536, 65537, 300_000] + [
        rng.randint(1, 200_000) for _ in range(120)]
    values = [payload(i, n) for i, n in enumerate(sizes)]
    tier = open_tier(tmp_path, 64 * MiB, mode)
    assert isinstance(tier, Tier) and tier.name == "ssd"
    assert tier.recover() == []
    locs: list[SsdLocation] = []
    for start in range(0, len(values), 16):  # batched writes
        batch = [(key_of(i), None, memoryview(values[i]))
                 for i in range(start, min(start + 16, len(values)))]
        got = tier.write_blocks(batch)
        assert all(loc is not None for loc in got)
        locs.extend(loc for loc in got if loc is not None)
    for loc, v in zip(locs, values, strict=True):
        assert loc.nbytes == len(v)
        assert loc.extent.offset % ALIGNMENT == 0 and loc.extent.length % ALIGNMENT == 0
        assert loc.extent.length >= HEADER_BYTES + len(v) and loc.header == HEADER_BYTES
    # Read in one big batch, and again in differently grouped batches.
    ok, data = read_back(tier, locs)
    assert all(ok) and data == values
    for start in range(0, len(locs), 7):
        ok, data = read_back(tier, locs[start:start + 7])
        assert all(ok) and data == values[start:start + 7]
    s = tier.stats()
    assert s["blocks"] == len(values) and s["writes"] == len(values)
    assert s["reads"] == 2 * len(values) and s["bytes_read"] == 2 * sum(sizes)
    assert s["bytes_written"] == sum(sizes) and s["checksum_failures"] == 0
    # Each block takes its header page and its value rounded up to the alignment.
    assert s["used"] == sum(HEADER_BYTES + -(-n // ALIGNMENT) * ALIGNMENT for n in sizes)
    assert s["io_backend"] == mode["io"]
    tier.close()


def test_aligned_and_unaligned_buffers(tmp_path: Path, mode: dict) -> None:
    """Page-aligned caller memory is used in place (only a partial last page bounces);
    unaligned memory (an odd offset into a bytearray) is bounced whole."""
    tier = open_tier(tmp_path, 16 * MiB, mode)
    sizes = [4096, 3 * 4096, 3 * 4096 + 5, 100, 1 << 20]
    with contextlib.ExitStack() as stack:
        srcs = [stack.enter_context(aligned(n)) for n in sizes]
        for i, s in enumerate(srcs):
            s[:] = payload(100 + i, len(s))
        locs = tier.write_blocks([(key_of(i), None, s) for i, s in enumerate(srcs)])
        assert all(loc is not None for loc in locs)
        outs = [stack.enter_context(aligned(n)) for n in sizes]
        assert all(tier.read_blocks_into(locs, outs))  # type: ignore[arg-type]
        assert [bytes(o) for o in outs] == [bytes(s) for s in srcs]
        # Unaligned destinations: one byte into a bytearray, larger than needed.
        backing = [bytearray(n + 9) for n in sizes]
        outs2 = [memoryview(b)[1:] for b in backing]
        assert all(tier.read_blocks_into(locs, outs2))  # type: ignore[arg-type]
        for b, s in zip(backing, srcs, strict=True):
            assert bytes(b[1:1 + len(s)]) == bytes(s)
            assert b[0] == 0 and bytes(b[1 + len(s):]) == bytes(8)  # nothing past nbytes
    tier.close()


def test_tier_protocol_raw_extents(tmp_path: Path, mode: dict) -> None:
    tier = open_tier(tmp_path, 4 * MiB, mode)
    ext = tier.allocate(10_000)
    assert ext is not None and ext.length == 3 * ALIGNMENT
    data = payload(5, 10_000)
    tier.write(ext, memoryview(data))
    out = bytearray(10_000)
    tier.read_into(ext, 10_000, memoryview(out))
    assert bytes(out) == data
    assert tier.used == ext.length
    tier.free(ext)
    assert tier.used == 0
    assert tier.allocate(8 * MiB) is None
    tier.close()


def test_on_tmpfs_if_present(uring_status: tuple[bool, str | None]) -> None:
    """/dev/shm is tmpfs: O_DIRECT either works (new kernels) or falls back to buffered."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        tier = SsdTier(Path(d) / "data.img", 4 * MiB, io="python", preallocate=False)
        assert tier.o_direct or tier.stats()["o_direct_fallback"]
        vals = [payload(i, 5000 * i + 1) for i in range(8)]
        locs = tier.write_blocks([(key_of(i), None, memoryview(v)) for i, v in enumerate(vals)])
        ok, data = read_back(tier, locs)  # type: ignore[arg-type]
        assert all(ok) and data == vals
        tier.close()


# --------------------------------------------------------------------------- restart


def _write_some(tier: SsdTier, n: int, seed: int) -> dict[bytes, tuple[bytes | None, bytes]]:
    rng = random.Random(seed)
    expect: dict[bytes, tuple[bytes | None, bytes]] = {}
    parent: BlockKey | None = None
    for start in range(0, n, 8):
        batch = []
        for i in range(start, min(n, start + 8)):
            k = key_of(seed * 1000 + i)
            v = payload(seed * 1000 + i, rng.randint(1, 100_000))
            batch.append((k, parent, memoryview(v)))
            expect[k] = (parent, v)
            parent = k
        assert all(loc is not None for loc in tier.write_blocks(batch))
    return expect


def _check_recovered(tier: SsdTier, expect: dict[bytes, tuple[bytes | None, bytes]]) -> None:
    records = tier.recover()
    assert {r.key for r in records} == set(expect)
    for r in records:
        assert r.parent == expect[r.key][0]
    ok, data = read_back(tier, [r.location for r in records])
    assert all(ok)
    assert data == [expect[r.key][1] for r in records]
    assert tier.used == sum(r.location.extent.length for r in records)
    assert tier.stats()["blocks"] == len(records)


@pytest.mark.parametrize("shutdown", ["close", "crash"])
def test_restart_recovers_every_acknowledged_block(tmp_path: Path, mode: dict,
                                                   shutdown: str) -> None:
    tier = open_tier(tmp_path, 16 * MiB, mode)
    expect = _write_some(tier, 40, seed=1)
    if shutdown == "close":
        tier.close()
    else:
        # Simulated crash: no close(), the object is just dropped.
        del tier
    tier = open_tier(tmp_path, 16 * MiB, mode)
    with pytest.raises(NotRecoveredError):
        tier.write_blocks([(key_of(999_999), None, memoryview(b"x"))])
    _check_recovered(tier, expect)
    # New writes after recovery land beside, never over, the recovered blocks.
    expect.update(_write_some(tier, 20, seed=2))
    tier.close()
    tier = open_tier(tmp_path, 16 * MiB, mode)
    _check_recovered(tier, expect)
    tier.close()


def test_index_for_another_file_size_is_refused(tmp_path: Path) -> None:
    mode = {"io": "python", "direct": True}
    tier = open_tier(tmp_path, 8 * MiB, mode)
    _write_some(tier, 3, seed=3)
    tier.close()
    # Bigger capacity: the file would grow, but the index was written for 8 MiB.
    with pytest.raises(SsdFormatError, match="written for a data file of 8388608 bytes"):
        SsdTier(tmp_path / "data.img", 16 * MiB, io="python")
    assert (tmp_path / "data.img").stat().st_size == 8 * MiB  # refused before resizing
    # Smaller: refused before the index is even read (never truncate a data file).
    with pytest.raises(SsdFormatError, match="refusing to truncate"):
        SsdTier(tmp_path / "data.img", 4 * MiB, io="python")
    # The original configuration still opens and serves.
    tier = open_tier(tmp_path, 8 * MiB, mode)
    assert len(tier.recover()) == 3
    tier.close()


def test_uring_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the native module, "auto" falls back (saying why) and "uring" refuses."""
    monkeypatch.setitem(sys.modules, "tiers._uring", None)  # makes the import fail
    tier = SsdTier(tmp_path / "a.img", MiB, io="auto")
    assert tier.io_backend == "python"
    assert "cffi_build.uring_build" in tier.stats()["io_backend_reason"]
    tier.close()
    with pytest.raises(UringUnavailableError, match="io='uring' requested but unavailable"):
        SsdTier(tmp_path / "a.img", MiB, io="uring")


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="io must be one of"):
        SsdTier(tmp_path / "a.img", MiB, io="spdk")
    tier = SsdTier(tmp_path / "b.img", MiB, io="python")
    with pytest.raises(ValueError, match="16 bytes"):
        tier.write_blocks([(BlockKey(b"short"), None, memoryview(b"x"))])
    tier.close()
    with pytest.raises(ValueError, match="closed"):
        tier.write_blocks([])


# --------------------------------------------------------------------------- corruption


def test_flipped_byte_is_reported_never_returned(tmp_path: Path, mode: dict) -> None:
    tier = open_tier(tmp_path, 8 * MiB, mode)
    vals = [payload(i, n) for i, n in enumerate([10_000, 4096 * 5, 777, 64 * 1024 + 3])]
    locs = tier.write_blocks([(key_of(i), None, memoryview(v)) for i, v in enumerate(vals)])
    assert all(loc is not None for loc in locs)
    victim = locs[1]
    assert victim is not None
    # Flip one byte in the middle of block 1 behind the tier's back.
    flip_byte(tmp_path / "data.img", victim.value_offset + victim.nbytes // 2)
    ok, data = read_back(tier, locs)  # type: ignore[arg-type]
    assert ok == [True, False, True, True]
    assert [data[i] for i in (0, 2, 3)] == [vals[i] for i in (0, 2, 3)]
    assert tier.stats()["checksum_failures"] == 1
    assert tier.stats()["io_errors"] == 0
    # A torn tail (last page zeroed, as a partially persisted write would leave it).
    torn = locs[3]
    assert torn is not None
    fd = os.open(tmp_path / "data.img", os.O_RDWR)
    try:
        os.pwrite(fd, bytes(ALIGNMENT), torn.extent.offset + torn.extent.length - ALIGNMENT)
        os.fsync(fd)
    finally:
        os.close(fd)
    ok, _ = read_back(tier, [torn])
    assert ok == [False]
    assert tier.stats()["checksum_failures"] == 2
    tier.close()


def test_corrupt_block_with_unaligned_destination_leaves_it_untouched(tmp_path: Path,
                                                                       mode: dict) -> None:
    """A bounced read copies to the caller only after the checksum verified."""
    tier = open_tier(tmp_path, 4 * MiB, mode)
    v = payload(9, 9000)
    (loc,) = tier.write_blocks([(key_of(1), None, memoryview(v))])
    assert loc is not None
    fd = os.open(tmp_path / "data.img", os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff", loc.value_offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    backing = bytearray(b"\x11" * 9001)
    assert tier.read_blocks_into([loc], [memoryview(backing)[1:]]) == [False]
    if tier.o_direct:
        assert backing == bytearray(b"\x11" * 9001)
    tier.close()


# --------------------------------------------------------------------------- capacity


def test_full_tier_rejects_only_what_does_not_fit(tmp_path: Path, mode: dict) -> None:
    tier = open_tier(tmp_path, MiB, mode)
    vals = [payload(1, 300_000), payload(2, 900_000), payload(3, 200_000), payload(4, 600_000)]
    locs = tier.write_blocks([(key_of(i), None, memoryview(v)) for i, v in enumerate(vals)])
    assert locs[1] is None  # 900 KB: does not fit after the first 300 KB
    assert locs[3] is None  # 600 KB: only ~545 KB is left
    assert locs[0] is not None and locs[2] is not None
    ok, data = read_back(tier, [locs[0], locs[2]])
    assert ok == [True, True] and data == [vals[0], vals[2]]
    assert tier.stats()["blocks"] == 2
    tier.close()
    tier = open_tier(tmp_path, MiB, mode)
    assert {r.key for r in tier.recover()} == {key_of(0), key_of(2)}
    tier.close()


def test_delete_frees_space_durably(tmp_path: Path, mode: dict) -> None:
    tier = open_tier(tmp_path, 4 * MiB, mode)
    vals = [payload(i, 100_000 + i) for i in range(30)]
    keys = [key_of(i) for i in range(30)]
    locs = tier.write_blocks([(k, None, memoryview(v)) for k, v in zip(keys, vals, strict=True)])
    assert all(loc is not None for loc in locs)
    assert tier.write_blocks([(key_of(99), None, memoryview(payload(0, 2 * MiB)))]) == [None]
    tier.delete([(k, loc) for k, loc in zip(keys[:10], locs[:10], strict=True)])  # type: ignore[misc]
    tier.close()
    tier = open_tier(tmp_path, 4 * MiB, mode)
    records = tier.recover()
    assert {r.key for r in records} == set(keys[10:])
    tier.delete([(r.key, r.location) for r in records])
    assert tier.used == 0 and tier.stats()["blocks"] == 0
    # The whole region is one free extent again.
    (big,) = tier.write_blocks([(key_of(99), None,
                                 memoryview(payload(0, tier.capacity - HEADER_BYTES)))])
    assert big is not None and big.extent == Extent(0, tier.capacity)
    tier.close()


def test_delete_of_a_stale_copy_keeps_the_newer_entry(tmp_path: Path) -> None:
    mode = {"io": "python", "direct": True}
    tier = open_tier(tmp_path, 4 * MiB, mode)
    v = payload(1, 5000)
    (old,) = tier.write_blocks([(key_of(1), None, memoryview(v))])
    (new,) = tier.write_blocks([(key_of(1), None, memoryview(v))])
    assert old is not None and new is not None and old != new
    tier.delete([(key_of(1), old)])
    tier.close()
    tier = open_tier(tmp_path, 4 * MiB, mode)
    (rec,) = tier.recover()
    assert rec.location == new
    tier.close()


# --------------------------------------------------------------------------- property


@st.composite
def op_sequences(draw: st.DrawFn) -> list[tuple]:
    ops = []
    for _ in range(draw(st.integers(1, 14))):
        if draw(st.booleans()) or not ops:
            sizes = draw(st.lists(st.integers(1, 120_000), min_size=1, max_size=4))
            ops.append(("put", sizes))
        else:
            ops.append(("delete", draw(st.integers(0, 1 << 30))))
    return ops


@pytest.mark.parametrize("io", ["python", "uring"])
@settings(max_examples=75, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(before=op_sequences(), after=op_sequences(), crash=st.booleans(),
       direct=st.booleans())
def test_recovery_rebuilds_allocator_property(tmp_path: Path, uring_status: tuple,
                                              io: str, before: list, after: list, crash: bool,
                                              direct: bool) -> None:
    if io == "uring" and not uring_status[0]:
        pytest.skip(f"io_uring backend unavailable: {uring_status[1]}")
    capacity = 640 * 1024  # small: sequences often fill it
    live: dict[bytes, tuple[SsdLocation, bytes]] = {}
    counter = [0]

    def apply(tier: SsdTier, ops: list) -> None:
        for op in ops:
            if op[0] == "put":
                batch = []
                for n in op[1]:
                    counter[0] += 1
                    batch.append((key_of(counter[0]), payload(counter[0], n)))
                locs = tier.write_blocks([(k, None, memoryview(v)) for k, v in batch])
                for (k, v), loc in zip(batch, locs, strict=True):
                    if loc is not None:
                        live[k] = (loc, v)
                    else:
                        # None only when no free extent of that size exists.
                        assert tier.largest_free() < \
                            HEADER_BYTES + -(-len(v) // ALIGNMENT) * ALIGNMENT
            elif live:
                k = sorted(live)[op[1] % len(live)]
                tier.delete([(BlockKey(k), live.pop(k)[0])])

    def check(tier: SsdTier) -> None:
        extents = sorted((loc.extent for loc, _ in live.values()), key=lambda e: e.offset)
        for a, b in itertools.pairwise(extents):
            assert a.end <= b.offset, f"overlap: {a} {b}"
        assert tier.used == sum(e.length for e in extents)
        keys = sorted(live)
        ok, data = read_back(tier, [live[k][0] for k in keys])
        assert all(ok) and data == [live[k][1] for k in keys]

    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        m = {"io": io, "direct": direct}
        tier = open_tier(Path(d), capacity, m)
        apply(tier, before)
        check(tier)
        if crash:
            del tier
        else:
            tier.close()
        tier = open_tier(Path(d), capacity, m)
        records = tier.recover()
        assert {r.key: r.location for r in records} == {k: v[0] for k, v in live.items()}
        check(tier)
        apply(tier, after)
        check(tier)
        tier.close()


# --------------------------------------------------------------------------- real crash


def _crash_writer(path: Path, capacity: int, enough: int) -> list[bytes]:
    """Runs tests/ssd_crash_writer.py on ``path`` until ``enough`` blocks were acknowledged,
    SIGKILLs it mid-run, and returns every key it acknowledged."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "ssd_crash_writer.py"), "--path", str(path),
         "--capacity", str(capacity)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    acked: list[bytes] = []
    assert proc.stdout is not None
    try:
        first = proc.stdout.readline().decode()
        assert first.startswith("BACKEND "), proc.stderr.read().decode() if proc.stderr else ""
        deadline = time.monotonic() + 30
        while len(acked) < enough and time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            if not line:
                break
            if line.startswith("ACK "):
                acked.append(bytes.fromhex(line.split()[1]))
        # Kill mid-run: the writer is almost always inside write_blocks now.
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read().decode()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    # Only complete lines count: a kill could have cut the final one.
    for line in rest.split("\n")[:-1]:
        if line.startswith("ACK "):
            acked.append(bytes.fromhex(line.split()[1]))
    assert len(acked) >= enough, "writer too slow or failed"
    return acked


def _every_block_intact(tier: SsdTier, acked: list[bytes]) -> dict[bytes, SsdRecord]:
    records = {r.key: r for r in tier.recover()}
    missing = [k.hex() for k in acked if k not in records]
    assert not missing, f"acknowledged blocks lost: {missing[:5]}"
    # Every indexed block (acknowledged or written just before the kill) is intact.
    keys = sorted(records)
    ok, data = read_back(tier, [records[k].location for k in keys])
    assert all(ok)
    assert data == [ssd_crash_writer.payload_for(k) for k in keys]
    assert tier.stats()["checksum_failures"] == 0
    return records


def test_sigkill_mid_run_loses_no_acknowledged_block(tmp_path: Path,
                                                     uring_status: tuple) -> None:
    path = tmp_path / "data.img"
    capacity = 256 * MiB
    acked = _crash_writer(path, capacity, 2000)
    tier = SsdTier(path, capacity, io="auto")
    assert tier.rebuild_report is None
    _every_block_intact(tier, acked)
    tier.close()


def _damage(index: Path, how: str) -> None:
    files = [f for f in index.iterdir() if f.is_file() and f.stat().st_size]
    if how == "deleted":
        shutil.rmtree(index)
    elif how == "truncated":  # every file cut in half
        for f in files:
            os.truncate(f, f.stat().st_size // 2)
    elif how == "garbage":  # every file overwritten
        for f in files:
            f.write_bytes(os.urandom(f.stat().st_size))
    elif how == "wal-cut":  # only the write-ahead log: RocksDB opens an older index
        for f in files:
            if f.suffix == ".log":
                os.truncate(f, f.stat().st_size // 2)
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["deleted", "truncated", "garbage", "wal-cut"])
def test_a_damaged_index_is_refused_and_a_rebuild_serves_every_acknowledged_block(
        tmp_path: Path, how: str) -> None:
    path = tmp_path / "data.img"
    capacity = 64 * MiB
    acked = _crash_writer(path, capacity, 300)
    index = Path(str(path) + ".index")
    _damage(index, how)
    before = path.read_bytes()
    with pytest.raises(SsdIndexDamagedError):
        SsdTier(path, capacity, io="python")
    assert path.read_bytes() == before  # refused before touching the data
    tier = SsdTier(path, capacity, io="python", allow_index_rebuild=True)
    report = tier.rebuild_report
    assert report is not None and report.dropped == 0
    records = _every_block_intact(tier, acked)
    assert report.rebuilt == len(records) >= len(acked)
    assert report.scanned_bytes == tier.capacity
    assert (report.kept_at is None) == (how == "deleted")
    if report.kept_at is not None:
        assert Path(report.kept_at).is_dir() and report.kept_at.startswith(str(index))
    # New writes go on after the rebuilt blocks, and a clean restart needs no rebuild.
    (loc,) = tier.write_blocks([(key_of(1), None, memoryview(b"after"))])
    assert loc is not None
    tier.close()
    tier = SsdTier(path, capacity, io="python")
    assert tier.rebuild_report is None
    assert len(tier.recover()) == len(records) + 1
    tier.close()


def test_rebuild_never_brings_back_a_deleted_block_and_keeps_the_newest_copy(
        tmp_path: Path) -> None:
    mode = {"io": "python", "direct": True}
    tier = open_tier(tmp_path, 8 * MiB, mode)
    old_v, new_v, gone_v = payload(1, 9000), payload(2, 7000), payload(3, 5000)
    (old,) = tier.write_blocks([(key_of(1), None, memoryview(old_v))])
    (gone,) = tier.write_blocks([(key_of(2), key_of(1), memoryview(gone_v))])
    (new,) = tier.write_blocks([(key_of(1), None, memoryview(new_v))])  # a second copy
    assert old is not None and new is not None and gone is not None
    tier.delete([(key_of(2), gone)])
    tier.close()
    shutil.rmtree(tmp_path / "data.img.index")
    tier = open_tier(tmp_path, 8 * MiB, mode, allow_index_rebuild=True)
    assert tier.rebuild_report is not None
    assert (tier.rebuild_report.rebuilt, tier.rebuild_report.dropped) == (1, 1)
    (rec,) = tier.recover()
    assert rec.key == key_of(1) and rec.location == new
    assert read_back(tier, [rec.location]) == ([True], [new_v])
    assert tier.used == new.extent.length  # the older copy's space is free again
    tier.close()


def test_a_format_1_index_and_its_blocks_still_read(tmp_path: Path) -> None:
    """Data written before block headers: its index entries (49 bytes) keep their meaning,
    the index is marked format 2 when opened, and new blocks get headers."""
    import json

    import rocksdict
    import xxhash

    path, capacity = tmp_path / "data.img", 4 * MiB
    values = [payload(i, n) for i, n in enumerate([5000, 4096, 1])]
    with open(path, "wb") as f:
        f.truncate(capacity)
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    db = rocksdict.Rdict(str(path) + ".index", opts)
    db[b"\x00meta"] = json.dumps({"format": "kvstore-ssd-index", "version": 1,
                                  "alignment": ALIGNMENT, "capacity": capacity,
                                  "block_device": False}, sort_keys=True).encode()
    offset = 0
    for i, v in enumerate(values):
        length = -(-len(v) // ALIGNMENT) * ALIGNMENT
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(v)
        db[b"b" + key_of(i)] = struct.pack("<QQQQB16s", offset, length, len(v),
                                           xxhash.xxh3_64_intdigest(v), 0, bytes(16))
        offset += length
    db.close()
    tier = SsdTier(path, capacity, io="python")
    records = sorted(tier.recover(), key=lambda r: r.key)
    assert [r.location.header for r in records] == [0, 0, 0]
    assert read_back(tier, [r.location for r in records]) == ([True] * 3, values)
    (loc,) = tier.write_blocks([(key_of(9), None, memoryview(b"new"))])
    assert loc is not None and loc.header == HEADER_BYTES
    tier.close()
    db = rocksdict.Rdict(str(path) + ".index", rocksdict.Options(raw_mode=True))
    assert json.loads(bytes(db[b"\x00meta"]))["version"] == 2
    db.close()
    tier = SsdTier(path, capacity, io="python")
    assert len(tier.recover()) == 4
    tier.close()
