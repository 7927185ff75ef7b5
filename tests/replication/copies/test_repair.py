"""Repair passes over in-process nodes: who pushes, what lands where, and the rate limit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import free_port

from kvstore.client import Client
from kvstore.node.semantics import Node, NodeSettings
from kvstore.server import NodeServer
from replication.copies.peers import PeerPool
from replication.copies.ratelimit import TokenBucket
from replication.copies.repair import RepairWorker
from replication.membership import StaticMembership
from replication.placement.rendezvous import Member, NodeId, Placement

MiB = 1 << 20
IDS = ["a", "b", "c"]


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@pytest.fixture
def cluster() -> Iterator[dict[str, tuple[Node, NodeServer]]]:
    out = {}
    for nid in IDS:
        node = Node(NodeSettings(dram_bytes=16 * MiB, prefault=False))
        server = NodeServer(node, listen=f"127.0.0.1:{free_port()}", grpc_workers=4)
        server.start()
        out[nid] = (node, server)
    try:
        yield out
    finally:
        for node, server in out.values():
            server.stop(grace=1.0)
            node.close()


def _members(cluster: dict[str, tuple[Node, NodeServer]]) -> list[Member]:
    return [Member(node_id=NodeId(n), addr=cluster[n][1].addresses.grpc) for n in IDS]


def _holders(cluster: dict[str, tuple[Node, NodeServer]], key: bytes) -> set[str]:
    return {n for n in IDS if cluster[n][0].exists([key])[0]}


def _worker(cluster: dict[str, tuple[Node, NodeServer]], nid: str, peers: PeerPool,
            **kw: object) -> RepairWorker:
    return RepairWorker(cluster[nid][0], StaticMembership(_members(cluster)), self_id=nid,
                        peers=peers, replicas=2, **kw)  # type: ignore[arg-type]


def test_a_pass_copies_each_block_to_its_missing_owners(cluster) -> None:
    placement = Placement(_members(cluster))
    a = cluster["a"][0]
    keys = [_key(i) for i in range(60)]
    for i, k in enumerate(keys):
        a.put(k, memoryview(bytes([i]) * 1000))
    with PeerPool() as peers:
        worker = _worker(cluster, "a", peers)
        assert worker.run_pass() is True
        stats = worker.stats()
    for k in keys:
        assert _holders(cluster, k) == set(placement.owners(k, 2)) | {"a"}
    pushed = sum(len(set(placement.owners(k, 2)) - {"a"}) for k in keys)
    assert stats["repaired_blocks"] == pushed
    assert stats["repaired_bytes"] == pushed * 1000
    assert stats["repair_backlog"] == 0 and stats["repair_passes"] == 1
    for i, k in enumerate(keys):  # the copies are the bytes
        for n in _holders(cluster, k):
            assert cluster[n][0].get(k) == bytes([i]) * 1000


def test_only_the_first_owner_holding_a_block_pushes_it(cluster) -> None:
    placement = Placement(_members(cluster))
    # keys whose owners are (b, c) in that order, held by the non-owner a and by c
    keys = [k for k in (_key(i) for i in range(400)) if placement.owners(k, 2) == ["b", "c"]]
    keys = keys[:10]
    assert len(keys) == 10
    for k in keys:
        cluster["a"][0].put(k, memoryview(b"v" * 10))
        cluster["c"][0].put(k, memoryview(b"v" * 10))
    with PeerPool() as peers:
        wa = _worker(cluster, "a", peers)
        wa.run_pass()  # a is no owner and c (an owner) holds them: a leaves them to c
        assert wa.stats()["repaired_blocks"] == 0
        assert all(_holders(cluster, k) == {"a", "c"} for k in keys)
        wc = _worker(cluster, "c", peers)
        wc.run_pass()  # c is the first owner holding them: it pushes to b
        assert wc.stats()["repaired_blocks"] == 10
    assert all(_holders(cluster, k) == {"a", "b", "c"} for k in keys)


def test_pushes_are_paced_by_the_token_bucket(cluster) -> None:
    placement = Placement(_members(cluster))
    keys = [k for k in (_key(i) for i in range(400)) if placement.owners(k, 2)[0] == "a"][:64]
    for k in keys:
        cluster["a"][0].put(k, memoryview(b"z" * 4096))
    t = FakeTime()
    # a burst as large as the largest push (32 blocks), so no push goes into debt
    bucket = TokenBucket(rate=64 * 1024, burst=32 * 4096, clock=t.clock, sleep=t.sleep)
    with PeerPool() as peers:
        worker = _worker(cluster, "a", peers, bucket=bucket)
        worker.run_pass()
        assert worker.stats()["repaired_bytes"] == 64 * 4096
    # 256 KiB through a 64 KiB/s bucket that starts with 128 KiB: (256 - 128) / 64 s asleep
    assert sum(t.slept) == pytest.approx(2.0)


def test_a_node_outside_the_membership_does_not_repair(cluster) -> None:
    a = cluster["a"][0]
    a.put(_key(1), memoryview(b"x"))
    members = [m for m in _members(cluster) if m.node_id != "a"]
    with PeerPool() as peers:
        worker = RepairWorker(a, StaticMembership(members), self_id="a", peers=peers,
                              replicas=2)
        assert worker.run_pass() is True
        assert worker.stats()["repair_passes"] == 0
    assert _holders(cluster, _key(1)) == {"a"}


def test_an_unreachable_owner_is_skipped_and_counted(cluster) -> None:
    members = _members(cluster)
    members[1] = Member(node_id=NodeId("b"), addr=f"127.0.0.1:{free_port()}")  # nobody there
    placement = Placement(members)
    keys = [k for k in (_key(i) for i in range(400)) if placement.owners(k, 2) == ["a", "b"]]
    cluster["a"][0].put(keys[0], memoryview(b"y"))
    with PeerPool(timeout=2.0) as peers:
        worker = RepairWorker(cluster["a"][0], StaticMembership(members), self_id="a",
                              peers=peers, replicas=2)
        assert worker.run_pass() is True
        assert worker.stats()["repair_failures"] == 1
        assert worker.stats()["repaired_blocks"] == 0
    with Client(cluster["a"][1].addresses.grpc) as c:
        assert c.get(keys[0]) == b"y"
