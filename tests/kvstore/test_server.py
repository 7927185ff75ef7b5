"""The client API against a real ``kvstore serve`` process, over every transport.

Each test names exact results: what every call returns, how the node's counters
move, which error each kind of bad request gets, and that a client which goes
away in the middle of a put leaves nothing reserved behind.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from conftest import TRANSPORTS, NodeProcess, free_port, wait_until

from kvstore import Client, InvalidArgument, ResourceExhausted, Unavailable
from kvstore.core.errors import BufferTooSmall
from kvstore.node.semantics import MAX_BATCH, Node, NodeSettings
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol import wire
from kvstore.server import NodeServer, host_id

# Every test on both paths of the transfer channel: the native helper, pure Python.
pytestmark = pytest.mark.usefixtures("channel_path")

MiB = 1 << 20
ALIGN = 64  # the DRAM tier hands out extents in multiples of 64 bytes


def key() -> bytes:
    return os.urandom(16)


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def dram(c: Client) -> dict:
    return c.stats()["tiers"]["dram"]


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def client(node: NodeProcess, transport: str) -> Iterator[Client]:
    with Client(node.addr, transport=transport, timeout=30) as c:
        assert c.transport == transport
        yield c


# ---- every call's exact results ------------------------------------------------------------

def test_put_get_exists_remove_exact_results(client: Client) -> None:
    k1, k2, absent = key(), key(), key()
    v1 = os.urandom(1000)
    assert client.put(k1, v1) is True
    assert client.put(k1, v1) is False
    assert client.put(k1, b"other bytes") is False  # an existing key is never overwritten
    assert client.get(k1) == v1
    assert client.get(absent) is None
    assert client.exists([k1, absent, k1]) == [True, False, True]
    assert client.exists([]) == []

    buf = bytearray(b"\xaa" * 1010)
    assert client.get_into(k1, buf) == 1000
    assert bytes(buf[:1000]) == v1
    assert bytes(buf[1000:]) == b"\xaa" * 10  # the tail is left alone
    miss_buf = bytearray(b"\x55" * 8)
    assert client.get_into(absent, miss_buf) is None
    assert miss_buf == bytearray(b"\x55" * 8)
    exact = bytearray(1000)
    assert client.get_into(k1, memoryview(exact)) == 1000
    assert bytes(exact) == v1

    assert client.put(k2, b"two") is True
    assert client.remove(k1) is True
    assert client.remove(k1) is False
    assert client.remove(absent) is False
    assert client.get(k1) is None
    assert client.exists([k1, k2]) == [False, True]
    assert client.put(k1, v1) is True  # a removed key can be stored again
    assert client.get(k1) == v1


def test_prefix_match_stops_at_the_first_gap(client: Client) -> None:
    ks = [key() for _ in range(6)]
    for k in ks[:3] + ks[4:]:
        assert client.put(k, k * 4)
    assert client.prefix_match(ks) == 3  # ks[3] is the gap
    assert client.prefix_match(ks[:3]) == 3
    assert client.prefix_match(ks[4:]) == 2
    assert client.prefix_match([ks[3], *ks[:3]]) == 0
    assert client.prefix_match([]) == 0
    assert client.put(ks[3], b"filled")
    assert client.prefix_match(ks) == 6


def test_batches_with_misses_and_duplicates(client: Client) -> None:
    ks = [key() for _ in range(4)]
    vs = [os.urandom(n) for n in (1, 100, 4096, 70_000)]
    assert client.put(ks[0], vs[0])
    assert client.put_batch(ks, vs) == [False, True, True, True]
    assert client.put_batch(ks, vs) == [False] * 4
    dup = key()
    assert client.put_batch([dup, dup], [b"same", b"same"]) == [True, False]
    assert client.get(dup) == b"same"
    assert client.put_batch([], []) == []

    absent = key()
    order = [ks[2], absent, ks[0], ks[3], absent, ks[1]]
    assert client.get_batch(order) == [vs[2], None, vs[0], vs[3], None, vs[1]]
    assert client.get_batch([]) == []
    bufs = [bytearray(80_000) for _ in order]
    assert client.get_batch_into(order, bufs) == [4096, None, 1, 70_000, None, 100]
    assert bytes(bufs[0][:4096]) == vs[2]
    assert bufs[1] == bytearray(80_000)  # a miss leaves its buffer untouched
    assert bytes(bufs[2][:1]) == vs[0]
    assert bytes(bufs[3][:70_000]) == vs[3]
    assert bytes(bufs[5][:100]) == vs[1]


def test_stats_counters_move_by_exact_amounts(client: Client) -> None:
    s = dram(client)
    assert (s["blocks"], s["used"], s["hits"], s["misses"], s["evictions"]) == (0, 0, 0, 0, 0)
    assert s["capacity"] == 64 * MiB

    k1, k2, absent = key(), key(), key()
    v1, v2 = os.urandom(1000), os.urandom(128 << 10)
    assert client.put(k1, v1)
    s = dram(client)
    assert (s["blocks"], s["used"]) == (1, padded(1000))
    assert client.put(k1, os.urandom(1000)) is False  # a no-op put takes no space
    assert (dram(client)["blocks"], dram(client)["used"]) == (1, padded(1000))
    assert client.put(k2, v2)
    s = dram(client)
    assert (s["blocks"], s["used"]) == (2, padded(1000) + (128 << 10))

    assert client.get(k1) == v1
    assert client.get(absent) is None
    s = dram(client)
    assert (s["hits"], s["misses"]) == (1, 1)
    assert client.get_batch([k1, absent, k2, absent]) == [v1, None, v2, None]
    s = dram(client)
    assert (s["hits"], s["misses"]) == (3, 3)
    assert client.get_into(k2, bytearray(128 << 10)) == 128 << 10
    assert client.get_into(absent, bytearray(1)) is None
    s = dram(client)
    assert (s["hits"], s["misses"]) == (4, 4)
    # exists and prefix_match are not reads
    client.exists([k1, k2, absent])
    client.prefix_match([k1, k2, absent])
    s = dram(client)
    assert (s["hits"], s["misses"]) == (4, 4)

    assert client.remove(k1)
    s = dram(client)
    assert (s["blocks"], s["used"]) == (1, 128 << 10)
    assert not client.remove(k1)
    assert client.remove(k2)
    s = dram(client)
    assert (s["blocks"], s["used"], s["evictions"]) == (0, 0, 0)


# ---- value types and sizes -----------------------------------------------------------------

def test_every_bytes_like_value_type(client: Client) -> None:
    raw = os.urandom(3000)
    floats = np.arange(1000, dtype=np.float32)
    cases: list[tuple[object, bytes]] = [
        (raw, raw),
        (bytearray(raw), raw),
        (memoryview(raw)[100:2100], raw[100:2100]),
        (np.frombuffer(raw, dtype=np.uint8), raw),
        (floats, floats.tobytes()),
        (np.arange(12, dtype=np.int64).reshape(3, 4), np.arange(12, dtype=np.int64).tobytes()),
    ]
    for value, expected in cases:
        k = key()
        assert client.put(k, value) is True, type(value)
        assert client.get(k) == expected, type(value)
        out = np.zeros(len(expected), dtype=np.uint8)
        assert client.get_into(k, out) == len(expected)
        assert out.tobytes() == expected
    with pytest.raises(InvalidArgument):
        client.put(key(), np.arange(20, dtype=np.uint8)[::2])  # not contiguous
    with pytest.raises(InvalidArgument):
        client.get_into(key(), b"read-only buffer")


@pytest.mark.parametrize("size", [1, 8 * MiB])
def test_smallest_and_large_values(client: Client, size: int) -> None:
    k, v = key(), os.urandom(size)
    assert client.put(k, v) is True
    assert client.get(k) == v
    out = bytearray(size)
    assert client.get_into(k, out) == size
    assert out == v
    assert client.put(k, v) is False
    assert dram(client)["used"] == padded(size)


def test_batches_larger_than_one_request(client: Client) -> None:
    n = MAX_BATCH + 4464  # 70000: the client splits every call
    ks = [i.to_bytes(16, "big") for i in range(1, n + 1)]
    edges = [0, MAX_BATCH - 1, MAX_BATCH, n - 1]
    assert client.put_batch([ks[i] for i in edges], [b"e"] * len(edges)) == [True] * 4
    present = client.exists(ks)
    assert len(present) == n
    assert [i for i, p in enumerate(present) if p] == edges

    assert client.put_batch(ks, [b"x"] * n).count(True) == n - len(edges)
    assert client.exists(ks) == [True] * n
    assert client.prefix_match(ks) == n
    gap = MAX_BATCH + 1000
    assert client.remove(ks[gap])
    assert client.prefix_match(ks) == gap  # the gap is in the second request
    got = client.get_batch(ks[MAX_BATCH - 2 : MAX_BATCH + 2])
    assert got == [b"x", b"e", b"e", b"x"]


# ---- errors --------------------------------------------------------------------------------

def test_invalid_arguments_and_the_connection_survives(client: Client) -> None:
    k, v = key(), os.urandom(5000)
    assert client.put(k, v)
    short = os.urandom(15)
    for call in (lambda: client.put(short, b"v"), lambda: client.get(short),
                 lambda: client.exists([k, short]), lambda: client.remove(short),
                 lambda: client.prefix_match([short]), lambda: client.put(k, b"", parent=short),
                 lambda: client.get_into(short, bytearray(10))):
        with pytest.raises(InvalidArgument, match="16 bytes"):
            call()
    with pytest.raises(InvalidArgument, match="empty"):
        client.put(key(), b"")
    with pytest.raises(InvalidArgument):
        client.put_batch([key(), key()], [b"a", b""])
    with pytest.raises(InvalidArgument):
        client.put_batch([key()], [b"a", b"b"])
    with pytest.raises(BufferTooSmall, match="buffer"):
        client.get_into(k, bytearray(4999))
    # the same connection still answers, byte-exact
    assert client.get(k) == v
    out = bytearray(5000)
    assert client.get_into(k, out) == 5000 and out == v
    assert client.exists([k]) == [True]


def test_too_small_buffer_in_a_batch_leaves_no_read_lease_behind(client: Client) -> None:
    """A failed get_batch_into must not keep the other blocks of the batch leased."""
    k1, k2 = key(), key()
    assert client.put_batch([k1, k2], [os.urandom(100 << 10), os.urandom(100 << 10)])
    with pytest.raises(BufferTooSmall, match="buffer"):
        client.get_batch_into([k1, k2], [bytearray(10), bytearray(100 << 10)])
    assert client.remove(k1) and client.remove(k2)
    # A block still leased by a reader keeps its space until the lease ends.
    s = dram(client)
    assert (s["blocks"], s["used"]) == (0, 0)


def test_value_larger_than_the_node(client: Client) -> None:
    k = key()
    with pytest.raises(ResourceExhausted):
        client.put(k, bytes(64 * MiB + 1))
    assert client.exists([k]) == [False]
    assert dram(client)["used"] == 0
    assert client.put(k, b"still works")
    assert client.get(k) == b"still works"


def test_raw_grpc_bad_key_gets_invalid_argument(node: NodeProcess) -> None:
    with grpc.insecure_channel(node.addr) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        for call, request in ((stub.Get, pb.GetRequest(key=b"short")),
                              (stub.Put, pb.PutRequest(key=b"k" * 17, value=b"v")),
                              (stub.Exists, pb.ExistsRequest(keys=[b"k" * 16, b""])),
                              (stub.Put, pb.PutRequest(key=b"k" * 16, value=b""))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details()
        assert stub.Put(pb.PutRequest(key=b"k" * 16, value=b"v"), timeout=10).stored


# ---- stopping ------------------------------------------------------------------------------

def test_sigterm_stops_cleanly_then_calls_are_unavailable(node: NodeProcess, transport: str
                                                           ) -> None:
    k = key()
    with Client(node.addr, transport=transport, timeout=5) as c:
        assert c.put(k, b"v") and c.get(k) == b"v"  # the connection is up
        assert node.stop(signal.SIGTERM) == 0
        assert "kvstore: stopped" in node.output()
        assert "Traceback" not in node.output()
        with pytest.raises(Unavailable):
            c.get(k)
        with pytest.raises(Unavailable):
            c.put(key(), b"w")
    with Client(node.addr, transport=transport, timeout=5) as fresh, \
            pytest.raises(Unavailable):
        fresh.exists([k])


@pytest.fixture
def inproc() -> Iterator[tuple[Node, NodeServer]]:
    node = Node(NodeSettings(dram_bytes=8 * MiB, prefault=False))
    server = NodeServer(node, listen=f"127.0.0.1:{free_port()}", grpc_workers=4)
    server.start()
    try:
        yield node, server
    finally:
        server.stop(grace=1.0)
        node.close()


def test_draining_node_refuses_requests(inproc: tuple[Node, NodeServer], transport: str
                                        ) -> None:
    node, server = inproc
    k = key()
    with Client(server.addresses.grpc, transport=transport, timeout=10) as c:
        assert c.put(k, b"before drain") is True
        assert c.get(k) == b"before drain"
        # The reply to the get can reach us a moment before its request scope ends, so
        # drain(0) may report one request still in flight; it refuses new ones either way.
        node.drain(0)
        with pytest.raises(Unavailable, match="draining"):
            c.get(k)
        with pytest.raises(Unavailable, match="draining"):
            c.put(key(), os.urandom(100 << 10))
        with pytest.raises(Unavailable, match="draining"):
            c.exists([k])
    with Client(server.addresses.grpc, transport=transport, timeout=10) as fresh, \
            pytest.raises(Unavailable):
        fresh.get(k)
    assert node.drain(10) is True  # refused requests never counted as in flight
    assert node.stats()["node"]["draining"] is True


# ---- a client that goes away mid-put ---------------------------------------------------------

def open_channel(addr: str, same_host: bool) -> pb.OpenChannelResponse:
    with grpc.insecure_channel(addr) as channel:
        return pb_grpc.KVStoreStub(channel).OpenChannel(
            pb.OpenChannelRequest(client_host_id=host_id() if same_host else ""), timeout=10)


def test_tcp_disconnect_mid_put_frees_the_reservation(node: NodeProcess) -> None:
    info = open_channel(node.addr, same_host=False)
    k = key()
    with Client(node.addr, transport="grpc") as c:
        assert c.put(key(), os.urandom(3000))
        before = dram(c)["used"]
        sock = socket.create_connection(("127.0.0.1", info.tcp_port), timeout=10)
        try:
            sock.sendall(wire.HELLO.pack(wire.MAGIC, info.token, wire.Mode.TCP))
            assert wire.HELLO_REPLY.unpack(wire.recv_exact(sock, wire.HELLO_REPLY.size)) == (
                0, 64 * MiB)
            sock.sendall(wire.header(wire.Op.PUT, 1, wire.PUT_ITEM.size)
                         + wire.PUT_ITEM.pack(k, bytes(16), 4 * MiB, 0))
            sock.sendall(os.urandom(MiB))  # a quarter of the value
            wait_until(lambda: dram(c)["used"] == before + 4 * MiB,
                       what="the node to reserve the 4 MiB put")
        finally:
            sock.close()
        wait_until(lambda: dram(c)["used"] == before, what="the reservation to be freed")
        assert c.exists([k]) == [False]
        assert c.get(k) is None
        assert dram(c)["blocks"] == 1


def test_shm_disconnect_before_commit_frees_the_reservation(node: NodeProcess) -> None:
    info = open_channel(node.addr, same_host=True)
    assert info.same_host and info.unix_path.startswith("@")
    k = key()
    with Client(node.addr, transport="grpc") as c:
        assert c.put(key(), os.urandom(3000))
        before = dram(c)["used"]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        try:
            sock.connect("\0" + info.unix_path[1:])
            sock.sendall(wire.HELLO.pack(wire.MAGIC, info.token, wire.Mode.SHM))
            msg, fds, _, _ = socket.recv_fds(sock, wire.HELLO_REPLY.size, 1)
            for fd in fds:
                os.close(fd)
            assert wire.HELLO_REPLY.unpack(msg) == (0, 64 * MiB)
            assert len(fds) == 1
            sock.sendall(wire.header(wire.Op.RESERVE, 1, wire.PUT_ITEM.size)
                         + wire.PUT_ITEM.pack(k, bytes(16), 4 * MiB, 0))
            status, count, meta_len = wire.HEADER.unpack(wire.recv_exact(sock, wire.HEADER.size))
            assert (status, count, meta_len) == (0, 1, wire.RESERVE_ITEM.size)
            rid, _offset, state = wire.RESERVE_ITEM.unpack(wire.recv_exact(sock, meta_len))
            assert rid != 0 and state == wire.RESERVE_OK
            assert dram(c)["used"] == before + 4 * MiB  # the reply came after the reservation
            assert c.exists([k]) == [False]  # reserved is not stored
        finally:
            sock.close()
        wait_until(lambda: dram(c)["used"] == before, what="the reservation to be aborted")
        assert c.exists([k]) == [False]
        assert dram(c)["blocks"] == 1
        assert c.put(k, b"now") and c.get(k) == b"now"



def test_an_unreachable_node_keeps_the_transport_cause() -> None:
    """The client's Unavailable chains the gRPC error it came from: a log shows both."""
    with (Client(f"127.0.0.1:{free_port()}", transport="grpc", timeout=2.0) as c,
          pytest.raises(Unavailable) as info):
        c.exists([bytes(16)])
    assert isinstance(info.value.__cause__, grpc.RpcError)
    assert info.value.__cause__.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(("grpc_port", "data_port"), [("given", 0), (0, "given")])
def test_the_port_given_is_bound_before_the_one_left_to_the_kernel(
        monkeypatch: pytest.MonkeyPatch, grpc_port: int | str, data_port: int | str) -> None:
    """A port picked free beforehand stays free only until it is bound: the node binds it
    before it asks the kernel for any port, which could otherwise be that very one (a test
    saw the channel's port 0 handed the gRPC port it was about to bind)."""
    import kvstore.server as server_module

    given = free_port()
    real = server_module.ChannelServer
    seen: list[bool] = []

    def channel_server(*args: object, **kwargs: object) -> object:
        probe = socket.socket()
        try:
            probe.bind(("127.0.0.1", given))
            seen.append(False)  # still free: not bound yet
        except OSError:
            seen.append(True)
        finally:
            probe.close()
        return real(*args, **kwargs)

    monkeypatch.setattr(server_module, "ChannelServer", channel_server)
    node = Node(NodeSettings(dram_bytes=8 * MiB, prefault=False))
    server = NodeServer(node, listen=f"127.0.0.1:{given if grpc_port == 'given' else 0}",
                        data_port=given if data_port == "given" else 0, grpc_workers=2)
    try:
        # The gRPC port, when given, is bound before the channel's; a channel port given
        # is bound by the channel itself, before the gRPC port left to the kernel.
        assert seen == [grpc_port == "given"]
        bound = server.addresses.grpc.rpartition(":")[2]
        assert (int(bound) == given) == (grpc_port == "given")
    finally:
        server.stop(grace=0.5)
        node.close()
