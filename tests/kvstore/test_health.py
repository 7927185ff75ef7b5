"""The standard gRPC health service on a node, and ``kvstore health`` as a container probe.

A real ``kvstore serve`` process answers SERVING for the whole server ("") and for
kvstore.v1.KVStore; once SIGTERM starts its drain it answers NOT_SERVING (held
open here by a put left half-sent on the transfer channel), then it is gone.
``kvstore health`` turns each outcome into exit 0, or exit 1 with one line.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from conftest import REPO, free_port, start_node, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import Client
from kvstore.node.semantics import Node, NodeSettings
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol import wire
from kvstore.server import HEALTH_SERVICES, NodeServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check(addr: str, service: str = "") -> int:
    with grpc.insecure_channel(addr) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def health_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", "health", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def assert_one_line_failure(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvstore health: error: ")
    for needle in needles:
        assert needle in lines[0]


def hold_put_in_flight(addr: str) -> socket.socket:
    """Starts a 1 MiB put on the node's TCP channel and sends only part of it.

    The node counts the request as in flight until the socket closes, so a drain
    waits for it (up to ``--drain-timeout``).
    """
    with grpc.insecure_channel(addr) as channel:
        info = pb_grpc.KVStoreStub(channel).OpenChannel(pb.OpenChannelRequest(), timeout=10)
    sock = socket.create_connection(("127.0.0.1", info.tcp_port), timeout=10)
    sock.sendall(wire.HELLO.pack(wire.MAGIC, info.token, wire.Mode.TCP))
    status, _ = wire.HELLO_REPLY.unpack(wire.recv_exact(sock, wire.HELLO_REPLY.size))
    assert status == 0
    meta = wire.PUT_ITEM.pack(os.urandom(16), bytes(16), 1 << 20, 0)
    sock.sendall(wire.HEADER.pack(wire.Op.PUT, 1, len(meta)) + meta + b"x" * 1000)
    return sock


def test_serving_node_answers_serving(tmp_path) -> None:
    node = start_node(tmp_path)
    try:
        assert HEALTH_SERVICES == ("", "kvstore.v1.KVStore")
        for service in HEALTH_SERVICES:
            assert check(node.addr, service) == SERVING
        ok = health_cli("--addr", node.addr)
        assert ok.returncode == 0, ok
        assert ok.stdout == f"{node.addr} SERVING\n"
        assert ok.stderr == ""
        ok = health_cli("--addr", node.addr, "--service", "kvstore.v1.KVStore", "--timeout", "2")
        assert ok.returncode == 0, ok
        assert_one_line_failure(health_cli("--addr", node.addr, "--service", "no.such.Service"),
                                "NOT_FOUND", "no.such.Service")
    finally:
        assert node.stop() == 0, node.output()


def test_sigterm_drain_is_not_serving_then_unreachable(tmp_path) -> None:
    node = start_node(tmp_path, "--drain-timeout", "30")
    watch_seen: queue.Queue[int] = queue.Queue()
    with grpc.insecure_channel(node.addr) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(),
                                                          timeout=60)

        def follow() -> None:
            try:
                for reply in watch:
                    watch_seen.put(reply.status)
            except grpc.RpcError:
                pass  # the server went away, or the test cancelled the stream

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        assert watch_seen.get(timeout=10) == SERVING

        sock = hold_put_in_flight(node.addr)
        try:
            with Client(node.addr, transport="grpc", timeout=10) as c:
                # Stats is itself in flight while it runs: 2 means the half-sent put counts.
                wait_until(lambda: c.stats()["node"]["in_flight"] >= 2, what="put in flight")
            node.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: check(node.addr) == NOT_SERVING, what="NOT_SERVING")
            assert check(node.addr, "kvstore.v1.KVStore") == NOT_SERVING
            assert node.proc.poll() is None  # still draining: the put holds it open
            assert_one_line_failure(health_cli("--addr", node.addr), "NOT_SERVING")
            assert watch_seen.get(timeout=10) == NOT_SERVING
        finally:
            sock.close()  # the put is abandoned; the drain completes
        assert node.stop(timeout=30) == 0, node.output()
        watch.cancel()
        follower.join(10)
    assert "Traceback" not in node.output()
    assert_one_line_failure(health_cli("--addr", node.addr, "--timeout", "3"), "UNAVAILABLE")


@pytest.mark.parametrize(("args", "needle"), [
    (["--addr", "not-an-address"], "HOST:PORT"),
    (["--addr", "127.0.0.1:http"], "HOST:PORT"),
    (["--addr", "127.0.0.1:7600", "--timeout", "0"], "--timeout"),
])
def test_malformed_arguments_fail_in_one_line(args: list[str], needle: str) -> None:
    assert_one_line_failure(health_cli(*args), needle)


def test_nothing_listening_fails_in_one_line() -> None:
    addr = f"127.0.0.1:{free_port()}"
    assert_one_line_failure(health_cli("--addr", addr, "--timeout", "3"), addr, "UNAVAILABLE")


def test_not_a_kvstore_node_fails_in_one_line() -> None:
    """A gRPC server without the health service: UNIMPLEMENTED, still one line and exit 1."""
    plain = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = plain.add_insecure_port("127.0.0.1:0")
    plain.start()
    try:
        assert_one_line_failure(health_cli("--addr", f"127.0.0.1:{port}"), "UNIMPLEMENTED")
    finally:
        plain.stop(0).wait()


@pytest.fixture
def inproc() -> Iterator[tuple[Node, NodeServer]]:
    node = Node(NodeSettings(dram_bytes=8 << 20, prefault=False))
    server = NodeServer(node, listen=f"127.0.0.1:{free_port()}", grpc_workers=4)
    server.start()
    try:
        yield node, server
    finally:
        server.stop(grace=1.0)
        node.close()


def test_any_drain_turns_check_not_serving(inproc: tuple[Node, NodeServer]) -> None:
    """Check follows ``node.draining`` whoever starts the drain, not only ``stop``."""
    node, server = inproc
    assert check(server.addresses.grpc) == SERVING
    node.drain(0)
    for service in HEALTH_SERVICES:
        assert check(server.addresses.grpc, service) == NOT_SERVING
