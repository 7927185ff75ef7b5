"""Which peer clients a master's forward uses: stream connections for small blocks (they
pipeline), the large-block pool (a node's same-host shared memory) for large ones."""

from __future__ import annotations

import pytest

from kvstore.core.errors import Unavailable
from kvstore.core.forwarding import BlockCopy
from kvstore.core.keys import BlockKey
from replication.copies.forwarder import LARGE_BLOCK_BYTES, Forwarder
from replication.membership import StaticMembership
from replication.placement.rendezvous import Member, NodeId

MEMBERS = [Member(node_id=NodeId("n0"), addr="a0"), Member(node_id=NodeId("n1"), addr="a1")]


class _Pool:
    """A peer pool whose clients cannot be had; it records who asked."""

    def __init__(self, name: str, asked: list[str]) -> None:
        self.name, self.asked = name, asked

    def peer(self, addr: str):
        self.asked.append(f"{self.name} {addr}")

        def refuse(owner: str | None):
            raise Unavailable(f"{addr} is unreachable")
        return refuse

    def drop_departed(self) -> None:
        pass

    def close(self) -> None:
        pass


def _blocks(*sizes: int) -> list[BlockCopy]:
    return [BlockCopy(key=BlockKey(bytes([i]) * 16), place=BlockKey(bytes([i]) * 16),
                      parent=None, pin=False, value=memoryview(bytes(n)))
            for i, n in enumerate(sizes, start=1)]


@pytest.mark.parametrize(("sizes", "pool"), [
    ((64 << 10,) * 3, "stream"),
    ((LARGE_BLOCK_BYTES,) * 2, "large"),
    ((LARGE_BLOCK_BYTES - 1, LARGE_BLOCK_BYTES), "stream"),  # the mean decides
    ((2 << 20, 64 << 10), "large"),
])
def test_a_push_takes_the_pool_its_blocks_mean_size_picks(sizes: tuple[int, ...],
                                                          pool: str) -> None:
    asked: list[str] = []
    forwarder = Forwarder(_Pool("stream", asked), large_peers=_Pool("large", asked))
    try:
        forwarder.attach(StaticMembership(MEMBERS), "n0", replicas=2)
        out = forwarder.forward(_blocks(*sizes), copies=2, write_quorum=2)
        assert asked == [f"{pool} a1"]
        assert (out.copies, out.failed) == (1, ("a1: a1 is unreachable",))
    finally:
        forwarder.close()


def test_without_a_large_pool_every_push_streams() -> None:
    asked: list[str] = []
    forwarder = Forwarder(_Pool("stream", asked))
    try:
        forwarder.attach(StaticMembership(MEMBERS), "n0", replicas=2)
        forwarder.forward(_blocks(4 << 20), copies=2, write_quorum=2)
        assert asked == ["stream a1"]
    finally:
        forwarder.close()
