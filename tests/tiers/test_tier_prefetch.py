"""TierManager prefetch: what a plan moves up, the room it may make, and what it never does.

As in test_tier_moves.py, the copy phase is the mover's job: each plan's moves are
finished directly here (marked copied or not), so the rules are tested without I/O and
on a fake clock where retention matters. tests/tiers/test_mover.py runs the same plans
through the TierMover over real DRAM and SSD tiers.
"""

from __future__ import annotations

import pytest

from kvstore.core.keys import BlockKey
from kvstore.core.prefetch import PrefetchOutcome
from tiers.manager import Move, PrefetchPlan, TierManager, Watermarks
from tiers.metadata import MetadataTier
from tiers.policy import make_policy
from tiers.retention import RetainAsk, RetentionBook

B = 64
PRESENT, QUEUED = PrefetchOutcome.PRESENT, PrefetchOutcome.QUEUED
PROMOTED = PrefetchOutcome.PROMOTED
MISSING, NO_ROOM = PrefetchOutcome.MISSING, PrefetchOutcome.NO_ROOM
BUSY, UNDONE = PrefetchOutcome.BUSY, PrefetchOutcome.UNDONE
NO_BOUND = 1 << 40


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(16, b"."))


def name(key: BlockKey) -> str:
    return key.rstrip(b".").decode()


def tiers(top: int = 4, below: int = 10, policy: str = "lru", clock: Clock | None = None,
          three: bool = False) -> TierManager:
    """DRAM (``top`` blocks) over a durable SSD stand-in (``below``), all fake; ``three``:
    an HBM of ``top`` blocks over both."""
    names = (["hbm"] if three else []) + ["dram", "ssd"]
    sizes = ([top] if three else []) + [top, below]
    made = []
    for tier_name, blocks in zip(names, sizes, strict=True):
        t = MetadataTier(blocks * B, alignment=B)
        t.name = tier_name
        made.append(t)
    return TierManager(made, make_policy(policy), durable=[False] * (len(made) - 1) + [True],
                       watermarks=Watermarks(high=1.0, low=0.5),
                       retention=RetentionBook(clock=clock or Clock()))


def put(m: TierManager, key: str, retain_s: float = 0.0) -> None:
    r = m.reserve(k(key), B, retain=RetainAsk(seconds=retain_s) if retain_s else None)
    assert r is not None
    assert m.commit(r)


def touch(m: TierManager, key: str) -> None:
    e = m.acquire_read(k(key))
    assert e is not None
    m.release_read(e)


def finish(m: TierManager, moves: list[Move], copied: bool = True) -> None:
    """Phase 3 of ``moves``. The durable stand-in's space is taken and given back as the
    SSD tier's is (``write_blocks`` allocates, the mover's ``delete_durable`` frees), so its
    ``used`` is right: the prefetch rules read it."""
    for mv in moves:
        mv.copied = copied
        if copied and mv.dst is not None and m.levels[mv.dst].durable:
            mv.dst_location = m.levels[mv.dst].tier.allocate(mv.entry.nbytes)
            mv.copied = mv.dst_location is not None
    for gone in m.finish_moves(moves):
        m.levels[-1].tier.free(gone.location)


def demote(m: TierManager, level: int, *keys: str) -> None:
    """Moves exactly ``keys`` (the oldest of ``level`` by LRU) one tier down."""
    moves = m.plan_moves(level, len(keys) * B)
    assert sorted(name(mv.entry.key) for mv in moves) == sorted(keys)
    finish(m, moves)


def run(m: TierManager, plan: PrefetchPlan) -> list[PrefetchOutcome]:
    """What the mover does with a plan (``TierMover.prefetch``), copies always succeeding."""
    finish(m, plan.room)
    finish(m, [*plan.moves, *m.plan_prefetch_rest(plan)])
    m.settle_prefetch(plan)
    return plan.answer()


def where(m: TierManager, *keys: str) -> list[str | None]:
    out = []
    for key in keys:
        e = m.entry(k(key))
        out.append(None if e is None else m.levels[e.level].tier.name)
    return out


def prefetch(m: TierManager, *keys: str, tier: str = "dram", max_bytes: int = NO_BOUND
             ) -> PrefetchPlan:
    return m.plan_prefetch([k(x) for x in keys], m.memory_level(tier), max_bytes=max_bytes)


def test_a_block_on_ssd_comes_up_to_dram_and_it_is_not_a_read() -> None:
    m = tiers()
    put(m, "a")
    put(m, "b")
    demote(m, 0, "a", "b")
    plan = prefetch(m, "a")
    assert plan.answer() == [QUEUED]
    assert m.prefetch_stats()["prefetch_bytes_in_flight"] == B
    assert run(m, plan) == [PROMOTED]
    assert where(m, "a", "b") == ["dram", "ssd"]
    e = m.entry(k("a"))
    assert e is not None and (e.hits, e.tier_hits) == (0, 0)  # not a read
    assert m.level_stats(0)["promotions"] == 1
    assert (m.level_stats(0)["hits"], m.level_stats(1)["hits"]) == (0, 0)
    assert m.pending_promotions() == 0
    assert m.prefetch_stats() == {
        "prefetch_blocks": {"present": 0, "promoted": 1, "missing": 0, "no_room": 0, "busy": 0,
                            "undone": 0},
        "prefetch_bytes_in_flight": 0}


def test_present_missing_and_repeats_need_no_move() -> None:
    m = tiers()
    put(m, "a")
    plan = prefetch(m, "a", "x", "a", "x")
    assert not plan.has_work
    assert plan.answer() == [PRESENT, MISSING, PRESENT, MISSING]
    m.settle_prefetch(plan)
    counted = m.prefetch_stats()["prefetch_blocks"]
    assert isinstance(counted, dict)
    assert (counted["present"], counted["missing"]) == (1, 1)  # each block once


def test_what_it_brings_up_is_the_newest_of_its_tier() -> None:
    """The policy's recency is refreshed, so the block is not the next victim."""
    m = tiers(top=3)
    put(m, "s")
    demote(m, 0, "s")
    put(m, "a")
    put(m, "b")
    assert run(m, prefetch(m, "s")) == [PROMOTED]
    moves = m.plan_moves(0, B)
    assert [name(mv.entry.key) for mv in moves] == ["a"]  # not s, put before a and b


def test_room_comes_from_the_coldest_ordinary_blocks_never_a_retained_one() -> None:
    clock = Clock()
    m = tiers(clock=clock)
    put(m, "s1")
    put(m, "s2")
    demote(m, 0, "s1", "s2")  # the session's previous turn, gone to SSD
    for r in ("r1", "r2", "r3"):  # another session's retained blocks
        put(m, r, retain_s=60)
    put(m, "c")  # DRAM full: 4 of 4
    plan = prefetch(m, "s1", "s2")
    assert plan.answer() == [QUEUED, NO_ROOM]  # room for one: c's
    assert [name(mv.entry.key) for mv in plan.room] == ["c"]
    assert run(m, plan) == [PROMOTED, NO_ROOM]
    assert where(m, "r1", "r2", "r3", "s1", "c", "s2") == ["dram"] * 4 + ["ssd"] * 2
    assert m.drain_evicted() == []
    # Retention ended (exactly at its deadline): r1 is an ordinary block again, and the
    # coldest one.
    clock.now += 60
    assert run(m, prefetch(m, "s2")) == [PROMOTED]
    assert where(m, "r1", "r2", "r3", "s1", "s2") == ["ssd"] + ["dram"] * 4


def test_the_promotion_rule_may_still_demote_a_retained_block() -> None:
    """The stricter rule is the prefetch's own: a block read twice is hotter than the
    tail of the tier above, retained or not (tiers.retention: demotion is allowed)."""
    m = tiers(top=2)
    m.watermarks = Watermarks(high=1.0, low=1.0)
    put(m, "s")
    demote(m, 0, "s")
    put(m, "r1", retain_s=60)
    put(m, "r2", retain_s=60)
    assert run(m, prefetch(m, "s")) == [NO_ROOM]
    touch(m, "s")
    touch(m, "s")
    assert m.plan_promotions(8) == ([], (0, B))  # room first, by the ordinary demotion:
    assert [name(mv.entry.key) for mv in m.plan_moves(0, B)] == ["r1"]


def test_blocks_the_call_names_are_never_its_room() -> None:
    """Under LFU a prefetch refreshes no priority: only ``spare`` keeps a named block."""
    m = tiers(top=2, policy="lfu")
    put(m, "s")
    demote(m, 0, "s")
    put(m, "a")  # no reads: LFU's first victim
    put(m, "b")
    touch(m, "b")
    plan = prefetch(m, "a", "s")
    assert [name(mv.entry.key) for mv in plan.room] == ["b"]
    assert run(m, plan) == [PRESENT, PROMOTED]
    assert where(m, "a", "s", "b") == ["dram", "dram", "ssd"]


def test_it_never_drops_a_block_to_make_room() -> None:
    """The tier below is full: demoting into it would push its own victims off the node."""
    m = tiers(top=2, below=2)
    for x in ("s", "t"):
        put(m, x)
    demote(m, 0, "s", "t")  # SSD full
    put(m, "a")
    put(m, "b")  # DRAM full
    plan = prefetch(m, "s")
    assert plan.room == [] and plan.answer() == [NO_ROOM]
    assert run(m, plan) == [NO_ROOM]
    assert where(m, "a", "b", "s", "t") == ["dram", "dram", "ssd", "ssd"]
    assert m.drain_evicted() == []


def test_room_below_is_counted_against_its_high_watermark() -> None:
    m = tiers(top=2, below=3)
    m.watermarks = Watermarks(high=0.7, low=0.5)  # SSD takes 2 blocks (2.1), DRAM 1 (1.4)
    put(m, "s")
    demote(m, 0, "s")  # SSD: 1 of 2
    put(m, "a")
    plan = prefetch(m, "s")
    assert [name(mv.entry.key) for mv in plan.room] == ["a"]
    assert run(m, plan) == [PROMOTED]
    put(m, "b")  # DRAM's one block would have to go to an SSD at its watermark (2 of 2)
    demote(m, 0, "s")
    plan = prefetch(m, "s")
    assert plan.room == [] and plan.answer() == [NO_ROOM]


def test_the_bytes_in_flight_are_bounded_across_calls() -> None:
    m = tiers(top=4, below=10)
    for x in ("a", "b", "c"):
        put(m, x)
    demote(m, 0, "a", "b", "c")
    first = prefetch(m, "a", "b", max_bytes=2 * B)
    assert first.answer() == [QUEUED, QUEUED]
    second = prefetch(m, "c", max_bytes=2 * B)  # the first is still on the move
    assert second.answer() == [BUSY]
    m.settle_prefetch(second)
    assert run(m, first) == [PROMOTED, PROMOTED]
    assert m.prefetch_stats()["prefetch_bytes_in_flight"] == 0
    assert run(m, prefetch(m, "c", max_bytes=2 * B)) == [PROMOTED]


def test_a_block_already_moving_is_busy() -> None:
    m = tiers()
    put(m, "a")
    put(m, "s")
    demote(m, 0, "a", "s")
    put(m, "b")
    moving = m.plan_moves(0, B)  # b on its way down
    assert run(m, prefetch(m, "b", "a")) == [BUSY, PROMOTED]  # b is on its way down
    finish(m, moving)
    assert where(m, "b") == ["ssd"]
    touch(m, "s")
    touch(m, "s")
    hot, _ = m.plan_promotions(8)  # s on its way up by the promotion rule
    assert run(m, prefetch(m, "s")) == [BUSY]
    finish(m, hot)
    assert where(m, "s") == ["dram"]


def test_a_read_during_the_copy_undoes_the_move() -> None:
    m = tiers()
    put(m, "s")
    demote(m, 0, "s")
    plan = prefetch(m, "s")
    reader = m.acquire_read(k("s"))  # the next turn came before the copy finished
    assert run(m, plan) == [UNDONE]
    assert reader is not None
    m.release_read(reader)
    assert where(m, "s") == ["ssd"] and m.level_stats(0)["used"] == 0


def test_a_block_removed_while_waiting_for_room_is_missing() -> None:
    m = tiers(top=1)
    put(m, "s")
    demote(m, 0, "s")
    put(m, "a")
    plan = prefetch(m, "s")
    assert plan.answer() == [QUEUED] and plan.waiting == [k("s")]
    finish(m, plan.room)
    m.remove(k("s"))
    assert m.plan_prefetch_rest(plan) == []
    m.settle_prefetch(plan)
    assert plan.answer() == [MISSING]
    assert m.prefetch_stats()["prefetch_bytes_in_flight"] == 0


def test_to_hbm_from_ssd_in_one_move_and_room_only_into_dram() -> None:
    m = tiers(top=2, below=10, three=True)  # hbm 2, dram 2 (landing), ssd 10
    assert [lv.tier.name for lv in m.levels] == ["hbm", "dram", "ssd"]
    put(m, "s")
    demote(m, 1, "s")
    plan = prefetch(m, "s", tier="hbm")
    assert [(mv.src, mv.dst) for mv in plan.moves] == [(2, 0)]
    assert run(m, plan) == [PROMOTED]
    assert where(m, "s") == ["hbm"]
    assert run(m, prefetch(m, "s", tier="dram")) == [PRESENT]  # a faster tier is present


def test_only_memory_tiers_the_node_has() -> None:
    m = tiers()
    assert m.memory_level("dram") == 0
    with pytest.raises(ValueError, match=r"no memory tier named 'ssd'.*'dram'"):
        m.memory_level("ssd")
    with pytest.raises(ValueError, match="no memory tier named 'hbm'"):
        m.memory_level("hbm")
    with pytest.raises(ValueError, match="memory tier"):
        m.plan_prefetch([k("a")], 1, max_bytes=NO_BOUND)


def test_the_room_looks_past_a_bounded_number_of_spared_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiers(top=4)
    put(m, "s")
    demote(m, 0, "s")
    for r in ("r1", "r2", "r3"):
        put(m, r, retain_s=60)
    put(m, "c")  # the one ordinary block, behind three retained ones
    monkeypatch.setattr("tiers.manager.SPARE_SCAN", 2)
    assert run(m, prefetch(m, "s")) == [NO_ROOM]  # gave up at r3
    monkeypatch.setattr("tiers.manager.SPARE_SCAN", 3)
    plan = prefetch(m, "s")
    assert [name(mv.entry.key) for mv in plan.room] == ["c"]
    assert run(m, plan) == [PROMOTED]
    # Every block looked past is still queued, in policy order, for ordinary demotion.
    assert [name(mv.entry.key) for mv in m.plan_moves(0, 4 * B)] == ["r1", "r2", "r3", "s"]
