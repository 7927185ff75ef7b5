"""Cluster membership against a real etcd: registration, leases, watches, outages."""

from __future__ import annotations

import asyncio
import queue
import signal
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import aetcd
import pytest
from conftest import wait_until

from replication.membership import (
    DEFAULT_PREFIX,
    EtcdMembership,
    MembershipError,
    MembershipUnavailable,
    StaticMembership,
    View,
    decode_member,
    encode_member,
)
from replication.membership.etcd_server import EtcdServer
from replication.placement.rendezvous import Member, NodeId

if TYPE_CHECKING:
    from etcd_fixtures import StartMember

pytest_plugins = ["etcd_fixtures"]

TTL = 2  # etcd's smallest lease with default timing is 2 s (1.5 x election timeout, rounded up)
# A lease expires between TTL and TTL + 0.5 s (etcd checks every 500 ms); allow for slow CI.
EXPIRY_WAIT = TTL + 4.0
# Cross-process effects through etcd take milliseconds; this only bounds a failure.
SEEN_WAIT = 5.0


def member(node_id: str, *, port: int = 1, zone: str = "", weight: float = 1.0) -> Member:
    return Member(node_id=NodeId(node_id), addr=f"127.0.0.1:{port}", zone=zone, weight=weight)


def ids(view: View) -> list[str]:
    return [m.node_id for m in view]


@pytest.fixture
def open_membership(etcd: EtcdServer) -> Iterator[Callable[[], EtcdMembership]]:
    """Opens EtcdMemberships on the test's etcd; closes whatever is still open afterwards."""
    opened: list[EtcdMembership] = []

    def open_one() -> EtcdMembership:
        m = EtcdMembership(etcd.endpoint)
        opened.append(m)
        return m

    yield open_one
    for m in opened:
        m.close()


def etcd_put(etcd: EtcdServer, key: bytes, value: bytes) -> None:
    """Writes a raw key (what a misbehaving or foreign writer could do)."""

    async def put() -> None:
        async with aetcd.Client("127.0.0.1", etcd.client_port, timeout=5) as client:
            await client.put(key, value)

    asyncio.run(put())


def etcd_delete(etcd: EtcdServer, key: bytes) -> None:
    async def delete() -> None:
        async with aetcd.Client("127.0.0.1", etcd.client_port, timeout=5) as client:
            await client.delete(key)

    asyncio.run(delete())


# ---- value format and static membership ----------------------------------------------------


def test_member_value_round_trips() -> None:
    m = member("node-1", zone="z1", weight=2.5)
    assert encode_member(m) == (
        b'{"node_id":"node-1","addr":"127.0.0.1:1","zone":"z1","weight":2.5}')
    assert decode_member("node-1", encode_member(m)) == m


@pytest.mark.parametrize("raw", [
    b"not json",
    b"\xff\xfe",
    b"[1, 2]",
    b'{"node_id": "n", "addr": "a:1", "weight": -1}',
    b'{"node_id": "n", "addr": "a:1", "weight": "heavy"}',
    b'{"node_id": "other", "addr": "a:1"}',
    b'{"node_id": "n"}',
    b'{"node_id": "n", "addr": "a:1", "zone": 7}',
])
def test_decode_member_rejects_malformed_values(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_member("n", raw)


def test_static_membership() -> None:
    b, a = member("b", port=2), member("a", port=1)
    static = StaticMembership([b, a])
    assert static.members() == (a, b)
    calls: list[View] = []
    unsubscribe = static.subscribe(calls.append)
    unsubscribe()
    assert static.wait_for(lambda v: len(v) == 2, timeout=0)
    assert not static.wait_for(lambda v: len(v) == 3, timeout=0)
    static.close()
    static.close()
    assert calls == []
    with pytest.raises(ValueError, match="duplicate"):
        StaticMembership([a, member("a", port=9)])


# ---- registration and watching ---------------------------------------------------------------


def test_two_members_seen_exactly_by_a_third_watcher(
        open_membership: Callable[[], EtcdMembership]) -> None:
    watcher = open_membership()
    assert watcher.members() == ()
    assert watcher.connected
    views: queue.Queue[View] = queue.Queue()
    watcher.subscribe(views.put)

    a = member("node-a", port=1001, zone="z1", weight=1.0)
    b = member("node-b", port=1002, zone="z2", weight=3.5)
    first, second = open_membership(), open_membership()
    first.register(a, ttl=TTL)
    assert a in first.members()  # register returns once the instance's own view shows it
    second.register(b, ttl=TTL)

    assert views.get(timeout=SEEN_WAIT) == (a,)
    assert views.get(timeout=SEEN_WAIT) == (a, b)
    assert watcher.members() == (a, b)  # field for field: ids, addr, zone, weight
    # A watcher started now gets the same view from its initial listing.
    assert open_membership().members() == (a, b)

    updated = member("node-b", port=1002, zone="z2", weight=7.0)
    second.update(updated)
    assert second.members() == (a, updated)
    assert views.get(timeout=SEEN_WAIT) == (a, updated)
    assert views.empty()


def test_leave_and_close_remove_members_at_once(
        open_membership: Callable[[], EtcdMembership]) -> None:
    watcher = open_membership()
    a, b = member("a"), member("b")
    first, second = open_membership(), open_membership()
    first.register(a, ttl=30)  # a long ttl: a removal seen within seconds is not expiry
    second.register(b, ttl=30)
    assert watcher.wait_for(lambda v: v == (a, b), SEEN_WAIT)

    first.leave()
    assert first.members() == (b,)  # leave returns once its own view has dropped the member
    assert watcher.wait_for(lambda v: v == (b,), SEEN_WAIT)
    first.leave()  # idempotent

    second.close()
    assert watcher.wait_for(lambda v: v == (), SEEN_WAIT)
    second.close()  # idempotent
    with pytest.raises(MembershipError, match="closed"):
        second.register(b, ttl=30)

    first.register(a, ttl=30)  # an instance that left may register again
    assert watcher.wait_for(lambda v: v == (a,), SEEN_WAIT)


def test_duplicate_node_id_is_refused_until_the_holder_leaves(
        open_membership: Callable[[], EtcdMembership]) -> None:
    holder, rival, watcher = open_membership(), open_membership(), open_membership()
    holder.register(member("n1", port=1), ttl=30)
    with pytest.raises(MembershipError, match="node id 'n1' is already registered by a live node"):
        rival.register(member("n1", port=2), ttl=30)
    # the rival's own view shows the holder (its watch may trail the refused write)
    assert rival.wait_for(lambda v: v == (member("n1", port=1),), SEEN_WAIT)

    holder.leave()
    rival.register(member("n1", port=2), ttl=30)
    assert watcher.wait_for(lambda v: v == (member("n1", port=2),), SEEN_WAIT)
    with pytest.raises(MembershipError, match="already registered as 'n1'"):
        rival.register(member("n2"), ttl=30)


def test_malformed_values_are_ignored(
        etcd: EtcdServer, open_membership: Callable[[], EtcdMembership]) -> None:
    watcher = open_membership()
    good = member("good")
    for suffix, raw in [(b"junk", b"not json"), (b"half", b'{"node_id": "half"}'),
                        (b"liar", encode_member(member("someone-else"))), (b"", b"{}"),
                        (b"\xff", encode_member(good))]:
        etcd_put(etcd, DEFAULT_PREFIX.encode() + suffix, raw)
    etcd_put(etcd, DEFAULT_PREFIX.encode() + b"good", encode_member(good))

    # Events arrive in order, so once "good" shows, every malformed put before it was seen.
    assert watcher.wait_for(lambda v: v == (good,), SEEN_WAIT)
    assert watcher.connected
    assert open_membership().members() == (good,)  # the initial listing skips them too

    # A valid member overwritten with junk is no longer a member.
    etcd_put(etcd, DEFAULT_PREFIX.encode() + b"good", b"{broken")
    assert watcher.wait_for(lambda v: v == (), SEEN_WAIT)


def test_registration_heals_a_deleted_key(
        etcd: EtcdServer, open_membership: Callable[[], EtcdMembership]) -> None:
    registered, watcher = open_membership(), open_membership()
    a = member("a")
    registered.register(a, ttl=TTL)
    assert watcher.wait_for(lambda v: v == (a,), SEEN_WAIT)
    # Every change in order: the heal may follow the delete too fast for a wait on the
    # current view to see the gap.
    views: queue.Queue[View] = queue.Queue()
    watcher.subscribe(views.put)
    etcd_delete(etcd, DEFAULT_PREFIX.encode() + b"a")  # the lease lives on
    assert views.get(timeout=SEEN_WAIT) == ()
    assert views.get(timeout=SEEN_WAIT) == (a,)  # the next keepalive writes it


def test_unreachable_etcd_fails_construction_clearly(etcd: EtcdServer) -> None:
    endpoint = etcd.endpoint
    etcd.stop()
    started = time.monotonic()
    with pytest.raises(MembershipUnavailable, match="could not be listed"):
        EtcdMembership(endpoint, timeout=0.5)
    assert time.monotonic() - started < 5.0


# ---- leases: crashes and stopped processes ----------------------------------------------------


def test_lease_expires_when_the_registering_process_is_killed(
        open_membership: Callable[[], EtcdMembership], member_process: StartMember) -> None:
    watcher = open_membership()
    crashed, survivor = member("crashed", port=11), member("survivor", port=12)
    child = member_process(crashed, TTL)
    other = member_process(survivor, TTL)
    assert watcher.wait_for(lambda v: v == (crashed, survivor), SEEN_WAIT)
    child.send(signal.SIGKILL)
    killed = time.monotonic()
    assert watcher.wait_for(lambda v: v == (survivor,), EXPIRY_WAIT), child.output()
    assert time.monotonic() - killed > TTL - 1.0  # gone by expiry, not by a revoke

    other.send(signal.SIGTERM)  # a clean exit leaves at once
    assert other.proc.wait(SEEN_WAIT) == 0, other.output()
    assert watcher.wait_for(lambda v: v == (), SEEN_WAIT)


def test_stopped_process_is_dropped_and_registers_again_when_continued(
        open_membership: Callable[[], EtcdMembership], member_process: StartMember) -> None:
    watcher = open_membership()
    views: queue.Queue[View] = queue.Queue()
    watcher.subscribe(views.put)
    sleeper = member("sleeper", port=21, zone="z9", weight=2.0)
    child = member_process(sleeper, TTL)
    assert views.get(timeout=SEEN_WAIT) == (sleeper,)
    child.send(signal.SIGSTOP)
    assert views.get(timeout=EXPIRY_WAIT) == ()
    child.send(signal.SIGCONT)
    assert views.get(timeout=SEEN_WAIT) == (sleeper,), child.output()
    # By a new lease (the old one expired), whichever of its checks noticed first.
    wait_until(lambda: "sleeper registered again" in child.output(), SEEN_WAIT, "re-register")


# ---- etcd outages ------------------------------------------------------------------------------


def test_view_survives_etcd_restarts(
        etcd: EtcdServer, open_membership: Callable[[], EtcdMembership]) -> None:
    watcher = open_membership()
    views: list[View] = []
    watcher.subscribe(views.append)
    a, b, c, d = member("a", port=1), member("b", port=2), member("c", port=3), member("d")
    first, second = open_membership(), open_membership()
    first.register(a, ttl=TTL)
    second.register(b, ttl=TTL)
    assert watcher.wait_for(lambda v: v == (a, b), SEEN_WAIT)

    # A crash: during the outage the last view stays, and the loss of etcd is reported.
    etcd.kill()
    deadline = time.monotonic() + SEEN_WAIT
    while watcher.connected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not watcher.connected
    time.sleep(TTL)  # longer than a lease: etcd's restart must not drop live members
    assert watcher.members() == (a, b)
    assert first.members() == (a, b)
    etcd.start()

    third = open_membership()
    third.register(c, ttl=TTL)  # a change made after the restart is seen
    assert watcher.wait_for(lambda v: v == (a, b, c), SEEN_WAIT)
    assert watcher.connected

    # A clean restart, as the CLI would do one.
    etcd.restart()
    fourth = open_membership()
    fourth.register(d, ttl=TTL)
    assert watcher.wait_for(lambda v: v == (a, b, c, d), SEEN_WAIT)
    second.leave()
    assert watcher.wait_for(lambda v: v == (a, c, d), SEEN_WAIT)
    assert all(a in v for v in views), views  # a's registration never lapsed
