"""TierManager across tiers: demotion order, promotion rule, and moves racing readers.

The copy phase is the mover's job; here each plan is finished directly (marking
moves copied or not), so the two-phase rules are tested without I/O.
"""

from __future__ import annotations

import pytest

from kvstore.core.keys import BlockKey
from kvstore.core.prefetch import PrefetchOutcome
from tiers.manager import NeedsRoom, TierManager, Watermarks
from tiers.metadata import MetadataTier
from tiers.policy import make_policy

B = 64


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(16, b"."))


def name(key: BlockKey) -> str:
    return key.rstrip(b".").decode()


def two_levels(top: int = 4, below: int = 10, policy: str = "lru",
               durable_below: bool = False) -> TierManager:
    upper = MetadataTier(top * B, alignment=B)
    upper.name = "dram"
    lower = MetadataTier(below * B, alignment=B)
    lower.name = "ssd"
    return TierManager([upper, lower], make_policy(policy), durable=[False, durable_below],
                       watermarks=Watermarks(high=1.0, low=0.5))


def put(m: TierManager, key: str) -> None:
    r = m.reserve(k(key), B)
    assert r is not None
    assert m.commit(r)


def touch(m: TierManager, key: str) -> None:
    e = m.acquire_read(k(key))
    assert e is not None
    m.release_read(e)


def demote(m: TierManager, level: int, blocks: int, copied: bool = True) -> list[str]:
    moves = m.plan_moves(level, blocks * B)
    for mv in moves:
        mv.copied = copied
        if mv.dst is not None and m.levels[mv.dst].durable:
            mv.dst_location = ("loc", name(mv.entry.key))
    m.finish_moves(moves)
    return [name(mv.entry.key) for mv in moves]


def test_full_landing_tier_asks_for_room_instead_of_dropping() -> None:
    m = two_levels()
    for n in "abcd":
        put(m, n)
    with pytest.raises(NeedsRoom) as info:
        m.reserve(k("e"), B)
    assert (info.value.level, info.value.nbytes) == (0, B)
    assert len(m) == 4


def test_demotion_follows_policy_order_and_keeps_every_block() -> None:
    m = two_levels()
    for n in "abcd":
        put(m, n)
    touch(m, "a")
    assert demote(m, 0, 2) == ["b", "c"]
    assert [m.entry(k(n)).level for n in "abcd"] == [0, 1, 1, 0]
    s0, s1 = m.level_stats(0), m.level_stats(1)
    assert (s0["blocks"], s0["demotions"], s1["blocks"]) == (2, 2, 2)
    assert s0["used"] == 2 * B and s1["used"] == 2 * B
    put(m, "e")  # room again in the landing tier


def test_over_high_and_target_bytes() -> None:
    m = two_levels()
    m.watermarks = Watermarks(high=0.7, low=0.5)
    for n in "abc":
        put(m, n)
    assert m.over_high() == [0]
    assert m.target_bytes(0) == B  # 3 blocks -> 2 blocks = 50%
    assert m.target_bytes(0, extra=B) == 2 * B


def test_a_block_read_during_its_move_stays_put() -> None:
    m = two_levels()
    for n in "ab":
        put(m, n)
    moves = m.plan_moves(0, B)
    assert [name(mv.entry.key) for mv in moves] == ["a"]
    reader = m.acquire_read(k("a"))  # arrives while the bytes are being copied
    moves[0].copied = True
    m.finish_moves(moves)
    assert m.entry(k("a")).level == 0
    assert m.level_stats(1)["used"] == 0  # the copy's space was returned
    m.release_read(reader)
    assert demote(m, 0, 1) == ["b"]  # a was read last: b goes first now


def test_removed_during_move_frees_both_copies() -> None:
    m = two_levels(durable_below=True)
    put(m, "a")
    moves = m.plan_moves(0, B)
    moves[0].copied = True
    moves[0].dst_location = ("loc", "a")
    assert m.remove(k("a")) is True  # unlinked; its bytes are still being copied
    garbage = m.finish_moves(moves)
    assert garbage == [(k("a"), ("loc", "a"))]
    assert m.level_stats(0)["used"] == 0 and k("a") not in m


def test_failed_copy_keeps_the_block_at_its_source() -> None:
    m = two_levels()
    put(m, "a")
    assert demote(m, 0, 1, copied=False) == ["a"]
    assert m.entry(k("a")).level == 0
    assert demote(m, 0, 1) == ["a"]  # queued again
    assert m.entry(k("a")).level == 1


def test_pinned_blocks_are_never_demoted() -> None:
    m = two_levels()
    r = m.reserve(k("p"), B, pin=True)
    assert r is not None
    m.commit(r)
    put(m, "a")
    assert demote(m, 0, 2) == ["a"]
    assert m.entry(k("p")).level == 0


def test_second_hit_in_a_lower_tier_promotes() -> None:
    m = two_levels()
    for n in "ab":
        put(m, n)
    demote(m, 0, 2)
    touch(m, "a")
    assert m.pending_promotions() == 0
    touch(m, "a")
    assert m.pending_promotions() == 1
    moves, blocked = m.plan_promotions(8)
    assert blocked is None
    assert [(name(mv.entry.key), mv.src, mv.dst) for mv in moves] == [("a", 1, 0)]
    for mv in moves:
        mv.copied = True
    m.finish_moves(moves)
    assert m.entry(k("a")).level == 0 and m.entry(k("b")).level == 1
    assert m.level_stats(0)["promotions"] == 1
    assert m.entry(k("a")).tier_hits == 0  # counting starts again in the new tier


def test_a_promotion_without_room_asks_for_a_demotion_first() -> None:
    m = two_levels(top=2)
    m.watermarks = Watermarks(high=0.5, low=0.5)
    put(m, "a")
    put(m, "b")
    demote(m, 0, 1)  # a goes down; the top tier is at 50%
    touch(m, "a")
    touch(m, "a")
    assert m.plan_promotions(8) == ([], (0, B))  # b must move down first
    assert m.pending_promotions() == 1  # a stays queued
    assert demote(m, 0, 1) == ["b"]
    moves, blocked = m.plan_promotions(8)
    assert blocked is None and [name(mv.entry.key) for mv in moves] == ["a"]


def test_drops_from_a_durable_last_tier_return_locations() -> None:
    m = two_levels(durable_below=True)
    for n in "abc":
        put(m, n)
    demote(m, 0, 3)
    moves = m.plan_moves(1, 2 * B)
    assert [(name(mv.entry.key), mv.dst) for mv in moves] == [("a", None), ("b", None)]
    for mv in moves:
        mv.copied = True
    garbage = m.finish_moves(moves)
    assert garbage == [(k("a"), ("loc", "a")), (k("b"), ("loc", "b"))]
    assert m.drain_evicted() == [k("a"), k("b")]
    assert k("c") in m and len(m) == 1


def test_adopt_indexes_recovered_blocks() -> None:
    m = two_levels(durable_below=True)
    assert m.adopt(k("x"), None, 100, level=1, location=("loc", "x"))
    assert not m.adopt(k("x"), None, 100, level=1, location=("loc", "x"))
    e = m.acquire_read(k("x"))
    assert e is not None and e.level == 1 and e.location == ("loc", "x")
    m.release_read(e)
    assert m.remove(k("x")) == (k("x"), ("loc", "x"))


def test_adopt_many_indexes_in_order_skips_the_indexed_and_counts_orphans() -> None:
    """A restart's records in any order: a child adopted before its parent is counted on
    the parent when it comes; a key indexed already is skipped; the queue orders them as
    adopted."""
    m = two_levels(durable_below=True)
    put(m, "a")  # indexed already (in the memory tier): skipped
    blocks = [(k("c"), k("b"), 100, ("loc", "c"), None), (k("a"), None, 100, ("loc", "a"), None),
              (k("b"), None, 100, ("loc", "b"), None), (k("d"), k("b"), 100, ("loc", "d"), None)]
    assert m.adopt_many(1, blocks) == 3
    assert [m.entry(k(n)).children for n in "bcd"] == [2, 0, 0]  # type: ignore[union-attr]
    assert m.entry(k("a")).level == 0  # type: ignore[union-attr]
    moves = m.plan_moves(1, 3 * 100)
    assert [name(mv.entry.key) for mv in moves] == ["c", "b", "d"]  # in the order adopted


def test_corrupt_block_leaves_the_index() -> None:
    m = two_levels(durable_below=True)
    m.adopt(k("x"), None, 100, level=1, location=("loc", "x"))
    e = m.acquire_read(k("x"))
    m.report_corrupt(e)
    assert k("x") not in m
    assert m.release_read(e) == (k("x"), ("loc", "x"))
    assert m.level_stats(1)["checksum_failures"] == 1


def test_a_round_frees_what_the_watermarks_ask_in_aligned_bytes() -> None:
    """16-byte values in a tier aligned to 64: each takes 64 of its used bytes, so getting
    from full down to half moves half the blocks, not (counting values) all of them."""
    upper = MetadataTier(8 * B, alignment=B)
    upper.name = "dram"
    lower = MetadataTier(64 * B, alignment=B)
    lower.name = "ssd"
    m = TierManager([upper, lower], make_policy("lru"),
                    watermarks=Watermarks(high=0.9, low=0.5))
    for n in "abcdefgh":
        r = m.reserve(k(n), 16)
        assert r is not None and m.commit(r)
    touch(m, "a")
    assert upper.used == 8 * B and m.over_high() == [0]
    assert m.target_bytes(0) == 4 * B
    moves = m.plan_moves(0, m.target_bytes(0))
    assert [name(mv.entry.key) for mv in moves] == ["b", "c", "d", "e"]
    for mv in moves:
        mv.copied = True
    m.finish_moves(moves)
    assert (upper.used, lower.used) == (4 * B, 4 * B) and m.over_high() == []


def test_a_restart_over_the_watermark_drops_only_what_it_asks() -> None:
    """Issue #24: 64-byte values on an SSD-like tier of 4 KiB pages, adopted at restart past
    the high watermark. The round drops the oldest 4 of 10 (down to the low watermark), where
    counting values it dropped every one."""
    upper = MetadataTier(4 * B, alignment=B)
    upper.name = "dram"
    page = 4096
    lower = MetadataTier(10 * page, alignment=page)
    lower.name = "ssd"
    m = TierManager([upper, lower], make_policy("lru"), durable=[False, True],
                    watermarks=Watermarks(high=0.9, low=0.6))
    names = [f"r{i}" for i in range(10)]
    for n in names:
        assert lower.allocate(B) is not None  # the space recovery found taken
        assert m.adopt(k(n), None, B, level=1, location=("loc", n))
    assert lower.used == 10 * page and m.over_high() == [1]
    assert m.target_bytes(1) == 4 * page
    moves = m.plan_moves(1, m.target_bytes(1))
    assert [(name(mv.entry.key), mv.dst) for mv in moves] == [(n, None) for n in names[:4]]
    for mv in moves:
        mv.copied = True
    garbage = m.finish_moves(moves)
    assert garbage == [(k(n), ("loc", n)) for n in names[:4]]
    assert m.drain_evicted() == [k(n) for n in names[:4]] and len(m) == 6


def test_promotion_room_counts_the_footprint() -> None:
    """A 16-byte block promoted into a full tier aligned to 64 asks for the room of its 64
    bytes, down to the low watermark."""
    m = two_levels(top=4, below=64)
    r = m.reserve(k("s"), 16)
    assert r is not None and m.commit(r)
    demote(m, 0, 1)
    for n in "abcd":
        r = m.reserve(k(n), 16)
        assert r is not None and m.commit(r)
    assert m.levels[0].tier.used == 4 * B
    touch(m, "s")
    touch(m, "s")  # a second hit below queues a promotion
    promotions, blocked = m.plan_promotions(4)
    assert promotions == [] and blocked == (0, 3 * B)  # 256 used + its 64 - low 128


def test_prefetch_room_counts_the_footprints_of_small_blocks() -> None:
    """Four 16-byte blocks brought up into a full tier aligned to 64 need four blocks of
    room (256 used bytes), not one (their 64 value bytes)."""
    m = two_levels(top=4, below=64)
    small = ["w", "x", "y", "z"]
    for n in small:
        r = m.reserve(k(n), 16)
        assert r is not None and m.commit(r)
    demote(m, 0, 4)
    for n in "abcd":
        put(m, n)
    plan = m.plan_prefetch([k(n) for n in small], 0, max_bytes=1 << 20)
    assert [name(mv.entry.key) for mv in plan.room] == ["a", "b", "c", "d"]
    assert plan.answer() == [PrefetchOutcome.QUEUED] * 4
