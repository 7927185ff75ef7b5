"""replication.copies.peers.PeerPool: a node's clients of peers that left the membership are
closed when the next one is created (a restarted peer comes back at a new address), so
their shared-memory mappings of dead peers' regions go with them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port

from kvstore.node.semantics import Node, NodeSettings
from kvstore.server import NodeServer
from replication.copies.peers import KnownMembers, PeerPool


@pytest.fixture
def servers() -> Iterator[list[NodeServer]]:
    out = []
    nodes = []
    for _ in range(2):
        node = Node(NodeSettings(dram_bytes=4 << 20, prefault=False))
        server = NodeServer(node, listen=f"127.0.0.1:{free_port()}", grpc_workers=2)
        server.start()
        nodes.append(node)
        out.append(server)
    try:
        yield out
    finally:
        for node, server in zip(nodes, out, strict=True):
            server.stop(grace=1.0)
            node.close()


def region_mappings() -> int:
    """Mappings of kvstore DRAM regions (memfds) in this process (not the staging areas a
    node maps for its same-host writers)."""
    return sum("memfd:kvstore-dram" in line for line in Path("/proc/self/maps").read_text()
               .splitlines())


def test_a_departed_peers_client_is_closed_when_the_next_one_is_made(
        servers: list[NodeServer]) -> None:
    a, b = (s.addresses.grpc for s in servers)
    view = {a}
    known = KnownMembers()
    known.follow(lambda: view)
    before = region_mappings()  # the two nodes' own regions
    with PeerPool(members=known) as pool:
        old = pool.get(a)
        assert pool.get(a) is old
        assert old.put(b"\x01" * 16, b"x" * 100) and old.transport == "shm"
        assert region_mappings() == before + 1  # the client maps a's region
        view = {b}  # a left; b joined
        new = pool.get(b)
        assert region_mappings() == before  # a's mapping went with its client
        assert pool.get(b) is new
        view = {a, b}
        assert pool.get(a) is not old  # a fresh client, if a comes back at that address
        assert pool.get(b) is new  # a member's client is kept


def test_drop_departed_closes_them_without_a_new_client(servers: list[NodeServer]) -> None:
    """What a node calls on every membership change: a peer that left is let go at once,
    even if no client is made after it (a fault at the end of a run left one mapped)."""
    a, b = (s.addresses.grpc for s in servers)
    view = {a, b}
    known = KnownMembers()
    known.follow(lambda: view)
    before = region_mappings()
    with PeerPool(members=known) as pool:
        old = pool.get(a)
        assert old.put(b"\x02" * 16, b"y" * 100) and region_mappings() == before + 1
        pool.drop_departed()  # a is still a member: kept
        assert pool.get(a) is old and region_mappings() == before + 1
        view = {b}
        pool.drop_departed()
        assert region_mappings() == before  # a's client and mapping are gone
        view = {a, b}
        assert pool.get(a) is not old
    assert PeerPool().drop_departed() is None  # a client's pool (no members): nothing to do
