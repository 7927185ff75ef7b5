"""Pipelined puts on a real 3-node cluster (etcd + node processes): a batch that spans
several masters reaches every one of them before the client reads any reply."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from kvstore.client import Client
from kvstore.core.checks import check_key
from kvstore.remote.channel_client import ChannelConnection
from kvstore.remote.node_client import NodeClient, PutBatch
from kvstore.remote.pipelined import start_put
from replication.local_cluster import LocalCluster

NODE_ARGS = ["--dram-bytes", "64MiB", "--no-prefault", "--replicas", "2"]
KEYS = [i.to_bytes(16, "big") for i in range(1, 49)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster.up(tmp_path_factory.mktemp("pipelined") / "cluster", 3,
                        node_args=NODE_ARGS)
    try:
        yield c
    finally:
        c.down(timeout=10)


def _holds_all(cluster: LocalCluster, parts: dict[str, list[bytes]]) -> bool:
    """True once every node holds every key of its part (asked over gRPC, not the
    channel the put is on)."""
    for addr, keys in parts.items():
        with NodeClient(addr, transport="grpc") as n:
            if not all(n.exists(keys)):
                return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_every_master_holds_its_part_before_any_reply_is_read(
        cluster: LocalCluster, replicas: int, monkeypatch: pytest.MonkeyPatch) -> None:
    tag = replicas.to_bytes(1, "big")
    keys = [tag + k[1:] for k in KEYS]
    values = [os.urandom(4096) for _ in keys]
    parts: dict[str, list[bytes]] = {}
    order: list[str] = []
    reply = ChannelConnection.put_reply

    def recorded(conn: ChannelConnection, count: int, *, replicated: bool = False
                 ) -> tuple[list[bool], int, str]:
        if not order:
            # The barrier: the first reply is read only once every master holds its part.
            # A client that read a master's reply before sending the next master its part
            # would wait here for a part it has not sent, and the deadline would fail it.
            deadline = time.monotonic() + 20
            while not _holds_all(cluster, parts):
                assert time.monotonic() < deadline, "a master lacked its part before a reply"
                time.sleep(0.05)
        order.append(f"{conn.session.tcp_host}:{conn.session.tcp_port}")
        return reply(conn, count, replicated=replicated)

    monkeypatch.setattr(ChannelConnection, "put_reply", recorded)
    with Client(etcd=cluster.etcd, replicas=replicas, write_quorum=replicas,
                transport="tcp") as c:
        view = c._current()
        for k in keys:
            master = view.by_id[c._write_candidates(view, check_key(k))[0]].addr
            parts.setdefault(master, []).append(k)
        assert len(parts) == 3  # the batch spans every master
        assert c.put_batch(keys, values) == [True] * len(keys)
        assert len(order) == 3  # one pipelined reply per master, read after the barrier
        assert c.get_batch(keys) == values
        for k in keys:
            assert c.remove(k)


def test_start_put_does_not_pipeline_a_grpc_client(cluster: LocalCluster) -> None:
    addr = cluster.nodes[0].addr
    with NodeClient(addr, transport="grpc") as n:
        batch = PutBatch.check([KEYS[0]], [b"v"], parents=None, pin=False, retain_s=None)
        assert start_put(n, batch) is None
        assert n.put_checked(batch) == [True]
        assert n.remove(KEYS[0])


def test_a_pipelined_put_answers_what_the_node_stored(cluster: LocalCluster) -> None:
    addr = cluster.nodes[1].addr
    with NodeClient(addr, transport="tcp") as n:
        batch = PutBatch.check(KEYS[:3], [b"a", b"b", b"c"], parents=None, pin=False,
                               retain_s=None)
        first = start_put(n, batch)
        assert first is not None
        assert first.finish() == ([True] * 3, 1, [])
        again = start_put(n, batch)
        assert again is not None
        assert again.finish() == ([False] * 3, 1, [])  # stored already: an idempotent no-op
        with pytest.raises(RuntimeError):
            again.finish()
        assert n.get_batch(KEYS[:3]) == [b"a", b"b", b"c"]
        assert [n.remove(k) for k in KEYS[:3]] == [True] * 3
