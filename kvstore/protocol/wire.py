"""The transfer channel: a binary request/response stream for bulk bytes.

gRPC is the API, but Python gRPC tops out near 1 GB/s and ~1,000 calls/s
here, so clients negotiate (``OpenChannel``) a plain stream instead: TCP for
remote clients, a Unix socket plus the DRAM region mapped by memfd for
clients on the same host. Values move with ``sendmsg`` straight from the
region and ``recv_into`` straight into it (or into the caller's buffer):
no intermediate copies.

Stream format (all integers little-endian)::

    hello    client -> server   MAGIC(4) | token(16) | mode u8 | caps u8 | pad(2)
             server -> client   status u8 | caps u8 | pad(2) | region_bytes u64
                                (mode SHM over a Unix socket: the region's memfd rides
                                 along as SCM_RIGHTS ancillary data; with staged puts, a
                                 read-only one, then the first staging area's memfd)
    request  header  op u8 | pad(3) | count u32 | meta_len u64,  then meta_len bytes of
             meta, then (PUT only) the values, concatenated in item order
    response header  status u8 | pad(3) | count u32 | meta_len u64, then meta, then
             (GET only) the values of the hits, concatenated in key order

One request is answered before the next is read; RELEASE and ABORT have no
response. A non-zero status is a gRPC status code and its meta is a UTF-8
message; its count names the error's reason (``ERROR_REASONS``, 0: none). Nodes
before reasons sent 0 there and clients before them ignore it. A malformed frame
gets an INVALID_ARGUMENT response and the server closes the stream, since it
cannot find the next frame boundary.

Per-op meta:

    GET      req  count x key(16)               resp count x u64 length (MISS for a miss)
    PUT      req  count x PUT_ITEM              resp count x u8 (0 existed, 1 stored)
    EXISTS   req  count x key(16)               resp count x u8
    PREFIX   req  count x key(16)               resp count = matched, no meta
    REMOVE   req  count x key(16)               resp count x u8 (1 removed)
    LEASE    req  count x key(16)               resp count x LEASE_ITEM (lease 0: a miss if
                                                nbytes is 0, else stored outside shared
                                                memory: fetch it with GET)
    RELEASE  req  count x u64 lease id          no response
    RESERVE  req  count x PUT_ITEM              resp count x RESERVE_ITEM
    COMMIT   req  count x u64 reservation id    resp count x u8 (0 existed, 1 stored)
    ABORT    req  count x u64 reservation id    no response
    RPUT     req  count x RPUT_ITEM             resp count x u8 (0 existed, 1 stored), then
                                                REPL_TAIL, then UTF-8 text of the failed
                                                forwards ("ADDR: reason; ...")
    RCOMMIT  req  count x RCOMMIT_ITEM          resp as RPUT
    RELEASE_CHECK  req  count x u64 lease id    resp count x u8 (1: the lease was still held
                                                when released, 0: it had expired or was
                                                never granted: bytes copied under it are void)

Retention (``retain_s``, see ``tiers.retention``) rides in the padding of PUT_ITEM and
RPUT_ITEM: a u32 of milliseconds at byte ``RETAIN_AT`` of the item (0: none). Writers
before it sent zeros there, so their puts ask for no retention, and a node before it
ignores the field; item sizes are unchanged.

Staged puts (``CAP_STAGED_PUTS``, SHM only): a client sets the bit in its HELLO's ``caps``
and a node that stages answers with it set. The client then maps the region read-only
and fills each reservation in a slot of a *staging area* (a memfd the size of the
region), instead of in the region; the node copies the slot into the region at
COMMIT/RCOMMIT, for a reservation still live. A RESERVE reply's items are then
RESERVE_STAGED_ITEM (32 bytes: the slot's offset, the region offset, and the area's
generation); when the generation changes (the node retires an area once one of its
reservations expired) the new area's memfd rides along with that RESERVE reply's first
bytes. A writer that resumes after its reservation expired thus
writes into an area the node no longer reads (``kvstore.node.staging``). Clients and
nodes before it send and answer zeros there: their puts write into the region as before.

RPUT and RCOMMIT are the cluster's replicated puts, in one trip from the writer: the
node (the keys' master) stores the values (RPUT: from the stream; RCOMMIT: the SHM
reservations named) and forwards them to the other owners, which it takes from its
own membership, before it answers. Every item of one request carries the same
copies and write quorum. A node outside a cluster answers FAILED_PRECONDITION (the
writer then puts and asks for ``Replicate``).

Leases and reservations of a same-host (SHM) client expire ``--read-lease-timeout``
seconds after they were granted (``MIN_LEASE_TIMEOUT`` at least); a client whose copy
out of shared memory took long enough that its lease may have expired releases with
RELEASE_CHECK instead of RELEASE and discards what it copied under a void lease; a
COMMIT of an expired reservation fails (UNAVAILABLE) and stores nothing from it.
"""

from __future__ import annotations

import math
import socket
import ssl
import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import Protocol, cast

import grpc

from kvstore.core.errors import KVStoreError, ReplyTooLarge, error_for_code
from kvstore.core.keys import BlockKey

MAGIC = b"KVS1"
PROTOCOL_VERSION = 1
TOKEN_BYTES = 16

HELLO = struct.Struct("<4s16sB3x")  # a client without capabilities (caps 0)
HELLO_CAPS = struct.Struct("<4s16sBB2x")  # magic, token, mode, caps
HELLO_REPLY = struct.Struct("<B3xQ")  # status, region bytes (a reader of no capabilities)
HELLO_REPLY_CAPS = struct.Struct("<BB2xQ")  # status, caps, region bytes
HEADER = struct.Struct("<B3xIQ")
PUT_ITEM = struct.Struct("<16s16sQB7x")  # key, parent, nbytes, flags
LEASE_ITEM = struct.Struct("<QQQ")  # lease id, region offset, nbytes
RESERVE_ITEM = struct.Struct("<QQB7x")  # reservation id, region offset, state
# Staged: reservation id, slot offset in the staging area, region offset, state, the
# staging area's generation.
RESERVE_STAGED_ITEM = struct.Struct("<QQQB3xI")
U64 = struct.Struct("<Q")
RPUT_ITEM = struct.Struct("<16s16sQBBB5x")  # key, parent, nbytes, flags, copies, write quorum
RCOMMIT_ITEM = struct.Struct("<QBB6x")  # reservation id, copies, write quorum
RETAIN_AT = 44  # offset of the u32 retain_ms inside a PUT_ITEM or an RPUT_ITEM
RETAIN_MS = struct.Struct("<I")
REPL_TAIL = struct.Struct("<B")  # copies that hold every item, the master's included

MISS = (1 << 64) - 1
FLAG_PARENT = 1
FLAG_PIN = 2
CAP_STAGED_PUTS = 1  # HELLO caps: puts are filled in staging areas (see above)
RESERVE_EXISTED = 0
RESERVE_OK = 1

MAX_META = 64 << 20  # 65536 x 48-byte items fits with room to spare
MIN_LEASE_TIMEOUT = 1.0
"""Smallest ``--read-lease-timeout``: a client that finishes a copy within half of it
knows its leases held throughout and releases them without asking."""
MAX_REPLY_BYTES = 1 << 30
"""Most value bytes one GET reply carries (repeated keys count each time); a GET past it
is refused with RESOURCE_EXHAUSTED before any block is read (clients split and retry)."""


class Mode(IntEnum):
    TCP = 0  # values travel in the stream
    SHM = 1  # values travel through the mapped DRAM region


class Op(IntEnum):
    GET = 1
    PUT = 2
    EXISTS = 3
    PREFIX = 4
    REMOVE = 5
    LEASE = 6
    RELEASE = 7
    RESERVE = 8
    COMMIT = 9
    ABORT = 10
    RPUT = 11
    RCOMMIT = 12
    RELEASE_CHECK = 20


KEY_META_OPS = frozenset({Op.GET, Op.EXISTS, Op.PREFIX, Op.REMOVE, Op.LEASE})
ID_META_OPS = frozenset({Op.RELEASE, Op.COMMIT, Op.ABORT, Op.RELEASE_CHECK})
ITEM_META_OPS = frozenset({Op.PUT, Op.RESERVE})
NO_REPLY_OPS = frozenset({Op.RELEASE, Op.ABORT})


def meta_item_size(op: Op) -> int:
    if op in KEY_META_OPS:
        return 16
    if op in ID_META_OPS:
        return 8
    if op is Op.RPUT:
        return RPUT_ITEM.size
    if op is Op.RCOMMIT:
        return RCOMMIT_ITEM.size
    return PUT_ITEM.size


class ProtocolError(Exception):
    """The peer broke the stream format; the connection cannot continue."""


class PeerClosed(ConnectionError):
    """The peer closed the stream at a frame boundary."""


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from ``sock``; ConnectionError if the stream ends first.

    MSG_WAITALL lets the kernel fill the whole view in one call on a blocking
    socket; the loop only covers signals and end of stream.
    """
    got, n = 0, len(view)
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL  # TLS takes none
    while got < n:
        r = sock.recv_into(view[got:], n - got, flags)
        if r == 0:
            if got == 0:
                raise PeerClosed("peer closed the stream")
            raise ConnectionError(f"stream ended after {got} of {n} bytes")
        got += r


def set_stall_timeout(sock: socket.socket, seconds: float) -> None:
    """Bounds how long any one ``recv``/``send`` on ``sock`` may wait for the peer.

    A plain socket stays blocking (no poll before every call, ``MSG_WAITALL`` keeps
    working) and the kernel ends a stalled call after ``seconds`` (SO_RCVTIMEO /
    SO_SNDTIMEO: the call raises BlockingIOError, or returns what arrived so far); a
    TLS socket gets Python's own timeout (TimeoutError).
    """
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


STALLED = (BlockingIOError, TimeoutError)
"""What a socket call raises when the peer stalled past ``set_stall_timeout``."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    if n:
        recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes as a new bytes object, received in place (no second copy)."""
    data = sock.recv(n, 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL)
    if len(data) == n:
        return data
    if not data:
        raise ConnectionError(f"stream ended before a {n}-byte value")
    return data + recv_exact(sock, n - len(data))


def discard(sock: socket.socket, n: int, scratch: memoryview) -> None:
    """Reads and drops ``n`` bytes (the payload of a rejected put)."""
    while n > 0:
        chunk = scratch[: min(n, len(scratch))]
        recv_exact_into(sock, chunk)
        n -= len(chunk)


_IOV_MAX = 1024


class FrameReader(Protocol):
    """What a node's connection reads a stream through: ``StreamReader`` (pure Python) or
    ``kvstore.protocol.native_channel.ServerStream``."""

    @property
    def buffered(self) -> int: ...

    def read_into(self, dest: memoryview) -> None: ...

    def discard(self, n: int, scratch: memoryview) -> None: ...


class StreamReader:
    """Reads frame headers and metadata through a buffer, large payloads straight through.

    One ``recv`` usually brings a whole request header with its metadata (and any
    fire-and-forget frames the peer sent before it), saving a syscall per frame;
    payload bytes already buffered are copied out first, the rest is received
    directly into the destination.
    """

    __slots__ = ("_buf", "_end", "_sock", "_start", "_view")

    def __init__(self, sock: socket.socket, size: int = 64 << 10) -> None:
        self._sock = sock
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def read(self, n: int) -> bytes:
        """Exactly ``n`` bytes; PeerClosed if the stream ends cleanly before the first byte."""
        start, end = self._start, self._end
        if end - start >= n:
            self._start = start + n
            return bytes(self._view[start : start + n])
        if n > len(self._buf):
            head = bytes(self._view[start:end])
            self._start = self._end = 0
            return head + recv_exact(self._sock, n - len(head))
        if start:
            self._view[: end - start] = self._view[start:end]
            end -= start
            self._start = 0
        while end < n:
            try:
                r = self._sock.recv_into(self._view[end:])
            except OSError:
                self._end = end  # keep what arrived (from 0): a retry continues from it
                raise
            if r == 0:
                if end == 0:
                    raise PeerClosed("peer closed the stream")
                raise ConnectionError(f"stream ended after {end} of {n} bytes")
            end += r
        self._end = end
        self._start = n
        return bytes(self._view[:n])

    @property
    def buffered(self) -> int:
        """Bytes received but not yet read."""
        return self._end - self._start

    def read_into(self, dest: memoryview) -> None:
        """Fills ``dest``: buffered bytes first, then straight from the socket."""
        start = self._start
        k = min(self._end - start, len(dest))
        if k:
            dest[:k] = self._view[start : start + k]
            self._start = start + k
        if k < len(dest):
            recv_exact_into(self._sock, dest[k:])

    def discard(self, n: int, scratch: memoryview) -> None:
        k = min(self._end - self._start, n)
        self._start += k
        if n > k:
            discard(self._sock, n - k, scratch)


_TLS_JOIN = 64 << 10  # below this a buffer is copied into one TLS write with its neighbours


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Sends every buffer in order with as few syscalls as the kernel allows.

    Buffers must be bytes-like with one-byte items (``len`` is their size). A TLS
    socket has no ``sendmsg``: small buffers are joined, large ones sent one by one.
    """
    if isinstance(sock, ssl.SSLSocket):
        small = sum(len(b) for b in buffers if len(b) < _TLS_JOIN)
        if small == sum(map(len, buffers)):
            sock.sendall(b"".join(buffers))
            return
        for b in buffers:
            sock.sendall(b)
        return
    if len(buffers) <= _IOV_MAX:
        total = sum(map(len, buffers))
        sent = sock.sendmsg(buffers)
        if sent == total:
            return
        pending = _after(buffers, sent)
    else:
        pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    while pending:
        pending = _after(pending, sock.sendmsg(pending[:_IOV_MAX]))


def _after(buffers: Sequence[bytes | memoryview], sent: int) -> list[memoryview]:
    """What is left of ``buffers`` after the first ``sent`` bytes went out."""
    out: list[memoryview] = []
    for b in buffers:
        n = len(b)
        if sent >= n:
            sent -= n
            continue
        out.append(memoryview(b).cast("B")[sent:])
        sent = 0
    return out


def header(op_or_status: int, count: int, meta_len: int) -> bytes:
    return HEADER.pack(op_or_status, count, meta_len)


ERROR_REASONS: tuple[str, ...] = ("", ReplyTooLarge.reason)
"""The ``reason`` (``kvstore.core.errors``) an error frame's count names, by index.
Append only: the indexes are on the wire."""


def error_frame(status: int, message: str, reason: str = "") -> bytes:
    body = message.encode("utf-8", "replace")[:4096]
    return HEADER.pack(status, ERROR_REASONS.index(reason), len(body)) + body


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_of(error: KVStoreError | type[KVStoreError]) -> int:
    """The status byte (of a response header or a HELLO reply) that carries ``error``:
    its class's gRPC status code, by number, so both transports share one code table."""
    return error.code.value[0]


def error_of(status: int, message: str, reason: int = 0) -> KVStoreError:
    """The exception a non-zero status byte (and an error frame's count, ``reason``)
    stands for (``status_of`` and ``error_frame`` read back); a reason index this side
    does not know stands for none."""
    name = ERROR_REASONS[reason] if 0 <= reason < len(ERROR_REASONS) else ""
    return error_for_code(_CODES.get(status, grpc.StatusCode.UNKNOWN), message, name)


def pack_keys(keys: Sequence[bytes]) -> bytes:
    return b"".join(keys)


def unpack_keys(meta: bytes, count: int) -> list[BlockKey]:
    # Block keys by construction: 16-byte slices of a meta whose length the channel server
    # checked against ``count``. A cast, not BlockKey() per key: the GET path makes no call
    # per key.
    return cast("list[BlockKey]", [meta[i * 16 : i * 16 + 16] for i in range(count)])


def pack_ids(ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(ids)}Q", *ids)


def unpack_ids(meta: bytes, count: int) -> tuple[int, ...]:
    return struct.unpack(f"<{count}Q", meta)


def retain_ms(retain_s: float) -> int:
    """``retain_s`` on the wire: whole milliseconds, rounded up (any positive ask keeps
    at least 1 ms); past the u32 range it is clamped, and the node refuses it as too long."""
    if retain_s <= 0:
        return 0
    return min(math.ceil(retain_s * 1000), 0xFFFFFFFF)


def item_retain_s(meta: bytes, index: int, item_size: int) -> float:
    """The ``retain_s`` of item ``index`` of a PUT/RESERVE/RPUT request's meta."""
    ms: int = RETAIN_MS.unpack_from(meta, index * item_size + RETAIN_AT)[0]
    return ms / 1000.0


def pack_put_items(
    keys: Sequence[bytes], sizes: Sequence[int], parents: Sequence[bytes | None], pin: bool,
    retain_s: float = 0.0,
) -> bytes:
    out = bytearray()
    zero = bytes(16)
    ms = retain_ms(retain_s)
    for key, size, parent in zip(keys, sizes, parents, strict=True):
        flags = (FLAG_PARENT if parent is not None else 0) | (FLAG_PIN if pin else 0)
        out += PUT_ITEM.pack(key, parent if parent is not None else zero, size, flags)
        if ms:
            RETAIN_MS.pack_into(out, len(out) - PUT_ITEM.size + RETAIN_AT, ms)
    return bytes(out)


def pack_rput_items(keys: Sequence[bytes], sizes: Sequence[int], parents: Sequence[bytes | None],
                    pin: bool, copies: int, write_quorum: int, retain_s: float = 0.0) -> bytes:
    out = bytearray()
    zero = bytes(16)
    ms = retain_ms(retain_s)
    for key, size, parent in zip(keys, sizes, parents, strict=True):
        flags = (FLAG_PARENT if parent is not None else 0) | (FLAG_PIN if pin else 0)
        out += RPUT_ITEM.pack(key, parent if parent is not None else zero, size, flags,
                              copies, write_quorum)
        if ms:
            RETAIN_MS.pack_into(out, len(out) - RPUT_ITEM.size + RETAIN_AT, ms)
    return bytes(out)


def pack_repl_reply(stored: Sequence[bool], copies: int, failed: Sequence[str]) -> bytes:
    return bytes(stored) + REPL_TAIL.pack(min(copies, 255)) + "; ".join(failed).encode()


def unpack_repl_reply(meta: bytes, count: int) -> tuple[list[bool], int, str]:
    """(stored flags, copies, failures text) of an RPUT or RCOMMIT reply."""
    if len(meta) < count + REPL_TAIL.size:
        raise ProtocolError(f"replicated-put reply of {len(meta)} bytes for {count} items")
    (copies,) = REPL_TAIL.unpack_from(meta, count)
    text = meta[count + REPL_TAIL.size :].decode("utf-8", "replace")
    return [bool(b) for b in meta[:count]], copies, text
