"""A TierManager on the native index against one on the Python index, operation by
operation (Hypothesis): the native index's C fast paths (a read hit, a lease's end and a
new block's indexing in one call each) must answer as the Python paths do, for puts and
for a restart's adopted blocks. The manager's own exact tests run on both indexes too
(CI's native-index phase)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.core.keys import BlockKey
from tiers.errors import OutOfSpace
from tiers.index_kind import native_available
from tiers.manager import TierManager
from tiers.metadata import MetadataTier
from tiers.policy import make_policy
from tiers.records import BlockEntry, Watermarks
from tiers.retention import Retention

pytestmark = pytest.mark.skipif(not native_available(), reason="native index not built")

KEYS = [BlockKey(i.to_bytes(16, "big")) for i in range(12)]  # 8 fit: puts evict
CAPACITY = 8
# Compared as they are. ``last_access`` is compared by order only: the native path draws
# its tick before the lookup, so a miss skips one (ticks only order).
FIELDS = ("readers", "hits", "tier_hits", "children", "flags", "level", "nbytes")

# Mostly puts and reads, so that reads decide victims.
OPS = st.lists(st.tuples(st.sampled_from(["put"] * 4 + ["read"] * 4 + ["release"] * 2
                                         + ["pin", "peer_read", "remove"]),
                         st.integers(0, len(KEYS) - 1)), min_size=30, max_size=150)


def _manager(kind: str, policy: str) -> TierManager:
    return TierManager(MetadataTier(CAPACITY, index=kind), make_policy(policy),
                       watermarks=Watermarks(high=1.0, low=1.0), index=kind)


def _step(m: TierManager, held: list[BlockEntry], op: str, i: int) -> object:
    key = KEYS[i]
    if op in ("put", "pin"):
        try:
            r = m.reserve(key, 1 + i % 2, parent=KEYS[i - 1] if i % 4 else None,
                          pin=op == "pin")
        except OutOfSpace:
            return "full"
        return r is not None and m.commit(r)
    if op in ("read", "peer_read"):
        e = m.acquire_read(key, access=op == "read")
        if e is not None:
            held.append(e)
        return e is not None
    if op == "release":
        return held and m.release_read(held.pop(i % len(held)))
    return bool(m.remove(key))


def _assert_alike(py: TierManager, native: TierManager) -> None:
    """The same keys, each with the same fields and location, in the same recency order."""
    assert py.keys() == native.keys()
    for key in KEYS:
        a, b = py.entry(key), native.entry(key)
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert [getattr(a, f) for f in FIELDS] == [getattr(b, f) for f in FIELDS]
            assert a.location == b.location
    assert _by_recency(py) == _by_recency(native)


def _by_recency(m: TierManager) -> list[BlockKey]:
    """The stored keys, least recently used first (ticks differ, their order must not)."""
    return sorted(m.keys(), key=lambda key: m.entry(key).last_access)  # type: ignore[union-attr]


@settings(max_examples=120, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu", "prefix"]), ops=OPS)
def test_a_manager_on_either_index_answers_every_call_alike(policy: str,
                                                          ops: list[tuple[str, int]]) -> None:
    py, native = _manager("python", policy), _manager("native", policy)
    held: tuple[list[BlockEntry], list[BlockEntry]] = ([], [])
    for op, i in ops:
        answers = [_step(m, h, op, i) for m, h in zip((py, native), held, strict=True)]
        assert answers[0] == answers[1], (op, i)
        assert py.drain_evicted() == native.drain_evicted()  # the same victims, in order
        _assert_alike(py, native)
        assert py.counters == native.counters
        assert py.tier.used == native.tier.used
    for m, h in zip((py, native), held, strict=True):
        while h:
            m.release_read(h.pop())
    assert py.tier.used == native.tier.used


# A restart's records: keys in any order (a child before its parent: an orphan count that
# the parent takes over when it comes), some twice (skipped), some retained.
ADOPTED = st.lists(st.tuples(st.integers(0, len(KEYS) - 1), st.booleans(), st.booleans()),
                   min_size=1, max_size=40)


def _two_levels(kind: str, policy: str) -> TierManager:
    """A memory tier over a durable one, each with room for every key (a full memory tier
    asks its owner's mover for room, which is not the subject here)."""
    return TierManager([MetadataTier(64, index=kind), MetadataTier(64, index=kind)],
                       make_policy(policy), durable=[False, True],
                       watermarks=Watermarks(high=1.0, low=1.0), index=kind)


@settings(max_examples=120, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu", "prefix"]), adopted=ADOPTED, ops=OPS)
def test_a_restart_on_either_index_adopts_alike(policy: str,
                                                adopted: list[tuple[int, bool, bool]],
                                                ops: list[tuple[str, int]]) -> None:
    py, native = _two_levels("python", policy), _two_levels("native", policy)
    blocks = [(KEYS[i], KEYS[i - 1] if has_parent and i else None, 1 + i % 3, ("loc", i),
               Retention(until=2e9, seconds=60.0) if kept else None)
              for i, has_parent, kept in adopted]
    assert py.adopt_many(1, blocks) == native.adopt_many(1, blocks) == len(
        {b[0] for b in blocks})
    held: tuple[list[BlockEntry], list[BlockEntry]] = ([], [])
    for op, i in [("adopted", 0), *ops]:  # then puts above them, reads of either level
        if op != "adopted":
            answers = [_step(m, h, op, i) for m, h in zip((py, native), held, strict=True)]
            assert answers[0] == answers[1], (op, i)
        _assert_alike(py, native)
        assert set(py.retention.held) == set(native.retention.held)
    for m, h in zip((py, native), held, strict=True):
        while h:
            m.release_read(h.pop())
    moves = [m.plan_moves(1, 64) for m in (py, native)]  # the durable level's victims
    assert [mv.entry.key for mv in moves[0]] == [mv.entry.key for mv in moves[1]]
