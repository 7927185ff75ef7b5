"""The cluster client's retain on a static cluster of two node processes: every copy of a
key is retained (and released), whichever node a later read goes to; a key nobody holds is
missing; the key bound holds for the whole call."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess, free_port, start_node

from kvstore import Client, InvalidArgument, RetainOutcome
from kvstore.core.retention import MAX_RETAIN_KEYS
from replication.placement.rendezvous import Member, NodeId

BLOCK = 64 << 10


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[NodeProcess]]:
    ports = [free_port() for _ in range(2)]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    nodes: list[NodeProcess] = []
    try:
        for p in ports:
            nodes.append(start_node(tmp_path, "--members", peers, dram="4MiB", port=p))
        yield nodes
    finally:
        for n in nodes:
            assert n.stop() == 0, n.output()


def retained(nodes: list[NodeProcess]) -> list[int]:
    out = []
    for n in nodes:
        with Client(n.addr, transport="grpc") as c:
            out.append(c.stats()["node"]["retained_blocks"])
    return out


def test_every_copy_is_retained_and_released(pair: list[NodeProcess]) -> None:
    members = [Member(node_id=NodeId(n.addr), addr=n.addr) for n in pair]
    with Client(members=members, replicas=2, transport="tcp") as c:
        keys = [os.urandom(16) for _ in range(5)]
        assert c.put_batch(keys, [os.urandom(BLOCK)] * 5) == [True] * 5
        stray = os.urandom(16)
        assert c.retain([*keys, stray], 60) == [RetainOutcome.RETAINED] * 5 + [
            RetainOutcome.MISSING]
        assert retained(pair) == [5, 5]
        assert c.retain(keys[:2], 0) == [RetainOutcome.RELEASED] * 2
        assert retained(pair) == [3, 3]
        with pytest.raises(InvalidArgument, match="at most"):
            c.retain(keys * MAX_RETAIN_KEYS, 5)
        assert retained(pair) == [3, 3]
