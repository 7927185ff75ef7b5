"""Quota accounting: each reservation carries its own charge, so same-key races settle exactly."""

from __future__ import annotations

import threading

import pytest

from kvstore.auth.quotas import QuotaBook
from kvstore.core.errors import ResourceExhausted
from kvstore.core.keys import BlockKey
from kvstore.node.semantics import Node, NodeSettings

K = BlockKey(b"k" * 16)


def test_two_reservations_of_one_key_settle_to_one_charge() -> None:
    book = QuotaBook()
    r1, r2 = object(), object()
    book.charge_reservation("a", r1, 100)
    book.charge_reservation("a", r2, 100)
    assert book.used() == {"a": 200} and book.open_reservations() == 2
    book.settle(r1, K, stored=True)
    book.settle(r2, K, stored=False)  # lost the race: its bytes come back
    assert book.used() == {"a": 100} and book.open_reservations() == 0
    book.release(K)
    assert book.used() == {} and book.open_reservations() == 0
    book.release(K)  # twice: nothing left to give back
    book.settle(r1, K, stored=True)  # already settled
    assert book.used() == {}


def test_check_counts_open_reservations() -> None:
    book = QuotaBook()
    book.charge_reservation("a", object(), 600)
    book.check("a", 1000, 400)
    with pytest.raises(ResourceExhausted, match="over its quota"):
        book.check("a", 1000, 401)


def test_a_racer_for_a_key_already_reserved_is_not_refused_and_settles_exactly() -> None:
    """At the quota's edge a second put of a key with an open reservation is a same-key
    race, not new bytes: it passes the check, and whichever wins, one charge stays."""
    book = QuotaBook()
    other, r1, r2 = object(), object(), object()  # held: the book keys them by id
    book.charge_reservation("a", other, 600)  # another block, still open
    book.check("a", 1000, 400, key=K)
    book.charge_reservation("a", r1, 400, key=K)
    with pytest.raises(ResourceExhausted, match="over its quota"):
        book.check("a", 1000, 400, key=BlockKey(b"o" * 16))  # another key: new bytes
    book.check("a", 1000, 400, key=K)  # the racer
    book.charge_reservation("a", r2, 400, key=K)
    assert book.used() == {"a": 1400}
    book.settle(r2, K, stored=True)
    book.settle(r1, K, stored=False)
    assert book.used() == {"a": 1000}
    with pytest.raises(ResourceExhausted, match="over its quota"):
        book.check("a", 1000, 1, key=K)  # no reservation of K is open any more


@pytest.mark.parametrize("quota", [None, 1 << 20])
def test_concurrent_puts_of_one_key_one_stores_the_rest_get_false(quota: int | None) -> None:
    node = Node(NodeSettings(dram_bytes=8 << 20, prefault=False))
    try:
        base = node.stats()["tiers"]["dram"]["used"]
        n = 8
        barrier = threading.Barrier(n)
        results: list[bool | BaseException] = [False] * n
        value = memoryview(bytes(range(256)) * 64)

        def put(i: int) -> None:
            # All reserve before any commits: each holds a reservation of the same key.
            try:
                with node.put_slot(K, len(value), owner="a", quota=quota) as slot:
                    barrier.wait(timeout=10)
                    assert slot is not None
                    slot.view[:] = value
                results[i] = slot.stored
            except BaseException as exc:
                results[i] = exc

        threads = [threading.Thread(target=put, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results, key=str) == [False] * (n - 1) + [True]
        assert node.get(K) == bytes(value)
        assert node.stats()["node"]["namespace_bytes"] == {"a": len(value)}
        assert node.remove(K)
        assert "namespace_bytes" not in node.stats()["node"]
        assert node.stats()["tiers"]["dram"]["used"] == base
    finally:
        node.close()
