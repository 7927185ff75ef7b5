"""Garbage at every door of one node: gRPC bodies, transfer-channel bytes, odd frames.

Whatever arrives, the node answers with OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED
(never INTERNAL, even for a body that does not decode), keeps serving, and the blocks
stored before the fuzzing read back byte-exact at the end.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from conftest import TRANSPORTS, NodeProcess, start_node, wait_until
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import Client
from kvstore.node.semantics import MAX_BATCH
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol import wire
from kvstore.protocol.wire import HEADER, Mode, Op
from kvstore.server import host_id

SC = grpc.StatusCode
OK, INVALID, EXHAUSTED, PRECONDITION, INTERNAL = 0, 3, 8, 9, 13
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Known blocks stored before any fuzzing; the last test reads them all back.
KNOWN: dict[bytes, bytes] = {
    b"\xa5" * 8 + i.to_bytes(8, "big"): os.urandom(n)
    for i, n in enumerate([1, 63, 64, 65, 4096, 100_000, 1 << 20, 3 << 20])
}

METHODS = {
    "Put": pb.PutRequest, "Get": pb.GetRequest, "Remove": pb.RemoveRequest,
    "Exists": pb.ExistsRequest, "PrefixMatch": pb.PrefixMatchRequest,
    "BatchPut": pb.BatchPutRequest, "BatchGet": pb.BatchGetRequest, "Stats": pb.StatsRequest,
    "OpenChannel": pb.OpenChannelRequest, "Locate": pb.LocateRequest,
}


@dataclass(slots=True)
class Channel:
    port: int
    unix_path: str
    token: bytes
    region_bytes: int


@pytest.fixture(scope="module")
def fuzzed(channel_path: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[NodeProcess]:
    """The module's node (one per channel path: native helper, pure Python), holding KNOWN
    (pinned) before any test sends garbage."""
    node = start_node(tmp_path_factory.mktemp(f"fuzzed-{channel_path}"), dram="256MiB")
    try:
        with Client(node.addr, transport="tcp") as c:
            assert c.put_batch(list(KNOWN), list(KNOWN.values()), pin=True) == [True] * len(
                KNOWN)
        yield node
    finally:
        code = node.stop()
    assert code == 0, node.output()


@pytest.fixture(scope="module")
def grpc_channel(fuzzed: NodeProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(fuzzed.addr) as ch:
        yield ch


@pytest.fixture(scope="module")
def chan(grpc_channel: grpc.Channel) -> Channel:
    info = pb_grpc.KVStoreStub(grpc_channel).OpenChannel(
        pb.OpenChannelRequest(client_host_id=host_id()), timeout=10)
    assert info.same_host
    return Channel(info.tcp_port, info.unix_path, info.token, info.region_bytes)


# ---- gRPC bodies ---------------------------------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def proto_like(draw: st.DrawFn, depth: int = 0) -> bytes:
    """Protobuf wire encodings of fields 1..5: usually decodable, with odd types and sizes."""
    out = bytearray()
    for _ in range(draw(st.integers(0, 5))):
        field = draw(st.integers(1, 6))
        kind = draw(st.sampled_from(["varint", "bytes", "message", "fixed64", "fixed32"]))
        if kind == "varint":
            out += _varint(field << 3) + _varint(draw(st.integers(0, (1 << 64) - 1)))
        elif kind in ("bytes", "message"):
            if kind == "message" and depth < 2:
                body = draw(proto_like(depth + 1))
            else:
                size = draw(st.sampled_from([0, 1, 15, 16, 17, 33]) | st.integers(0, 300))
                body = draw(st.binary(min_size=size, max_size=size))
            out += _varint(field << 3 | 2) + _varint(len(body)) + body
        elif kind == "fixed64":
            out += _varint(field << 3 | 1) + draw(st.binary(min_size=8, max_size=8))
        else:
            out += _varint(field << 3 | 5) + draw(st.binary(min_size=4, max_size=4))
    return bytes(out)


def _call_raw(ch: grpc.Channel, method: str, body: bytes) -> tuple[SC, str]:
    call = ch.unary_unary(f"/kvstore.v1.KVStore/{method}", request_serializer=None,
                          response_deserializer=None)
    try:
        call(body, timeout=20)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return SC.OK, ""


def _check_grpc_status(method: str, body: bytes, code: SC, details: str) -> None:
    try:
        request = METHODS[method].FromString(body)
    except DecodeError:
        assert code is SC.INVALID_ARGUMENT, (code, details)
        assert details.startswith("malformed "), details
        return
    assert code in (SC.OK, SC.INVALID_ARGUMENT, SC.RESOURCE_EXHAUSTED), (
        method, request, code, details)
    if code is not SC.OK:
        assert details, "an error needs a message"


@pytest.mark.parametrize("method", sorted(METHODS))
@FUZZ
@given(body=st.binary(max_size=600))
def test_random_grpc_bodies(grpc_channel: grpc.Channel, method: str, body: bytes) -> None:
    code, details = _call_raw(grpc_channel, method, body)
    _check_grpc_status(method, body, code, details)


@pytest.mark.parametrize("method", sorted(METHODS))
@FUZZ
@given(body=proto_like())
def test_decodable_grpc_garbage(grpc_channel: grpc.Channel, method: str, body: bytes) -> None:
    code, details = _call_raw(grpc_channel, method, body)
    _check_grpc_status(method, body, code, details)


_any_key = st.binary(min_size=16, max_size=16) | st.binary(max_size=20)


def _put_request() -> st.SearchStrategy[pb.PutRequest]:
    return st.builds(pb.PutRequest, key=_any_key, value=st.binary(max_size=300),
                     parent=st.just(b"") | _any_key, pin=st.booleans())


REQUESTS = {
    "Put": _put_request(),
    "Get": st.builds(pb.GetRequest, key=_any_key),
    "Remove": st.builds(pb.RemoveRequest, key=st.binary(max_size=20)),  # spares KNOWN
    "Exists": st.builds(pb.ExistsRequest, keys=st.lists(_any_key | st.sampled_from(
        sorted(KNOWN)), max_size=8)),
    "PrefixMatch": st.builds(pb.PrefixMatchRequest, keys=st.lists(_any_key, max_size=8)),
    "BatchPut": st.builds(pb.BatchPutRequest, items=st.lists(_put_request(), max_size=5)),
    "BatchGet": st.builds(pb.BatchGetRequest, keys=st.lists(_any_key | st.sampled_from(
        sorted(KNOWN)), max_size=8)),
    "Stats": st.builds(pb.StatsRequest),
    "OpenChannel": st.builds(pb.OpenChannelRequest, client_host_id=st.text(max_size=40)),
    "Locate": st.builds(pb.LocateRequest, keys=st.lists(_any_key, max_size=8)),
}


@pytest.mark.parametrize("method", sorted(METHODS))
@FUZZ
@given(data=st.data())
def test_well_typed_requests_with_odd_values(grpc_channel: grpc.Channel, method: str,
                                             data: st.DataObject) -> None:
    request = data.draw(REQUESTS[method])
    # Trailing garbage fields: unknown ones are kept, known ones merge into the request.
    body = request.SerializeToString() + data.draw(st.just(b"") | proto_like())
    code, details = _call_raw(grpc_channel, method, body)
    _check_grpc_status(method, body, code, details)
    if method == "BatchGet" and code is SC.OK:
        decoded = pb.BatchGetRequest.FromString(body)
        reply = pb_grpc.KVStoreStub(grpc_channel).BatchGet(decoded, timeout=20)
        for k, item in zip(decoded.keys, reply.items, strict=True):
            if k in KNOWN:
                assert item.found and item.value == KNOWN[k]


# ---- the transfer channel ------------------------------------------------------------------

def _tcp(c: Channel) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", c.port), timeout=20)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_to_end(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the node sends until it closes; True if it reset instead of closing."""
    data = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        return bytes(data), True
    return bytes(data), False


def _hello(sock: socket.socket, c: Channel, mode: Mode) -> mmap.mmap | None:
    sock.sendall(wire.HELLO.pack(wire.MAGIC, c.token, mode))
    if mode is Mode.SHM:
        msg, fds, _, _ = socket.recv_fds(sock, wire.HELLO_REPLY.size, 1)
        assert len(fds) == 1
        try:
            region = mmap.mmap(fds[0], c.region_bytes, flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ)
        finally:
            os.close(fds[0])
    else:
        msg, region = wire.recv_exact(sock, wire.HELLO_REPLY.size), None
    assert wire.HELLO_REPLY.unpack(msg) == (OK, c.region_bytes)
    return region


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_instead_of_hello(chan: Channel, data: bytes) -> None:
    with _tcp(chan) as sock:
        sock.sendall(data)
        # The node may already have answered a bad hello and reset the connection.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        reply, reset = _read_to_end(sock)
    if len(data) < wire.HELLO.size:
        assert reply == b"" and not reset  # the hello never completed
    elif reply or not reset:  # extra bytes left unread may turn the close into a reset
        assert reply == wire.HELLO_REPLY.pack(16, 0)  # UNAUTHENTICATED


@FUZZ
@given(mode=st.integers(0, 255), pad=st.binary(min_size=3, max_size=3))
def test_hello_with_any_mode_byte(chan: Channel, mode: int, pad: bytes) -> None:
    hello = wire.MAGIC + chan.token + bytes([mode]) + pad
    with _tcp(chan) as sock:
        sock.sendall(hello)
        status, region = wire.HELLO_REPLY.unpack(wire.recv_exact(sock, wire.HELLO_REPLY.size))
        if mode == Mode.TCP:
            assert (status, region) == (OK, chan.region_bytes)
        else:  # unknown, or shared memory over TCP
            assert (status, region) == (INVALID, 0)
            sock.shutdown(socket.SHUT_WR)
            assert _read_to_end(sock) == (b"", False)


def _first_frame_is_malformed(data: bytes, mode: Mode) -> bool | None:
    """Whether the first request frame in ``data`` breaks the format (None: incomplete)."""
    if len(data) < HEADER.size:
        return None
    op, count, meta_len = HEADER.unpack_from(data)
    allowed = {Op.GET, Op.PUT, Op.EXISTS, Op.PREFIX, Op.REMOVE, Op.RPUT}
    if mode is Mode.SHM:
        allowed |= {Op.LEASE, Op.RELEASE, Op.RESERVE, Op.COMMIT, Op.ABORT, Op.RCOMMIT,
                    Op.RELEASE_CHECK}
    if op not in allowed or count > MAX_BATCH:
        return True
    return meta_len != count * wire.meta_item_size(Op(op))


@FUZZ
@given(data=st.binary(max_size=3000))
def test_random_bytes_after_hello(chan: Channel, data: bytes) -> None:
    with _tcp(chan) as sock:
        _hello(sock, chan, Mode.TCP)
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        reply, _reset = _read_to_end(sock)
    if _first_frame_is_malformed(data, Mode.TCP):
        # One INVALID_ARGUMENT frame, then the node closes: it cannot resynchronise.
        status, count, meta_len = HEADER.unpack_from(reply)
        assert (status, count) == (INVALID, 0)
        assert len(reply) == HEADER.size + meta_len
        assert reply[HEADER.size:].decode("utf-8")
    elif len(reply) >= HEADER.size:
        assert reply[0] in (OK, INVALID, EXHAUSTED), reply[:16]


# ---- well-formed headers, random ops, counts and metadata --------------------------------

@dataclass(slots=True)
class Frame:
    op: int
    count: int
    meta: bytes
    payload: bytes = b""
    keys: tuple[bytes, ...] = ()
    malformed: bool = False  # the node must reply INVALID_ARGUMENT and close
    abandoned: bool = False  # a PUT item larger than the node: RESOURCE_EXHAUSTED, close

    def encode(self) -> bytes:
        return HEADER.pack(self.op, self.count, len(self.meta)) + self.meta + self.payload


_random_key = st.binary(min_size=16, max_size=16)
_read_key = _random_key | st.sampled_from(sorted(KNOWN))


@st.composite
def frames(draw: st.DrawFn, mode: Mode, region_bytes: int) -> Frame:
    op = draw(st.integers(0, 14))
    count = draw(st.integers(0, 5))
    keys: tuple[bytes, ...] = ()
    payload = b""
    abandoned = False
    if op in (Op.GET, Op.EXISTS, Op.PREFIX, Op.LEASE):
        keys = tuple(draw(st.lists(_read_key, min_size=count, max_size=count)))
        meta = b"".join(keys)
    elif op == Op.REMOVE:  # never a known block
        meta = b"".join(draw(st.lists(_random_key, min_size=count, max_size=count)))
    elif op in (Op.RELEASE, Op.COMMIT, Op.ABORT):
        ids = draw(st.lists(st.integers(0, 6) | st.integers(0, (1 << 64) - 1),
                            min_size=count, max_size=count))
        meta = wire.pack_ids(ids)
    elif op == Op.RCOMMIT:
        meta = b"".join(wire.RCOMMIT_ITEM.pack(draw(st.integers(0, 6)), draw(st.integers(0, 3)),
                                               draw(st.integers(0, 3))) for _ in range(count))
    elif op in (Op.PUT, Op.RESERVE, Op.RPUT):
        items = bytearray()
        sizes = []
        for _ in range(count):
            k = draw(_random_key | st.sampled_from(sorted(KNOWN)))
            parent = draw(_random_key | st.just(k) | st.just(bytes(16)))
            small = st.integers(1, 2048)
            nbytes = draw(st.one_of(small, small, small, st.sampled_from(
                [0, region_bytes + 1, (1 << 64) - 1])))
            if op == Op.RPUT:
                items += wire.RPUT_ITEM.pack(k, parent, nbytes, draw(st.integers(0, 255)),
                                             draw(st.integers(0, 3)), draw(st.integers(0, 3)))
            else:
                items += wire.PUT_ITEM.pack(k, parent, nbytes, draw(st.integers(0, 255)))
            sizes.append(nbytes)
        meta = bytes(items)
        if op in (Op.PUT, Op.RPUT):
            abandoned = any(n > region_bytes for n in sizes)
            if not abandoned:
                payload = draw(st.sampled_from([b"\x00", b"\xff"])) * sum(sizes)
    else:  # not an op at all
        meta = draw(st.binary(max_size=64))
    malformed = False
    if draw(st.integers(0, 9)) == 0:  # a metadata length that does not match the count
        meta += draw(st.binary(min_size=1, max_size=20))
        malformed = True
    allowed = {Op.GET, Op.PUT, Op.EXISTS, Op.PREFIX, Op.REMOVE, Op.RPUT}
    if mode is Mode.SHM:
        allowed |= {Op.LEASE, Op.RELEASE, Op.RESERVE, Op.COMMIT, Op.ABORT, Op.RCOMMIT,
                    Op.RELEASE_CHECK}
    if op not in allowed:
        malformed = True
    return Frame(op, count, meta, payload if not malformed else b"", keys, malformed,
                 abandoned and not malformed)


def _response(sock: socket.socket) -> tuple[int, int, bytes]:
    status, count, meta_len = HEADER.unpack(wire.recv_exact(sock, HEADER.size))
    return status, count, wire.recv_exact(sock, meta_len)


def _assert_closed(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_WR)
    rest, _reset = _read_to_end(sock)
    assert rest == b"", f"the node kept talking after closing the stream: {rest[:32]!r}"


def _check_reply(sock: socket.socket, f: Frame, region: mmap.mmap | None) -> None:
    """Reads and checks the reply to a frame the node must process."""
    status, count, meta = _response(sock)
    if f.op in (Op.RPUT, Op.RCOMMIT):  # a node outside a cluster replicates nothing
        assert status in (INVALID, PRECONDITION), (Op(f.op).name, status, meta[:200])
    assert status in (OK, INVALID, EXHAUSTED, PRECONDITION), (Op(f.op).name, status, meta[:200])
    if status != OK:
        assert count == 0 and meta.decode("utf-8"), meta
        return
    op = Op(f.op)
    if op is Op.GET:
        lengths = wire.unpack_ids(meta, count)
        assert count == f.count
        for k, n in zip(f.keys, lengths, strict=True):
            if k in KNOWN:
                assert n == len(KNOWN[k])
            if n != wire.MISS:
                value = wire.recv_exact(sock, n)
                if k in KNOWN:
                    assert value == KNOWN[k]
    elif op in (Op.PUT, Op.EXISTS, Op.REMOVE, Op.COMMIT):
        assert count == f.count and len(meta) == count and set(meta) <= {0, 1}
        if op is Op.EXISTS:
            assert all(meta[i] for i, k in enumerate(f.keys) if k in KNOWN)
    elif op is Op.PREFIX:
        assert meta == b"" and 0 <= count <= f.count
    elif op is Op.LEASE:
        assert count == f.count and len(meta) == count * wire.LEASE_ITEM.size
        assert region is not None
        for k, (lease, offset, n) in zip(f.keys, wire.LEASE_ITEM.iter_unpack(meta),
                                         strict=True):
            if k in KNOWN:
                assert lease != 0 and n == len(KNOWN[k])
                assert region[offset : offset + n] == KNOWN[k]
    elif op is Op.RESERVE:
        assert count == f.count and len(meta) == count * wire.RESERVE_ITEM.size
        for _rid, offset, state in wire.RESERVE_ITEM.iter_unpack(meta):
            assert state in (wire.RESERVE_EXISTED, wire.RESERVE_OK)
            assert offset < (region.size() if region is not None else 1 << 62)
    else:
        raise AssertionError(f"a reply to {op.name}, which has none")


def _probe(sock: socket.socket) -> None:
    """A valid EXISTS: the stream must still be in step."""
    known = next(iter(KNOWN))
    sock.sendall(HEADER.pack(Op.EXISTS, 2, 32) + known + b"\x00\x11" * 8)
    assert _response(sock) == (OK, 2, b"\x01\x00")


def _fuzz_frames(c: Channel, mode: Mode, sequence: list[Frame]) -> None:
    if mode is Mode.SHM:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(20)
        sock.connect("\0" + c.unix_path[1:])
    else:
        sock = _tcp(c)
    region = None
    try:
        region = _hello(sock, c, mode)
        for f in sequence:
            sock.sendall(f.encode())
            if f.malformed or f.abandoned:
                status, count, meta = _response(sock)
                assert (status, count) == ((INVALID if f.malformed else EXHAUSTED), 0)
                assert meta.decode("utf-8")
                _assert_closed(sock)
                return
            if f.op not in (Op.RELEASE, Op.ABORT):
                _check_reply(sock, f, region)
        _probe(sock)
    finally:
        sock.close()
        if region is not None:
            region.close()


@FUZZ
@given(data=st.data())
def test_well_formed_frames_tcp(chan: Channel, data: st.DataObject) -> None:
    seq = data.draw(st.lists(frames(Mode.TCP, chan.region_bytes), min_size=1, max_size=5))
    _fuzz_frames(chan, Mode.TCP, seq)


@FUZZ
@given(data=st.data())
def test_well_formed_frames_shm(chan: Channel, data: st.DataObject) -> None:
    seq = data.draw(st.lists(frames(Mode.SHM, chan.region_bytes), min_size=1, max_size=5))
    _fuzz_frames(chan, Mode.SHM, seq)


def test_fuzz_can_fail_on_a_wrong_reply(chan: Channel) -> None:
    """The frame checker is not vacuous: a GET of a known key must return its bytes."""
    known = sorted(KNOWN)[3]
    get = Frame(Op.GET, 1, known, keys=(known,))
    _fuzz_frames(chan, Mode.TCP, [get])
    lie = Frame(Op.GET, 1, known, keys=(known,))
    KNOWN[known], saved = b"not the bytes", KNOWN[known]
    try:
        with pytest.raises(AssertionError):
            _fuzz_frames(chan, Mode.TCP, [lie])
    finally:
        KNOWN[known] = saved


# ---- after all of it -----------------------------------------------------------------------

def test_node_survived_and_known_blocks_are_intact(fuzzed: NodeProcess) -> None:
    assert fuzzed.proc.poll() is None, fuzzed.output()
    for transport in TRANSPORTS:
        with Client(fuzzed.addr, transport=transport) as c:
            assert c.get_batch(list(KNOWN)) == list(KNOWN.values())
            for k, v in KNOWN.items():
                out = bytearray(len(v))
                assert c.get_into(k, out) == len(v) and out == v
            assert c.exists(list(KNOWN)) == [True] * len(KNOWN)
            stats = c.stats()
            assert stats["tiers"]["dram"]["blocks"] >= len(KNOWN)
            # Only this Stats call, once the previous calls' scopes have closed (a reply
            # leaves a moment before its request scope ends).
            wait_until(lambda c=c: c.stats()["node"]["in_flight"] <= 1, timeout=5,
                       what="no request left in flight")
    log = fuzzed.output()
    assert "internal error" not in log and "channel connection failed" not in log, log[-3000:]

