"""Node: put/get semantics, scoped puts and reads, admission and draining."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvstore.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvstore.core.keys import BlockKey
from kvstore.node.client_holds import LeaseSet, ReservationSet
from kvstore.node.semantics import Node, NodeSettings, check_key, check_parent


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node(NodeSettings(dram_bytes=1 << 20, prefault=False))
    yield n
    n.close()


def used(n: Node) -> int:
    return n.stats()["tiers"]["dram"]["used"]


def test_put_get_remove(node: Node) -> None:
    assert node.put(k(1), memoryview(b"hello"))
    assert not node.put(k(1), memoryview(b"hello"))
    assert node.get(k(1)) == b"hello"
    assert node.get(k(2)) is None
    assert node.exists([k(1), k(2)]) == [True, False]
    assert node.remove(k(1)) and not node.remove(k(1))
    assert used(node) == 0


def test_prefix_match_counts_leading_keys(node: Node) -> None:
    for i in (1, 2, 4):
        node.put(k(i), memoryview(b"x"))
    assert node.prefix_match([k(1), k(2), k(3), k(4)]) == 2
    assert node.prefix_match([k(3), k(1)]) == 0
    assert node.prefix_match([]) == 0


def test_failed_fill_aborts_and_leaks_nothing(node: Node) -> None:
    with pytest.raises(ConnectionError), node.put_slot(k(1), 4096) as slot:
        assert slot is not None
        slot.view[:100] = b"y" * 100
        raise ConnectionError("client went away mid-transfer")
    assert used(node) == 0
    assert node.get(k(1)) is None


def test_put_slot_of_existing_key_yields_none(node: Node) -> None:
    node.put(k(1), memoryview(b"a"))
    with node.put_slot(k(1), 1) as slot:
        assert slot is None


def test_errors(node: Node) -> None:
    with pytest.raises(InvalidArgument, match="empty"):
        node.put(k(1), memoryview(b""))
    with pytest.raises(InvalidArgument, match="own parent"):
        node.put(k(1), memoryview(b"a"), parent=k(1))
    with pytest.raises(ResourceExhausted, match="exceeds"):
        node.put(k(1), memoryview(bytes(2 << 20)))
    with pytest.raises(InvalidArgument, match="16 bytes"):
        check_key(b"short")
    with pytest.raises(InvalidArgument):
        check_key("not bytes")
    assert check_parent(b"") is None and check_parent(None) is None


def test_reader_keeps_bytes_while_block_is_removed(node: Node) -> None:
    node.put(k(1), memoryview(b"A" * 1000))
    reading = threading.Event()
    removed = threading.Event()
    seen: list[bytes] = []

    def reader() -> None:
        with node.reading(k(1)) as view:
            assert view is not None
            reading.set()
            removed.wait()
            seen.append(bytes(view))

    t = threading.Thread(target=reader)
    t.start()
    reading.wait()
    assert node.remove(k(1))
    # The freed space must not be handed out while the reader holds it.
    assert node.put(k(2), memoryview(b"B" * 1000))
    assert used(node) == 2048
    removed.set()
    t.join()
    assert seen == [b"A" * 1000]
    assert used(node) == 1024


def test_drain_waits_for_in_flight_and_refuses_new(node: Node) -> None:
    entered = threading.Event()
    finish = threading.Event()
    result: list[bool] = []

    def slow_request() -> None:
        with node.request():
            entered.set()
            finish.wait()

    t = threading.Thread(target=slow_request)
    t.start()
    entered.wait()
    assert node.drain(timeout=0) is False  # one request still in flight
    assert node.draining
    with pytest.raises(Unavailable), node.request():
        pass
    drainer = threading.Thread(target=lambda: result.append(node.drain(timeout=30)))
    drainer.start()
    finish.set()
    t.join()
    drainer.join()
    assert result == [True]


def test_lease_set_releases_everything_on_close(node: Node) -> None:
    node.put(k(1), memoryview(b"x" * 64))
    leases = LeaseSet(node)
    got = leases.acquire(k(1))
    assert got is not None
    lease_id, _ = got
    assert leases.acquire(k(9)) is None
    node.remove(k(1))
    assert used(node) == 64  # still leased
    leases.close()
    assert used(node) == 0
    assert not leases.release(lease_id)


def test_reservation_set_aborts_leftovers(node: Node) -> None:
    rs = ReservationSet(node)
    got = rs.reserve(k(1), 100, parent=None, pin=False)
    assert got is not None
    rid, reservation = got
    node.fill_view(reservation)[:] = b"z" * 100
    got2 = rs.reserve(k(2), 100, parent=None, pin=False)
    assert got2 is not None
    assert rs.commit(rid)
    with pytest.raises(InvalidArgument):
        rs.commit(rid)
    rs.close()  # k(2) was never committed
    assert node.exists([k(1), k(2)]) == [True, False]
    assert used(node) == 128


def test_stats_shape(node: Node) -> None:
    node.put(k(1), memoryview(b"x"))
    node.get(k(1))
    node.get(k(2))
    s = node.stats()
    assert s["node"]["policy"] == "lru" and s["node"]["draining"] is False
    d = s["tiers"]["dram"]
    assert {key: d[key] for key in ("blocks", "hits", "misses", "evictions", "used")} == {
        "blocks": 1, "hits": 1, "misses": 1, "evictions": 0, "used": 64}
    assert d["capacity"] == 1 << 20


def test_put_waits_for_victims_already_moving_instead_of_failing(tmp_path) -> None:
    """Every DRAM block is mid-demotion when a third put needs room: it waits, then stores."""
    block = 64 << 10
    n = Node(NodeSettings(dram_bytes=4 * block, prefault=False, high_watermark=1.0,
                          low_watermark=0.5, ssd_path=str(tmp_path / "kv.img"),
                          ssd_bytes=16 << 20, ssd_io="python"))
    try:
        ssd = n._tiers[-1]
        real_write = ssd.write_blocks
        gate = threading.Event()
        entered = threading.Semaphore(0)

        def gated_write(items, *more):  # the real write, held at a barrier
            entered.release()
            gate.wait()
            return real_write(items, *more)

        ssd.write_blocks = gated_write
        for i in range(4):
            assert n.put(k(i), memoryview(bytes([i]) * block))
        results: dict[int, object] = {}

        def put(i: int) -> None:
            try:
                results[i] = n.put(k(i), memoryview(bytes([i]) * block))
            except Exception as exc:  # recorded, asserted below
                results[i] = exc

        movers = [threading.Thread(target=put, args=(i,)) for i in (4, 5)]
        movers[0].start()
        entered.acquire()  # put 4 planned 3 victims and is copying them
        movers[1].start()
        entered.acquire()  # put 5 planned the last one: every DRAM block is moving
        waiter = threading.Thread(target=put, args=(6,))
        waiter.start()
        gate.set()
        for t in (*movers, waiter):
            t.join()
        assert results == {4: True, 5: True, 6: True}
        assert all(n.get(k(i)) == bytes([i]) * block for i in range(7))
    finally:
        n.close()


def test_leases_and_reservations_expire_in_grant_order(node: Node) -> None:
    now = [100.0]
    node.put(k(1), memoryview(b"x" * 64))
    node.put(k(2), memoryview(b"y" * 64))
    leases = LeaseSet(node, clock=lambda: now[0])
    rs = ReservationSet(node, clock=lambda: now[0])
    first = leases.acquire(k(1))
    got = rs.reserve(k(3), 100, parent=None, pin=False)
    assert first is not None and got is not None
    now[0] = 104.0
    second = leases.acquire(k(2))
    assert second is not None
    assert node.remove(k(1)) and node.remove(k(2))
    assert used(node) == 64 + 64 + 128  # both leased, one reservation
    now[0] = 104.999
    assert leases.expire(5.0) == 0 and rs.expire(5.0) == 0
    now[0] = 105.0  # the first lease and the reservation are exactly 5 s old
    assert leases.expire(5.0) == 1 and rs.expire(5.0) == 1
    assert used(node) == 64 and len(leases) == 1 and len(rs) == 0
    assert not leases.release(first[0])  # expired: the holder learns its lease was void
    with pytest.raises(InvalidArgument, match="unknown or expired"):
        rs.commit(got[0])
    assert node.exists([k(3)]) == [False]
    assert leases.release(second[0]) and used(node) == 0
