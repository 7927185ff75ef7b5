"""Transfer-channel framing helpers over real socket pairs."""

from __future__ import annotations

import socket
import threading

import pytest

from kvstore.core.errors import (
    REPLY_BOUND,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    ReplyTooLarge,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.protocol import wire


def test_send_buffers_survives_partial_sends() -> None:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    parts = [bytes([i]) * n for i, n in enumerate([1, 70_000, 0, 3, 1_000_000, 5])]
    received = bytearray(sum(map(len, parts)))
    t = threading.Thread(target=wire.recv_exact_into, args=(b, memoryview(received)))
    t.start()
    wire.send_buffers(a, [memoryview(p) for p in parts])
    t.join()
    assert bytes(received) == b"".join(parts)
    a.close()
    b.close()


def test_send_buffers_more_than_iov_max() -> None:
    a, b = socket.socketpair()
    parts = [bytes([i % 251]) for i in range(3000)]
    out = bytearray(3000)
    t = threading.Thread(target=wire.recv_exact_into, args=(b, memoryview(out)))
    t.start()
    wire.send_buffers(a, parts)
    t.join()
    assert bytes(out) == b"".join(parts)


def test_recv_exact_reports_where_the_stream_ended() -> None:
    a, b = socket.socketpair()
    a.sendall(b"abc")
    a.close()
    with pytest.raises(ConnectionError, match="3 of 10"):
        wire.recv_exact(b, 10)
    c, d = socket.socketpair()
    c.close()
    with pytest.raises(wire.PeerClosed):
        wire.recv_exact(d, 4)


def test_recv_bytes_and_discard() -> None:
    a, b = socket.socketpair()
    a.sendall(b"0123456789" * 3)
    assert wire.recv_bytes(b, 10) == b"0123456789"
    wire.discard(b, 15, memoryview(bytearray(4)))
    assert wire.recv_exact(b, 5) == b"56789"


def test_packing_round_trips() -> None:
    keys = [bytes([i]) * 16 for i in range(3)]
    assert wire.unpack_keys(wire.pack_keys(keys), 3) == keys
    assert wire.unpack_ids(wire.pack_ids([1, 2**64 - 1]), 2) == (1, 2**64 - 1)
    meta = wire.pack_put_items(keys[:2], [5, 6], [None, keys[2]], pin=True)
    assert list(wire.PUT_ITEM.iter_unpack(meta)) == [
        (keys[0], bytes(16), 5, wire.FLAG_PIN),
        (keys[1], keys[2], 6, wire.FLAG_PIN | wire.FLAG_PARENT),
    ]
    frame = wire.error_frame(3, "bad key")
    assert wire.HEADER.unpack(frame[: wire.HEADER.size]) == (3, 0, 7)
    assert frame[wire.HEADER.size :] == b"bad key"


def test_status_bytes_are_the_error_classes_grpc_codes_and_read_back() -> None:
    # Pinned: these bytes are the wire format (HELLO replies and response headers).
    expected = {InvalidArgument: 3, PermissionDenied: 7, ResourceExhausted: 8,
                FailedPrecondition: 9, InternalError: 13, Unavailable: 14, Unauthenticated: 16}
    for cls, status in expected.items():
        assert wire.status_of(cls) == status == wire.status_of(cls("m"))
        back = wire.error_of(status, "why")
        assert type(back) is cls and str(back) == "why"
    unknown = wire.error_of(2, "odd")  # UNKNOWN: no class of its own
    assert type(unknown) is KVStoreError and str(unknown) == "odd"


def test_an_error_frame_names_its_reason_in_the_count() -> None:
    # Pinned: the index is on the wire; 0 is what nodes before reasons sent.
    assert ("", ReplyTooLarge.reason) == wire.ERROR_REASONS
    frame = wire.error_frame(8, f"over the {REPLY_BOUND}", ReplyTooLarge.reason)
    status, count, _ = wire.HEADER.unpack(frame[: wire.HEADER.size])
    assert (status, count) == (8, 1)
    back = wire.error_of(status, frame[wire.HEADER.size :].decode(), count)
    assert type(back) is ReplyTooLarge and str(back) == f"over the {REPLY_BOUND}"


@pytest.mark.parametrize("count", [0, 2, 1 << 31])
def test_an_error_frame_without_a_known_reason_is_the_codes_own_class(count: int) -> None:
    # 0: a node before reasons, whose message still names the bound; else a reason
    # from a newer node this side does not know.
    back = wire.error_of(8, f"over the {REPLY_BOUND}", count)
    assert type(back) is ResourceExhausted


def test_meta_sizes() -> None:
    assert wire.meta_item_size(wire.Op.GET) == 16
    assert wire.meta_item_size(wire.Op.RELEASE) == 8
    assert wire.meta_item_size(wire.Op.PUT) == wire.PUT_ITEM.size == 48
