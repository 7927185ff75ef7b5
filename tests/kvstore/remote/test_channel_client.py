"""The channel client's shared-memory puts in parts (``shm_parts``), alone and against a
real node whose DRAM is smaller than one batch."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import start_node

from kvstore import Client
from kvstore.remote.channel_client import SHM_PUT_MIN_BYTES, shm_parts


def test_parts_are_bounded_in_order_and_cover_every_value() -> None:
    big = SHM_PUT_MIN_BYTES
    assert shm_parts([big] * 5, 2 * big) == [(0, 2), (2, 4), (4, 5)]
    assert shm_parts([big, 3 * big, big], 2 * big) == [(0, 1), (1, 2), (2, 3)]  # one alone
    assert shm_parts([10] * 5, 25) == [(0, 5)]  # never below SHM_PUT_MIN_BYTES
    assert shm_parts([], 2 * big) == []
    assert shm_parts([big] * 4, 0) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_a_shm_batch_larger_than_dram_lands(tmp_path: Path) -> None:
    """20 values of 256 KiB (5 MiB) into 2 MiB of DRAM over an SSD: reserved all at once,
    the batch held all of DRAM with nothing to move, and failed; in parts it lands."""
    node = start_node(tmp_path, "--ssd-path", str(tmp_path / "kv.img"), "--ssd-bytes",
                      "64MiB", "--ssd-io", "python", dram="2MiB")
    try:
        values = {os.urandom(16): os.urandom(256 << 10) for _ in range(20)}
        with Client(node.addr, transport="shm") as c:
            assert c.put_batch(list(values), list(values.values())) == [True] * 20
            assert c.get_batch(list(values)) == list(values.values())
            assert c.put_batch(list(values), list(values.values())) == [False] * 20
    finally:
        assert node.stop() == 0, node.output()
