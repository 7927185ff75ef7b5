"""tiers.observer: what the TierManager tells its observer, in index order (the KV events'
one source). Pure: moves are planned and finished directly, as in test_tier_moves."""

from __future__ import annotations

from kvstore.core.keys import BlockKey
from tiers.manager import TierManager, Watermarks
from tiers.metadata import MetadataTier
from tiers.policy import make_policy

B = 64


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(16, b"."))


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[object, ...]] = []

    def stored(self, key: BlockKey, parent: BlockKey | None, level: int) -> None:
        self.log.append(("stored", key, parent, level))

    def removed(self, key: BlockKey, level: int) -> None:
        self.log.append(("removed", key, level))

    def moved(self, key: BlockKey, parent: BlockKey | None, src: int, dst: int) -> None:
        self.log.append(("moved", key, parent, src, dst))


def tier(blocks: int, name: str) -> MetadataTier:
    t = MetadataTier(blocks * B, alignment=B)
    t.name = name
    return t


def put(m: TierManager, key: str, parent: str | None = None) -> bool:
    r = m.reserve(k(key), B, parent=None if parent is None else k(parent))
    return r is not None and m.commit(r)


def test_commits_moves_both_ways_drops_and_removals() -> None:
    m = TierManager([tier(4, "dram"), tier(2, "ssd")], make_policy("lru"),
                    watermarks=Watermarks(high=1.0, low=0.5))
    rec = Recorder()
    m.observer = rec
    assert put(m, "a") and put(m, "b", parent="a")
    assert not put(m, "a")  # already stored: nothing to tell
    moves = m.plan_moves(0, B)  # demote the LRU victim, a
    for mv in moves:
        mv.copied = True
    m.finish_moves(moves)
    undone = m.plan_moves(0, B)  # b, but its copy fails: it stays, silently
    m.finish_moves(undone)
    for _ in range(2):  # read twice below the top: queued for promotion
        e = m.acquire_read(k("a"))
        assert e is not None
        m.release_read(e)
    ups, need = m.plan_promotions(4)
    assert need is None and [mv.entry.key for mv in ups] == [k("a")]
    for mv in ups:
        mv.copied = True
    m.finish_moves(ups)
    assert m.remove(k("b"))
    assert not m.remove(k("b"))
    down = m.plan_moves(0, B)  # a again, to level 1
    for mv in down:
        mv.copied = True
    m.finish_moves(down)
    drop = m.plan_moves(1, B)  # the last tier drops its victim
    m.finish_moves(drop)
    assert rec.log == [
        ("stored", k("a"), None, 0),
        ("stored", k("b"), k("a"), 0),
        ("moved", k("a"), None, 0, 1),
        ("moved", k("a"), None, 1, 0),
        ("removed", k("b"), 0),
        ("moved", k("a"), None, 0, 1),
        ("removed", k("a"), 1),
    ]


def test_evictions_corruption_and_a_lost_race() -> None:
    m = TierManager(tier(2, "dram"), make_policy("lru"), watermarks=Watermarks(high=1.0,
                                                                                low=0.5))
    rec = Recorder()
    m.observer = rec
    assert put(m, "a") and put(m, "b")
    r1 = m.reserve(k("c"), B)  # evicts a (LRU) to make room
    assert r1 is not None
    r2 = m.reserve(k("c"), B)  # a racing put of the same key: evicts b
    assert r2 is not None
    assert m.commit(r1) and not m.commit(r2)  # the loser publishes nothing
    e = m.acquire_read(k("c"))
    assert e is not None
    m.report_corrupt(e)
    m.release_read(e)
    assert rec.log == [
        ("stored", k("a"), None, 0),
        ("stored", k("b"), None, 0),
        ("removed", k("a"), 0),
        ("removed", k("b"), 0),
        ("stored", k("c"), None, 0),
        ("removed", k("c"), 0),
    ]
