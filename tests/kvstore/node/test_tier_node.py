"""The tier hierarchy in a real node process: demotion, promotion, restart, corruption.

Every test runs over both SSD I/O paths (io_uring and the thread-pool fallback).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
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


# ---- a damaged SSD index (issue 25): loud, and rebuilt from the blocks on disk ----------------


def _log_levels(node_output: str) -> list[str]:
    """The level of every JSON log line the node wrote (``--log-format json``)."""
    levels = []
    for line in node_output.splitlines():
        if line.startswith("{"):
            levels.append(json.loads(line)["level"])
    return levels


def _blocks_on_ssd(tmp_path: Path, io: str, *, runs: int = 2) -> dict[bytes, bytes]:
    """Blocks on the SSD tier of a node that crashed: each run puts 24 blocks into 4 MiB of
    DRAM (so some demote) and the last one is SIGKILLed, the others stop cleanly (their
    index entries reach RocksDB's tables, the last run's stay in its write-ahead log)."""
    values: dict[bytes, bytes] = {}
    for run in range(runs):
        node = tiered(tmp_path, io)
        with Client(node.addr, transport="tcp") as c:
            before = ssd_blocks(c)
            for _ in range(24):
                k, v = os.urandom(16), os.urandom(BLOCK)
                assert c.put(k, v)
                values[k] = v
            wait_until(lambda: ssd_blocks(c) >= before + 4, what="blocks on SSD")  # noqa: B023
            where = c.locate(list(values))
        if run + 1 < runs:
            assert node.stop() == 0, node.output()
        else:
            node.stop(signal.SIGKILL)
    return {k: values[k] for k, w in zip(values, where, strict=True) if w == "ssd"}


def _damage(index: Path, how: str) -> None:
    files = [f for f in index.iterdir() if f.is_file()]
    if how == "deleted":
        shutil.rmtree(index)
    elif how == "truncated":  # every file cut in half: RocksDB refuses to open
        for f in files:
            os.truncate(f, f.stat().st_size // 2)
    elif how == "wal-cut":  # only the log: RocksDB opens an older index and says nothing
        logs = [f for f in files if f.suffix == ".log" and f.stat().st_size]
        assert logs
        for f in logs:
            os.truncate(f, f.stat().st_size // 2)
    elif how == "garbage":  # the tables overwritten
        tables = [f for f in files if f.suffix == ".sst"]
        assert tables
        for f in tables:
            f.write_bytes(os.urandom(f.stat().st_size))
    else:
        raise ValueError(how)


def _refused(tmp_path: Path, *extra: str) -> str:
    """What a node that must refuse to start wrote, its exit status first."""
    try:
        node = tiered(tmp_path, "python", *extra)
    except RuntimeError as exc:
        return str(exc)
    node.stop()
    pytest.fail("the node started on a damaged index")


@pytest.mark.parametrize("how", ["deleted", "truncated", "wal-cut", "garbage"])
def test_a_damaged_index_stops_the_node_loudly_and_rebuild_serves_every_block(
        tmp_path: Path, how: str) -> None:
    on_ssd = _blocks_on_ssd(tmp_path, "python")
    assert len(on_ssd) >= 8
    _damage(tmp_path / "kv.img.index", how)
    output = _refused(tmp_path, "--log-format", "json")
    assert "node exited with 1" in output
    assert "ERROR" in _log_levels(output.split("\n", 1)[1])
    assert "--allow-index-rebuild" in output  # the message names the way out
    node = tiered(tmp_path, "python", "--log-format", "json", "--allow-index-rebuild")
    try:
        with Client(node.addr, transport="tcp") as c:
            assert c.get_batch(list(on_ssd)) == list(on_ssd.values())
            stats = c.stats()["node"]
            assert stats["ssd_index_rebuilds"] == 1
            # Blocks demoted just before the kill may be on disk unacknowledged: found too.
            assert stats["ssd_rebuilt_blocks"] >= len(on_ssd)
            assert stats["ssd_rebuild_dropped_blocks"] == 0
            assert stats["recovered_blocks"] == stats["ssd_rebuilt_blocks"]
        assert "ERROR" in _log_levels(node.output())
    finally:
        assert node.stop() == 0, node.output()
    # The rebuilt index is an ordinary one: the next start needs no flag.
    again = tiered(tmp_path, "python")
    try:
        with Client(again.addr, transport="tcp") as c:
            assert c.get_batch(list(on_ssd)) == list(on_ssd.values())
            assert c.stats()["node"].get("ssd_index_rebuilds", 0) == 0
    finally:
        assert again.stop() == 0, again.output()


@pytest.mark.parametrize("io", IO_PATHS)
def test_rebuild_drops_a_torn_block_and_serves_the_rest(tmp_path: Path, io: str) -> None:
    on_ssd = _blocks_on_ssd(tmp_path, io, runs=1)
    shutil.rmtree(tmp_path / "kv.img.index")
    image = tmp_path / "kv.img"
    data = image.read_bytes()
    victim = next(iter(on_ssd))
    at = data.index(on_ssd[victim])
    with open(image, "r+b") as f:  # its second half never reached the disk
        f.seek(at + BLOCK // 2)
        f.write(bytes(BLOCK // 2))
    node = tiered(tmp_path, io, "--allow-index-rebuild")
    try:
        with Client(node.addr, transport="tcp") as c:
            served = c.get_batch(list(on_ssd))
            assert served[0] is None  # torn: never served
            assert served[1:] == list(on_ssd.values())[1:]
            stats = c.stats()
            assert stats["node"]["ssd_rebuild_dropped_blocks"] == 1
            assert stats["node"]["ssd_rebuilt_blocks"] == stats["tiers"]["ssd"]["blocks"]
            assert stats["tiers"]["ssd"]["checksum_failures"] == 0  # dropped at the scan
    finally:
        assert node.stop() == 0, node.output()


# ---- retention across a restart (issue 25) ------------------------------------------------------


def test_a_retained_block_on_ssd_stays_retained_across_a_restart(tmp_path: Path) -> None:
    node = tiered(tmp_path, "python")
    kept, short = os.urandom(16), os.urandom(16)
    with Client(node.addr, transport="tcp") as c:
        assert c.put(kept, os.urandom(BLOCK), retain_s=3600)
        assert c.put(short, os.urandom(BLOCK), retain_s=1)
        short_until = time.time() + 1
        for _ in range(24):
            assert c.put(os.urandom(16), os.urandom(BLOCK))
        wait_until(lambda: c.locate([kept, short]) == ["ssd", "ssd"], what="both on SSD")
        assert c.stats()["node"]["retained_blocks"] >= 1
    node.stop(signal.SIGKILL)
    while time.time() <= short_until:  # the short retention has passed before the restart
        time.sleep(0.05)
    again = tiered(tmp_path, "python")
    try:
        with Client(again.addr, transport="tcp") as c:
            assert c.locate([kept, short]) == ["ssd", "ssd"]
            stats = c.stats()["node"]
            assert stats["retained_blocks"] == 1
            assert stats["retained_bytes"] == BLOCK
    finally:
        assert again.stop() == 0, again.output()
