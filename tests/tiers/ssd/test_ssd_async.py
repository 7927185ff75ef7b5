"""Tests of the SSD tier's asynchronous reads (SsdTier.submit_reads -> SsdReads) and of
the shared queue under them, on both backends: results in completion order, failures
as results (never exceptions), checksum failures reported, close while in flight."""

from __future__ import annotations

import errno
import mmap
import os
import random
import threading
from pathlib import Path

import pytest
from conftest import flip_byte

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent
from tiers.ssd.tier import SsdLocation, SsdTier

MiB = 1 << 20
MODES = [("python", True), ("python", False), ("uring", True), ("uring", False)]


@pytest.fixture(params=MODES, ids=[f"{io}-{'direct' if d else 'buffered'}" for io, d in MODES])
def tier(request: pytest.FixtureRequest, tmp_path: Path, uring_status: tuple) -> SsdTier:
    io, direct = request.param
    if io == "uring" and not uring_status[0]:
        pytest.skip(f"io_uring backend unavailable: {uring_status[1]}")
    t = SsdTier(tmp_path / "data.img", 64 * MiB, io=io, direct=direct)
    t.recover()
    yield t
    t.close()


def key_of(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "big") + b"\x5a" * 8)


def payload(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def store(tier: SsdTier, sizes: list[int]) -> tuple[list[bytes], list[SsdLocation]]:
    vals = [payload(i, n) for i, n in enumerate(sizes)]
    locs = tier.write_blocks([(key_of(i), None, memoryview(v)) for i, v in enumerate(vals)])
    assert all(loc is not None for loc in locs)
    return vals, locs  # type: ignore[return-value]


def corrupt(tier: SsdTier, loc: SsdLocation) -> None:
    """Flips one byte of the block behind the tier's back."""
    flip_byte(tier.path, loc.value_offset + loc.nbytes // 2)


def test_results_arrive_once_each_in_any_order(tier: SsdTier) -> None:
    """Every index once, with its own bytes, whatever order the reads finish in; two
    handles outstanding may be collected newest first."""
    sizes = [4 * MiB if i % 5 == 0 else 4096 * (1 + i % 3) + (i % 7) for i in range(24)]
    vals, locs = store(tier, sizes)
    outs = [bytearray(n) for n in sizes]
    first = tier.submit_reads(locs[:12], [memoryview(o) for o in outs[:12]])
    second = tier.submit_reads(locs[12:], [memoryview(o) for o in outs[12:]])
    seen = [i + 12 for i, ok in second.completions() if ok]
    assert second.done
    got = list(first.completions())
    seen += [i for i, ok in got if ok]
    assert sorted(seen) == list(range(24))
    assert [bytes(o) for o in outs] == vals
    assert first.wait() == [True] * 12  # already collected: the results stay
    assert tier.stats()["reads"] == 24


def test_failures_are_results_not_exceptions(tier: SsdTier) -> None:
    """A corrupted block and a block past the end of the data read as False (counted
    as a checksum failure and an I/O error); the others are good."""
    vals, locs = store(tier, [8192, 5000, 64 * 1024])
    corrupt(tier, locs[1])
    beyond = SsdLocation(extent=Extent(offset=tier.capacity, length=4096), nbytes=4096,
                         checksum=0)
    targets = [locs[0], locs[1], beyond, locs[2]]
    outs = [bytearray(loc.nbytes) for loc in targets]
    handle = tier.submit_reads(targets, [memoryview(o) for o in outs])
    assert dict(handle.completions()) == {0: True, 1: False, 2: False, 3: True}
    assert bytes(outs[0]) == vals[0] and bytes(outs[3]) == vals[2]
    stats = tier.stats()
    assert stats["checksum_failures"] == 1
    assert stats["io_errors"] == 1


def test_close_handle_and_tier_while_in_flight(tier: SsdTier) -> None:
    """Closing a handle mid-flight waits for its I/O and leaves the rest False;
    closing the tier with reads in flight ends them as results, never a crash."""
    n = 128
    _, locs = store(tier, [64 * 1024] * n)
    bufs = [mmap.mmap(-1, 64 * 1024) for _ in range(n)]
    handle = tier.submit_reads(locs, [memoryview(b) for b in bufs])
    next(handle.completions())
    handle.close()
    assert sum(handle.wait()) >= 1  # (nothing more is reported after close)
    handle = tier.submit_reads(locs, [memoryview(b) for b in bufs])
    closer = threading.Thread(target=tier.close)
    closer.start()
    results = handle.wait()
    closer.join()
    assert len(results) == n  # each read finished, was cancelled or failed
    with pytest.raises(ValueError):
        tier.submit_reads(locs[:1], [memoryview(bufs[0])])


def test_concurrent_callers_share_the_queue(tier: SsdTier) -> None:
    """Many threads reading single blocks at once (as a node does) each get their own."""
    vals, locs = store(tier, [4096 * (1 + i % 4) + i for i in range(64)])
    errors: list[str] = []

    def reader(w: int) -> None:
        for i in range(w, 64, 8):
            out = bytearray(locs[i].nbytes)
            if not tier.read_blocks_into([locs[i]], [memoryview(out)])[0] or out != vals[i]:
                errors.append(f"block {i}")

    threads = [threading.Thread(target=reader, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("io", ["python", "uring"])
def test_backend_cancel_fails_unstarted_ops(tmp_path: Path, io: str,
                                            uring_status: tuple) -> None:
    """submit(); cancel(): every op is reported once, with its bytes or -ECANCELED;
    release() returns only when nothing is in flight; the backend stays usable. (How
    many were cancelled depends on timing: see the pipe test for an exact count.)"""
    from tiers.ssd.io import _Op, open_backend

    if io == "uring" and not uring_status[0]:
        pytest.skip(f"io_uring backend unavailable: {uring_status[1]}")
    path = tmp_path / "raw.img"
    path.write_bytes(bytes(256 * 4096))
    fd = os.open(path, os.O_RDWR)
    backend, _, _ = open_backend(fd, io, 4)
    try:
        ops = [_Op(is_write=False, offset=i * 4096, bufs=[memoryview(bytearray(4096))],
                   nbytes=4096) for i in range(256)]
        batch = backend.submit(ops, 1)
        batch.cancel()
        reported: list[int] = []
        while got := batch.reap():
            reported += got
        batch.release()
        assert sorted(reported) == list(range(256))
        assert set(batch.results) <= {4096, -errno.ECANCELED}
        assert backend.run(ops[:8]) == [4096] * 8  # still usable
    finally:
        backend.close()
        os.close(fd)


def test_uring_cancel_fails_exactly_the_ops_behind_a_blocked_one(
        uring_status: tuple) -> None:
    """One op in flight at a time, the first a read of an empty pipe (it cannot finish
    before data arrives): cancel() fails every later op, deterministically; the first
    ends with its bytes (or -ECANCELED if it had not started); then the queue is
    reusable. Also the regression test for a group freed while still on the queue's
    ready list (a use-after-free that hung the next batch)."""
    from tiers.ssd.io import _Op, open_backend

    if not uring_status[0]:
        pytest.skip(f"io_uring backend unavailable: {uring_status[1]}")
    r, w = os.pipe()
    backend, _, _ = open_backend(r, "uring", 4)
    try:
        ops = [_Op(is_write=False, offset=0, bufs=[memoryview(bytearray(8))], nbytes=8)
               for _ in range(16)]
        for _ in range(10):
            batch = backend.submit(ops, 1)
            batch.cancel()
            first = batch.reap(min_new=15)  # no data yet: only cancellations can finish
            assert first is not None and set(first) >= set(range(1, 16))
            if 0 not in first:  # the first read had started: it waits for data
                os.write(w, b"x" * 8)
                assert batch.reap() == [0]
            batch.release()
            assert batch.results[1:] == [-errno.ECANCELED] * 15
            assert batch.results[0] in (8, -errno.ECANCELED)
            # A freed group must not linger where the next one is linked.
            os.write(w, b"y" * 16)
            assert backend.run(ops[:2]) == [8, 8]
    finally:
        backend.close()
        os.close(r)
        os.close(w)
