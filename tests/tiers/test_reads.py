"""tiers.reads: reading leased blocks out of the tiers (``leased_block_views``).

The mover's background moves run in real node processes (test_tier_node.py); here the
batch read path is checked in-process against a real DRAM and SSD tier, on both SSD I/O
paths.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import flip_byte

from kvstore.core.keys import BlockKey
from tiers.dram import DramTier
from tiers.manager import TierManager
from tiers.policy import make_policy
from tiers.reads import leased_block_views
from tiers.ssd.buffers import address_of
from tiers.ssd.tier import SsdTier


@pytest.fixture(params=["uring", "python"])
def io(request: pytest.FixtureRequest, uring_status: tuple[bool, str | None]) -> str:
    if request.param == "uring" and not uring_status[0]:
        pytest.skip(f"io_uring unavailable: {uring_status[1]}")
    return request.param


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


def test_ssd_blocks_of_one_request_are_read_in_one_aligned_batch(tmp_path: Path,
                                                                  io: str) -> None:
    ssd = SsdTier(tmp_path / "kv.img", 8 << 20, io=io)
    dram = DramTier(1 << 20)
    manager = TierManager([dram, ssd], make_policy("lru"), durable=[False, True])
    # Sizes that are not page multiples: each block must still start on a page.
    values = [os.urandom(n) for n in (5000, 70_000, 1, 4096, 0, 123_457)]
    locations = ssd.write_blocks([(key(i), None, memoryview(v)) for i, v in enumerate(values)])
    for i, (v, loc) in enumerate(zip(values, locations, strict=True)):
        assert loc is not None
        assert manager.adopt(key(i), None, len(v), level=1, location=loc)
    in_dram = manager.reserve(key(99), 3)
    assert in_dram is not None
    manager.fill_view(in_dram)[:] = b"abc"
    manager.commit(in_dram)
    # Corrupt block 1 on disk (its first byte), after the checksum was recorded.
    flip_byte(tmp_path / "kv.img", locations[1].value_offset)  # type: ignore[union-attr]

    calls: list[int] = []
    real_read = ssd.read_blocks_into

    def counting_read(locs: Any, outs: Any) -> list[bool]:
        calls.append(len(locs))
        return real_read(locs, outs)

    ssd.read_blocks_into = counting_read  # type: ignore[method-assign]
    keys = [key(i) for i in range(len(values))] + [key(99), key(12345)]
    entries = [manager.acquire_read(k) for k in keys]
    assert entries[-1] is None
    views = leased_block_views(manager, threading.Lock(), entries)

    assert calls == [len(values)]  # every SSD block of the request in one call
    assert views[1] is None  # corrupt: a miss, counted, out of the index
    assert manager.entry(key(1)) is None
    assert manager.level_stats(1)["checksum_failures"] == 1
    for i, v in enumerate(values):
        if i != 1:
            assert bytes(views[i]) == v  # type: ignore[arg-type]
            if v:
                assert address_of(views[i]) % 4096 == 0  # type: ignore[arg-type]
    assert bytes(views[-2]) == b"abc"  # type: ignore[arg-type]
    assert views[-1] is None
    for e in entries:
        if e is not None:
            manager.release_read(e)
    ssd.close()
    dram.close()
