"""retain_s on a real cluster (etcd plus three node processes): every copy is retained,
through the one-trip replicated put (RPUT over TCP, RESERVE + RCOMMIT over shared
memory) and through the two-trip path (put, then ``Replicate``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from replication.local_cluster import LocalCluster
from replication.placement.rendezvous import Placement

NODE_ARGS = ["--dram-bytes", "64MiB", "--no-prefault", "--lease-ttl", "30",
             "--replicas", "1", "--repair-interval", "600"]
N = 12
SIZE = 70_000  # over SHM_PUT_MIN_BYTES per batch: "auto" takes RESERVE + RCOMMIT


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster.up(Path(tmp_path_factory.mktemp("cluster")) / "c", 3,
                        node_args=NODE_ARGS)
    try:
        yield c
    finally:
        c.down(timeout=10)


def retained(cluster: LocalCluster) -> dict[str, tuple[int, int]]:
    out = {}
    for rec in cluster.nodes:
        with Client(rec.addr, transport="grpc", timeout=5) as c:
            node = c.stats()["node"]
            out[rec.id] = (node["retained_blocks"], node["retained_bytes"])
    return out


@pytest.mark.parametrize("transport", ["tcp", "auto", "grpc"])
def test_every_copy_of_a_retained_put_is_retained(cluster: LocalCluster,
                                                  transport: str) -> None:
    before = retained(cluster)
    keys = [os.urandom(16) for _ in range(N)]
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, transport=transport) as c:
        owners = Placement(c.members())
        assert c.put_batch(keys, [os.urandom(SIZE) for _ in keys], retain_s=300) == [True] * N
        plain = os.urandom(16)
        assert c.put(plain, os.urandom(SIZE)) is True  # no retention: on no node
    want = {rec.id: 0 for rec in cluster.nodes}
    for k in keys:
        for node_id in owners.owners(k, 2):
            want[node_id] += 1
    after = retained(cluster)
    assert {n: after[n][0] - before[n][0] for n in want} == want
    assert {n: after[n][1] - before[n][1] for n in want} == {n: SIZE * w
                                                             for n, w in want.items()}
