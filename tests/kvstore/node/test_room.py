"""Room for a put that found DRAM full (``kvstore.node.room``), on an in-process Node with
an SSD tier. The mover's rounds never run (high watermark 1.0: no tier is ever past it),
so only the put under test makes room, and each step is ordered by the test."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstore.node.room as room_module
from kvstore.core.errors import ResourceExhausted
from kvstore.core.keys import BlockKey
from kvstore.node.semantics import Node, NodeSettings
from tiers.manager import Reservation
from tiers.mover import Room, TierMover

BLOCK = 64 << 10


def key() -> BlockKey:
    return BlockKey(os.urandom(16))


def value(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * BLOCK)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    # A put that waited when it must not would hang here (and fail the run), not pass.
    monkeypatch.setattr(room_module, "ROOM_WAIT_S", 3600.0)
    n = Node(NodeSettings(dram_bytes=8 * BLOCK, prefault=False, high_watermark=1.0,
                          low_watermark=0.5, ssd_path=str(tmp_path / "kv.img"),
                          ssd_bytes=64 << 20, ssd_io="python", max_retained_fraction=1.0))
    yield n
    n.close()


def dram_free_blocks(n: Node) -> int:
    d = n.stats()["tiers"]["dram"]
    return (d["capacity"] - d["used"]) // BLOCK


def test_a_put_keeps_making_room_while_other_puts_take_it(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each time the put made room, other writers' puts took all of it before the put
    tried again: 12 times, more than the 8 tries a put used to get. It still lands."""
    stored = {key(): value(i) for i in range(8)}  # DRAM full
    for k, v in stored.items():
        assert node.put(k, v)
    real = TierMover.room_for
    me = threading.get_ident()
    rounds: list[Room] = []

    def then_taken(self: TierMover, level: int, nbytes: int, *, timeout: float) -> Room:
        got = real(self, level, nbytes, timeout=timeout)
        if threading.get_ident() == me and len(rounds) < 12:
            rounds.append(got)
            for _ in range(dram_free_blocks(node)):  # another writer's puts
                k, v = key(), value(len(stored))
                assert node.put(k, v)
                stored[k] = v
        return got

    monkeypatch.setattr(TierMover, "room_for", then_taken)
    mine = key()
    assert node.put(mine, value(99))
    stored[mine] = value(99)
    assert rounds == [Room.FREED] * 12
    assert all(node.get(k) == bytes(v) for k, v in stored.items())


def test_a_put_waits_for_another_writers_reservations(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """DRAM is all reservations of a same-host writer that has not committed yet: nothing
    can move, but room will come once it commits. The put waits for that, then lands."""
    theirs = [node.reserve(key(), BLOCK) for _ in range(8)]
    real = TierMover.room_for
    answered = threading.Event()
    rounds: list[Room] = []

    def watched(self: TierMover, level: int, nbytes: int, *, timeout: float) -> Room:
        got = real(self, level, nbytes, timeout=timeout)
        rounds.append(got)
        answered.set()
        return got

    monkeypatch.setattr(TierMover, "room_for", watched)
    result: list[object] = []

    def put() -> None:
        try:
            result.append(node.put(key(), value(1)))
        except Exception as exc:  # recorded, asserted below
            result.append(exc)

    putter = threading.Thread(target=put)
    putter.start()
    assert answered.wait(30)
    assert rounds[0] is Room.NONE and not result  # found nothing to move, and waits
    for i, r in enumerate(theirs):  # the writer fills and commits its batch
        assert r is not None
        view = node.fill_view(r)
        view[:] = value(i)
        view.release()
        assert node.commit(r)
    putter.join(30)
    assert result == [True]
    assert rounds[-1] is Room.FREED


def test_a_put_holding_the_only_reservations_fails_at_once(node: Node) -> None:
    """A writer whose own batch holds all of DRAM: no one else's commit will make room, so
    its next reservation fails instead of waiting for itself."""
    mine: list[Reservation] = []
    for _ in range(8):
        r = node.reserve(key(), BLOCK, holding=sum(x.extent.length for x in mine))
        assert r is not None
        mine.append(r)
    with pytest.raises(ResourceExhausted):
        node.reserve(key(), BLOCK, holding=sum(x.extent.length for x in mine))
    for r in mine:
        node.abort(r)
    assert node.put(key(), value(2))  # the room is back


def test_a_put_fails_when_the_ssd_keeps_every_block_it_holds(tmp_path: Path) -> None:
    """DRAM and the SSD are full of retained blocks: each round's moves are undone, and the
    put fails after a few rounds rather than until ROOM_WAIT_S."""
    n = Node(NodeSettings(dram_bytes=4 * BLOCK, prefault=False, high_watermark=1.0,
                          low_watermark=0.5, ssd_path=str(tmp_path / "kv.img"),
                          ssd_bytes=4 * (BLOCK + 4096), ssd_io="python",
                          max_retained_fraction=1.0))
    try:
        kept = [key() for _ in range(8)]
        for i, k in enumerate(kept):
            assert n.put(k, value(i), retain_s=600)
        assert sorted(n.locate(kept)) == ["dram"] * 4 + ["ssd"] * 4
        with pytest.raises(ResourceExhausted):
            n.put(key(), value(9))
        assert all(n.get(k) == bytes(value(i)) for i, k in enumerate(kept))
    finally:
        n.close()
