"""The tier hierarchy in a real node process: demotion, promotion, restart, corruption.

Every test runs over both SSD I/O paths (io_uring and the thread-pool fallback).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from conftest import flip_byte, start_node, wait_until

from kvstore import Client, ResourceExhausted
from tiers.ssd.io import uring_available

IO_PATHS = [pytest.param("uring", marks=pytest.mark.skipif(
    not uring_available(), reason="io_uring helper not built or not allowed here")), "python"]
BLOCK = 256 << 10


def tiered(tmp_path: Path, io: str, *extra: str, dram: str = "4MiB"):
    return start_node(tmp_path, "--ssd-path", str(tmp_path / "kv.img"), "--ssd-bytes", "64MiB",
                      "--ssd-io", io, *extra, dram=dram)


def ssd_blocks(c: Client) -> int:
    return c.stats()["tiers"]["ssd"]["blocks"]


@pytest.mark.parametrize("io", IO_PATHS)
def test_blocks_demote_to_ssd_and_promote_on_second_hit(tmp_path: Path, io: str) -> None:
    node = tiered(tmp_path, io)
    try:
        values = {os.urandom(16): os.urandom(BLOCK) for _ in range(40)}  # 10 MiB > 4 MiB DRAM
        with Client(node.addr, transport="tcp") as c:
            for k, v in values.items():
                assert c.put(k, v)

            def settled() -> bool:
                # No reads yet, so nothing is promoted: every demotion left a block on SSD.
                where = c.locate(list(values))
                dram = c.stats()["tiers"]["dram"]
                return (dram["used"] <= 0.95 * (4 << 20)
                        and dram["demotions"] == where.count("ssd"))

            wait_until(settled, what="demotions to finish")
            where = c.locate(list(values))
            assert set(where) == {"dram", "ssd"}
            on_ssd = next(k for k, w in zip(values, where, strict=True) if w == "ssd")
            assert c.get(on_ssd) == values[on_ssd]
            assert c.get(on_ssd) == values[on_ssd]  # second hit since it reached SSD
            wait_until(lambda: c.locate([on_ssd]) == ["dram"], what="promotion to DRAM")
            assert c.stats()["tiers"]["dram"]["promotions"] >= 1
            for transport in ("tcp", "shm", "grpc"):
                with Client(node.addr, transport=transport) as t:
                    assert all(t.get(k) == v for k, v in values.items())
    finally:
        assert node.stop() == 0, node.output()


@pytest.mark.parametrize("io", IO_PATHS)
def test_sigkill_during_puts_loses_no_block_that_reached_ssd(tmp_path: Path, io: str) -> None:
    node = tiered(tmp_path, io)
    acked: dict[bytes, bytes] = {}
    stop = threading.Event()

    def load() -> None:
        with Client(node.addr, transport="tcp", timeout=10) as c:
            while not stop.is_set():
                k, v = os.urandom(16), os.urandom(BLOCK)
                try:
                    c.put(k, v)
                except Exception:
                    return  # the node is gone
                acked[k] = v

    t = threading.Thread(target=load)
    t.start()
    with Client(node.addr, transport="grpc") as c:
        wait_until(lambda: ssd_blocks(c) >= 30, timeout=60, what="blocks on SSD")
        snapshot = list(acked)
        durable = [k for k, w in zip(snapshot, c.locate(snapshot), strict=True) if w == "ssd"]
    node.proc.send_signal(signal.SIGKILL)  # mid-load
    node.proc.wait()
    stop.set()
    t.join()
    assert len(durable) >= 20
    again = tiered(tmp_path, io)
    try:
        with Client(again.addr, transport="shm") as c:
            for k in durable:
                assert c.get(k) == acked[k]
            served = c.get_batch(list(acked))
            assert all(v is None or v == acked[k] for k, v in zip(acked, served, strict=True))
            assert c.stats()["node"]["recovered_blocks"] >= len(durable)
    finally:
        assert again.stop() == 0, again.output()


@pytest.mark.parametrize("io", IO_PATHS)
def test_flipped_byte_on_ssd_is_a_counted_miss(tmp_path: Path, io: str) -> None:
    node = tiered(tmp_path, io)
    values = {os.urandom(16): os.urandom(BLOCK) for _ in range(24)}
    with Client(node.addr, transport="tcp") as c:
        for k, v in values.items():
            c.put(k, v)
        wait_until(lambda: ssd_blocks(c) >= 4, what="blocks on SSD")
    assert node.stop() == 0
    data = (tmp_path / "kv.img").read_bytes()
    victim_key, victim_value = next((k, v) for k, v in values.items() if v in data)
    flip_byte(tmp_path / "kv.img", data.index(victim_value) + 1000)
    again = tiered(tmp_path, io)
    try:
        with Client(again.addr, transport="tcp") as c:
            # One batch holding the victim and intact SSD blocks: only the victim misses.
            served = c.get_batch(list(values))
            assert served[list(values).index(victim_key)] is None
            assert all(v is None or v == values[k] for k, v in zip(values, served, strict=True))
            # Everything recovered from SSD but the victim was served (DRAM died with the node).
            present = c.exists(list(values))
            assert [v is not None for v in served] == present and sum(present) >= 3
            assert c.get(victim_key) is None
            assert c.stats()["tiers"]["ssd"]["checksum_failures"] == 1
            assert not c.exists([victim_key])[0]
            intact = [k for k in values if k != victim_key and c.exists([k])[0]]
            assert intact and all(c.get(k) == values[k] for k in intact)
    finally:
        assert again.stop() == 0


@pytest.mark.parametrize("io", IO_PATHS)
def test_no_room_when_everything_is_pinned_and_nothing_lost(tmp_path: Path, io: str) -> None:
    node = tiered(tmp_path, io, dram="2MiB")
    try:
        with Client(node.addr, transport="tcp") as c:
            pinned = {os.urandom(16): os.urandom(BLOCK) for _ in range(8)}  # fills 2 MiB
            for k, v in pinned.items():
                assert c.put(k, v, pin=True)
            with pytest.raises(ResourceExhausted):
                c.put(os.urandom(16), os.urandom(BLOCK))
            assert all(c.get(k) == v for k, v in pinned.items())
            assert c.locate(list(pinned)) == ["dram"] * 8
    finally:
        assert node.stop() == 0
