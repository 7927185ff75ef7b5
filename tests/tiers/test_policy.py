"""EvictionQueue and the policies' priority functions, on plain block records."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvstore.core.keys import BlockKey
from tiers.policy import (
    Eligibility,
    EvictionQueue,
    LFUPolicy,
    LRUPolicy,
    PrefixAwarePolicy,
    make_policy,
)


@dataclass(slots=True, kw_only=True)
class Block:
    hits: int = 0
    last_access: int = 0
    queue_seq: int = 0
    queue_priority: float = 0.0
    state: Eligibility = Eligibility.EVICT


def k(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(16, b"."))


def drain(q: EvictionQueue, blocks: dict[BlockKey, Block]) -> list[str]:
    order: list[str] = []
    deferred: list = []
    while (key := q.pop_victim(blocks, lambda b: b.state, deferred)) is not None:
        order.append(key.rstrip(b".").decode())
        del blocks[key]
    q.restore(deferred)
    return order


def test_lru_orders_by_last_access_and_ignores_stale_items() -> None:
    q = EvictionQueue(LRUPolicy())
    blocks = {k(n): Block(last_access=t) for n, t in [("a", 1), ("b", 2), ("c", 3)]}
    for key, b in blocks.items():
        q.push(key, b)
    blocks[k("a")].last_access = 4
    q.push(k("a"), blocks[k("a")])  # its first heap item is now stale
    assert drain(q, blocks) == ["b", "c", "a"]


def test_ties_go_to_the_block_pushed_first() -> None:
    q = EvictionQueue(LRUPolicy())
    blocks = {k(n): Block(last_access=7) for n in "xyz"}
    for key in (k("y"), k("x"), k("z")):
        q.push(key, blocks[key])
    assert drain(q, blocks) == ["y", "x", "z"]


def test_deferred_blocks_stay_queued_and_dropped_ones_leave_the_queue() -> None:
    q = EvictionQueue(LRUPolicy())
    blocks = {k(n): Block(last_access=t) for n, t in [("a", 1), ("b", 2), ("c", 3)]}
    for key, b in blocks.items():
        q.push(key, b)
    blocks[k("a")].state = Eligibility.DEFER
    blocks[k("b")].state = Eligibility.DROP
    assert drain(q, blocks) == ["c"]
    assert blocks[k("b")].queue_seq == 0  # forgotten until pushed again
    blocks[k("a")].state = Eligibility.EVICT
    assert drain(q, blocks) == ["a"]


def test_lfu_priority_is_age_plus_hits_and_age_follows_victims() -> None:
    policy = LFUPolicy()
    q = EvictionQueue(policy)
    blocks = {k("a"): Block(hits=3), k("b"): Block(hits=1)}
    for key, b in blocks.items():
        q.push(key, b)
    deferred: list = []
    assert q.pop_victim(blocks, lambda b: b.state, deferred) == k("b")
    assert policy.age == 1
    late = Block(hits=1)
    q.push(k("c"), late)
    assert late.queue_priority == 2  # age 1 + 1 hit: ranks above an old block with 1 hit


def test_prefix_policy_declares_leaves_only() -> None:
    assert PrefixAwarePolicy().leaves_only
    assert not LRUPolicy().leaves_only and not LFUPolicy().leaves_only


def test_a_policy_by_recency_is_one_whose_priority_is_the_last_access() -> None:
    block = Block(last_access=7, hits=3)
    for policy in (LRUPolicy(), LFUPolicy(), PrefixAwarePolicy()):
        assert policy.by_recency == (policy.priority(block) == block.last_access), policy.name
    assert [p.by_recency for p in (LRUPolicy(), LFUPolicy(), PrefixAwarePolicy())] == \
        [True, False, True]


def test_compact_drops_stale_items_only() -> None:
    q = EvictionQueue(LRUPolicy())
    blocks = {k("a"): Block(last_access=1), k("b"): Block(last_access=2)}
    for _ in range(1500):
        for key, b in blocks.items():
            b.last_access += 2
            q.push(key, b)
    assert len(q) == 3000
    q.compact(blocks)
    assert len(q) == 2
    assert drain(q, blocks) == ["a", "b"]


def test_make_policy() -> None:
    assert make_policy("lru").name == "lru"
    assert make_policy("lfu").name == "lfu"
    assert make_policy("prefix").name == "prefix"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")


def test_a_shared_clock_orders_pushes_and_may_be_drawn_by_the_owner() -> None:
    import itertools

    clock = itertools.count(1)
    q1, q2 = EvictionQueue(LRUPolicy(), clock=clock), EvictionQueue(LRUPolicy(), clock=clock)
    a, b, c = Block(last_access=5), Block(last_access=5), Block(last_access=5)
    q1.push(k("a"), a)
    q2.push(k("b"), b)
    tick = next(clock)
    q1.push(k("c"), c, tick)
    assert (a.queue_seq, b.queue_seq, c.queue_seq) == (1, 2, 3)
    assert drain(q1, {k("a"): a, k("c"): c}) == ["a", "c"]  # ties: pushed first goes first
