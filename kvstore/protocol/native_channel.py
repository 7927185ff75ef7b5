"""The transfer channel's per-call work in native code, both ends (``cffi_build/channel.c``).

``kvstore.protocol._channel`` (built by ``python -m cffi_build.channel_build``) frames,
parses and moves a request with the GIL released: a client's call is one C call that
sends the header, the metadata and the values with ``sendmsg`` and receives the reply's
header, metadata and (GET) the values straight into the caller's buffers; a node's
connection reads each request's header and metadata in one C call that checks every field
against its bounds before it is used (reading at most 4 KiB past them), receives put
values straight into their reserved slots (a value or rest under 16 KiB through its
buffer, refilled with all that has arrived in one ``recv``), and sends each reply with one
``sendmsg``. The bytes on the wire are
``kvstore.protocol.wire``'s, unchanged: either end may run the pure-Python path.

The pure-Python path is the fallback: without the built module, for TLS streams (no
``sendmsg`` on them), and when ``KVSTORE_NATIVE_CHANNEL=0`` is set (read when a stream is
opened, so a test can run both paths in one process). A signal that interrupts a native
call is retried in C; its Python handler runs once the call returns (a stalled peer is
bounded by the stream's stall timeout, as before).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import ssl
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from kvstore.core.errors import BufferTooSmall, KVStoreError
from kvstore.protocol import wire
from kvstore.protocol.wire import Op, PeerClosed, ProtocolError

log = logging.getLogger("kvstore.channel")

ENV = "KVSTORE_NATIVE_CHANNEL"
"""``0``: the pure-Python path everywhere; anything else (or unset): native when built."""
API_VERSION = 2  # cffi_build/channel_build.py API_VERSION
_META_ROOM = 64 << 10  # a reply's metadata up to this lands in the stream's own buffer

_module: ModuleType | None = None
_why: str | None = None
_loaded = False


def load(*, retry: bool = False) -> tuple[ModuleType | None, str | None]:
    """The native module, or None and why not (imported once; ``retry``: try again after a
    failure, as after building it)."""
    global _module, _why, _loaded
    if retry and _module is None:
        _loaded, _why = False, None
        importlib.invalidate_caches()
    if not _loaded:
        _loaded = True
        try:
            # import_module honours sys.modules (a None entry there disables the helper).
            mod = importlib.import_module("kvstore.protocol._channel")
        except ImportError as exc:
            _why = (
                f"native module kvstore.protocol._channel not importable ({exc}); build "
                "it with: python -m cffi_build.channel_build"
            )
        else:
            version = mod.lib.kvc_api_version()
            if version != API_VERSION:
                _why = (
                    f"native module kvstore.protocol._channel is stale (API version "
                    f"{version}, need {API_VERSION}): rebuild it with "
                    "python -m cffi_build.channel_build"
                )
            else:
                _module = mod
        if _why is not None:
            log.info("transfer channel: pure-Python path (%s)", _why)
    return _module, _why


def enabled() -> bool:
    """Whether a stream opened now takes the native path."""
    return os.environ.get(ENV, "1") != "0" and load()[0] is not None


def _usable(sock: socket.socket) -> ModuleType | None:
    if isinstance(sock, ssl.SSLSocket) or os.environ.get(ENV, "1") == "0":
        return None
    return load()[0]


def _raise(rc: int) -> None:
    """The exception a negative return code of the C helper stands for."""
    mod = _module
    assert mod is not None
    lib = mod.lib
    if rc == lib.KVC_EOF:
        raise PeerClosed("peer closed the stream")
    if rc == lib.KVC_SHORT:
        raise ConnectionError("stream ended inside a frame")
    if rc == lib.KVC_PROTO:
        raise ProtocolError("the reply does not answer the request")
    if rc <= -100000:
        raise ProtocolError(f"native channel code {rc}")
    raise OSError(-rc, os.strerror(-rc))  # EAGAIN: BlockingIOError (a stall), and so on


class FrameRejected(ProtocolError):
    """A request header that breaks its bounds (the server words the error from it)."""

    def __init__(self, op: int, count: int, meta_len: int) -> None:
        super().__init__(f"bad frame: op {op}, {count} items, {meta_len} meta bytes")
        self.op = op
        self.count = count
        self.meta_len = meta_len


_SMALL = 16  # calls of up to this many values or keys reuse the stream's own C arrays


class _Base:
    __slots__ = ("_ffi", "_frame", "_iovs", "_lib", "fd", "sock")

    def __init__(self, mod: ModuleType, sock: socket.socket) -> None:
        self._ffi: Any = mod.ffi
        self._lib: Any = mod.lib
        self.sock = sock
        self.fd = sock.fileno()
        self._frame = self._ffi.new("struct kvc_frame *")
        self._iovs = self._ffi.new("struct iovec[]", _SMALL + 2)

    def _iov(self, values: Sequence[bytes | memoryview]) -> tuple[Any, list[Any]]:
        """An iovec array with two free entries (header, meta), then ``values``."""
        ffi = self._ffi
        iov = self._iovs if len(values) <= _SMALL else ffi.new("struct iovec[]", len(values) + 2)
        keep = []
        for i, v in enumerate(values, 2):
            buf = ffi.from_buffer(v)
            keep.append(buf)
            iov[i].iov_base = buf
            iov[i].iov_len = len(buf)
        return iov, keep

    def _release(self, bufs: list[Any]) -> None:
        """Ends the exports ``from_buffer`` holds (a region's memoryview must be releasable)."""
        release = self._ffi.release
        for b in bufs:
            release(b)

    def send_frame(
        self, code: int, count: int, meta: bytes, values: Sequence[bytes | memoryview] = ()
    ) -> None:
        """Header, meta and values in as few ``sendmsg`` calls as the kernel allows."""
        iov, keep = self._iov(values)
        try:
            rc = self._lib.kvc_send_frame(
                self.fd, code, count, meta, len(meta), iov, len(values) + 2
            )
        finally:
            self._release(keep)
        if rc < 0:
            _raise(rc)


class ServerStream(_Base):
    """A node's side of one stream: requests in through a buffer, replies out."""

    __slots__ = ("_buf", "_max_count", "_reader", "_sizes", "_view")

    def __init__(
        self,
        mod: ModuleType,
        sock: socket.socket,
        item_sizes: Mapping[int, int],
        max_count: int,
        size: int = 64 << 10,
    ) -> None:
        super().__init__(mod, sock)
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._reader = self._ffi.new("struct kvc_reader *")
        self._reader.buf = self._ffi.from_buffer(self._buf)
        self._reader.cap = size
        sizes = [0] * 256
        for op, n in item_sizes.items():
            sizes[op] = n
        self._sizes = self._ffi.new("uint16_t[256]", sizes)
        self._max_count = max_count

    @property
    def buffered(self) -> int:
        r = self._reader
        return int(r.end - r.start)

    def next_request(self) -> tuple[int, int, bytes]:
        """(op, count, meta) of the next request, its bounds checked in C. PeerClosed at a
        frame boundary, FrameRejected for a header past its bounds, STALLED for a stall
        (``buffered`` then says whether it stalled inside a frame)."""
        f = self._frame
        rc = self._lib.kvc_next_request(
            self.fd, self._reader, self._sizes, self._max_count, wire.MAX_META, f
        )
        if rc == 0:
            at = f.meta_at
            return f.code, f.count, bytes(self._view[at : at + f.meta_len])
        lib = self._lib
        if rc == lib.KVC_META_BIG:  # past the buffer (a batch of thousands): read it whole
            meta = bytearray(f.meta_len)
            self.read_into(memoryview(meta))
            return f.code, f.count, bytes(meta)
        if rc in (lib.KVC_BAD_OP, lib.KVC_BAD_COUNT, lib.KVC_BAD_META):
            raise FrameRejected(f.code, f.count, f.meta_len)
        _raise(rc)
        raise AssertionError("unreachable")

    def read_into(self, dest: memoryview) -> None:
        """Fills ``dest``: buffered bytes first, then straight from the socket (a rest
        under 16 KiB: through the buffer, refilled with all that has arrived)."""
        if not len(dest):
            return
        with self._ffi.from_buffer(dest, require_writable=True) as buf:
            rc = self._lib.kvc_reader_read_into(self.fd, self._reader, buf, len(buf))
        if rc:
            _raise(rc)

    def discard(self, n: int, scratch: memoryview) -> None:
        with self._ffi.from_buffer(scratch, require_writable=True) as buf:
            rc = self._lib.kvc_reader_discard(self.fd, self._reader, n, buf, len(buf))
        if rc:
            _raise(rc)


def server_stream(
    sock: socket.socket, item_sizes: Mapping[int, int], max_count: int
) -> ServerStream | None:
    """The native side of an accepted stream, or None (the pure-Python path)."""
    mod = _usable(sock)
    return None if mod is None else ServerStream(mod, sock, item_sizes, max_count)


class ClientStream(_Base):
    """A client's side of one TCP stream: each call one C call, the GIL released."""

    __slots__ = ("_caps", "_lengths", "_meta", "_outs")

    def __init__(self, mod: ModuleType, sock: socket.socket) -> None:
        super().__init__(mod, sock)
        ffi = self._ffi
        self._meta = ffi.new("char[]", _META_ROOM)
        self._outs = ffi.new("char *[]", _SMALL)
        self._caps = ffi.new("uint64_t[]", _SMALL)
        self._lengths = ffi.new("uint64_t[]", _SMALL)

    def _status(self) -> KVStoreError:
        """The error an error reply (its header in the frame) stands for; reads its text."""
        f = self._frame
        if f.meta_len > wire.MAX_META:
            raise ProtocolError(f"error reply with {f.meta_len} bytes of text")
        text = wire.recv_bytes(self.sock, f.meta_len) if f.meta_len else b""
        return wire.error_of(f.code, text.decode("utf-8", "replace"), f.count)

    def call(
        self, op: Op, count: int, meta: bytes, values: Sequence[bytes | memoryview] = ()
    ) -> tuple[int, bytes]:
        """Sends a request, returns its reply's (count, meta)."""
        iov, keep = self._iov(values)
        f = self._frame
        try:
            rc = self._lib.kvc_call(
                self.fd,
                op,
                count,
                meta,
                len(meta),
                iov,
                len(values) + 2,
                f,
                self._meta,
                _META_ROOM,
                wire.MAX_META,
            )
        finally:
            self._release(keep)
        if rc >= 0:
            return f.count, self._ffi.unpack(self._meta, rc)
        if rc == self._lib.KVC_META_BIG:
            return f.count, wire.recv_bytes(self.sock, f.meta_len)
        if rc == self._lib.KVC_STATUS:
            raise self._status()
        _raise(rc)
        raise AssertionError("unreachable")

    def get(
        self, keys: Sequence[bytes], outs: Sequence[memoryview | None] | None
    ) -> list[bytes | int | None]:
        """A GET: values into ``outs[i]`` (returns nbytes) or as new bytes."""
        meta = wire.pack_keys(keys)
        if len(meta) != 16 * len(keys):
            raise ProtocolError("keys must be 16 bytes each")
        return self._get_reply(len(keys), outs, meta)

    def get_reply(
        self, n: int, outs: Sequence[memoryview | None] | None
    ) -> list[bytes | int | None]:
        """The reply to a GET of ``n`` keys already sent (``send_frame``): as ``get``."""
        return self._get_reply(n, outs, None)

    def _get_reply(
        self, n: int, outs: Sequence[memoryview | None] | None, meta: bytes | None
    ) -> list[bytes | int | None]:
        """Sends the GET of ``meta`` (its keys) first, in the same C call, unless None."""
        ffi = self._ffi
        if n <= _SMALL:
            c_outs, caps, lengths = self._outs, self._caps, self._lengths
        else:
            c_outs = ffi.new("char *[]", n)
            caps = ffi.new("uint64_t[]", n)
            lengths = ffi.new("uint64_t[]", n)
        keep = []
        null = ffi.NULL
        for i in range(n):
            out = outs[i] if outs is not None else None
            if out is None:
                c_outs[i] = null
                caps[i] = 0
            else:
                buf = ffi.from_buffer(out, require_writable=True)
                keep.append(buf)
                c_outs[i] = buf
                caps[i] = len(buf)
        f = self._frame
        try:
            if meta is None:
                rc = self._lib.kvc_get_reply(self.fd, n, c_outs, caps, lengths, f,
                                             wire.MAX_REPLY_BYTES)
            else:
                rc = self._lib.kvc_get(self.fd, meta, n, c_outs, caps, lengths, f,
                                       wire.MAX_REPLY_BYTES)
        finally:
            self._release(keep)
        if rc < 0:
            if rc == self._lib.KVC_STATUS:
                raise self._status()
            _raise(rc)
        results: list[bytes | int | None] = [
            None if lengths[i] == wire.MISS else int(lengths[i]) for i in range(rc)
        ]
        too_small: str | None = None
        for i in range(rc, n):  # where C stopped: a value with no buffer, or too small a one
            size = int(lengths[i])
            if size == wire.MISS:
                results.append(None)
                continue
            out = outs[i] if outs is not None else None
            if out is None:
                results.append(wire.recv_bytes(self.sock, size))
            elif len(out) < size:
                wire.discard(self.sock, size, memoryview(bytearray(min(size, 1 << 20))))
                too_small = too_small or f"buffer of {len(out)} bytes for a {size}-byte value"
                results.append(None)
            else:
                wire.recv_exact_into(self.sock, out[:size])
                results.append(size)
        if too_small:
            raise BufferTooSmall(too_small)
        return results


def client_stream(sock: socket.socket) -> ClientStream | None:
    """The native side of a connected TCP stream, or None (the pure-Python path)."""
    mod = _usable(sock)
    return None if mod is None else ClientStream(mod, sock)
