"""Retention (tiers.retention): eligibility, demotion, caps, owners, expiry on a fake clock."""

from __future__ import annotations

import math

import pytest

from kvstore.core.keys import BlockKey
from tiers.manager import TierManager, Watermarks
from tiers.metadata import MetadataTier
from tiers.policy import make_policy
from tiers.retention import MAX_RETAIN_S, RetainAsk, Retention, RetentionBook, check_retain_s

B = 64


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(16, b"."))


def name(key: BlockKey) -> str:
    return key.rstrip(b".").decode()


def one_level(clock: Clock, blocks: int = 4, policy: str = "lru",
              max_bytes: int | None = None) -> TierManager:
    tier = MetadataTier(blocks * B, alignment=B)
    return TierManager(tier, make_policy(policy), landing=0,
                       watermarks=Watermarks(high=1.0, low=1.0),
                       retention=RetentionBook(clock=clock, max_bytes=max_bytes))


def two_levels(clock: Clock, top: int = 4, below: int = 4) -> TierManager:
    upper = MetadataTier(top * B, alignment=B)
    upper.name = "dram"
    lower = MetadataTier(below * B, alignment=B)
    lower.name = "ssd"
    return TierManager([upper, lower], make_policy("lru"), durable=[False, True],
                       watermarks=Watermarks(high=1.0, low=0.5),
                       retention=RetentionBook(clock=clock, wall_clock=clock))


def put(m: TierManager, key: str, retain_s: float = 0.0, owner: str | None = None,
        owner_cap: int | None = None) -> list[str]:
    ask = RetainAsk(seconds=retain_s, owner=owner, owner_cap=owner_cap) if retain_s else None
    r = m.reserve(k(key), B, retain=ask)
    if r is not None:
        m.commit(r)
    return [name(x) for x in m.drain_evicted()]


def touch(m: TierManager, key: str) -> None:
    e = m.acquire_read(k(key))
    assert e is not None
    m.release_read(e)


def test_a_retained_block_survives_pressure_until_the_clock_passes() -> None:
    clock = Clock()
    m = one_level(clock)
    put(m, "a", retain_s=10)
    for n in "bcd":
        put(m, n)
    # LRU would take "a" first; it is retained, so the others go in policy order.
    assert put(m, "e") == ["b"]
    assert put(m, "f") == ["c"]
    clock.now += 9.999
    assert put(m, "g") == ["d"]
    clock.now += 0.001  # exactly S seconds after the put: ordinary again
    assert put(m, "h") == ["a"]
    assert m.retention.stats()["retained_blocks"] == 0


def test_a_read_restarts_the_retention() -> None:
    clock = Clock()
    m = one_level(clock)
    put(m, "a", retain_s=10)
    for n in "bcd":
        put(m, n)
    clock.now += 8
    touch(m, "a")  # kept until 1018 now
    clock.now += 9  # 1017
    assert put(m, "e") == ["b"]
    clock.now += 1  # 1018
    assert put(m, "f") == ["c"]  # "a" was read after "c": LRU order again
    assert put(m, "g") == ["d"]
    assert put(m, "h") == ["a"]


def test_a_later_put_refreshes_and_never_shortens() -> None:
    clock = Clock()
    m = one_level(clock)
    put(m, "a", retain_s=100)
    clock.now += 50
    assert m.reserve(k("a"), B, retain=RetainAsk(seconds=10)) is None  # stored: no-op put
    assert m.retention.held[k("a")].until == 1100.0  # not shortened to 1060
    clock.now += 60  # 1110: past 1100
    assert not m.retention.retains(k("a"))
    put(m, "b", retain_s=5)
    assert m.reserve(k("b"), B, retain=RetainAsk(seconds=20)) is None
    assert m.retention.held[k("b")].until == 1130.0


def test_when_every_block_is_retained_a_put_is_out_of_space() -> None:
    clock = Clock()
    m = one_level(clock, blocks=2)
    put(m, "a", retain_s=1)
    put(m, "b", retain_s=1)
    from tiers.errors import OutOfSpace

    with pytest.raises(OutOfSpace, match="retained"):
        m.reserve(k("c"), B)
    assert len(m) == 2
    clock.now += 1
    assert put(m, "c") == ["a"]


def test_retained_blocks_are_demoted_but_not_dropped_from_the_last_tier() -> None:
    clock = Clock()
    m = two_levels(clock, top=2, below=2)
    put(m, "a", retain_s=30)
    put(m, "b")
    moves = m.plan_moves(0, 2 * B)
    assert [name(mv.entry.key) for mv in moves] == ["a", "b"]  # demotion in LRU order
    for mv in moves:
        mv.copied, mv.dst_location = True, ("loc", name(mv.entry.key))
    m.finish_moves(moves)
    assert [m.entry(k(n)).level for n in "ab"] == [1, 1]
    drops = m.plan_moves(1, 2 * B)
    assert [name(mv.entry.key) for mv in drops] == ["b"]  # "a" is retained: it stays
    m.finish_moves(drops)
    assert m.drain_evicted() == [k("b")]
    clock.now += 30
    drops = m.plan_moves(1, B)
    assert [name(mv.entry.key) for mv in drops] == ["a"]
    m.finish_moves(drops)
    assert len(m) == 0


def test_a_drop_planned_before_a_retaining_put_does_not_happen() -> None:
    clock = Clock()
    m = two_levels(clock, top=1, below=1)
    put(m, "a")
    m.finish_moves([setattr(mv, "copied", True) or setattr(mv, "dst_location", 1) or mv
                    for mv in m.plan_moves(0, B)])
    drops = m.plan_moves(1, B)
    assert [name(mv.entry.key) for mv in drops] == ["a"]
    assert m.reserve(k("a"), B, retain=RetainAsk(seconds=5)) is None
    m.finish_moves(drops)
    assert k("a") in m and m.drain_evicted() == []


def test_node_cap_stores_without_retention_and_counts_the_refusal() -> None:
    clock = Clock()
    m = one_level(clock, blocks=4, max_bytes=2 * B)
    put(m, "a", retain_s=10)
    put(m, "b", retain_s=10)
    put(m, "c", retain_s=10)  # over the cap: stored, not retained
    assert k("c") in m
    assert m.retention.stats() == {"retained_blocks": 2, "retained_bytes": 2 * B,
                                   "retention_denied": 1, "retained_cap_bytes": 2 * B}
    put(m, "a", retain_s=10)  # a refresh of a retained block is not new bytes
    assert m.retention.denied == 1
    m.remove(k("a"))
    put(m, "d", retain_s=10)  # the removed block's bytes came back
    assert m.retention.retains(k("d"))


def test_owner_cap_and_per_owner_bytes() -> None:
    clock = Clock()
    m = one_level(clock, blocks=8)
    put(m, "a", retain_s=10, owner="t1", owner_cap=2 * B)
    put(m, "b", retain_s=10, owner="t1", owner_cap=2 * B)
    put(m, "c", retain_s=10, owner="t1", owner_cap=2 * B)  # t1's cap
    put(m, "d", retain_s=10, owner="t2", owner_cap=2 * B)  # another owner is not affected
    st = m.retention.stats()
    assert st["namespace_retained_bytes"] == {"t1": 2 * B, "t2": B}
    assert (st["retained_blocks"], st["retention_denied"]) == (3, 1)
    clock.now += 10
    assert m.retention.stats() == {"retained_blocks": 0, "retained_bytes": 0,
                                   "retention_denied": 1}


def test_expiry_requeues_refreshed_items_without_growing_the_heap() -> None:
    clock = Clock()
    book = RetentionBook(clock=clock)
    assert book.grant(k("a"), B, RetainAsk(seconds=5))
    for _ in range(100):
        clock.now += 1
        book.touch(k("a"))
    assert len(book._heap) == 1
    assert book.expire() == 0 and book.retains(k("a"))
    clock.now += 5
    assert book.expire() == 1 and not book.held
    assert book.grant(k("a"), B, RetainAsk(seconds=0)) is False  # 0 asks for nothing


@pytest.mark.parametrize("bad", [-1, math.inf, math.nan, MAX_RETAIN_S + 1, "5", True])
def test_check_retain_s_refuses_bad_values(bad: object) -> None:
    with pytest.raises(ValueError, match="retain_s"):
        check_retain_s(bad)  # type: ignore[arg-type]


def test_check_retain_s_accepts() -> None:
    assert check_retain_s(None) == 0.0
    assert check_retain_s(0) == 0.0
    assert check_retain_s(600) == 600.0
    assert check_retain_s(MAX_RETAIN_S) == MAX_RETAIN_S


class CountingBook(RetentionBook):
    __slots__ = ("asked",)

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock=clock)
        self.asked = 0

    def retains(self, key: BlockKey) -> bool:
        self.asked += 1
        return super().retains(key)


def test_retained_blocks_leave_the_queue_so_evictions_do_not_rescan_them() -> None:
    clock = Clock()
    book = CountingBook(clock)
    tier = MetadataTier(100 * B, alignment=B)
    m = TierManager(tier, make_policy("lru"), landing=0, retention=book,
                    watermarks=Watermarks(high=1.0, low=1.0))
    for i in range(50):  # the 50 least recently used blocks are retained
        put(m, f"r{i}", retain_s=100)
    for i in range(50):
        put(m, f"p{i}")
    evicted = []
    for i in range(50):
        evicted += put(m, f"n{i}")
    assert evicted == [f"p{i}" for i in range(50)]
    assert book.asked == 50 + 50  # each retained block once, then each victim once
    clock.now += 100  # expired: back in the queue at their old LRU priority
    assert put(m, "late") == ["r0"]
    assert put(m, "later") == ["r1"]


def test_hard_pins_are_unchanged_by_retention() -> None:
    clock = Clock()
    m = one_level(clock, blocks=3)
    r = m.reserve(k("p"), B, pin=True, retain=RetainAsk(seconds=5))
    assert r is not None and m.commit(r)
    put(m, "a")
    put(m, "b")
    clock.now += 5  # its retention ended: still pinned, never a victim
    assert put(m, "c") == ["a"]
    assert put(m, "d") == ["b"]
    assert k("p") in m and m.entry(k("p")).pinned


# ---- across a restart: the deadline a durable tier keeps (issue 25) -----------------------------


def test_a_kept_deadline_is_wall_clock_and_a_restore_keeps_what_is_left() -> None:
    mono, wall = Clock(), Clock()
    wall.now = 1.7e9
    book = RetentionBook(clock=mono, wall_clock=wall)
    assert book.grant(k("a"), B, RetainAsk(seconds=60))
    mono.now += 15
    wall.now += 15
    kept = book.kept(k("a"))
    assert kept == Retention(until=1.7e9 + 60, seconds=60)
    assert book.kept(k("b")) is None
    # A restart: a new process, its monotonic clock from another origin, 30 s later.
    mono2 = Clock()
    mono2.now = 7.0
    wall.now += 30
    after = RetentionBook(clock=mono2, wall_clock=wall, max_bytes=2 * B)
    assert after.restore(k("a"), B, kept)
    assert not after.restore(k("a"), B, kept)  # already held: left as it is
    mono2.now += 14.999
    assert after.retains(k("a"))
    assert after.touch(k("a"))  # reads refresh by the kept seconds, as before the restart
    mono2.now += 59.999
    assert after.retains(k("a"))
    mono2.now += 0.001
    assert not after.retains(k("a"))
    # A deadline that passed while the node was down leaves the block ordinary.
    assert not after.restore(k("b"), B, Retention(until=wall.now, seconds=60))
    # The node's cap still holds.
    assert after.restore(k("c"), 2 * B, Retention(until=wall.now + 5, seconds=5))
    assert not after.restore(k("d"), B, Retention(until=wall.now + 5, seconds=5))
    assert after.denied == 1


def test_a_block_adopted_after_a_restart_is_retained_until_its_kept_deadline() -> None:
    clock = Clock()
    m = two_levels(clock)
    until = clock.now + 20  # the fake clock serves as the wall clock too
    m.adopt(k("kept"), None, B, level=1, location="at 0", retention=Retention(until=until,
                                                                            seconds=20))
    m.adopt(k("gone"), None, B, level=1, location="at 1",
            retention=Retention(until=clock.now, seconds=20))
    assert m.retention.retains(k("kept")) and not m.retention.retains(k("gone"))
    clock.now += 20
    assert not m.retention.retains(k("kept"))


def test_retain_of_a_stored_block_is_a_put_time_grant_and_release_ends_it_now() -> None:
    clock = Clock()
    m = one_level(clock, max_bytes=2 * B)
    for n in "abcd":
        put(m, n)
    assert m.retain(k("a"), RetainAsk(seconds=10)) is True
    assert m.retain(k("zz"), RetainAsk(seconds=10)) is None  # not stored
    assert m.retain(k("b"), RetainAsk(seconds=10)) is True
    assert m.retain(k("c"), RetainAsk(seconds=10)) is False  # the node's cap: 2 blocks
    assert m.retention.stats()["retention_denied"] == 1
    # LRU would take "a" then "b"; both retained, so "c" and "d" go first.
    assert put(m, "e") == ["c"]
    assert put(m, "f") == ["d"]
    clock.now += 5
    assert m.retain(k("a"), RetainAsk(seconds=1)) is True
    assert m.retention.held[k("a")].until == 1010.0  # never shortened
    assert m.release(k("a")) is True
    assert m.release(k("zz")) is False
    assert k("a") not in m.retention.held
    assert m.retention.stats()["retained_bytes"] == B  # "b" only: a's bytes left the cap
    assert put(m, "g") == ["a"]  # ordinary again, and the LRU block
    assert m.release(k("e")) is True  # stored, never retained: released is a no-op
    assert put(m, "h") == ["e"]


def test_a_released_block_that_left_the_queue_rejoins_it() -> None:
    clock = Clock()
    m = one_level(clock, blocks=2)
    put(m, "a", retain_s=60)
    put(m, "b")
    assert put(m, "c") == ["b"]  # the round passed "a" over: it left the queue
    assert m.release(k("a")) is True
    assert put(m, "d") == ["a"]


def test_retain_charges_the_owner_cap_like_a_put() -> None:
    clock = Clock()
    m = one_level(clock, blocks=8)
    for n in "abc":
        put(m, n)
    ask = RetainAsk(seconds=10, owner="t1", owner_cap=2 * B)
    assert [m.retain(k(n), ask) for n in "abc"] == [True, True, False]
    assert m.retention.stats()["namespace_retained_bytes"] == {"t1": 2 * B}
    m.release(k("a"))
    assert m.retain(k("c"), ask) is True
