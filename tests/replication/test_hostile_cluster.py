"""Cluster calls as a hostile caller would make them: addresses the node must never
contact, members that stall, more replicate calls than the node will wait on, and a
SIGTERM while all of that is under way."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port, start_node, wait_until, write_auth_file

from kvstore.client import Client
from kvstore.core.errors import ResourceExhausted
from kvstore.node.semantics import Node, NodeSettings
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server import NodeServer
from replication.membership.etcd_server import EtcdServer

pytest_plugins = ["etcd_fixtures"]

MiB = 1 << 20
KEY = b"r" * 16
VALUE = b"replicated " * 100


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP socket on loopback that never accepts: a caller-named address, or a member
    that stalls (connections complete in the backlog; nothing ever answers)."""
    s = socket.create_server(("127.0.0.1", 0), backlog=64)
    yield s
    s.close()


def _addr(s: socket.socket) -> str:
    return f"127.0.0.1:{s.getsockname()[1]}"


def _nothing_connected(s: socket.socket) -> bool:
    s.settimeout(0.2)
    try:
        conn, _ = s.accept()
    except TimeoutError:
        return True
    conn.close()
    return False


def test_replicate_never_contacts_an_address_outside_the_membership(
        tmp_path: Path, listener: socket.socket) -> None:
    token = "cluster-token-of-this-test-0123"
    auth = write_auth_file(tmp_path / "tenants.toml", {}, cluster=token)
    (tmp_path / "peer-token").write_text(token)
    member = start_node(tmp_path, "--auth-file", str(auth))
    n = start_node(tmp_path, "--auth-file", str(auth), "--peer-token-file",
                   str(tmp_path / "peer-token"), "--members", member.addr)
    try:
        with Client(n.addr, transport="grpc", token=token) as c:
            assert c.put(KEY, VALUE)
            reply = c._grpc("Replicate", pb.ReplicateRequest(
                keys=[KEY], targets=[_addr(listener), "127.0.0.1:1", member.addr], copies=2,
                write_quorum=2))
        assert (reply.copies, list(reply.stored_on)) == (2, [member.addr])
        assert [f.split(": ")[0] for f in reply.failed] == [_addr(listener), "127.0.0.1:1"]
        assert all("is not a member of this node's cluster" in f for f in reply.failed)
        assert _nothing_connected(listener)  # no bytes, no token
        with Client(member.addr, transport="grpc", token=token) as m:
            assert m.get(KEY) == VALUE
    finally:
        n.stop()
        member.stop()


@pytest.fixture
def stalled(listener: socket.socket) -> Iterator[tuple[Node, NodeServer]]:
    node = Node(NodeSettings(dram_bytes=8 * MiB, prefault=False))
    server = NodeServer(node, listen=f"127.0.0.1:{free_port()}", grpc_workers=4,
                        peer_timeout=30.0, members=[_addr(listener)])
    server.start()
    try:
        yield node, server
    finally:
        server.stop(grace=1.0)
        node.close()


def test_replicate_calls_to_a_stalled_member_are_capped_and_cancelled_by_stop(
        stalled: tuple[Node, NodeServer], listener: socket.socket) -> None:
    _, server = stalled
    addr = server.addresses.grpc
    with Client(addr, transport="grpc") as c:
        assert c.put(KEY, VALUE)
    replies: list[object] = []

    def replicate() -> None:
        with Client(addr, transport="grpc", timeout=60) as c:
            try:
                replies.append(c._grpc("Replicate", pb.ReplicateRequest(
                    keys=[KEY], targets=[_addr(listener)], copies=2, write_quorum=2)))
            except Exception as exc:
                replies.append(exc)

    # grpc_workers=4: at most 2 replicate calls wait; the handler threads left serve others.
    threads = [threading.Thread(target=replicate) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: server.replicator.active == 2, what="two replicate calls")
    with Client(addr, transport="grpc") as c:
        with pytest.raises(ResourceExhausted, match="already runs 2 replicate calls"):
            c._grpc("Replicate", pb.ReplicateRequest(keys=[KEY], targets=[_addr(listener)],
                                                     copies=2, write_quorum=2))
        assert c.get(KEY) == VALUE  # the node answers the others meanwhile
        assert c.exists([KEY]) == [True]
    started = time.monotonic()
    assert server.stop(grace=2.0) is True  # the waiting calls were woken, not waited out
    assert time.monotonic() - started < 2.0 + 3.0
    for t in threads:
        t.join(timeout=10)
    assert len(replies) == 2
    for r in replies:
        assert isinstance(r, pb.ReplicateResponse), r
        assert r.copies == 1 and "node is stopping" in " ".join(r.failed)


def test_sigterm_ends_a_node_with_stuck_replicate_calls_within_the_drain_timeout(
        tmp_path: Path, listener: socket.socket) -> None:
    n = start_node(tmp_path, "--members", _addr(listener), "--drain-timeout", "2")
    with Client(n.addr, transport="grpc") as c:
        assert c.put(KEY, VALUE)

    def replicate() -> None:
        # The node going away mid-call is what this test does: any outcome will do.
        with Client(n.addr, transport="grpc", timeout=60) as c, \
                contextlib.suppress(Exception):
            c._grpc("Replicate", pb.ReplicateRequest(keys=[KEY], targets=[_addr(listener)],
                                                     copies=2, write_quorum=2))

    threads = [threading.Thread(target=replicate, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()

    def in_flight() -> int:
        with Client(n.addr, transport="grpc") as c:
            return c.stats()["node"]["in_flight"] - 1  # not counting this Stats call

    wait_until(lambda: in_flight() == 4, what="four replicate calls in flight")
    started = time.monotonic()
    n.proc.send_signal(signal.SIGTERM)
    assert n.proc.wait(timeout=2 + 5 + 5) == 0, n.output()
    assert time.monotonic() - started < 2 + 5 + 5
    assert "kvstore: stopped" in n.output()


def test_a_member_stopped_mid_transfer_costs_one_stall_timeout(tmp_path: Path) -> None:
    member = start_node(tmp_path, dram="64MiB")
    node = Node(NodeSettings(dram_bytes=64 * MiB, prefault=False))
    server = NodeServer(node, listen=f"127.0.0.1:{free_port()}", grpc_workers=4,
                        peer_timeout=1.0, members=[member.addr])
    server.start()
    try:
        with Client(server.addresses.grpc, transport="grpc", timeout=60) as c:
            assert c.put(KEY, VALUE)
            reply = c._grpc("Replicate", pb.ReplicateRequest(
                keys=[KEY], targets=[member.addr], copies=2, write_quorum=2))
            assert list(reply.stored_on) == [member.addr]  # the peer stream is open now
            big = b"b" * 16
            assert c.put(big, bytes(range(256)) * (32 * MiB // 256))
            member.proc.send_signal(signal.SIGSTOP)
            try:
                reply = c._grpc("Replicate", pb.ReplicateRequest(
                    keys=[big], targets=[member.addr], copies=2, write_quorum=2))
                assert reply.copies == 1 and list(reply.stored_on) == []
                assert len(reply.failed) == 1 and reply.failed[0].startswith(member.addr)
                assert c.get(KEY) == VALUE  # and the node answers
                # The push holds a read lease on the block while it sends: once the stall
                # timeout ends it (the member still stopped), a removal frees the space.
                used = node.stats()["tiers"]["dram"]["used"]
                assert node.remove(big)
                wait_until(lambda: node.stats()["tiers"]["dram"]["used"] == used - 32 * MiB,
                           timeout=30, what="the stalled push to end")
            finally:
                member.proc.send_signal(signal.SIGCONT)
        assert server.stop(grace=5.0) is True
    finally:
        server.stop(grace=1.0)
        node.close()
        member.stop()


def test_an_etcd_node_replicates_to_its_live_members_only(
        tmp_path: Path, etcd: EtcdServer, listener: socket.socket) -> None:
    nodes = [start_node(tmp_path, "--etcd", etcd.endpoint, "--node-id", f"n{i}")
             for i in range(2)]
    try:
        with Client(nodes[0].addr, transport="grpc") as c:
            assert c.put(KEY, VALUE)
            reply = c._grpc("Replicate", pb.ReplicateRequest(
                keys=[KEY], targets=[_addr(listener), nodes[1].addr], copies=2,
                write_quorum=2))
        assert (reply.copies, list(reply.stored_on)) == (2, [nodes[1].addr])
        assert len(reply.failed) == 1 and reply.failed[0].startswith(_addr(listener))
        assert "is not a member of this node's cluster" in reply.failed[0]
        assert _nothing_connected(listener)
    finally:
        for n in nodes:
            n.stop()
