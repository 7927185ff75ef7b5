"""HBM tier: runs on the CPU device here and says so; copies are byte-exact."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tiers.base import Tier  # noqa: E402
from tiers.hbm import HbmTier, pick_device  # noqa: E402


def test_reports_the_device_it_really_uses() -> None:
    t = HbmTier(1 << 20)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert t.device == expected
    assert t.describe()["on_gpu"] is torch.cuda.is_available()
    assert isinstance(t, Tier)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_cuda_without_a_gpu() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        pick_device("cuda")


def test_round_trip_and_allocator() -> None:
    t = HbmTier(1 << 20, device="cpu")
    blobs = [os.urandom(n) for n in (1, 255, 4096, 100_000)]
    extents = []
    for b in blobs:
        e = t.allocate(len(b))
        assert e is not None
        t.write(e, memoryview(b))
        extents.append(e)
    assert t.used == sum(e.length for e in extents)
    for b, e in zip(blobs, extents, strict=True):
        out = bytearray(len(b) + 10)
        t.read_into(e, len(b), memoryview(out))
        assert bytes(out[: len(b)]) == b
        assert bytes(t.tensor(e, len(b)).numpy()) == b
    for e in extents:
        t.free(e)
    assert t.used == 0
    with pytest.raises(ValueError):
        t.read_into(extents[0], 10, memoryview(bytearray(5)))


def test_footprint_is_the_allocator_rounding() -> None:
    t = HbmTier(1 << 20, device="cpu")
    assert [t.footprint(n) for n in (1, 64, 256, 257)] == [256, 256, 256, 512]
    assert t.allocate(64) is not None and t.used == t.footprint(64)
