"""Master/replica writes and read failover over three real node processes (static members)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess, start_node, start_static_cluster, wait_until

from kvstore.client import Client
from kvstore.core.errors import InvalidArgument, PermissionDenied, Unavailable
from kvstore.core.forwarding import BlockCopy
from kvstore.core.keys import BlockKey
from kvstore.proto import kvstore_pb2 as pb
from kvstore.remote.node_client import NodeClient, ReplicateOutcome
from kvstore.remote.pipelined import PendingPut, PendingShmPut
from replication.cluster_client import ClusterClient
from replication.copies.replicator import start_copies
from replication.placement.rendezvous import Member, NodeId, Placement


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def _value(i: int, n: int = 3000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[list[NodeProcess]]:
    nodes = start_static_cluster(tmp_path, 3, dram="32MiB")
    try:
        yield nodes
    finally:
        for n in nodes:
            n.stop(signal.SIGKILL if n.proc.poll() is None else signal.SIGTERM)


def _members(nodes: list[NodeProcess]) -> list[Member]:
    # In a static cluster a node is named by its address (as `kvstore_members` names it):
    # the nodes rank the same list when they forward a replicated put.
    return [Member(node_id=NodeId(n.addr), addr=n.addr) for n in nodes]


def _holders(nodes: list[NodeProcess], members: list[Member], key: bytes) -> set[str]:
    out = set()
    for n, m in zip(nodes, members, strict=True):
        if n.proc.poll() is None:
            with Client(n.addr, transport="grpc") as c:
                if c.exists([key])[0]:
                    out.add(m.node_id)
    return out


def test_put_lands_on_exactly_the_owners(trio: list[NodeProcess]) -> None:
    members = _members(trio)
    placement = Placement(members)
    with Client(members=members, replicas=2, write_quorum=2) as c:
        assert isinstance(c, ClusterClient)
        keys = [_key(i) for i in range(40)]
        assert c.put_batch(keys, [_value(i) for i in range(40)]) == [True] * 40
        assert c.put(keys[0], _value(0)) is False  # content-addressed: no-op
        for i, k in enumerate(keys):
            assert _holders(trio, members, k) == set(placement.owners(k, 2)), i
            assert c.get(k) == _value(i)
        assert c.exists([*keys, _key(999)]) == [True] * 40 + [False]
        assert c.prefix_match([keys[0], keys[1], _key(999), keys[2]]) == 2


def test_replicas_copy_parent_links(trio: list[NodeProcess]) -> None:
    members = _members(trio)
    with Client(members=members, replicas=3, write_quorum=3) as c:
        c.put(_key(1), b"a" * 100)
        c.put(_key(2), b"b" * 100, parent=_key(1))
    for n in trio:  # every node holds both, and knows 2 is 1's child (prefix order)
        with Client(n.addr) as direct:
            assert direct.prefix_match([_key(1), _key(2)]) == 2


def test_dead_replica_is_replaced_by_the_next_ranked_node(trio: list[NodeProcess]) -> None:
    members = _members(trio)
    placement = Placement(members)
    trio[2].stop(signal.SIGKILL)
    with Client(members=members, replicas=2, write_quorum=2) as c:
        keys = [_key(i) for i in range(30)]
        c.put_batch(keys, [_value(i) for i in range(30)])
        for i, k in enumerate(keys):
            # two copies on the two live nodes, whichever were its owners
            assert _holders(trio, members, k) == {members[0].node_id, members[1].node_id}, i
            assert c.get(k) == _value(i)
        dead_mastered = [k for k in keys if placement.master(k) == members[2].node_id]
        assert dead_mastered  # the read of these failed over from node 2
        assert c.get_batch(dead_mastered) == [_value(keys.index(k)) for k in dead_mastered]


def test_quorum_not_met_raises_and_keeps_the_copy_made(trio: list[NodeProcess]) -> None:
    members = _members(trio)
    trio[1].stop(signal.SIGKILL)
    trio[2].stop(signal.SIGKILL)
    with Client(members=members, replicas=2, write_quorum=2) as c:
        with pytest.raises(Unavailable, match="quorum"):
            c.put(_key(5), _value(5))
        assert c.get(_key(5)) == _value(5)  # the one copy stays readable
    with Client(members=members, replicas=2, write_quorum=1) as c:
        assert c.put(_key(6), _value(6)) is True


def test_reads_fail_over_and_report_when_no_holder_answers(trio: list[NodeProcess]) -> None:
    members = _members(trio)
    with Client(members=members, replicas=2, write_quorum=2) as c:
        c.put_batch([_key(i) for i in range(20)], [_value(i) for i in range(20)])
        os.kill(trio[0].proc.pid, signal.SIGKILL)
        trio[0].proc.wait()
        assert c.get_batch([_key(i) for i in range(20)]) == [_value(i) for i in range(20)]
        buf = bytearray(4000)
        assert c.get_into(_key(3), buf) == 3000 and bytes(buf[:3000]) == _value(3)
        for n in trio[1:]:
            n.stop(signal.SIGKILL)
        with pytest.raises(Unavailable, match="no holder"):
            c.get(_key(1))


def test_holders_names_nodes_and_tiers(trio: list[NodeProcess]) -> None:
    members = _members(trio)
    placement = Placement(members)
    with Client(members=members, replicas=2) as c:
        c.put(_key(8), _value(8))
        holders = c.holders([_key(8), _key(9)])
    assert {h.node_id for h in holders[0]} == set(placement.owners(_key(8), 2))
    assert {h.tier for h in holders[0]} == {"dram"}
    assert holders[1] == []


def test_replicate_rpc_rejects_bad_requests_and_reports_missing(trio: list[NodeProcess]) -> None:
    stub_client = Client(trio[0].addr, transport="grpc")
    with stub_client:
        stub_client.put(_key(1), b"x" * 10)
        assert stub_client.replicate([_key(1), _key(2)], [trio[1].addr], copies=2,
                                     write_quorum=2) == ReplicateOutcome(
            copies=2, missing=[_key(2)], stored_on=[trio[1].addr], failed=[])
        for bad in (pb.ReplicateRequest(keys=[_key(1)], targets=["nope"], copies=2,
                                        write_quorum=2),
                    pb.ReplicateRequest(keys=[_key(1)], targets=[trio[1].addr], copies=2,
                                        write_quorum=3),
                    pb.ReplicateRequest(keys=[b"short"], targets=[], copies=1),
                    pb.ReplicateRequest(keys=[_key(1)], targets=[trio[1].addr], copies=2,
                                        write_quorum=2, orders=[pb.TargetOrder(index=[1])]),
                    pb.ReplicateRequest(keys=[_key(1), _key(2)], targets=[trio[1].addr],
                                        copies=2, write_quorum=2,
                                        orders=[pb.TargetOrder(index=[0])])):
            with pytest.raises(InvalidArgument):
                stub_client._grpc("Replicate", bad)
        reply = stub_client.replicate([_key(1)], ["127.0.0.1:1", trio[2].addr], copies=2,
                                      write_quorum=2)
        assert reply.copies == 2 and reply.stored_on == [trio[2].addr]
        assert len(reply.failed) == 1 and reply.failed[0].startswith("127.0.0.1:1: ")
    with Client(trio[2].addr) as c:
        assert c.get(_key(1)) == b"x" * 10
    # per-key orders: key 3 goes to node 1 only, key 4 to node 2 only, in one call
    with Client(trio[0].addr, transport="grpc") as c:
        c.put_batch([_key(3), _key(4)], [b"3", b"4"])
        reply = c.replicate([_key(3), _key(4)], [trio[1].addr, trio[2].addr], copies=2,
                            write_quorum=2, orders=[[0], [1]])
        assert reply == ReplicateOutcome(copies=2, missing=[], stored_on=[], failed=[])
    with Client(trio[1].addr) as c1, Client(trio[2].addr) as c2:
        assert c1.exists([_key(3), _key(4)]) == [True, False]
        assert c2.exists([_key(3), _key(4)]) == [False, True]


def test_cluster_options_need_a_cluster() -> None:
    with pytest.raises(InvalidArgument, match="replicas"):
        Client("127.0.0.1:1", replicas=2)
    with pytest.raises(InvalidArgument, match="exactly one"):
        Client(members=[], etcd="127.0.0.1:2379")
    with pytest.raises(InvalidArgument, match="write_quorum"):
        Client(members=[Member(node_id=NodeId("a"), addr="127.0.0.1:1")], replicas=2,
               write_quorum=3)
    with Client(members=[]) as c, pytest.raises(Unavailable, match="no live"):
        c.get(_key(1))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _hits(nodes: list[NodeProcess]) -> list[int]:
    out = []
    for n in nodes:
        with Client(n.addr, transport="grpc") as c:
            out.append(c.stats()["tiers"]["dram"]["hits"])
    return out


def test_hot_block_fans_out_spreads_reads_and_is_dropped_when_cool(
        trio: list[NodeProcess]) -> None:
    members = _members(trio)
    placement = Placement(members)
    clock = FakeClock()
    hot, cold = _key(1), _key(2)
    with Client(members=members, replicas=1, hot_reads_per_s=5.0, fanout=2,
                clock=clock) as c:
        c.put(hot, b"h" * 1000)
        c.put(cold, b"c" * 1000)
        for _ in range(7):  # 7 reads at one instant: rate 7 * ln2 / 10 s = 0.49/s: cold
            assert c.get(hot) == b"h" * 1000
        assert c.fanned_out() == {}
        for _ in range(70):  # 77 reads: 5.3/s >= 5/s: hot from the 73rd read on
            c.get(hot)
        wait_until(lambda: hot in c.fanned_out(), timeout=10, what="fan-out done")
        assert c.fanned_out()[hot] == placement.rank(hot)[1:]
        assert _holders(trio, members, hot) == {m.node_id for m in members}
        assert _holders(trio, members, cold) == {placement.master(cold)}
        before = _hits(trio)
        for _ in range(30):
            assert c.get(hot) == b"h" * 1000
        after = _hits(trio)
        assert [a - b for a, b in zip(after, before, strict=True)] == [10, 10, 10]
        clock.now += 120.0  # twelve half-lives without reads: cold again
        c.get(cold)  # any read runs the cool-down check
        wait_until(lambda: _holders(trio, members, hot) == {placement.master(hot)},
                   timeout=10, what="extra copies dropped")
        assert c.fanned_out() == {}


def test_start_copies_reads_the_answers_already_due_before_a_failed_send_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first batch (no tenant) is sent; the second's client cannot be had. The error
    propagates only once the first batch's answer is read: its block is stored and its
    connection is in step for the next call."""
    steps: list[str] = []
    finish = PendingPut.finish

    def logged_finish(self: PendingPut) -> tuple[list[bool], int, list[str]]:
        steps.append("answer read")
        return finish(self)

    monkeypatch.setattr(PendingPut, "finish", logged_finish)
    node = start_node(tmp_path, dram="32MiB")
    try:
        with NodeClient(node.addr, transport="tcp") as client:
            def peer(owner: str | None) -> NodeClient:
                steps.append(f"client for {owner}")
                if owner is not None:
                    raise PermissionDenied(f"no client charging {owner}")
                return client

            blocks = [BlockCopy(key=BlockKey(_key(i)), place=BlockKey(_key(i)), parent=None,
                                pin=False, retain_s=0.0, owner=owner, value=memoryview(_value(i)))
                      for i, owner in ((1, None), (2, "tenant"))]
            with pytest.raises(PermissionDenied, match="charging tenant"):
                start_copies(peer, blocks)
            assert steps == ["client for None", "client for tenant", "answer read"]
            assert client.exists([_key(1), _key(2)]) == [True, False]
            assert client.get(_key(1)) == _value(1)
    finally:
        node.stop()


def test_start_copies_to_a_same_host_peer_reads_no_value_once_it_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a peer's shared memory the copy is reserved, then filled before
    ``start_copies`` returns; only the COMMITs' answers are read later. The source's
    buffers, overwritten in between (a lease ended, the space reused), change nothing."""
    advanced: list[int] = []
    advance = PendingShmPut.advance

    def logged_advance(self: PendingShmPut) -> None:
        advanced.append(len(self.batch.keys))
        advance(self)

    monkeypatch.setattr(PendingShmPut, "advance", logged_advance)
    node = start_node(tmp_path, dram="32MiB")
    try:
        with NodeClient(node.addr, transport="shm") as client:
            client.exists([_key(0)])  # connects: the channel is negotiated
            assert client.maps_node_memory
            sources = [bytearray(_value(i, 48 << 10)) for i in (1, 2)]
            blocks = [BlockCopy(key=BlockKey(_key(i)), place=BlockKey(_key(i)), parent=None,
                                pin=False, retain_s=0.0, owner=None, value=memoryview(src))
                      for i, src in zip((1, 2), sources, strict=True)]
            finish = start_copies(lambda owner: client, blocks)
            assert advanced == [2]  # one batch, filled before the return
            for src in sources:
                src[:] = bytes(len(src))
            finish()
            assert client.get_batch([_key(1), _key(2)]) == [_value(1, 48 << 10),
                                                            _value(2, 48 << 10)]
    finally:
        node.stop()
