"""``TierManager.adopt_many``: a restart's blocks indexed in one batch end in the state
that adopting them one by one leaves (Hypothesis, on each index and policy): the same
entries and fields, the same children and orphan counts, the same retention, the same
victims in the same order, before and after further puts and reads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.core.keys import BlockKey
from tiers.index_kind import native_available
from tiers.manager import AdoptedBlock, TierManager
from tiers.metadata import MetadataTier
from tiers.policy import make_policy
from tiers.records import Watermarks
from tiers.retention import Retention

KEYS = [BlockKey(i.to_bytes(16, "big")) for i in range(16)]
FIELDS = ("readers", "hits", "tier_hits", "children", "flags", "level", "nbytes",
          "last_access", "queue_seq")
INDEXES = ["python", "native"] if native_available() else ["python"]

# (key, whether it names the key before it as parent, whether it is retained): in any
# order, some twice, parents before or after their children or never adopted.
ADOPTED = st.lists(st.tuples(st.integers(0, len(KEYS) - 1), st.booleans(), st.booleans()),
                   min_size=1, max_size=40)
AFTER = st.lists(st.tuples(st.sampled_from(["put", "read"]), st.integers(0, len(KEYS) - 1)),
                 max_size=20)


def _two_levels(index: str, policy: str) -> TierManager:
    return TierManager([MetadataTier(64, index=index), MetadataTier(64, index=index)],
                       make_policy(policy), durable=[False, True],
                       watermarks=Watermarks(high=1.0, low=1.0), index=index)


def _state(m: TierManager) -> object:
    entries = []
    indexed = m.keys()  # insertion order (a TierManager has no __iter__)
    for key in indexed:
        e = m.entry(key)
        assert e is not None
        entries.append((key, [getattr(e, f) for f in FIELDS], e.location, e.parent))
    return (entries, [m.children_of(key) for key in KEYS], sorted(m.retention.held),
            m.levels[1].blocks, len(m.levels[1].queue))


def _victims(m: TierManager) -> list[BlockKey]:
    return [mv.entry.key for mv in m.plan_moves(1, 64)]


@settings(max_examples=150, deadline=None)
@given(index=st.sampled_from(INDEXES), policy=st.sampled_from(["lru", "lfu", "prefix"]),
       adopted=ADOPTED, after=AFTER, indexed_before=st.lists(st.integers(0, len(KEYS) - 1),
                                                             max_size=4))
def test_a_batch_adopts_as_one_by_one(index: str, policy: str,
                                      adopted: list[tuple[int, bool, bool]],
                                      after: list[tuple[str, int]],
                                      indexed_before: list[int]) -> None:
    blocks: list[AdoptedBlock] = [
        (KEYS[i], KEYS[i - 1] if has_parent and i else None, 1 + i % 3, ("loc", i),
         Retention(until=2e9, seconds=60.0) if kept else None)
        for i, has_parent, kept in adopted]
    batch, single = _two_levels(index, policy), _two_levels(index, policy)
    for m in (batch, single):  # some keys in the memory tier already: skipped
        for i in indexed_before:
            r = m.reserve(KEYS[i], 1, parent=KEYS[i + 1] if i + 1 < len(KEYS) else None)
            if r is not None:
                m.commit(r)
    assert batch.adopt_many(1, blocks) == sum(
        single.adopt(key, parent, n, level=1, location=loc, retention=kept)
        for key, parent, n, loc, kept in blocks)
    assert _state(batch) == _state(single)
    for op, i in after:
        for m in (batch, single):
            if op == "put":
                r = m.reserve(KEYS[i], 1, parent=KEYS[i - 1] if i else None)
                if r is not None:
                    m.commit(r)
            else:
                e = m.acquire_read(KEYS[i])
                if e is not None:
                    m.release_read(e)
        assert _state(batch) == _state(single)
    assert _victims(batch) == _victims(single)


@pytest.mark.parametrize("index", INDEXES)
def test_a_child_adopted_before_its_parent_is_counted_on_it(index: str) -> None:
    m = _two_levels(index, "prefix")
    blocks: list[AdoptedBlock] = [(KEYS[2], KEYS[1], 1, ("loc", 2), None),
                                  (KEYS[1], KEYS[0], 1, ("loc", 1), None)]
    assert m.adopt_many(1, blocks) == 2
    assert [m.children_of(k) for k in KEYS[:3]] == [1, 1, 0]  # KEYS[0]: an orphan count
    # Leaves only: KEYS[1] waits until its child has left, not planned in the same round.
    assert _victims(m) == [KEYS[2]]
