"""A hostile client on the transfer channel, against a node run under RLIMIT_AS.

Raw frames (``kvstore.protocol.wire``): each test asserts an error frame or a closed
stream, a node that keeps answering, and the blocks stored before it intact.
Stalled clients are real processes stopped with SIGSTOP; the node runs with
``--read-lease-timeout 1`` so what they pin comes back within the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import REPO, NodeProcess, start_node, wait_until

from kvstore.client import Client
from kvstore.core.errors import ReplyTooLarge
from kvstore.node.semantics import MAX_BATCH
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol import wire
from kvstore.protocol.wire import HEADER, Op

MiB = 1 << 20
LIMIT_AS = 3 << 30
BIG = 4 * MiB
BIG_KEY = b"B" * 16
SMALL_KEY = b"s" * 16
BIG_VALUE = bytes(range(256)) * (BIG // 256)
SMALL_VALUE = b"small value " * 50


@pytest.fixture(scope="module")
def node(channel_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    n = start_node(tmp_path_factory.mktemp("hostile-channel"), "--read-lease-timeout", "1",
                   dram="128MiB", limit_as=LIMIT_AS)
    with Client(n.addr, transport="grpc") as c:
        assert c.put(BIG_KEY, BIG_VALUE) and c.put(SMALL_KEY, SMALL_VALUE)
    yield n
    assert n.stop() == 0, n.output()


@pytest.fixture(autouse=True)
def intact(node: NodeProcess) -> Iterator[None]:
    yield
    assert node.proc.poll() is None, node.output()
    with Client(node.addr, transport="tcp") as c:
        assert c.get_batch([BIG_KEY, SMALL_KEY]) == [BIG_VALUE, SMALL_VALUE]


def _used(node: NodeProcess) -> int:
    with Client(node.addr, transport="grpc") as c:
        return c.stats()["tiers"]["dram"]["used"]


def _connect(node: NodeProcess, token: bytes | None = None) -> socket.socket:
    with grpc.insecure_channel(node.addr) as ch:
        info = pb_grpc.KVStoreStub(ch).OpenChannel(pb.OpenChannelRequest(), timeout=10)
    sock = socket.create_connection(("127.0.0.1", info.tcp_port), timeout=30)
    sock.sendall(wire.HELLO.pack(wire.MAGIC, info.token if token is None else token,
                                 wire.Mode.TCP))
    return sock


def _hello(sock: socket.socket) -> int:
    return wire.HELLO_REPLY.unpack(wire.recv_exact(sock, wire.HELLO_REPLY.size))[0]


def _reply(sock: socket.socket) -> tuple[int, int, bytes]:
    status, count, meta_len = HEADER.unpack(wire.recv_exact(sock, HEADER.size))
    return status, count, wire.recv_exact(sock, meta_len)


def _closed(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


def _exists(sock: socket.socket, key: bytes) -> bool:
    sock.sendall(HEADER.pack(Op.EXISTS, 1, 16) + key)
    status, count, meta = _reply(sock)
    assert (status, count) == (0, 1)
    return meta == b"\x01"


@pytest.fixture
def sock(node: NodeProcess) -> Iterator[socket.socket]:
    s = _connect(node)
    assert _hello(s) == 0
    yield s
    s.close()


def test_get_of_one_block_many_times_is_refused_and_the_stream_goes_on(
        sock: socket.socket) -> None:
    sock.sendall(HEADER.pack(Op.GET, MAX_BATCH, 16 * MAX_BATCH) + BIG_KEY * MAX_BATCH)
    status, count, meta = _reply(sock)
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert f"GET reply would be {MAX_BATCH * BIG} bytes".encode() in meta
    assert b"bound of one reply" in meta  # what clients before the reason split on
    assert count == wire.ERROR_REASONS.index(ReplyTooLarge.reason)
    assert type(wire.error_of(status, meta.decode(), count)) is ReplyTooLarge
    assert _exists(sock, SMALL_KEY)  # the same stream, still in step


def test_get_reply_bound_is_exact(tmp_path: Path) -> None:
    # Its own node with the default lease timeout: a 1 GiB reply read by a test process
    # on a loaded machine may pause longer than the module node's 1 s allows.
    roomy = start_node(tmp_path, dram="128MiB", limit_as=LIMIT_AS)
    try:
        with Client(roomy.addr, transport="grpc") as c:
            assert c.put(BIG_KEY, BIG_VALUE) and c.put(SMALL_KEY, SMALL_VALUE)
        sock = _connect(roomy)
        try:
            assert _hello(sock) == 0
            _get_at_and_past_the_bound(sock)
        finally:
            sock.close()
    finally:
        assert roomy.stop() == 0, roomy.output()


def _get_at_and_past_the_bound(sock: socket.socket) -> None:
    n = wire.MAX_REPLY_BYTES // BIG  # exactly the bound
    sock.sendall(HEADER.pack(Op.GET, n + 1, 16 * (n + 1)) + BIG_KEY * n + SMALL_KEY)
    status, _, meta = _reply(sock)
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], meta
    sock.sendall(HEADER.pack(Op.GET, n, 16 * n) + BIG_KEY * n)
    status, count, meta = _reply(sock)
    assert (status, count) == (0, n)
    assert wire.unpack_ids(meta, n) == (BIG,) * n
    view = memoryview(bytearray(BIG))
    for _ in range(n):  # 1 GiB, straight from the node's region
        wire.recv_exact_into(sock, view)
        assert view == BIG_VALUE
    assert _exists(sock, BIG_KEY)


@pytest.mark.parametrize("frame, status, words", [
    (HEADER.pack(99, 1, 16) + bytes(16), "INVALID_ARGUMENT", b"unknown op 99"),
    (HEADER.pack(Op.GET, MAX_BATCH + 1, 16 * (MAX_BATCH + 1)), "INVALID_ARGUMENT",
     b"at most 65536 items"),
    (HEADER.pack(Op.EXISTS, 1, (1 << 63)), "INVALID_ARGUMENT", b"needs 16 meta bytes"),
    (HEADER.pack(Op.LEASE, 1, 16) + SMALL_KEY, "INVALID_ARGUMENT",
     b"LEASE is not available in TCP mode"),
    (HEADER.pack(Op.COMMIT, 1, 8) + bytes(8), "INVALID_ARGUMENT",
     b"COMMIT is not available in TCP mode"),
    (HEADER.pack(Op.PUT, 1, wire.PUT_ITEM.size)
     + wire.PUT_ITEM.pack(b"h" * 16, bytes(16), 1 << 60, 0), "RESOURCE_EXHAUSTED",
     b"exceeds the node's capacity"),
])
def test_malformed_frames_get_an_error_and_a_closed_stream(sock: socket.socket, frame: bytes,
                                                          status: str, words: bytes) -> None:
    sock.sendall(frame)
    code, _, meta = _reply(sock)
    assert code == grpc.StatusCode[status].value[0] and words in meta, meta
    assert _closed(sock)


def test_a_wrong_token_is_refused_at_hello(node: NodeProcess) -> None:
    s = _connect(node, token=b"\x00" * wire.TOKEN_BYTES)
    try:
        assert _hello(s) == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert _closed(s)
    finally:
        s.close()


def test_shared_memory_over_tcp_is_refused(node: NodeProcess) -> None:
    with grpc.insecure_channel(node.addr) as ch:
        info = pb_grpc.KVStoreStub(ch).OpenChannel(pb.OpenChannelRequest(), timeout=10)
    s = socket.create_connection(("127.0.0.1", info.tcp_port), timeout=30)
    try:
        s.sendall(wire.HELLO.pack(wire.MAGIC, info.token, wire.Mode.SHM))
        assert _hello(s) == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    finally:
        s.close()


# ---- stalled and killed clients ---------------------------------------------------------------

_STALLER = textwrap.dedent("""
    import os, signal, socket, sys
    from kvstore.protocol import wire
    port, token, what = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), sys.argv[3]
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(wire.HELLO.pack(wire.MAGIC, token, wire.Mode.TCP))
    wire.recv_exact(s, wire.HELLO_REPLY.size)
    if what == "put":  # a 8 MiB put, a quarter sent
        s.sendall(wire.header(wire.Op.PUT, 1, wire.PUT_ITEM.size)
                  + wire.PUT_ITEM.pack(b"p" * 16, bytes(16), 8 << 20, 0) + bytes(2 << 20))
    else:  # a 64 MiB read that is never read: the node's send fills the socket and waits
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(wire.header(wire.Op.GET, 16, 16 * 16) + b"B" * 16 * 16)
    os.kill(os.getpid(), signal.SIGSTOP)
""")


def _stalled_client(node: NodeProcess, what: str) -> subprocess.Popen:
    with grpc.insecure_channel(node.addr) as ch:
        info = pb_grpc.KVStoreStub(ch).OpenChannel(pb.OpenChannelRequest(), timeout=10)
    proc = subprocess.Popen([sys.executable, "-c", _STALLER, str(info.tcp_port),
                             info.token.hex(), what], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    _, st = os.waitpid(proc.pid, os.WUNTRACED)  # returns once it stopped itself
    assert os.WIFSTOPPED(st), st
    return proc


@pytest.mark.parametrize("what", ["put", "get"])
def test_a_stopped_client_pins_nothing_past_the_lease_timeout(node: NodeProcess,
                                                              what: str) -> None:
    base = _used(node)
    proc = _stalled_client(node, what)
    try:
        if what == "put":
            # The node reserved the 8 MiB; after --read-lease-timeout the stall ends it.
            wait_until(lambda: _used(node) == base, timeout=30,
                       what="the stalled put's reservation to be aborted")
            with Client(node.addr, transport="grpc") as c:
                assert c.exists([b"p" * 16]) == [False]
        else:
            # While the reply is stuck, its read leases hold BIG_KEY: a removal waits for
            # them. Once the stall ends the stream, the leases go and the space with them.
            with Client(node.addr, transport="grpc") as c:
                assert c.remove(BIG_KEY)
            wait_until(lambda: _used(node) == base - BIG, timeout=30,
                       what="the stalled read's leases to be released")
            with Client(node.addr, transport="grpc") as c:
                assert c.put(BIG_KEY, BIG_VALUE)
    finally:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait()


def test_a_client_killed_mid_put_leaves_nothing_behind(node: NodeProcess) -> None:
    base = _used(node)
    proc = _stalled_client(node, "put")
    proc.kill()
    proc.wait()
    wait_until(lambda: _used(node) == base, timeout=30, what="the reservation to be freed")
    with Client(node.addr, transport="tcp") as c:
        assert c.exists([b"p" * 16]) == [False]


# ---- same-host clients that hold leases and reservations too long -----------------------------


def _region_fd(node: NodeProcess) -> int:
    """The region's memfd as a client from before staged puts receives it (writable)."""
    from kvstore.server import host_id

    with grpc.insecure_channel(node.addr) as ch:
        info = pb_grpc.KVStoreStub(ch).OpenChannel(
            pb.OpenChannelRequest(client_host_id=host_id()), timeout=10)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect("\0" + info.unix_path[1:])
        s.sendall(wire.HELLO.pack(wire.MAGIC, info.token, wire.Mode.SHM))
        msg, fds, _, _ = socket.recv_fds(s, wire.HELLO_REPLY.size, 1)
    assert wire.HELLO_REPLY.unpack(msg)[0] == 0 and len(fds) == 1
    return fds[0]


def _connect_shm(node: NodeProcess) -> socket.socket:
    from kvstore.server import host_id

    with grpc.insecure_channel(node.addr) as ch:
        info = pb_grpc.KVStoreStub(ch).OpenChannel(
            pb.OpenChannelRequest(client_host_id=host_id()), timeout=10)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect("\0" + info.unix_path[1:])
    s.sendall(wire.HELLO.pack(wire.MAGIC, info.token, wire.Mode.SHM))
    msg, fds, _, _ = socket.recv_fds(s, wire.HELLO_REPLY.size, 1)
    for fd in fds:
        os.close(fd)
    assert wire.HELLO_REPLY.unpack(msg)[0] == 0
    return s


def test_an_idle_same_host_client_loses_its_leases_and_reservations(node: NodeProcess) -> None:
    key, other = b"L" * 16, b"R" * 16
    with Client(node.addr, transport="grpc") as c:
        assert c.put(key, bytes(MiB))
    base = _used(node)
    s = _connect_shm(node)
    try:
        s.sendall(HEADER.pack(Op.LEASE, 1, 16) + key)
        status, _, meta = _reply(s)
        lease, _, n = wire.LEASE_ITEM.unpack(meta)
        assert status == 0 and lease and n == MiB
        s.sendall(HEADER.pack(Op.RESERVE, 1, wire.PUT_ITEM.size)
                  + wire.PUT_ITEM.pack(other, bytes(16), 2 * MiB, 0))
        status, _, meta = _reply(s)
        rid, _, state = wire.RESERVE_ITEM.unpack(meta)
        assert status == 0 and state == wire.RESERVE_OK
        with Client(node.addr, transport="grpc") as c:
            assert c.remove(key)  # deferred: the lease still holds its bytes
        assert _used(node) == base + 2 * MiB
        # The client says nothing; within 1.5 x --read-lease-timeout both are gone.
        wait_until(lambda: _used(node) == base - MiB, timeout=30,
                   what="the idle client's lease and reservation to expire")
        s.sendall(HEADER.pack(Op.RELEASE_CHECK, 1, 8) + wire.pack_ids([lease]))
        assert _reply(s) == (0, 1, b"\x00")  # void: whatever it copied must not be used
        s.sendall(HEADER.pack(Op.COMMIT, 1, 8) + wire.pack_ids([rid]))
        status, _, meta = _reply(s)
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert b"unknown or expired" in meta
        assert not _exists(s, other)  # the stream goes on; nothing was stored
    finally:
        s.close()


def test_a_client_whose_lease_expired_mid_copy_reports_a_miss_not_other_bytes(
        node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.remote.channel_client import ChannelConnection

    key, successor = b"E" * 16, b"F" * 16
    value, other = b"\x11" * MiB, b"\x22" * MiB
    with Client(node.addr, transport="grpc") as c:
        assert c.put(key, value)
    without = _used(node) - MiB  # once the block and its last lease are gone
    real_reply = ChannelConnection._lease_reply
    stalled: list[Op] = []

    def stalled_reply(self: ChannelConnection, keys: list[bytes], outs: object,
                      started: float) -> list[bytes | int | None]:
        if key in keys and not stalled:
            stalled.append(Op.LEASE)
            # The LEASE is sent and granted; the engine stalls here, before its copy: the
            # node expires the lease, the block goes, and another block takes its place in
            # the region (the expiry shows the node granted it: ``_used`` drops).
            with Client(node.addr, transport="grpc") as c:
                assert c.remove(key)
                wait_until(lambda: _used(node) == without, timeout=30,
                           what="the stalled lease to expire")
                assert c.put(successor, other)
        return real_reply(self, keys, outs, started)  # type: ignore[arg-type]

    monkeypatch.setattr(ChannelConnection, "_lease_reply", stalled_reply)
    with Client(node.addr, transport="shm") as c:
        assert c.get(key) is None  # a miss: never the successor's bytes
        assert stalled == [Op.LEASE]
        buf = bytearray(MiB)
        assert c.get_into(successor, buf) == MiB and buf == other
    monkeypatch.undo()
    with Client(node.addr, transport="grpc") as c:
        assert c.remove(successor)



def _region_offset(node: NodeProcess, key: bytes) -> int:
    """Where ``key``'s block lies in the node's region (a same-host lease, released)."""
    s = _connect_shm(node)
    try:
        s.sendall(HEADER.pack(Op.LEASE, 1, 16) + key)
        status, _, meta = _reply(s)
        lease, offset, _ = wire.LEASE_ITEM.unpack(meta)
        assert status == 0 and lease
        s.sendall(HEADER.pack(Op.RELEASE, 1, 8) + wire.pack_ids([lease]))
        return offset
    finally:
        s.close()


def test_a_writer_that_resumes_after_its_reservation_expired_changes_no_other_block(
        node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.core.errors import InvalidArgument
    from kvstore.remote.channel_client import ChannelConnection

    size = 3 * MiB + 12345  # a length no other test uses: the freed extent is reused exactly
    key, successor = b"W" * 16, b"V" * 16
    late, theirs = b"\x5a" * size, b"\xa5" * size
    base = _used(node)
    real_take = ChannelConnection._take_new_staging
    reserved: list[int] = []

    def stalled_take(self: ChannelConnection, reply: bytes) -> None:
        real_take(self, reply)  # the RESERVE's answer, read before the copy
        if not reserved:  # this client's one put: the late writer's RESERVE
            # Its space in the region (a staged reply names it after the staging slot).
            staged = len(reply) == getattr(wire, "RESERVE_STAGED_ITEM", wire.RESERVE_ITEM).size
            reserved.append(wire.RESERVE_STAGED_ITEM.unpack(reply)[2] if staged
                            else wire.RESERVE_ITEM.unpack(reply)[1])
            # The writer is paused here, between its reservation and its copy: the node
            # expires the reservation, and another block takes exactly its space.
            wait_until(lambda: _used(node) == base, timeout=30,
                       what="the paused writer's reservation to expire")
            with Client(node.addr, transport="grpc") as c:
                assert c.put(successor, theirs)
            assert _region_offset(node, successor) == reserved[0]
        # the writer resumes: it copies its bytes, then commits

    monkeypatch.setattr(ChannelConnection, "_take_new_staging", stalled_take)
    with Client(node.addr, transport="shm") as c, pytest.raises(InvalidArgument):
        c.put(key, late)  # its commit fails: nothing of it was stored
    monkeypatch.undo()
    assert reserved
    with Client(node.addr, transport="grpc") as c:
        assert c.get(successor) == theirs  # not one byte of the late writer's
        assert c.exists([key]) == [False]
        assert c.remove(successor)


def _connect_staged(node: NodeProcess) -> tuple[socket.socket, list[int]]:
    """A same-host connection that asks for staged puts: the socket and the descriptors
    its HELLO reply brought (the region, then the first staging area)."""
    from kvstore.server import host_id

    with grpc.insecure_channel(node.addr) as ch:
        info = pb_grpc.KVStoreStub(ch).OpenChannel(
            pb.OpenChannelRequest(client_host_id=host_id()), timeout=10)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect("\0" + info.unix_path[1:])
    s.sendall(wire.HELLO_CAPS.pack(wire.MAGIC, info.token, wire.Mode.SHM,
                                   wire.CAP_STAGED_PUTS))
    msg, fds, _, _ = socket.recv_fds(s, wire.HELLO_REPLY_CAPS.size, 2, socket.MSG_WAITALL)
    status, caps, _ = wire.HELLO_REPLY_CAPS.unpack(msg)
    assert (status, caps, len(fds)) == (0, wire.CAP_STAGED_PUTS, 2)
    return s, fds


def _reserve_staged(s: socket.socket, key: bytes, size: int
                    ) -> tuple[int, int, int, int, list[int]]:
    """(reservation id, staging slot, region offset, staging generation, descriptors that
    rode along)."""
    s.sendall(HEADER.pack(Op.RESERVE, 1, wire.PUT_ITEM.size)
              + wire.PUT_ITEM.pack(key, bytes(16), size, 0))
    head, fds, _, _ = socket.recv_fds(s, HEADER.size, 1, socket.MSG_WAITALL)
    status, _, meta_len = HEADER.unpack(head)
    assert status == 0
    rid, slot, offset, state, generation = wire.RESERVE_STAGED_ITEM.unpack(
        wire.recv_exact(s, meta_len))
    assert state == wire.RESERVE_OK
    return rid, slot, offset, generation, fds


def test_a_late_writer_on_its_own_connection_writes_where_nobody_reads(
        node: NodeProcess) -> None:
    """The same connection reserves again after its reservation expired and gets the same
    space: the new reservation comes with a new staging area, and the late bytes written
    into the old one never reach the region."""
    import mmap

    size = 3 * MiB + 54321
    key, successor = b"X" * 16, b"Y" * 16
    base = _used(node)
    s, (region_fd, first_fd) = _connect_staged(node)
    try:
        with pytest.raises(PermissionError):  # the region comes read-only
            mmap.mmap(region_fd, MiB, flags=mmap.MAP_SHARED)
        old_area = mmap.mmap(first_fd, 0, flags=mmap.MAP_SHARED)  # all of it
        rid, slot, offset, generation, fds = _reserve_staged(s, key, size)
        assert (generation, fds) == (1, [])  # the area of the HELLO
        # The writer is paused: the node expires its reservation.
        wait_until(lambda: _used(node) == base, timeout=30, what="the reservation to expire")
        rid2, slot2, offset2, generation2, fds = _reserve_staged(s, successor, size)
        assert (offset2, generation2, len(fds)) == (offset, 2, 1)  # same space, new area
        new_area = mmap.mmap(fds[0], 0, flags=mmap.MAP_SHARED)
        new_area[slot2:slot2 + size] = b"\xa5" * size
        old_area[slot:slot + size] = b"\x5a" * size  # the late writer resumes
        s.sendall(HEADER.pack(Op.COMMIT, 1, 8) + wire.pack_ids([rid2]))
        assert _reply(s) == (0, 1, b"\x01")
        s.sendall(HEADER.pack(Op.COMMIT, 1, 8) + wire.pack_ids([rid]))
        assert _reply(s)[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        with Client(node.addr, transport="grpc") as c:
            assert c.get(successor) == b"\xa5" * size
            assert c.exists([key]) == [False]
            assert c.remove(successor)
        for fd in fds:
            os.close(fd)
        new_area.close()
        old_area.close()
    finally:
        os.close(region_fd)
        os.close(first_fd)
        s.close()


def test_a_client_from_before_staged_puts_still_puts_through_the_region(
        node: NodeProcess) -> None:
    import mmap

    key, value = b"O" * 16, os.urandom(2 * MiB)
    s = _connect_shm(node)  # the old HELLO: no capabilities
    try:
        s.sendall(HEADER.pack(Op.RESERVE, 1, wire.PUT_ITEM.size)
                  + wire.PUT_ITEM.pack(key, bytes(16), len(value), 0))
        status, _, meta = _reply(s)
        rid, offset, state = wire.RESERVE_ITEM.unpack(meta)
        assert status == 0 and state == wire.RESERVE_OK
        region_fd = _region_fd(node)
        try:
            region = mmap.mmap(region_fd, offset + len(value), flags=mmap.MAP_SHARED)
            region[offset:offset + len(value)] = value
            region.close()
        finally:
            os.close(region_fd)
        s.sendall(HEADER.pack(Op.COMMIT, 1, 8) + wire.pack_ids([rid]))
        assert _reply(s) == (0, 1, b"\x01")
    finally:
        s.close()
    with Client(node.addr, transport="grpc") as c:
        assert c.get(key) == value
        assert c.remove(key)


def test_unknown_ids_are_refused_or_ignored_and_the_stream_goes_on(node: NodeProcess) -> None:
    s = _connect_shm(node)
    try:
        ids = wire.pack_ids([0, 7, (1 << 64) - 1])
        s.sendall(HEADER.pack(Op.RELEASE, 3, 24) + ids)  # no reply: nothing to release
        s.sendall(HEADER.pack(Op.ABORT, 3, 24) + ids)  # no reply: nothing to abort
        s.sendall(HEADER.pack(Op.RELEASE_CHECK, 3, 24) + ids)
        assert _reply(s) == (0, 3, b"\x00\x00\x00")
        s.sendall(HEADER.pack(Op.COMMIT, 3, 24) + ids)
        status, _, meta = _reply(s)
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert b"reservation 0 is unknown or expired" in meta
        assert _exists(s, SMALL_KEY)
    finally:
        s.close()


def test_connections_past_the_cap_are_closed_and_the_cap_frees_up() -> None:
    from kvstore.auth.security import OPEN
    from kvstore.node.channel_server import ChannelServer
    from kvstore.node.semantics import Node, NodeSettings

    node = Node(NodeSettings(dram_bytes=8 * MiB, prefault=False))
    server = ChannelServer(node, host="127.0.0.1", port=0, unix_name=None, max_connections=2)
    server.start()
    addr = server.tcp_address
    token = server.token_for(OPEN)
    held = [socket.create_connection(addr, timeout=30) for _ in range(2)]
    try:
        for s in held:  # both served (a thread each): their hello is answered
            s.sendall(wire.HELLO.pack(wire.MAGIC, token, wire.Mode.TCP))
            assert _hello(s) == 0
        third = socket.create_connection(addr, timeout=30)
        assert _closed(third)  # over the cap: closed before a byte is read
        third.close()
        held.pop().close()

        def admitted() -> bool:
            s = socket.create_connection(addr, timeout=30)
            try:
                s.sendall(wire.HELLO.pack(wire.MAGIC, token, wire.Mode.TCP))
                return s.recv(1) != b""
            except ConnectionError:
                return False
            finally:
                s.close()

        wait_until(admitted, what="a slot to free up once a connection ended")
        assert _exists(held[0], SMALL_KEY) is False  # the first one still serves
    finally:
        for s in held:
            s.close()
        server.stop()
        node.close()


def test_a_channel_op_marked_cluster_only_is_refused_to_tenants(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.auth import tenancy
    from kvstore.auth.security import Principal, Tenant
    from kvstore.node.channel_server import ChannelServer, _Connection
    from kvstore.node.semantics import Node, NodeSettings

    original = _Connection.on_exists

    @tenancy.cluster_only  # the one line a new op of the cluster's carries
    def on_exists(self: _Connection, count: int, meta: bytes) -> None:
        original(self, count, meta)

    monkeypatch.setattr(_Connection, "on_exists", on_exists)
    node = Node(NodeSettings(dram_bytes=8 * MiB, prefault=False))
    server = ChannelServer(node, host="127.0.0.1", port=0, unix_name=None)
    server.start()
    try:
        tenant = Principal(tenant=Tenant(name="t", token_sha256=b"\x01" * 32))
        cluster = Principal(tenant=Tenant(name="c", token_sha256=b"\x02" * 32, role="cluster"))
        for who, allowed in ((tenant, False), (cluster, True)):
            s = socket.create_connection(server.tcp_address, timeout=30)
            try:
                s.sendall(wire.HELLO.pack(wire.MAGIC, server.token_for(who), wire.Mode.TCP))
                assert _hello(s) == 0
                s.sendall(HEADER.pack(Op.EXISTS, 1, 16) + SMALL_KEY)
                status, _, meta = _reply(s)
                if allowed:
                    assert (status, meta) == (0, b"\x00")
                else:
                    assert status == grpc.StatusCode.PERMISSION_DENIED.value[0]
                    assert b"EXISTS needs a cluster-role token; tenant 't'" in meta
                    s.sendall(HEADER.pack(Op.GET, 1, 16) + SMALL_KEY)  # the stream goes on
                    assert _reply(s) == (0, 1, wire.pack_ids([wire.MISS]))
            finally:
                s.close()
    finally:
        server.stop()
        node.close()
