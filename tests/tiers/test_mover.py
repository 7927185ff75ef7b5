"""TierMover running prefetch plans over a real DRAM and SSD tier (the thread-pool SSD path).

The mover is never started: each test runs what its worker would (``prefetch``,
``run_prefetches``, ``stop``) in the test's own thread, so every step is in order. The
rules of a plan are tests/tiers/test_tier_prefetch.py's; here the bytes move.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.core.keys import BlockKey
from kvstore.core.prefetch import PrefetchOutcome
from tiers.dram import DramTier
from tiers.manager import PrefetchPlan, TierManager, Watermarks
from tiers.mover import Room, TierMover, leased_block_view
from tiers.policy import make_policy
from tiers.retention import RetainAsk
from tiers.ssd.tier import SsdTier
from tiers.ssd.types import HEADER_BYTES

BLOCK = 8192


@dataclass(slots=True, kw_only=True)
class Tiers:
    manager: TierManager
    mover: TierMover
    lock: threading.Lock
    values: dict[BlockKey, bytes]

    def put(self, name: str, retain_s: float = 0.0, nbytes: int = BLOCK) -> BlockKey:
        key = BlockKey(name.encode().ljust(16, b"."))
        value = os.urandom(nbytes)
        with self.lock:
            r = self.manager.reserve(key, nbytes,
                                     retain=RetainAsk(seconds=retain_s) if retain_s else None)
            assert r is not None
            self.manager.fill_view(r)[:] = value
            assert self.manager.commit(r)
        self.values[key] = value
        return key

    def where(self, *keys: BlockKey) -> list[str | None]:
        with self.lock:
            entries = [self.manager.entry(k) for k in keys]
            return [None if e is None else self.manager.levels[e.level].tier.name
                    for e in entries]

    def plan(self, *keys: BlockKey) -> PrefetchPlan:
        with self.lock:
            return self.manager.plan_prefetch(list(keys), 0, max_bytes=1 << 30)

    def read(self, key: BlockKey, *, as_user: bool = False) -> bytes:
        """The block's bytes; ``as_user``: counted as a read (a hit, and the block's
        recency), else not."""
        with self.lock:
            e = self.manager.acquire_read(key, access=as_user)
        assert e is not None
        try:
            view = leased_block_view(self.manager, self.lock, e)
            assert view is not None
            return bytes(view)
        finally:
            with self.lock:
                self.manager.release_read(e)


def make(tmp_path: Path, *, dram_blocks: int, ssd_blocks: int, low: float = 0.5) -> Tiers:
    dram = DramTier(dram_blocks * BLOCK, prefault=False)
    # each SSD block takes its header page too (format 2)
    ssd = SsdTier(tmp_path / "kv.img", ssd_blocks * (BLOCK + HEADER_BYTES), io="python")
    manager = TierManager([dram, ssd], make_policy("lru"),
                          watermarks=Watermarks(high=1.0, low=low))
    lock = threading.Lock()
    return Tiers(manager=manager, mover=TierMover(manager, lock), lock=lock, values={})


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Tiers]:
    t = make(tmp_path, dram_blocks=4, ssd_blocks=16)
    yield t
    t.mover.stop()
    for lv in t.manager.levels:
        lv.tier.close()


def test_a_waited_prefetch_makes_room_and_brings_the_bytes_up(small: Tiers) -> None:
    t = small
    s1, s2 = t.put("s1"), t.put("s2")
    assert t.mover.make_room(0, 2 * BLOCK)  # the session's blocks go to SSD
    assert t.where(s1, s2) == ["ssd", "ssd"]
    r1, r2 = t.put("r1", retain_s=600), t.put("r2", retain_s=600)
    c1, c2 = t.put("c1"), t.put("c2")  # DRAM full
    plan = t.plan(s1, s2)
    assert plan.answer() == [PrefetchOutcome.QUEUED] * 2
    t.mover.prefetch(plan)
    assert plan.answer() == [PrefetchOutcome.PROMOTED] * 2
    assert t.where(s1, s2, r1, r2, c1, c2) == ["dram"] * 4 + ["ssd"] * 2
    for key, value in t.values.items():  # every block's bytes, wherever it went
        assert t.read(key) == value
    with t.lock:
        assert t.manager.prefetch_stats()["prefetch_bytes_in_flight"] == 0
        assert t.manager.drain_evicted() == []


def test_a_submitted_plan_runs_on_the_worker(small: Tiers) -> None:
    t = small
    s = t.put("s")
    t.mover.make_room(0, BLOCK)
    plan = t.plan(s)
    answer = plan.answer()  # what the caller got back
    t.mover.submit_prefetch(plan)
    assert t.where(s) == ["ssd"]
    assert t.mover.run_prefetches() == 1
    assert answer == [PrefetchOutcome.QUEUED]
    assert plan.answer() == [PrefetchOutcome.PROMOTED]
    assert t.where(s) == ["dram"] and t.read(s) == t.values[s]
    assert t.mover.run_prefetches() == 0


def test_stop_undoes_the_plans_left_queued(small: Tiers) -> None:
    t = small
    s = t.put("s")
    t.mover.make_room(0, BLOCK)
    plan = t.plan(s)
    t.mover.submit_prefetch(plan)
    with t.lock:
        assert t.manager.level_stats(0)["used"] == BLOCK  # the destination is reserved
    t.mover.stop()
    assert plan.answer() == [PrefetchOutcome.UNDONE]
    with t.lock:
        e = t.manager.entry(s)
        assert e is not None and not e.moving and e.readers == 0
        assert t.manager.level_stats(0)["used"] == 0
        assert t.manager.prefetch_stats()["prefetch_bytes_in_flight"] == 0
    late = t.plan(s)
    t.mover.submit_prefetch(late)  # after stop: undone at once, never stranded
    assert late.answer() == [PrefetchOutcome.UNDONE]
    assert t.where(s) == ["ssd"] and t.read(s) == t.values[s]


def test_room_is_never_made_on_a_full_ssd(tmp_path: Path) -> None:
    t = make(tmp_path, dram_blocks=2, ssd_blocks=2)
    try:
        s, u = t.put("s"), t.put("u")
        t.mover.make_room(0, 2 * BLOCK)  # SSD full
        a, b = t.put("a"), t.put("b")  # DRAM full
        plan = t.plan(s)
        assert plan.answer() == [PrefetchOutcome.NO_ROOM]
        t.mover.prefetch(plan)
        assert t.where(s, u, a, b) == ["ssd", "ssd", "dram", "dram"]
        assert all(t.read(k) == v for k, v in t.values.items())
        with t.lock:
            assert t.manager.drain_evicted() == []
    finally:
        t.mover.stop()
        for lv in t.manager.levels:
            lv.tier.close()


def test_ssd_to_hbm_in_one_move(tmp_path: Path) -> None:
    """HBM is not addressable memory (a torch device; the CPU one here): the block is read
    off the SSD into a buffer, then copied onto the device."""
    pytest.importorskip("torch")
    from tiers.hbm import HbmTier

    hbm = HbmTier(4 * BLOCK, device="cpu")
    dram = DramTier(4 * BLOCK, prefault=False)
    ssd = SsdTier(tmp_path / "kv.img", 16 * BLOCK, io="python")
    manager = TierManager([hbm, dram, ssd], make_policy("lru"),
                          watermarks=Watermarks(high=1.0, low=0.5))
    lock = threading.Lock()
    t = Tiers(manager=manager, mover=TierMover(manager, lock), lock=lock, values={})
    try:
        s = t.put("s")
        assert t.mover.make_room(1, BLOCK)
        assert t.where(s) == ["ssd"]
        with lock:
            plan = manager.plan_prefetch([s], manager.memory_level("hbm"), max_bytes=BLOCK)
        assert [(m.src, m.dst) for m in plan.moves] == [(2, 0)]
        t.mover.prefetch(plan)
        assert plan.answer() == [PrefetchOutcome.PROMOTED]
        assert t.where(s) == ["hbm"] and t.read(s) == t.values[s]
    finally:
        t.mover.stop()
        for tier in (hbm, dram, ssd):
            tier.close()



# ---- room for a put (``room_for``: what ``kvstore.node.room`` acts on) ---------------------


def test_room_for_a_put_is_freed_by_demoting(small: Tiers) -> None:
    t = small
    keys = [t.put(f"b{i}") for i in range(4)]  # DRAM full
    assert t.mover.room_for(0, BLOCK, timeout=0.0) is Room.FREED
    assert t.where(*keys) == ["ssd", "dram", "dram", "dram"]
    with t.lock:
        assert t.manager.moves_in_flight == 0


def test_room_for_a_put_is_none_when_nothing_could_move(small: Tiers) -> None:
    t = small
    with t.lock:
        held = [t.manager.reserve(BlockKey(bytes([i]) * 16), BLOCK) for i in range(4)]
        assert t.manager.reserved_bytes == 4 * BLOCK
    assert t.mover.room_for(0, BLOCK, timeout=0.0) is Room.NONE  # only reservations there
    assert not t.mover.make_room(0, BLOCK)
    with t.lock:
        for r in held:
            assert r is not None
            t.manager.abort(r)
        assert t.manager.reserved_bytes == 0


def test_room_for_a_put_waits_for_moves_in_flight(small: Tiers) -> None:
    """Every DRAM block is planned to move by another caller: nothing can move now, but
    room will come; the answer is WAITED (not NONE), read with the plan under the lock."""
    t = small
    for i in range(4):
        t.put(f"b{i}")
    with t.lock:
        theirs = t.manager.plan_moves(0, 4 * BLOCK)
        assert len(theirs) == 4 and t.manager.moves_in_flight == 4
    assert t.mover.room_for(0, BLOCK, timeout=0.0) is Room.WAITED
    with t.lock:
        t.manager.finish_moves(theirs)  # never copied: undone
        assert t.manager.moves_in_flight == 0
    assert t.mover.room_for(0, BLOCK, timeout=0.0) is Room.FREED


def test_room_for_a_put_is_undone_when_the_ssd_keeps_every_block(tmp_path: Path) -> None:
    t = make(tmp_path, dram_blocks=2, ssd_blocks=2)
    try:
        kept = [t.put(f"k{i}", retain_s=600) for i in range(2)]
        assert t.mover.make_room(0, 2 * BLOCK)  # the SSD is full of retained blocks
        more = [t.put(f"m{i}", retain_s=600) for i in range(2)]  # and DRAM too
        assert t.mover.room_for(0, BLOCK, timeout=0.0) is Room.UNDONE
        assert not t.mover.make_room(0, BLOCK)  # planned, but nothing left DRAM
        assert t.where(*kept, *more) == ["ssd", "ssd", "dram", "dram"]
        with t.lock:
            assert t.manager.moves_in_flight == 0
        assert all(t.read(k) == v for k, v in t.values.items())
    finally:
        t.mover.stop()
        for lv in t.manager.levels:
            lv.tier.close()



def test_a_demotion_drops_more_when_the_room_made_is_not_in_one_piece(tmp_path: Path) -> None:
    """The SSD is full of blocks one page smaller than the one demoted (another model's
    size). The coldest two are dropped for it, but they are not neighbours: the block does
    not fit in either hole. The mover drops more until the holes join, rather than undo."""
    t = make(tmp_path, dram_blocks=4, ssd_blocks=4, low=1.0)
    try:
        small = [t.put(f"s{i}") for i in range(4)]
        assert t.mover.make_room(0, 4 * BLOCK)
        assert t.where(*small) == ["ssd"] * 4
        for k in (small[1], small[3]):  # read: now s0 and s2 are the coldest
            assert t.read(k, as_user=True) == t.values[k]
        big = t.put("big", nbytes=BLOCK + HEADER_BYTES)
        assert t.mover.make_room(0, BLOCK + HEADER_BYTES)
        assert t.where(big) == ["ssd"] and t.read(big) == t.values[big]
        with t.lock:
            assert t.manager.moves_in_flight == 0
    finally:
        t.mover.stop()
        for lv in t.manager.levels:
            lv.tier.close()


SMALL = 64  # a value far below the SSD's 8 KiB per block (a header page, the value aligned)


def small_values(tmp_path: Path) -> Tiers:
    """A DRAM tier of 8 small values (64-byte aligned) and an SSD of 8 small blocks."""
    dram = DramTier(8 * 64, prefault=False)
    ssd = SsdTier(tmp_path / "kv.img", 8 * (HEADER_BYTES + 4096), io="python")
    manager = TierManager([dram, ssd], make_policy("lru"),
                          watermarks=Watermarks(high=0.9, low=0.5))
    lock = threading.Lock()
    return Tiers(manager=manager, mover=TierMover(manager, lock), lock=lock, values={})


def put_small(t: Tiers, name: str, size: int) -> BlockKey:
    key = BlockKey(name.encode().ljust(16, b"."))
    value = os.urandom(size)
    with t.lock:
        r = t.manager.reserve(key, size)
        assert r is not None
        t.manager.fill_view(r)[:] = value
        assert t.manager.commit(r)
    t.values[key] = value
    return key


def close(t: Tiers) -> None:
    t.mover.stop()
    for lv in t.manager.levels:
        lv.tier.close()


def test_a_round_demotes_half_a_full_dram_tier_of_small_values(tmp_path: Path) -> None:
    """16-byte values, each taking 64 bytes of DRAM (its alignment) and 8 KiB of SSD."""
    t = small_values(tmp_path)
    try:
        keys = [put_small(t, f"d{i}", 16) for i in range(8)]
        dram, ssd = (lv.tier for lv in t.manager.levels)
        assert dram.used == dram.capacity and t.manager.over_high() == [0]
        assert t.mover.run_once()
        # Down to the low watermark (256 of 512 bytes): the 4 least recent went to the SSD.
        assert t.where(*keys) == ["ssd"] * 4 + ["dram"] * 4
        assert (dram.used, ssd.used) == (4 * 64, 4 * ssd.footprint(16))
        assert all(t.read(k) == v for k, v in t.values.items())
    finally:
        close(t)


def test_a_restart_past_the_watermark_drops_only_what_it_asks(tmp_path: Path) -> None:
    """Issue #24: an SSD full of small blocks at restart. The first round drops the 4
    oldest of 8 (down to the low watermark), not every one of them."""
    first = SsdTier(tmp_path / "kv.img", 8 * (HEADER_BYTES + 4096), io="python")
    names = [BlockKey(f"r{i}".encode().ljust(16, b".")) for i in range(8)]
    values = {k: os.urandom(SMALL) for k in names}
    for k in names:  # one batch each: the sequence numbers follow the names
        assert first.write_blocks([(k, None, memoryview(values[k]))])[0] is not None
    assert first.used == first.capacity
    first.close()
    t = small_values(tmp_path)
    try:
        ssd = t.manager.levels[1].store
        records = ssd.recover()
        assert sorted(r.key for r in records) == sorted(names)
        with t.lock:
            for r in records:
                assert t.manager.adopt(r.key, r.parent, r.location.nbytes, level=1,
                                       location=r.location, retention=r.retention)
        adopted = [r.key for r in records]  # the policy's order: oldest adoption first
        t.values.update({k: values[k] for k in adopted[4:]})
        assert t.manager.over_high() == [1]
        assert t.mover.run_once()
        with t.lock:
            assert t.manager.drain_evicted() == adopted[:4]
            assert len(t.manager) == 4
        assert ssd.used == 4 * ssd.footprint(SMALL)
        assert t.where(*adopted) == [None] * 4 + ["ssd"] * 4
        assert all(t.read(k) == v for k, v in t.values.items())
    finally:
        close(t)
