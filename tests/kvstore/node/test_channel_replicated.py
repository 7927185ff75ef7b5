"""Cut-through forwarding of replicated puts on a real cluster (etcd plus three node
processes): the master forwards the parts of a request that have landed while the rest is
still arriving, and still answers only once ``write_quorum`` copies of every block exist."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.node.channel_replicated import CUT_THROUGH_BYTES
from kvstore.protocol import wire
from kvstore.protocol.wire import HEADER, Op
from kvstore.remote.node_client import NodeClient
from replication.cluster_client import QuorumNotMet
from replication.local_cluster import LocalCluster
from replication.placement.rendezvous import NodeId, Placement

# Repair keeps its hands off (one copy, a long interval): only forwards make copies here.
NODE_ARGS = ["--dram-bytes", "64MiB", "--no-prefault", "--lease-ttl", "30",
             "--replicas", "1", "--repair-interval", "600"]
BLOCK = CUT_THROUGH_BYTES  # each block is a part of its own in a 4-block request


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster.up(tmp_path / "cluster", 3, node_args=NODE_ARGS)
    try:
        deadline = time.monotonic() + 30
        while True:  # every node sees all three members, no repair pass running
            stats = []
            for rec in c.nodes:
                with Client(rec.addr, transport="grpc") as one:
                    stats.append(one.stats()["node"])
            if all(s["cluster_members"] == 3 and not s["repair_pending"] for s in stats):
                break
            assert time.monotonic() < deadline, f"the cluster never settled: {stats}"
            time.sleep(0.1)
        yield c
    finally:
        for rec in c.nodes:
            c.signal_node(rec.id, signal.SIGCONT)
        c.down(timeout=10)


def _holds(cluster: LocalCluster, node: str, keys: list[bytes]) -> list[bool]:
    with NodeClient(cluster.node(node).addr, transport="grpc", timeout=5) as c:
        return c.exists(keys)


def _keys(placement: Placement, master: str, replica: str, n: int) -> list[bytes]:
    """``n`` keys whose owners (2 copies) are ``master`` then ``replica``."""
    out = []
    for i in range(1, 100_000):
        k = i.to_bytes(16, "big")
        if placement.owners(k, 2) == [NodeId(master), NodeId(replica)]:
            out.append(k)
            if len(out) == n:
                return out
    raise AssertionError("no such keys")


@pytest.mark.slow
def test_the_replica_has_the_first_parts_before_the_request_has_fully_arrived(
        cluster: LocalCluster) -> None:
    with Client(etcd=cluster.etcd, replicas=2) as c:
        placement = Placement(c.members())
    keys = _keys(placement, "node-1", "node-2", 4)
    values = [os.urandom(BLOCK) for _ in keys]
    meta = wire.pack_rput_items(keys, [BLOCK] * 4, [None] * 4, False, 2, 2)
    with NodeClient(cluster.node("node-1").addr, transport="tcp") as master:
        master._resolve()
        conn = master._checkout()
        # The request's first two blocks only: the master has a part (block 0) to forward.
        wire.send_buffers(conn.sock, [HEADER.pack(Op.RPUT, 4, len(meta)) + meta,
                                      memoryview(values[0]), memoryview(values[1])])
        deadline = time.monotonic() + 20
        while not _holds(cluster, "node-2", keys[:1])[0]:
            # The barrier: blocks 2 and 3 are not sent until the replica holds block 0.
            assert time.monotonic() < deadline, "nothing was forwarded before the rest came"
            time.sleep(0.05)
        assert _holds(cluster, "node-1", keys[2:]) == [False, False]  # still arriving
        wire.send_buffers(conn.sock, [memoryview(values[2]), memoryview(values[3])])
        flags, copies, failed = conn.put_reply(4, replicated=True)
        assert (flags, copies, failed) == ([True] * 4, 2, "")
        master._checkin(conn)
    for node in ("node-1", "node-2"):
        with NodeClient(cluster.node(node).addr, transport="tcp") as direct:
            assert direct.get_batch(keys) == values
    assert _holds(cluster, "node-3", keys) == [False] * 4


@pytest.mark.slow
def test_a_stopped_replica_still_holds_back_the_answer_until_the_quorum_exists(
        cluster: LocalCluster) -> None:
    """SIGSTOP: the replica's socket stays open and silent. Each part's forward to it
    times out (the peer timeout) and the next ranked node takes the copy; the writer's
    answer waits for that: two copies of every block, none of them on the stopped node."""
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, transport="tcp") as c:
        placement = Placement(c.members())
        keys = _keys(placement, "node-1", "node-3", 5)
        warm, mine = keys[0], keys[1:]
        assert c.put(warm, b"w" * 1000) is True  # node-1's channel to node-3 is open
        cluster.signal_node("node-3", signal.SIGSTOP)
        try:
            values = [os.urandom(BLOCK) for _ in mine]
            assert c.put_batch(mine, values) == [True] * 4
            assert _holds(cluster, "node-1", mine) == [True] * 4
            assert _holds(cluster, "node-2", mine) == [True] * 4
        finally:
            cluster.signal_node("node-3", signal.SIGCONT)


@pytest.mark.slow
def test_below_the_quorum_a_multi_part_put_raises(cluster: LocalCluster) -> None:
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, transport="tcp") as c:
        placement = Placement(c.members())
        keys = _keys(placement, "node-1", "node-2", 4)
        cluster.kill_node("node-2")
        cluster.kill_node("node-3")  # still listed (the lease outlives the test)
        with pytest.raises(QuorumNotMet, match="1 of 2 copies"):
            c.put_batch(keys, [os.urandom(BLOCK) for _ in keys])
        assert _holds(cluster, "node-1", keys) == [True] * 4  # the master's copies stay
