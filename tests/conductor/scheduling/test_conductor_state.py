"""conductor.scheduling.state: prefix caches, the pool index, prefill queues and decode batches."""

from __future__ import annotations

import pytest

from conductor.scheduling.state import (
    DecodeInstance,
    LocalPrefixCache,
    PoolIndex,
    PrefillInstance,
)
from conductor.scheduling.types import InstanceId, RequestId


def test_prefix_len_stops_at_the_first_miss() -> None:
    c = LocalPrefixCache(10)
    c.use(["a", "b", "c"])
    assert c.prefix_len(["a", "b", "c", "d"]) == 3
    assert c.prefix_len(["a", "x", "c"]) == 1
    assert c.prefix_len(["x", "a"]) == 0
    assert c.prefix_len([]) == 0


def test_lru_evicts_chain_tails_first() -> None:
    c = LocalPrefixCache(4)
    c.use(["a", "b", "c"])       # head refreshed last: order c, b, a
    assert c.keys() == ["c", "b", "a"]
    c.use(["x", "y"])            # 5 blocks > 4: the oldest is the tail "c"
    assert c.keys() == ["b", "a", "y", "x"]
    assert c.prefix_len(["a", "b", "c"]) == 2  # the chain is still a usable prefix
    assert c.evictions == 1
    c.use(["a"])                 # a hit refreshes
    c.use(["z"])                 # evicts "b" (the oldest), not the refreshed head
    assert c.keys() == ["y", "x", "a", "z"]


def test_zero_capacity_holds_nothing() -> None:
    c = LocalPrefixCache(0)
    c.use(["a"])
    assert len(c) == 0 and c.prefix_len(["a"]) == 0
    with pytest.raises(ValueError):
        LocalPrefixCache(-1)


def test_pool_index_counts_holders_across_local_caches() -> None:
    pool = PoolIndex()
    c1, c2 = LocalPrefixCache(2, pool), LocalPrefixCache(2, pool)
    c1.use(["a", "b"])
    c2.use(["a", "c"])
    assert pool.count == {"a": 2, "b": 1, "c": 1}
    assert pool.prefix_len(["a", "b", "z"]) == 2
    c1.use(["d"])                # c1 evicts its oldest, the tail "b"
    assert pool.count == {"a": 2, "c": 1, "d": 1}
    assert pool.prefix_len(["a", "b"]) == 1
    c2.use(["e", "f"])           # c2 drops both of its blocks
    assert pool.count == {"a": 1, "d": 1, "e": 1, "f": 1}
    assert not pool.holds("c") and len(pool) == 4


def test_prefill_queue_estimate_and_drift_correction() -> None:
    p = PrefillInstance(id=InstanceId("p0"), cache=LocalPrefixCache(1))
    assert p.queue_s(5.0) == 0.0
    assert p.enqueue(RequestId(1), 10.0, 2.0) == 12.0
    assert p.enqueue(RequestId(2), 10.5, 3.0) == 15.0
    assert p.queue_s(11.0) == 4.0 and p.queued == 2
    p.complete(RequestId(1), 12.5)   # finished 0.5 s late: the rest shifts by 0.5
    assert p.busy_until_s == 15.5
    p.complete(RequestId(2), 15.0)   # finished 0.5 s early relative to the shifted estimate
    assert p.busy_until_s == 15.0 and p.queued == 0
    p.report_queue(20.0, 7.0)
    assert p.queue_s(20.0) == 7.0
    p.complete(RequestId(99), 1.0)   # unknown ids are ignored
    assert p.busy_until_s == 27.0


def test_decode_instance_batch_bookkeeping() -> None:
    d = DecodeInstance(id=InstanceId("d0"), kv_capacity_tokens=3_000)
    d.expect(RequestId(1), 1.0, 1_000, 5)
    assert RequestId(1) in d.incoming
    d.start(RequestId(1), 1_000, 4, 5)
    assert not d.incoming and d.context_tokens == 1_000 and d.reserved_tokens == 1_005
    d.start(RequestId(2), 500, 2, 3)
    d.step()
    d.step()
    assert d.context_tokens == 1_500 + 4 and d.remaining(RequestId(1)) == 2
    assert d.remaining(RequestId(2)) == 0
    assert d.fits(1_000, 400) and not d.fits(1_000, 600)
    d.finish(RequestId(2))
    assert d.context_tokens == 1_002 and d.reserved_tokens == 1_005
    d.set_remaining(RequestId(1), 7)
    assert d.remaining(RequestId(1)) == 7
    d.drop(RequestId(42))  # absent: no error
