"""The native channel helper against hostile bytes, differentially against the Python path.

Each test writes bytes into one end of a socket pair and reads them through the helper
(``kvstore.protocol.native_channel``) on the other: the node's request parser must agree
with the pure-Python reader and ``check_frame`` on every frame (property-based frames,
truncated and oversized lengths, random bytes), and a client must never write past the
buffers it was given, nor hand back a byte the peer did not send for that value.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.core.errors import BufferTooSmall, KVStoreError
from kvstore.node.semantics import MAX_BATCH
from kvstore.protocol import native_channel, wire
from kvstore.protocol.wire import HEADER, Op, ProtocolError

mod, why = native_channel.load()
pytestmark = pytest.mark.skipif(mod is None, reason=f"native helper unavailable: {why}")

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TCP_OPS = (Op.GET, Op.PUT, Op.EXISTS, Op.PREFIX, Op.REMOVE, Op.RPUT)
SIZES = {int(op): wire.meta_item_size(op) for op in TCP_OPS}


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _feed(sock: socket.socket, data: bytes) -> threading.Thread:
    """Writes ``data`` then closes the write side, from a thread (it may exceed the
    socket buffer)."""

    def run() -> None:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the reader closed first

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


Outcome = tuple[str, int, int, bytes]


def _python_requests(data: bytes) -> list[Outcome]:
    """What the pure-Python reader and the node's checks make of ``data``."""
    out: list[Outcome] = []
    pos = 0
    while True:
        if pos == len(data):
            return [*out, ("closed", 0, 0, b"")]
        if len(data) - pos < HEADER.size:
            return [*out, ("short", 0, 0, b"")]
        op, count, meta_len = HEADER.unpack_from(data, pos)
        if (
            op not in SIZES
            or count > MAX_BATCH
            or meta_len != count * SIZES[op]
            or meta_len > wire.MAX_META
        ):
            return [*out, ("rejected", op, count, b"")]
        start = pos + HEADER.size
        if len(data) - start < meta_len:
            return [*out, ("short", 0, 0, b"")]
        out.append(("ok", op, count, data[start : start + meta_len]))
        pos = start + meta_len


def _native_requests(
    pair: tuple[socket.socket, socket.socket], data: bytes, bufsize: int
) -> list[Outcome]:
    a, b = pair
    t = _feed(a, data)
    stream = native_channel.server_stream(b, SIZES, MAX_BATCH)
    assert stream is not None
    if bufsize != 64 << 10:  # a small buffer: every meta past it takes the long way
        stream = native_channel.ServerStream(mod, b, SIZES, MAX_BATCH, size=bufsize)
    out: list[Outcome] = []
    try:
        while True:
            try:
                op, count, meta = stream.next_request()
            except wire.PeerClosed:
                return [*out, ("closed", 0, 0, b"")]
            except native_channel.FrameRejected as bad:
                return [*out, ("rejected", bad.op, bad.count, b"")]
            except ConnectionError:
                return [*out, ("short", 0, 0, b"")]
            out.append(("ok", op, count, meta))
    finally:
        b.close()
        t.join()


def _frame(op: int, count: int, meta_len: int, meta: bytes) -> bytes:
    return HEADER.pack(op, count, meta_len) + meta


frames = st.builds(
    lambda op, count, delta, fill, cut: (op, count, delta, fill, cut),
    st.one_of(st.sampled_from([int(o) for o in Op]), st.integers(0, 255)),
    st.one_of(st.integers(0, 8), st.sampled_from([MAX_BATCH, MAX_BATCH + 1, (1 << 32) - 1])),
    st.sampled_from([0, 0, 0, 1, -1, 16, 1 << 40, (1 << 64) - 1]),
    st.binary(max_size=64),
    st.one_of(st.none(), st.integers(0, 400)),
)


def _build(parts: list[tuple[int, int, int, bytes, int | None]]) -> bytes:
    """Frames whose meta is count x item size (then nudged by delta), the last maybe cut."""
    out = bytearray()
    for op, count, delta, fill, cut in parts:
        size = SIZES.get(op, 16)
        meta_len = max(0, min(count * size, 4096) + delta) % (1 << 64)
        if count * size > 4096:
            meta_len = (count * size + delta) % (1 << 64)
        body = (fill * (min(meta_len, 4096) // max(1, len(fill)) + 1))[: min(meta_len, 4096)]
        frame = _frame(op, count, meta_len, body.ljust(min(meta_len, 4096), b"\0"))
        out += frame if cut is None else frame[:cut]
    return bytes(out)


@FUZZ
@given(parts=st.lists(frames, max_size=4), bufsize=st.sampled_from([32, 100, 64 << 10]))
def test_requests_parse_as_the_python_path_does(parts: list, bufsize: int) -> None:
    data = _build(parts)
    a, b = socket.socketpair()
    with a, b:
        assert _native_requests((a, b), data, bufsize) == _python_requests(data)


@FUZZ
@given(data=st.binary(max_size=2000), bufsize=st.sampled_from([32, 64 << 10]))
def test_random_bytes_parse_as_the_python_path_does(data: bytes, bufsize: int) -> None:
    a, b = socket.socketpair()
    with a, b:
        assert _native_requests((a, b), data, bufsize) == _python_requests(data)


def test_a_frame_split_across_many_writes_is_one_request(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    keys = bytes(range(64))
    data = _frame(Op.GET, 4, 64, keys) + _frame(Op.EXISTS, 1, 16, b"k" * 16)

    def trickle() -> None:
        for i in range(len(data)):
            a.sendall(data[i : i + 1])
        a.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=trickle)
    t.start()
    stream = native_channel.ServerStream(mod, b, SIZES, MAX_BATCH, size=32)
    assert stream.next_request() == (Op.GET, 4, keys)
    assert stream.next_request() == (Op.EXISTS, 1, b"k" * 16)
    with pytest.raises(wire.PeerClosed):
        stream.next_request()
    t.join()


def test_values_land_in_place_after_the_buffered_head(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    value = bytes(range(256)) * 1000
    meta = wire.PUT_ITEM.pack(b"k" * 16, bytes(16), len(value), 0)
    t = _feed(a, _frame(Op.PUT, 1, len(meta), meta) + value + _frame(Op.REMOVE, 1, 16, b"r" * 16))
    stream = native_channel.server_stream(b, SIZES, MAX_BATCH)
    assert stream is not None
    assert stream.next_request() == (Op.PUT, 1, meta)
    dest = bytearray(len(value) + 8)
    stream.read_into(memoryview(dest)[: len(value)])
    assert dest == value + bytes(8)
    assert stream.next_request() == (Op.REMOVE, 1, b"r" * 16)
    t.join()


@FUZZ
@given(sizes=st.lists(st.sampled_from([0, 1, 600, 4000, 16383, 16384, 40000, 70000]),
                      min_size=1, max_size=6),
       bufsize=st.sampled_from([32, 100, 5000, 64 << 10]), trickle=st.booleans())
def test_every_value_of_a_put_batch_lands_whole_and_in_frame(sizes: list[int], bufsize: int,
                                                             trickle: bool) -> None:
    """Values of any size after a put's meta, read one by one (buffered head, refills of a
    short rest, or straight from the socket, any buffer size, arriving at once or in
    pieces), each byte for byte, and the stream stays in frame for the next request."""
    values = [bytes([(i * 7 + j) % 251 for j in range(min(n, 251))]) * (n // 251 + 1)
              for i, n in enumerate(sizes)]
    values = [v[:n] for v, n in zip(values, sizes, strict=True)]
    meta = b"".join(wire.PUT_ITEM.pack(bytes([i]) * 16, bytes(16), n, 0)
                    for i, n in enumerate(sizes))
    data = _frame(Op.PUT, len(sizes), len(meta), meta) + b"".join(values) + _frame(
        Op.REMOVE, 1, 16, b"r" * 16)
    a, b = socket.socketpair()
    with a, b:
        if trickle:
            def run() -> None:
                for i in range(0, len(data), 1500):
                    a.sendall(data[i:i + 1500])
            t = threading.Thread(target=run)
            t.start()
        else:
            t = _feed(a, data)
        stream = native_channel.ServerStream(mod, b, SIZES, MAX_BATCH, size=bufsize)
        assert stream.next_request() == (Op.PUT, len(sizes), meta)
        for value in values:
            dest = bytearray(len(value) + 1)
            stream.read_into(memoryview(dest)[: len(value)])
            assert dest[: len(value)] == value and dest[-1] == 0
        assert stream.next_request() == (Op.REMOVE, 1, b"r" * 16)
        t.join()


def test_a_large_value_is_received_in_place_not_through_the_buffer(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Everything has arrived, but reading the request takes in little past its meta: the
    64 KiB value then goes straight into its slot instead of being copied through the
    64 KiB buffer."""
    a, b = pair
    value = bytes(range(256)) * 256
    meta = wire.PUT_ITEM.pack(b"k" * 16, bytes(16), len(value), 0)
    a.sendall(_frame(Op.PUT, 1, len(meta), meta) + value)
    stream = native_channel.server_stream(b, SIZES, MAX_BATCH)
    assert stream is not None
    assert stream.next_request() == (Op.PUT, 1, meta)
    assert 0 < stream.buffered <= 4096 - HEADER.size - len(meta)
    dest = bytearray(len(value))
    stream.read_into(memoryview(dest))
    assert dest == value and stream.buffered == 0


def test_a_batch_of_small_values_is_read_through_one_refill(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Small values come through the buffer: the first one not buffered whole refills it
    with all that has arrived (the rest of the batch), not one recv per value."""
    a, b = pair
    values = [bytes([i]) * 600 for i in range(20)]
    meta = b"".join(wire.PUT_ITEM.pack(bytes([i]) * 16, bytes(16), 600, 0) for i in range(20))
    a.sendall(_frame(Op.PUT, 20, len(meta), meta) + b"".join(values))
    stream = native_channel.server_stream(b, SIZES, MAX_BATCH)
    assert stream is not None
    assert stream.next_request() == (Op.PUT, 20, meta)
    refills = []
    for i, value in enumerate(values):
        before = stream.buffered
        dest = bytearray(600)
        stream.read_into(memoryview(dest))
        assert dest == value
        if before < 600:
            refills.append((i, stream.buffered))
    assert len(refills) == 1
    i, after = refills[0]
    assert after == (len(values) - 1 - i) * 600


def test_a_stall_inside_a_frame_leaves_it_buffered(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    wire.set_stall_timeout(b, 0.05)
    stream = native_channel.server_stream(b, SIZES, MAX_BATCH)
    assert stream is not None
    with pytest.raises(wire.STALLED):  # idle: nothing buffered
        stream.next_request()
    assert stream.buffered == 0
    a.sendall(_frame(Op.GET, 1, 16, b"x" * 8))
    with pytest.raises(wire.STALLED):  # inside a frame
        stream.next_request()
    assert stream.buffered == HEADER.size + 8
    a.sendall(b"y" * 8)
    assert stream.next_request() == (Op.GET, 1, b"x" * 8 + b"y" * 8)


# ---- the client: hostile replies ----------------------------------------------------------

CANARY = b"\xee" * 64


def _client_get(
    pair: tuple[socket.socket, socket.socket], reply: bytes, n: int, caps: list[int | None],
    split: bool = False,
) -> tuple[list | BaseException, list[bytearray]]:
    """A GET of ``n`` keys answered by ``reply``: in one call, or (``split``) sent first
    and its reply read by ``get_reply``, as a pipelined get does."""
    a, b = pair
    t = _feed(a, reply)
    stream = native_channel.client_stream(b)
    assert stream is not None
    bufs = [bytearray(c or 0) + CANARY for c in caps]
    outs = [None if c is None else memoryview(buf)[:c] for c, buf in zip(caps, bufs, strict=True)]
    keys = [bytes([i]) * 16 for i in range(n)]
    try:
        got: list | BaseException
        if split:
            stream.send_frame(Op.GET, n, b"".join(keys))
            got = stream.get_reply(n, outs)
        else:
            got = stream.get(keys, outs)
    except (ProtocolError, ConnectionError, KVStoreError) as exc:
        got = exc
    b.close()
    t.join()
    return got, bufs


lengths_st = st.lists(
    st.one_of(
        st.integers(0, 300), st.just(wire.MISS), st.integers(wire.MAX_REPLY_BYTES, (1 << 64) - 2)
    ),
    min_size=0,
    max_size=5,
)


@FUZZ
@given(
    lengths=lengths_st,
    status=st.sampled_from([0, 0, 0, 3, 8]),
    count_delta=st.sampled_from([0, 0, 1, -1]),
    meta_delta=st.sampled_from([0, 0, 8, -8]),
    caps=st.lists(st.one_of(st.none(), st.integers(0, 300)), min_size=5, max_size=5),
    cut=st.one_of(st.none(), st.integers(0, 2000)),
    seed=st.integers(0, 255),
    split=st.booleans(),
)
def test_a_get_never_writes_past_its_buffers_nor_serves_a_wrong_byte(
    lengths: list[int],
    status: int,
    count_delta: int,
    meta_delta: int,
    caps: list[int | None],
    cut: int | None,
    seed: int,
    split: bool,
) -> None:
    """Whole (``get``) or its reply alone (``get_reply``, after the request was sent)."""
    n = len(lengths)
    caps = caps[:n]
    values = [
        bytes((seed + i + j) % 256 for j in range(m)) if m <= 300 else b""
        for i, m in enumerate(lengths)
    ]
    meta = struct.pack(f"<{n}Q", *lengths)
    if meta_delta > 0:
        meta += bytes(meta_delta)
    elif meta_delta < 0:
        meta = meta[:meta_delta]
    body = meta + b"".join(values) if status == 0 else b"error text"
    reply = HEADER.pack(status, max(0, n + count_delta), len(body) if status else len(meta))
    reply += body
    if cut is not None:
        reply = reply[:cut]
    a, b = socket.socketpair()
    with a, b:
        got, bufs = _client_get((a, b), reply, n, caps, split)
    for cap, buf in zip(caps, bufs, strict=True):
        assert buf[(cap or 0) :] == CANARY  # nothing past the buffer given
    if isinstance(got, BaseException):
        return
    # Answered: the reply was well formed, and every value is the peer's bytes for it.
    assert status == 0 and max(0, n + count_delta) == n and len(meta) == 8 * n
    assert all(m == wire.MISS or m <= 300 for m in lengths)
    for i, (m, r) in enumerate(zip(lengths, got, strict=True)):
        if m == wire.MISS:
            assert r is None
        elif caps[i] is None:
            assert r == values[i]
        else:
            assert r == m and bufs[i][:m] == values[i]


def test_too_small_a_buffer_is_reported_and_the_stream_stays_in_frame(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    values = [b"a" * 10, b"b" * 20, b"c" * 5]
    reply = (
        HEADER.pack(0, 3, 24)
        + struct.pack("<3Q", 10, 20, 5)
        + b"".join(values)
        + HEADER.pack(0, 1, 1)
        + b"\x01"
    )
    a, b = pair
    t = _feed(a, reply)
    stream = native_channel.client_stream(b)
    assert stream is not None
    outs = [bytearray(10), bytearray(19), bytearray(5)]
    with pytest.raises(BufferTooSmall):
        stream.get([b"k" * 16] * 3, [memoryview(o) for o in outs])
    assert outs[0] == values[0] and outs[1] == bytes(19) and outs[2] == values[2]
    assert stream.call(Op.EXISTS, 1, b"k" * 16) == (1, b"\x01")
    t.join()


def test_an_error_reply_raises_its_error_with_its_text(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    t = _feed(a, wire.error_frame(8, "too big", "reply-too-large"))
    stream = native_channel.client_stream(b)
    assert stream is not None
    with pytest.raises(KVStoreError, match="too big"):
        stream.call(Op.EXISTS, 1, b"k" * 16)
    t.join()


# ---- the fallback: where the native path is not taken -------------------------------------


def test_the_environment_switch_selects_the_python_path(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = pair
    monkeypatch.setenv(native_channel.ENV, "0")
    assert not native_channel.enabled()
    assert native_channel.client_stream(a) is None
    assert native_channel.server_stream(a, SIZES, MAX_BATCH) is None
    monkeypatch.setenv(native_channel.ENV, "1")
    assert native_channel.enabled()
    assert native_channel.client_stream(a) is not None


def test_a_build_that_cannot_load_leaves_the_python_path(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    a, _ = pair
    monkeypatch.setitem(sys.modules, "kvstore.protocol._channel", None)  # as if never built
    monkeypatch.setattr(native_channel, "_module", None)
    monkeypatch.setattr(native_channel, "_loaded", False)
    monkeypatch.setattr(native_channel, "_why", None)
    got, reason = native_channel.load()
    assert got is None and reason is not None and "cffi_build.channel_build" in reason
    assert not native_channel.enabled()
    assert native_channel.client_stream(a) is None
