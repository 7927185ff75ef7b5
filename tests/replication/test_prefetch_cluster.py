"""The cluster client's prefetch on a static cluster of two node processes: each key is
asked of its holder, the first of its read candidates, so the copy made hot is the one a
get reads; a key nobody holds is missing; the key bound holds for the whole call.

Each node has 4 MiB of DRAM over an SSD tier, high watermark 1.0, low 0.75 (see
tests/kvstore/node/test_prefetch_node.py): a put into a full DRAM demotes exactly its 5
oldest blocks, so where each copy is stays exact.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess, free_port, start_node

from kvstore import Client, InvalidArgument
from kvstore.core.prefetch import MAX_PREFETCH_KEYS
from replication.placement.rendezvous import Member, NodeId, Placement

BLOCK = 256 << 10


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[NodeProcess]]:
    """Two nodes that know each other from ``--members``, each with its own SSD file."""
    ports = [free_port() for _ in range(2)]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    nodes: list[NodeProcess] = []
    try:
        for p in ports:
            nodes.append(start_node(tmp_path, "--members", peers, "--ssd-path",
                                    str(tmp_path / f"kv-{p}.img"), "--ssd-bytes", "64MiB",
                                    "--ssd-io", "python", "--high-watermark", "1.0",
                                    "--low-watermark", "0.75", dram="4MiB", port=p))
        yield nodes
    finally:
        for n in nodes:
            assert n.stop() == 0, n.output()


def members(nodes: list[NodeProcess]) -> list[Member]:
    return [Member(node_id=NodeId(n.addr), addr=n.addr) for n in nodes]


def where(nodes: list[NodeProcess], keys: list[bytes]) -> dict[str, list[str | None]]:
    out = {}
    for n in nodes:
        with Client(n.addr, transport="grpc") as c:
            out[n.addr] = c.locate(keys)
    return out


def test_each_key_is_prefetched_on_the_holder_a_read_goes_to(
        pair: list[NodeProcess]) -> None:
    with Client(members=members(pair), replicas=2, transport="tcp") as c:
        keys = [os.urandom(16) for _ in range(17)]  # both copies on every node: 17 each
        for k in keys:
            assert c.put(k, os.urandom(BLOCK))
        cold = keys[:5]
        assert where(pair, cold) == {n.addr: ["ssd"] * 5 for n in pair}
        stray = os.urandom(16)
        assert c.prefetch([*cold, stray], wait=True) == ["promoted"] * 5 + ["missing"]
        first = {k: Placement(c.members()).owners(k, 2)[0] for k in cold}
        after = where(pair, cold)
        for i, k in enumerate(cold):  # the first owner's copy came up; the other stayed
            assert {addr: tiers[i] for addr, tiers in after.items()} == {
                addr: "dram" if addr == first[k] else "ssd" for addr in after}
        assert c.locate(cold) == ["dram"] * 5  # what a read finds first
        assert c.prefetch(cold) == ["present"] * 5
        with pytest.raises(InvalidArgument, match=f"at most {MAX_PREFETCH_KEYS} keys"):
            c.prefetch([stray] * (MAX_PREFETCH_KEYS + 1))


def test_keys_spread_over_nodes_each_come_up_where_they_live(
        pair: list[NodeProcess]) -> None:
    with Client(members=members(pair), replicas=1, transport="tcp") as c:
        owner = Placement(c.members())
        per_node: dict[str, list[bytes]] = {n.addr: [] for n in pair}
        while min(len(v) for v in per_node.values()) < 17:  # 17 blocks on each node
            k = os.urandom(16)
            home = owner.owners(k, 1)[0]
            if len(per_node[home]) < 17:
                assert c.put(k, os.urandom(BLOCK))
                per_node[home].append(k)
        cold = [k for keys in per_node.values() for k in keys[:5]]
        assert c.locate(cold) == ["ssd"] * 10
        assert c.prefetch(cold, wait=True) == ["promoted"] * 10
        assert c.locate(cold) == ["dram"] * 10
        for n in pair:
            with Client(n.addr, transport="grpc") as one:
                assert one.stats()["node"]["prefetch_blocks"]["promoted"] == 5
