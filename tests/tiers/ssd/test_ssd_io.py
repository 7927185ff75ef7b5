"""Tests of the SSD tier's I/O backends (tiers/ssd/io.py) and the native io_uring helper
(cffi_build/): batches with an in-flight limit, completion callbacks, and checksums
verified in C. The tier built on them is tested in test_ssd_tier.py."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

from tiers.ssd.io import load_uring
from tiers.ssd.tier import SsdTier, uring_available

MiB = 1 << 20


def payload(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


# --------------------------------------------------------------------------- backend batches


@pytest.mark.parametrize("io", ["python", "uring"])
def test_backend_depth_limit_and_incremental_completion(tmp_path: Path, io: str,
                                                        uring_status: tuple) -> None:
    """run(ops, depth, on_complete): every op reported exactly once, with its result,
    at any in-flight limit; a raising on_complete drains the batch and leaves the
    backend usable."""
    from tiers.ssd.io import _Op, open_backend

    if io == "uring" and not uring_status[0]:
        pytest.skip(f"io_uring backend unavailable: {uring_status[1]}")
    path = tmp_path / "raw.img"
    path.write_bytes(bytes(64 * 4096))
    fd = os.open(path, os.O_RDWR)
    backend, name, _ = open_backend(fd, io, 8)
    try:
        assert name == io
        data = [payload(i, 4096) for i in range(16)]
        writes = [_Op(is_write=True, offset=i * 4096, bufs=[memoryview(d)], nbytes=4096)
                  for i, d in enumerate(data)]
        assert backend.run(writes, 2) == [4096] * 16
        for depth in (0, 1, 3, 8, 64):
            outs = [bytearray(4096) for _ in range(16)]
            seen: list[tuple[int, int, bytes]] = []
            reads = [_Op(is_write=False, offset=i * 4096, bufs=[memoryview(o)], nbytes=4096)
                     for i, o in enumerate(outs)]
            res = backend.run(reads, depth,
                              lambda i, r, s=seen, o=outs: s.append((i, r, bytes(o[i]))))
            assert res == [4096] * 16
            assert sorted(i for i, _, _ in seen) == list(range(16))
            # The op's bytes are in place when its completion is reported.
            assert all(r == 4096 and b == data[i] for i, r, b in seen)

        def boom(i: int, r: int) -> None:
            raise RuntimeError("verify failed")

        reads = [_Op(is_write=False, offset=i * 4096, bufs=[memoryview(bytearray(4096))],
                     nbytes=4096) for i in range(16)]
        with pytest.raises(RuntimeError, match="verify failed"):
            backend.run(reads, 4, boom)
        assert backend.run(reads, 4) == [4096] * 16
    finally:
        backend.close()
        os.close(fd)


def test_inflight_depth_by_block_size() -> None:
    from tiers.ssd.io import INFLIGHT_BYTES, MIN_INFLIGHT, inflight_depth

    assert inflight_depth(64 << 10, 32) == min(32, INFLIGHT_BYTES // (64 << 10))
    assert inflight_depth(INFLIGHT_BYTES, 32) == MIN_INFLIGHT
    assert inflight_depth(1 << 30, 32) == MIN_INFLIGHT
    assert inflight_depth(4096, 1) == 1
    assert inflight_depth(0, 8) == 8


# --------------------------------------------------------------------------- C verification


def test_native_checksum_matches_python_xxh3(uring_status: tuple) -> None:
    """The helper's xxh3 equals the on-disk format's (xxhash.xxh3_64), over split iovecs."""
    import xxhash

    if not uring_status[0]:
        pytest.skip(f"io_uring backend unavailable: {uring_status[1]}")
    from tiers import _uring

    ffi, lib = _uring.ffi, _uring.lib
    if not lib.kv_have_verify():
        pytest.skip("tiers._uring built without xxhash.h (reads are verified in Python)")
    rng = random.Random(7)
    for n in [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 4095, 4097, 65536 + 5,
              MiB + 123]:
        data = rng.randbytes(n)
        cuts = sorted(rng.randrange(n + 1) for _ in range(2))
        parts = [data[: cuts[0]], data[cuts[0]: cuts[1]], data[cuts[1]:] + b"slack"]
        pins = [ffi.from_buffer(p) for p in parts]
        iov = ffi.new("struct iovec[]", 3)
        for k, part in enumerate(parts):
            iov[k].iov_base = pins[k]
            iov[k].iov_len = len(part)
        assert lib.kv_xxh3_iov(iov, 3, n) == xxhash.xxh3_64_intdigest(data), n
        assert lib.kv_xxh3_iov(iov, 1, min(n, len(parts[0]))) == \
            xxhash.xxh3_64_intdigest(parts[0][:n]), n


def test_uring_backend_verifies_in_c(tmp_path: Path, uring_status: tuple) -> None:
    """With a helper built with xxHash, read ops get a verdict from C: good blocks 1, a
    corrupted one 0; ops without a checksum (writes, raw reads) stay -1."""
    from tiers.ssd.io import _Op, open_backend

    if not uring_status[0]:
        pytest.skip(f"io_uring backend unavailable: {uring_status[1]}")
    import xxhash

    path = tmp_path / "raw.img"
    data = [payload(i, 8192) for i in range(8)]
    path.write_bytes(b"".join(data))
    fd = os.open(path, os.O_RDWR)
    backend, _, _ = open_backend(fd, "uring", 4)
    try:
        if not backend.verifies:  # type: ignore[union-attr]
            pytest.skip("tiers._uring built without xxhash.h")
        outs = [bytearray(8192) for _ in range(8)]
        tails = [bytearray(4096) for _ in range(8)]
        sums = [xxhash.xxh3_64_intdigest(d[:5000]) for d in data]
        sums[3] ^= 1  # block 3 "corrupt"
        # Value of 5000 bytes read as 4096 in place + a 4096-byte bounce (a tail of 904).
        ops = [_Op(is_write=False, offset=i * 8192,
                   bufs=[memoryview(outs[i])[:4096], memoryview(tails[i])], nbytes=8192,
                   checksum=sums[i], verify_bytes=5000) for i in range(8)]
        seen: dict[int, int] = {}
        res = backend.run(ops, 3, lambda i, r: seen.__setitem__(i, ops[i].verified))
        assert res == [8192] * 8
        assert seen == {i: 0 if i == 3 else 1 for i in range(8)}
        raw = [_Op(is_write=False, offset=0, bufs=[memoryview(bytearray(4096))], nbytes=4096)]
        backend.run(raw)
        assert raw[0].verified == -1
    finally:
        backend.close()
        os.close(fd)


def test_stale_native_module_is_not_used(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    """A helper of another API version (an old build) is refused, never called."""
    import types

    fake = types.SimpleNamespace(ffi=None, lib=types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "tiers._uring", fake)
    ok, reason = uring_available()
    assert not ok and "stale" in (reason or "")
    module, why = load_uring()  # what the raw benchmark loads: nothing, and why
    assert module is None and why == reason
    tier = SsdTier(tmp_path / "a.img", MiB, io="auto")
    assert tier.io_backend == "python" and not tier.verifies_in_c
    assert "rebuild" in (tier.stats()["io_backend_reason"] or "")
    tier.close()


def test_helper_builds_without_xxhash(tmp_path: Path, uring_status: tuple) -> None:
    """Without xxhash.h the helper still builds and runs; it just gives no verdicts."""
    import importlib.util

    if not uring_status[0]:
        pytest.skip(f"io_uring backend unavailable: {uring_status[1]}")
    from cffi_build.uring_build import API_VERSION, build

    built = build(tmp_path, verify=False)
    assert built is not None
    spec = importlib.util.spec_from_file_location("_uring", built)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.lib.kv_ring_api_version() == API_VERSION
    assert module.lib.kv_have_verify() == 0
    from tiers.ssd.io import _Op, _UringBackend

    path = tmp_path / "raw.img"
    data = payload(3, 8192)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    backend = _UringBackend(fd, 4, module)
    try:
        assert not backend.verifies
        out = bytearray(8192)
        op = _Op(is_write=False, offset=0, bufs=[memoryview(out)], nbytes=8192,
                 checksum=123, verify_bytes=8192)
        assert backend.run([op]) == [8192]
        assert op.verified == -1 and bytes(out) == data
    finally:
        backend.close()
        os.close(fd)
