"""A tenant's copies on a real cluster (etcd and node processes with an auth file): capped
at the cluster's ``--replicas``, and every copy charged to the tenant on the node that holds
it, whichever path made it (a forwarded one-trip put, Replicate, repair).

The accounts are checked exactly: on every node, the tenant's ``namespace_bytes`` in Stats
(the cluster's view and the tenant's own) is the sum of the sizes of the tenant's blocks
that node holds.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
from conftest import write_auth_file

from kvstore.auth.security import salt_key
from kvstore.client import Client
from kvstore.core.errors import PermissionDenied, ResourceExhausted
from kvstore.proto import kvstore_pb2 as pb
from replication.cluster_client import ClusterClient, QuorumNotMet
from replication.local_cluster import LocalCluster
from replication.placement.rendezvous import Placement

KiB = 1 << 10
TOKENS = {"team-a": "tenant-copies-team-a-0123456789", "team-b": "tenant-copies-team-b-012345",
          "cluster": "tenant-copies-cluster-0123456789"}
B_BLOCK = 64 * KiB
B_QUOTA = 4 * B_BLOCK  # team-b fills a node with four blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("tenant-copies")
    auth = write_auth_file(tmp / "tenants.toml",
                           {"team-a": TOKENS["team-a"], "team-b": TOKENS["team-b"]},
                           cluster=TOKENS["cluster"],
                           quotas={"team-a": "16MiB", "team-b": B_QUOTA})
    peer = tmp / "peer-token"
    peer.write_text(TOKENS["cluster"] + "\n")
    # Repair keeps two copies but runs only after membership changes (the interval is
    # longer than the module): the tests that count copies see only the ones they made.
    c = LocalCluster.up(tmp / "cluster", 3, node_args=[
        "--dram-bytes", "64MiB", "--no-prefault", "--lease-ttl", "30", "--replicas", "2",
        "--repair-interval", "600", "--auth-file", str(auth), "--peer-token-file", str(peer)])
    try:
        _settled(c)
        yield c
    finally:
        c.down(timeout=10)


def _settled(c: LocalCluster, passes: dict[str, int] | None = None,
             timeout: float = 30.0) -> None:
    """Until every node sees every member and no repair pass is pending or running; with
    ``passes`` (each node's ``repair_passes`` before a change), until each node finished a
    pass after it (seeing a new member comes a moment before its pass is pending)."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = {rec.id: _stats(rec.addr) for rec in c.nodes}
        if all(s["cluster_members"] == len(c.nodes) and not s["repair_pending"]
               and s["repair_passes"] > (passes or {}).get(n, -1) for n, s in nodes.items()):
            return
        assert time.monotonic() < deadline, f"the cluster never settled: {nodes}"
        time.sleep(0.05)


def _stats(addr: str, token: str = TOKENS["cluster"]) -> dict:
    with Client(addr, transport="grpc", token=token) as c:
        return c.stats()["node"]


def _tenant(c: LocalCluster, name: str, replicas: int, **kw: object) -> ClusterClient:
    return Client(etcd=c.etcd, replicas=replicas, token=TOKENS[name], **kw)  # type: ignore[return-value]


def _key(tag: str, i: int) -> bytes:
    return f"{tag}-{i}".encode().ljust(16, b".")[:16]


def _value(i: int, n: int) -> bytes:
    return random.Random(i).randbytes(n)


def _holders(c: LocalCluster, tenant: str, key: bytes) -> set[str]:
    stored = salt_key(tenant, key)
    out = set()
    for rec in c.nodes:
        with Client(rec.addr, transport="grpc", token=TOKENS["cluster"]) as node:
            if node.exists([stored])[0]:
                out.add(rec.id)
    return out


@pytest.fixture(scope="module")
def ledger() -> dict[str, dict[bytes, int]]:
    """Every block each tenant stored on the module's cluster (raw key -> size), kept by
    the tests as they put and remove: what the nodes' accounts must add up to."""
    return {"team-a": {}, "team-b": {}}


def _check_accounts(c: LocalCluster, tenant: str, sizes: dict[bytes, int]) -> dict[str, int]:
    """Each node's charge to ``tenant`` is exactly the bytes of its blocks there (``sizes``:
    every key the tenant stored, raw, and its size); returns the charges by node."""
    charged = {}
    for rec in c.nodes:
        with Client(rec.addr, transport="grpc", token=TOKENS["cluster"]) as node:
            held = node.exists([salt_key(tenant, k) for k in sizes])
        want = sum(n for n, h in zip(sizes.values(), held, strict=True) if h)
        seen = _stats(rec.addr).get("namespace_bytes", {}).get(tenant, 0)
        own = _stats(rec.addr, TOKENS[tenant]).get("namespace_bytes", {}).get(tenant, 0)
        assert (rec.id, seen, own) == (rec.id, want, want)
        charged[rec.id] = want
    return charged


def _mastered(p: Placement, tag: str, master: str, n: int) -> list[bytes]:
    """``n`` keys whose top-ranked node is ``master``."""
    return [k for k in (_key(tag, i) for i in range(10_000)) if p.master(k) == master][:n]


def test_a_tenant_may_not_ask_for_more_copies_than_the_cluster_keeps(
        cluster: LocalCluster, ledger: dict[str, dict[bytes, int]]) -> None:
    key, value = _key("cap", 0), _value(0, 10_000)
    with _tenant(cluster, "team-a", 3) as greedy, pytest.raises(PermissionDenied) as refused:
        greedy.put(key, value)
    # Both numbers, so the writer knows what to change.
    assert "3 copies" in str(refused.value) and "--replicas 2" in str(refused.value)
    assert _holders(cluster, "team-a", key) == set()  # refused before anything was stored
    with _tenant(cluster, "team-a", 2) as fair:
        assert fair.put(key, value) is True
    ledger["team-a"][key] = len(value)
    assert len(_holders(cluster, "team-a", key)) == 2
    _check_accounts(cluster, "team-a", ledger["team-a"])
    # The cap is the tenants': the cluster role (operators, nodes) may ask for more.
    with Client(etcd=cluster.etcd, replicas=3, token=TOKENS["cluster"]) as operator:
        assert operator.put(_key("cap", 1), value) is True
    held = []
    for rec in cluster.nodes:
        with Client(rec.addr, transport="grpc", token=TOKENS["cluster"]) as node:
            held += node.exists([_key("cap", 1)])
    assert held == [True] * 3


def test_forwarded_copies_are_charged_to_the_tenant_on_every_node(
        cluster: LocalCluster, ledger: dict[str, dict[bytes, int]]) -> None:
    keys = [_key("fwd", i) for i in range(24)]
    values = [_value(i, 4000 + 1717 * i) for i in range(24)]
    mine = dict(zip(keys, map(len, values), strict=True))
    before = _check_accounts(cluster, "team-a", ledger["team-a"])
    with _tenant(cluster, "team-a", 2) as a:
        assert a.put_batch(keys, values) == [True] * 24
        ledger["team-a"] |= mine
        charged = _check_accounts(cluster, "team-a", ledger["team-a"])
        # Every block has its two copies, each charged where it is.
        assert sum(charged.values()) - sum(before.values()) == 2 * sum(mine.values())
        for k in keys[::2]:
            assert a.remove(k) is True
            del ledger["team-a"][k]
    charged = _check_accounts(cluster, "team-a", ledger["team-a"])
    assert sum(charged.values()) - sum(before.values()) == 2 * sum(mine[k] for k in keys[1::2])


def test_replicate_copies_are_charged_to_the_tenant_that_wrote_the_block(
        cluster: LocalCluster, ledger: dict[str, dict[bytes, int]]) -> None:
    with _tenant(cluster, "team-a", 1) as a:
        (key,) = _mastered(Placement(a.members()), "rep", "node-1", 1)
        assert a.put(key, _value(1, 30_000)) is True
    ledger["team-a"][key] = 30_000
    assert _holders(cluster, "team-a", key) == {"node-1"}
    target = cluster.node("node-2").addr
    with Client(cluster.node("node-1").addr, transport="grpc", token=TOKENS["cluster"]) as m:
        reply = m._grpc("Replicate", pb.ReplicateRequest(
            keys=[salt_key("team-a", key)], targets=[target], copies=2, write_quorum=2))
    assert reply.copies == 2 and list(reply.stored_on) == [target]
    assert _holders(cluster, "team-a", key) == {"node-1", "node-2"}
    _check_accounts(cluster, "team-a", ledger["team-a"])


def test_a_copy_past_the_tenants_quota_on_a_receiving_node_is_refused(
        cluster: LocalCluster, ledger: dict[str, dict[bytes, int]]) -> None:
    sizes = ledger["team-b"]
    with _tenant(cluster, "team-b", 1) as one:
        placement = Placement(one.members())
        # node-2 and node-3 hold team-b's whole quota there, one copy each.
        for node in ("node-2", "node-3"):
            keys = _mastered(placement, f"full-{node}", node, 5)
            values = [_value(i, B_BLOCK) for i in range(4)]
            assert one.put_batch(keys[:4], values) == [True] * 4
            sizes |= dict.fromkeys(keys[:4], B_BLOCK)
            with pytest.raises(ResourceExhausted):  # the master's own quota check
                one.put(keys[4], _value(4, B_BLOCK))
    assert _check_accounts(cluster, "team-b", sizes) == {
        "node-1": 0, "node-2": B_QUOTA, "node-3": B_QUOTA}
    (key,) = _mastered(placement, "over", "node-1", 1)
    # node-1 stores it; its copy is refused on node-2, then on node-3 (the next ranked):
    # both are at team-b's quota. The writer hears why, and the copy made stays.
    with _tenant(cluster, "team-b", 2) as two, pytest.raises(QuorumNotMet) as refused:
        two.put(key, _value(9, B_BLOCK))
    assert str(refused.value).count("over its quota") == 2
    assert _holders(cluster, "team-b", key) == {"node-1"}
    sizes[key] = B_BLOCK
    assert _check_accounts(cluster, "team-b", sizes) == {
        "node-1": B_BLOCK, "node-2": B_QUOTA, "node-3": B_QUOTA}


def test_only_the_cluster_role_names_the_tenant_a_copy_is_charged_to(
        cluster: LocalCluster) -> None:
    addr = cluster.node("node-1").addr
    key = _key("charge", 0)
    for transport in ("grpc", "tcp"):
        with (Client(addr, transport=transport, token=TOKENS["team-a"],
                     charge_to="team-b") as a, pytest.raises(PermissionDenied)):
            a.put(key, b"x" * 1000)
    stored = salt_key("team-b", key)  # a copy carries the key as stored on its source
    before = _stats(addr)["namespace_bytes"]
    with Client(addr, transport="tcp", token=TOKENS["cluster"], charge_to="team-b") as peer:
        assert peer.put(stored, b"y" * 1000) is True
    after = _stats(addr)["namespace_bytes"]
    assert after.get("team-b", 0) - before.get("team-b", 0) == 1000
    # A peer that names no tenant (a node from before the charge existed) still copies,
    # as before: its copy is charged to nobody.
    with Client(addr, transport="grpc", token=TOKENS["cluster"]) as old:
        unowned = salt_key("team-b", _key("charge", 1))
        assert old.put(unowned, b"z" * 1000) is True
        assert _stats(addr)["namespace_bytes"] == after
        assert old.remove(stored) and old.remove(unowned)  # the next test counts team-b
    assert _stats(addr)["namespace_bytes"] == before


def test_repair_copies_are_charged_to_the_tenant_that_wrote_the_block(
        cluster: LocalCluster, ledger: dict[str, dict[bytes, int]]) -> None:
    """Runs last: a fourth node joins, and its join starts the repair passes."""
    keys = [_key("repair", i) for i in range(16)]
    values = [_value(100 + i, 20_000 + 333 * i) for i in range(16)]
    with _tenant(cluster, "team-a", 1) as a:
        assert a.put_batch(keys, values) == [True] * 16
    ledger["team-a"] |= dict(zip(keys, map(len, values), strict=True))
    assert all(len(_holders(cluster, "team-a", k)) == 1 for k in keys)
    passes = {rec.id: _stats(rec.addr)["repair_passes"] for rec in cluster.nodes}
    cluster.start_node("node-4")
    _settled(cluster, passes)
    assert any(len(_holders(cluster, "team-a", k)) == 2 for k in keys)  # --replicas 2
    charged = _check_accounts(cluster, "team-a", ledger["team-a"])
    assert charged["node-4"] > 0  # node-4 holds only copies that repair made
    _check_accounts(cluster, "team-b", ledger["team-b"])
