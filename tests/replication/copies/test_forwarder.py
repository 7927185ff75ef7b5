"""One-trip replicated puts on a real cluster (etcd plus three node processes).

The writer sends each block once, to its master, over the transfer channel; the
master forwards to the owners its own membership ranks (``replication/copies/forwarder.py``,
``kvstore/node/channel_replicated.py``).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import start_node, write_auth_file

from kvstore.auth.security import salt_key
from kvstore.client import Client
from kvstore.core.errors import FailedPrecondition, InvalidArgument, KVStoreError
from replication.cluster_client import ClusterClient, QuorumNotMet
from replication.local_cluster import LocalCluster
from replication.placement.rendezvous import NodeId, Placement

# The nodes' repair keeps one copy (it only ever adds copies): a repair pass that the
# last join starts after the cluster is up must not add the copies these tests count.
NODE_ARGS = ["--dram-bytes", "64MiB", "--no-prefault", "--lease-ttl", "30",
             "--replicas", "1", "--repair-interval", "600"]


def _settled(c: LocalCluster, n: int, timeout: float = 30.0, token: str | None = None) -> None:
    """Until every node sees all ``n`` members and has finished the repair pass that the
    last join started: a pass still running would copy a block onto its master between the
    master's reserve and commit, and the writers' flags would then all be False."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = []
        for rec in c.nodes:
            with Client(rec.addr, transport="grpc", token=token) as one:
                nodes.append(one.stats()["node"])
        if all(s["cluster_members"] == n and not s["repair_pending"] for s in nodes):
            return
        assert time.monotonic() < deadline, f"the cluster never settled: {nodes}"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster.up(tmp_path / "cluster", 3, node_args=NODE_ARGS)
    try:
        _settled(c, 3)
        yield c
    finally:
        c.down(timeout=10)


@pytest.fixture
def one_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if a put takes the two-trip path (put, then Replicate)."""
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the writer asked for Replicate: a second trip")

    monkeypatch.setattr(ClusterClient, "_replicate", refuse)


def _value(i: int, n: int = 20000) -> bytes:
    return random.Random(i).randbytes(n + i % 977)


def _key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def _holders(cluster: LocalCluster, key: bytes, skip: set[str] = frozenset()) -> set[str]:
    out = set()
    for rec in cluster.nodes:
        if rec.id not in skip:
            with Client(rec.addr, transport="grpc", timeout=5) as c:
                if c.exists([key])[0]:
                    out.add(rec.id)
    return out


def _placement(c: ClusterClient) -> Placement:
    return Placement(c.members())


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_replicated_put_is_one_trip_and_lands_on_the_owners(
        cluster: LocalCluster, one_trip: None, transport: str) -> None:
    keys = [_key(i) for i in range(48)]
    values = [_value(i) for i in range(48)]
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, transport=transport) as c:
        placement = _placement(c)
        assert c.put_batch(keys, values, parents=[None, *keys[:-1]]) == [True] * 48
        assert c.put_batch(keys[:3], values[:3]) == [False] * 3  # content-addressed no-op
        for k, v in zip(keys, values, strict=True):
            assert _holders(cluster, k) == set(placement.owners(k, 2))
            assert c.get(k) == v
    for rec in cluster.nodes:  # each copy is the bytes sent, with its parent link
        with Client(rec.addr, transport="tcp") as direct:
            held = [k for k in keys if direct.exists([k])[0]]
            assert direct.get_batch(held) == [values[keys.index(k)] for k in held]


def test_a_master_forwards_to_both_other_owners_of_three_copies(
        cluster: LocalCluster, one_trip: None) -> None:
    """Each group goes to two targets: both are sent their blocks before either answer is
    read (``quorum.run_lent``), and both hold every byte."""
    keys = [_key(i) for i in range(200, 224)]
    values = [_value(i) for i in range(200, 224)]
    with Client(etcd=cluster.etcd, replicas=3, write_quorum=3, transport="tcp") as c:
        assert c.put_batch(keys, values) == [True] * len(keys)
    for rec in cluster.nodes:
        with Client(rec.addr, transport="tcp") as direct:
            assert direct.get_batch(keys) == values


def test_an_existing_block_is_still_forwarded_to_an_owner_that_lacks_it(
        cluster: LocalCluster, one_trip: None) -> None:
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, transport="tcp") as c:
        placement = _placement(c)
        key = _key(7)
        master, replica = placement.owners(key, 2)
        with Client(cluster.node(master).addr) as direct:  # only the master has it
            assert direct.put(key, _value(7)) is True
        assert _holders(cluster, key) == {master}
        assert c.put(key, _value(7)) is False
        assert _holders(cluster, key) == {master, replica}


def test_a_dead_replica_is_replaced_by_the_next_ranked_node(
        cluster: LocalCluster, one_trip: None) -> None:
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, transport="tcp") as c:
        placement = _placement(c)
        keys = [_key(i) for i in range(60)]
        dead = NodeId("node-3")
        # Still listed (the lease outlives the test): the masters' forwards to it fail.
        cluster.kill_node(dead)
        mine = [k for k in keys if placement.owners(k, 2)[1] == dead]
        assert mine
        assert c.put_batch(mine, [_value(keys.index(k)) for k in mine]) == [True] * len(mine)
        for k in mine:
            assert _holders(cluster, k, skip={dead}) == {"node-1", "node-2"}


def test_a_stopped_replica_times_out_and_is_replaced(cluster: LocalCluster,
                                                     one_trip: None) -> None:
    """SIGSTOP: the replica's socket stays open and silent. The master's forward times
    out (its peer timeout, 10 s) and the next ranked node takes the copy."""
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, transport="tcp") as c:
        placement = _placement(c)
        keys = [_key(i) for i in range(200, 300)]
        to_3 = [k for k in keys if placement.owners(k, 2)[1] == "node-3"]
        # First, each master forwards to node-3 once: its channel to node-3 is open.
        warm = [next(k for k in to_3 if placement.master(k) == m) for m in ("node-1", "node-2")]
        assert c.put_batch(warm, [b"w" * 1000] * 2) == [True, True]
        mine = [k for k in to_3 if k not in warm][:4]
        cluster.signal_node("node-3", signal.SIGSTOP)
        try:
            assert c.put_batch(mine, [_value(i) for i in range(len(mine))]) == \
                [True] * len(mine)
            for k in mine:
                assert _holders(cluster, k, skip={"node-3"}) == {"node-1", "node-2"}
        finally:
            cluster.signal_node("node-3", signal.SIGCONT)


def test_quorum_not_met_raises_and_keeps_the_master_copy(
        cluster: LocalCluster, one_trip: None) -> None:
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, transport="tcp") as c:
        placement = _placement(c)
        key = next(_key(i) for i in range(100) if placement.master(_key(i)) == "node-1")
        cluster.kill_node("node-2")
        cluster.kill_node("node-3")
        with pytest.raises(QuorumNotMet, match="1 of 2 copies"):
            c.put(key, _value(1))
        assert _holders(cluster, key, skip={"node-2", "node-3"}) == {"node-1"}
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=1, transport="tcp") as c:
        assert c.put(key, _value(1)) is False  # one copy meets a quorum of one


def test_concurrent_puts_of_one_key_from_two_writers(cluster: LocalCluster,
                                                     one_trip: None) -> None:
    keys = [_key(i) for i in range(16)]
    values = [_value(i, 1 << 20) for i in range(16)]
    writers = [Client(etcd=cluster.etcd, replicas=2, write_quorum=2, transport=t)
               for t in ("tcp", "auto")]
    barrier = threading.Barrier(2)
    results: list[list[bool]] = [[], []]

    def write(n: int) -> None:
        barrier.wait()
        results[n] = writers[n].put_batch(keys, values)

    try:
        threads = [threading.Thread(target=write, args=(n,)) for n in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        placement = _placement(writers[0])
        for i, k in enumerate(keys):
            assert results[0][i] + results[1][i] == 1  # exactly one writer stored it
            assert _holders(cluster, k) == set(placement.owners(k, 2))
            assert writers[1].get(k) == values[i]
    finally:
        for w in writers:
            w.close()


def test_a_master_killed_under_load_never_acks_fewer_than_the_quorum(
        cluster: LocalCluster) -> None:
    """A master that dies after storing but before forwarding (or while it forwards):
    the writer sees an error, or success from a stand-in master with W copies."""
    acked: list[tuple[int, bool]] = []  # (first key of a batch, started after the kill)
    errors: list[str] = []
    ready, dead, stop = threading.Event(), threading.Event(), threading.Event()

    def load() -> None:
        with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, transport="tcp") as c:
            i = 0
            while not stop.is_set():
                after = dead.is_set()
                batch = list(range(i, i + 8))
                i += 8
                try:
                    c.put_batch([_key(j) for j in batch], [_value(j, 4096) for j in batch])
                except KVStoreError as exc:
                    errors.append(str(exc))
                    continue
                acked.append((batch[0], after))
                if len(acked) >= 10:
                    ready.set()
                if sum(a for _, a in acked) >= 25:
                    stop.set()

    t = threading.Thread(target=load)
    t.start()
    try:
        assert ready.wait(60)
        cluster.kill_node("node-1")
        dead.set()
        assert stop.wait(120)
    finally:
        stop.set()
        t.join()
    late = [j for first, after in acked if after for j in range(first, first + 8)]
    assert len(late) >= 25 * 8
    for j in late:  # each batch acknowledged after the crash has two live copies
        assert len(_holders(cluster, _key(j), skip={"node-1"})) >= 2, (j, errors)


def test_a_node_outside_a_cluster_refuses_a_replicated_put(tmp_path: Path) -> None:
    node = start_node(tmp_path)
    try:
        with Client(node.addr, transport="tcp") as direct:
            with pytest.raises(FailedPrecondition, match="not a cluster member"):
                direct.put_batch_replicated([_key(1)], [_value(1)], copies=2, write_quorum=2)
            with pytest.raises(InvalidArgument, match="write_quorum"):
                direct.put_batch_replicated([_key(1)], [_value(1)], copies=2, write_quorum=3)
            # The refused payloads were skipped: the stream is still in step.
            assert direct.put(_key(1), _value(1)) is True
            assert direct.get(_key(1)) == _value(1)
        with Client(node.addr, transport="grpc") as slow, pytest.raises(FailedPrecondition):
            slow.put_batch_replicated([_key(2)], [_value(2)], copies=2, write_quorum=2)
    finally:
        node.stop()


def test_a_tenant_put_is_forwarded_with_the_peer_token_under_its_salted_keys(
        tmp_path: Path) -> None:
    tokens = {"team-a": "token-of-team-a-0123456789abcdef",
              "cluster": "token-of-the-cluster-0123456789"}
    auth = write_auth_file(tmp_path / "tenants.toml", {"team-a": tokens["team-a"]},
                           cluster=tokens["cluster"])
    peer = tmp_path / "peer-token"
    peer.write_text(tokens["cluster"] + "\n")
    # Two copies: a tenant may ask for no more than the cluster keeps (--replicas).
    args = [*NODE_ARGS, "--auth-file", str(auth), "--peer-token-file", str(peer)]
    args[args.index("--replicas") + 1] = "2"
    c = LocalCluster.up(tmp_path / "cluster", 3, node_args=args)
    try:
        _settled(c, 3, token=tokens["cluster"])
        keys = [_key(i) for i in range(12)]
        with Client(etcd=c.etcd, replicas=2, write_quorum=2, token=tokens["team-a"]) as a:
            placement = _placement(a)
            assert a.put_batch(keys, [_value(i) for i in range(12)]) == [True] * 12
            for i, k in enumerate(keys):
                held = set()
                for rec in c.nodes:  # stored salted, on the raw key's owners
                    with Client(rec.addr, token=tokens["cluster"]) as node:
                        if node.exists([salt_key("team-a", k)])[0]:
                            held.add(rec.id)
                        assert not node.exists([k])[0]
                # Owners by the raw key (as the writer ranks); repair ranks the stored,
                # salted key and may add a copy there: more copies, never fewer.
                assert held >= set(placement.owners(k, 2)), i
            c.kill_node(placement.master(keys[0]))
            assert a.get(keys[0]) == _value(0)  # the replica serves the tenant
    finally:
        c.down(timeout=10)
