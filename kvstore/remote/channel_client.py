"""Client side of the transfer channel (format in ``kvstore.protocol.wire``).

A ``ChannelConnection`` is one stream serving one request at a time; the
``Client`` keeps a pool of them for concurrent callers. Values land directly
in the caller's buffer (``recv_into`` over TCP, one memcpy from the mapped
region over shared memory). Over shared memory a connection asks for staged puts
(``wire.CAP_STAGED_PUTS``): it then maps the region read-only and writes its puts into
its staging area, which the node copies at commit, so a put that stalls past its
reservation can never write into a block that took its space; against a node without
them it writes into the region, as before.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from kvstore.core.checks import byte_view
from kvstore.core.errors import BufferTooSmall, InternalError, InvalidArgument, error_for_code
from kvstore.protocol import native_channel, wire
from kvstore.protocol.wire import HEADER, Mode, Op

SHM_PUT_MIN_BYTES = 64 << 10
"""Puts at least this large (per batch) go through reserve/commit in shared memory."""

SHM_PUT_REGION_SHARE = 16
"""A shared-memory put reserves at most 1/16 of the node's DRAM region at a time (at least
one value, and at least ``SHM_PUT_MIN_BYTES``): reserved space is held, neither a block
nor movable, until its commit, so writers that each reserved a large batch at once could
fill DRAM between them and leave each other no room (``kvstore.node.room``)."""


def shm_parts(sizes: Sequence[int], bound: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of ``sizes`` in order, each at most ``max(bound,
    SHM_PUT_MIN_BYTES)`` bytes in all or a single value."""
    bound = max(bound, SHM_PUT_MIN_BYTES)
    parts: list[tuple[int, int]] = []
    lo, total = 0, 0
    for i, n in enumerate(sizes):
        if i > lo and total + n > bound:
            parts.append((lo, i))
            lo, total = i, 0
        total += n
    if lo < len(sizes):
        parts.append((lo, len(sizes)))
    return parts


@dataclass(slots=True, kw_only=True)
class ChannelSession:
    """What ``OpenChannel`` told the client; shared by all its connections."""

    tcp_host: str
    tcp_port: int
    unix_path: str
    token: bytes
    region_bytes: int
    region: mmap.mmap | None = field(default=None)
    tls: ssl.SSLContext | None = None  # wraps TCP connections (the node serves TLS)

    def close(self) -> None:
        if self.region is not None:
            # A caller may still hold a view; the mapping then goes with it.
            with contextlib.suppress(BufferError):
                self.region.close()
            self.region = None


def _as_bytes_view(value: object) -> memoryview:
    try:
        return byte_view(value)
    except TypeError:
        numpy = getattr(value, "numpy", None)  # a torch CPU tensor
        if numpy is not None:
            return byte_view(numpy())
        raise InvalidArgument(f"value must be a bytes-like object, got {type(value).__name__}"
                              ) from None


def as_readable(value: object) -> memoryview:
    """A flat byte view of a bytes-like value, numpy array or torch CPU tensor."""
    view = _as_bytes_view(value)
    if not view.contiguous:
        raise InvalidArgument("value must be contiguous")
    return view


def as_writable(buf: object) -> memoryview:
    view = _as_bytes_view(buf)
    if view.readonly or not view.contiguous:
        raise InvalidArgument("buffer must be writable and contiguous")
    return view


class ChannelConnection:
    """One transfer-channel stream."""

    def __init__(self, session: ChannelSession, mode: Mode, *, timeout: float | None,
                 io_timeout: float | None = None, staged: bool = True) -> None:
        """``timeout``: connecting and the hello; ``io_timeout``: how long any one read or
        write may then stall before the call fails (None: block, as a local engine wants;
        a node calling its peers sets it, so a stalled peer cannot hold its thread);
        ``staged``: ask for staged puts over shared memory (False: write into the region,
        as clients before them do)."""
        self.session = session
        self.mode = mode
        self._ask_staged = staged and mode is Mode.SHM
        self._staging: mmap.mmap | None = None  # this connection's staging area, mapped
        self._staging_gen = 0
        self._new_staging_fd = -1  # a staging area's memfd received, not yet mapped
        if mode is Mode.SHM:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            path = session.unix_path
            sock.settimeout(timeout)
            sock.connect("\0" + path[1:] if path.startswith("@") else path)
        else:
            sock = socket.create_connection((session.tcp_host, session.tcp_port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if session.tls is not None:
                try:
                    sock = session.tls.wrap_socket(sock, server_hostname=session.tcp_host)
                except BaseException:
                    sock.close()
                    raise
        self.sock = sock
        try:
            self._hello(timeout)
        except BaseException:
            sock.close()
            raise
        # Blocking from here on: a transfer takes as long as its size needs; only a stall
        # is bounded, by the kernel (no poll before every call).
        sock.settimeout(None)
        if io_timeout is not None:
            wire.set_stall_timeout(sock, io_timeout)
        self._header = memoryview(bytearray(HEADER.size))
        # TCP calls through the native helper (None: the pure-Python path, the same bytes).
        self._native = native_channel.client_stream(sock) if mode is Mode.TCP else None

    def _hello(self, timeout: float | None) -> None:
        caps = wire.CAP_STAGED_PUTS if self._ask_staged else 0
        self.sock.sendall(wire.HELLO_CAPS.pack(wire.MAGIC, self.session.token, self.mode, caps))
        if self.mode is Mode.SHM:
            msg, fds, _, _ = socket.recv_fds(self.sock, wire.HELLO_REPLY_CAPS.size, 2,
                                             socket.MSG_WAITALL)
            try:
                status, caps, _region = wire.HELLO_REPLY_CAPS.unpack(msg)
                self._check_hello(status)
                staged = bool(caps & wire.CAP_STAGED_PUTS) and len(fds) == 2
                if self.session.region is None:
                    # Staged: read-only, so not even a bug here can write into a block.
                    self.session.region = mmap.mmap(
                        fds[0], self.session.region_bytes, flags=mmap.MAP_SHARED,
                        prot=mmap.PROT_READ if staged else mmap.PROT_READ | mmap.PROT_WRITE)
                if staged:
                    self._map_staging(fds[1], 1)
            finally:
                for fd in fds:
                    socket.close(fd)
        else:
            status, _region = wire.HELLO_REPLY.unpack(wire.recv_exact(self.sock,
                                                                      wire.HELLO_REPLY.size))
            self._check_hello(status)

    @staticmethod
    def _check_hello(status: int) -> None:
        if status:
            raise wire.error_of(status, f"transfer channel refused (status {status})")

    def close(self) -> None:
        self.sock.close()
        self._unmap_staging()
        if self._new_staging_fd >= 0:
            socket.close(self._new_staging_fd)
            self._new_staging_fd = -1

    def _map_staging(self, fd: int, generation: int) -> None:
        self._unmap_staging()
        self._staging = mmap.mmap(fd, self.session.region_bytes, flags=mmap.MAP_SHARED)
        self._staging_gen = generation

    def _unmap_staging(self) -> None:
        if self._staging is not None:
            with contextlib.suppress(BufferError):  # a view escaped: the GC unmaps it
                self._staging.close()
            self._staging = None

    # ---- framing -------------------------------------------------------------------------

    def _send(self, op: Op, count: int, meta: bytes,
              values: Sequence[memoryview] = ()) -> None:
        if self._native is not None:
            self._native.send_frame(op, count, meta, values)
            return
        head = HEADER.pack(op, count, len(meta)) + meta
        if values:
            wire.send_buffers(self.sock, [head, *values])
        else:
            self.sock.sendall(head)

    def _response(self, *, staging_fd: bool = False) -> tuple[int, bytes]:
        """The next reply's (count, meta); an error reply raised. ``staging_fd``: the reply
        to a RESERVE, the only one a new staging area's memfd rides along with (the others
        skip the ancillary-data receive)."""
        if self._staging is None or not staging_fd:
            wire.recv_exact_into(self.sock, self._header)
            head: bytes | memoryview = self._header
        else:
            head = self._staged_header()
        status, count, meta_len = HEADER.unpack(head)
        if meta_len > wire.MAX_META:  # bounded before use, as the native path does
            raise wire.ProtocolError(f"reply with {meta_len} bytes of metadata")
        meta = wire.recv_bytes(self.sock, meta_len) if meta_len else b""
        if status:
            raise wire.error_of(status, meta.decode("utf-8", "replace"), count)
        return count, meta

    def _staged_header(self) -> bytes:
        """A response header on a staged connection: a new staging area's memfd may ride
        along with its first bytes (kept for ``_take_new_staging``)."""
        head, fds, _, _ = socket.recv_fds(self.sock, HEADER.size, 1, socket.MSG_WAITALL)
        for fd in fds:
            if self._new_staging_fd >= 0:
                socket.close(self._new_staging_fd)
            self._new_staging_fd = fd
        if not head:
            raise wire.PeerClosed("peer closed the stream")
        if len(head) < HEADER.size:
            head += wire.recv_exact(self.sock, HEADER.size - len(head))
        return head

    def _call(self, op: Op, count: int, meta: bytes,
              values: Sequence[memoryview] = ()) -> tuple[int, bytes]:
        if self._native is not None:
            return self._native.call(op, count, meta, values)
        self._send(op, count, meta, values)
        return self._response()

    # ---- ops -----------------------------------------------------------------------------

    def get(self, keys: Sequence[bytes], outs: Sequence[memoryview | None] | None
            ) -> list[bytes | int | None]:
        """Values of ``keys``: into ``outs[i]`` (returns nbytes) or as new bytes."""
        if self.mode is Mode.SHM:
            return self._get_shm(keys, outs)
        return self._get_stream(keys, outs)

    def _get_stream(self, keys: Sequence[bytes], outs: Sequence[memoryview | None] | None
                    ) -> list[bytes | int | None]:
        if self._native is not None:
            return self._native.get(keys, outs)  # request and reply in one C call
        self._send(Op.GET, len(keys), wire.pack_keys(keys))
        return self._get_stream_reply(keys, outs)

    def send_get(self, keys: Sequence[bytes]) -> float:
        """The first half of a get: sends the request for ``keys`` (a GET, or over shared
        memory a LEASE) without reading the answer, which ``get_reply`` (with the same keys
        and the time returned) reads next on this connection. Between the two, other
        nodes' requests may be sent: the cluster client pipelines a batch this way."""
        started = time.monotonic()  # before the node can grant a lease: bounds its age
        self._send(Op.LEASE if self.mode is Mode.SHM else Op.GET, len(keys),
                   wire.pack_keys(keys))
        return started

    def get_reply(self, keys: Sequence[bytes], outs: Sequence[memoryview | None] | None,
                  started: float) -> list[bytes | int | None]:
        """The second half of ``send_get``: per key as ``get``."""
        if self.mode is Mode.SHM:
            return self._lease_reply(keys, outs, started)
        return self._get_stream_reply(keys, outs)

    def _get_stream_reply(self, keys: Sequence[bytes],
                          outs: Sequence[memoryview | None] | None) -> list[bytes | int | None]:
        """Reads the answer to a GET of ``keys`` sent on this stream."""
        if self._native is not None:
            return self._native.get_reply(len(keys), outs)
        count, meta = self._response()
        if count != len(keys) or len(meta) != 8 * count:
            raise wire.ProtocolError("the reply does not answer the request")
        lengths = wire.unpack_ids(meta, count)
        if any(n != wire.MISS and n > wire.MAX_REPLY_BYTES for n in lengths):
            raise wire.ProtocolError("the reply does not answer the request")
        results: list[bytes | int | None] = []
        too_small: str | None = None
        for i, n in enumerate(lengths):
            if n == wire.MISS:
                results.append(None)
                continue
            out = outs[i] if outs is not None else None
            if out is None:
                results.append(wire.recv_bytes(self.sock, n))
            elif len(out) < n:
                wire.discard(self.sock, n, memoryview(bytearray(min(n, 1 << 20))))
                too_small = too_small or f"buffer of {len(out)} bytes for a {n}-byte value"
                results.append(None)
            else:
                wire.recv_exact_into(self.sock, out[:n])
                results.append(n)
        if too_small:
            raise BufferTooSmall(too_small)
        return results

    def _get_shm(self, keys: Sequence[bytes], outs: Sequence[memoryview | None] | None
                 ) -> list[bytes | int | None]:
        return self._lease_reply(keys, outs, self.send_get(keys))

    def _lease_reply(self, keys: Sequence[bytes], outs: Sequence[memoryview | None] | None,
                     started: float) -> list[bytes | int | None]:
        """Reads the answer to a LEASE of ``keys``, copies the leased values out of the
        region (into ``outs[i]``: returns nbytes; else new bytes), releases the leases and
        fetches by stream what the region does not hold."""
        _, meta = self._response()
        region = self.session.region
        assert region is not None
        results: list[bytes | int | None] = []
        items = list(wire.LEASE_ITEM.iter_unpack(meta))
        # Every lease is released whatever happens below, not only those reached.
        leases = [lease for lease, _, _ in items if lease]
        unmapped: list[int] = []
        try:
            for i, (lease, offset, n) in enumerate(items):
                if lease == 0:
                    results.append(None)
                    if n:
                        unmapped.append(i)
                    continue
                out = outs[i] if outs is not None else None
                if out is None:
                    results.append(region[offset : offset + n])
                elif len(out) < n:
                    raise BufferTooSmall(f"buffer of {len(out)} bytes for a {n}-byte value")
                else:
                    with memoryview(region) as rv:
                        out[:n] = rv[offset : offset + n]
                    results.append(n)
        except BaseException:
            if leases:
                self._send(Op.RELEASE, len(leases), wire.pack_ids(leases))
            raise
        if leases:
            if time.monotonic() - started < wire.MIN_LEASE_TIMEOUT / 2:
                # Granted after ``started`` and held at least MIN_LEASE_TIMEOUT: every
                # lease held throughout the copy, no need to ask.
                self._send(Op.RELEASE, len(leases), wire.pack_ids(leases))
            else:
                # Slow copy (a stall, a stop): the node may have expired a lease and reused
                # its space. Bytes copied under a void lease are fetched again by stream.
                _, held = self._call(Op.RELEASE_CHECK, len(leases), wire.pack_ids(leases))
                void = {lease for lease, ok in zip(leases, held, strict=True) if not ok}
                if void:
                    unmapped += [i for i, (lease, _, _) in enumerate(items) if lease in void]
                    unmapped.sort()
                    for i in unmapped:
                        results[i] = None
        if unmapped:
            # Blocks in HBM or on SSD come through the stream instead.
            fetched = self._get_stream([keys[i] for i in unmapped],
                                       None if outs is None else [outs[i] for i in unmapped])
            for i, r in zip(unmapped, fetched, strict=True):
                results[i] = r
        return results

    def check_sizes(self, values: Sequence[memoryview]) -> list[int]:
        """The values' sizes; raises for one this node cannot hold (empty, or larger than
        its region), before anything is on the wire."""
        return self._sizes(values)

    def _sizes(self, values: Sequence[memoryview]) -> list[int]:
        sizes = [len(v) for v in values]
        limit = self.session.region_bytes
        for n in sizes:
            if n == 0:
                raise InvalidArgument("a block value must not be empty")
            if n > limit:
                raise error_for_code(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"value of {n} bytes exceeds the node's capacity of "
                                     f"{limit} bytes")
        return sizes

    def put(self, keys: Sequence[bytes], values: Sequence[memoryview],
            parents: Sequence[bytes | None], pin: bool, retain_s: float = 0.0) -> list[bool]:
        sizes = self._sizes(values)
        meta = wire.pack_put_items(keys, sizes, parents, pin, retain_s)
        if self.mode is Mode.SHM and sum(sizes) >= SHM_PUT_MIN_BYTES:
            return self._put_shm(keys, values, meta)
        _, reply = self._call(Op.PUT, len(keys), meta, values)
        return [bool(b) for b in reply]

    def _put_shm(self, keys: Sequence[bytes], values: Sequence[memoryview], meta: bytes
                 ) -> list[bool]:
        """Reserve, fill and commit, in parts of at most ``SHM_PUT_REGION_SHARE`` of the
        region (one part for a batch that small)."""
        out: list[bool] = []
        size = wire.PUT_ITEM.size
        for lo, hi in shm_parts([len(v) for v in values],
                                self.session.region_bytes // SHM_PUT_REGION_SHARE):
            part = meta[lo * size:hi * size]  # PUT items are of one size
            self._send(Op.RESERVE, hi - lo, part)
            out += self.commit_reply(self.fill_and_commit(keys[lo:hi], values[lo:hi]))
        return out

    def _take_new_staging(self, reply: bytes) -> None:
        """Maps the staging area that rode along with a RESERVE reply, if one did."""
        fd, self._new_staging_fd = self._new_staging_fd, -1
        if fd < 0:
            return
        try:
            generation = next((g for _, _, _, state, g in
                               wire.RESERVE_STAGED_ITEM.iter_unpack(reply)
                               if state == wire.RESERVE_OK), self._staging_gen + 1)
            self._map_staging(fd, generation)
        finally:
            socket.close(fd)

    def _reserve_and_fill(self, keys: Sequence[bytes], values: Sequence[memoryview],
                          meta: bytes) -> tuple[list[int], list[int | None]]:
        """Reserves room for the values and copies them there (the staging area, or the
        mapped region); the reservation ids, and each value's offset (None: the key was
        already stored)."""
        self._send(Op.RESERVE, len(keys), meta)
        return self._fill_reserved(keys, values)

    def _fill_reserved(self, keys: Sequence[bytes], values: Sequence[memoryview]
                       ) -> tuple[list[int], list[int | None]]:
        """``_reserve_and_fill`` once its RESERVE is sent: reads the answer and fills."""
        _, reply = self._response(staging_fd=True)
        self._take_new_staging(reply)
        target = self._staging if self._staging is not None else self.session.region
        assert target is not None
        rids: list[int] = []
        slots: list[int | None] = []
        stale = False
        if self._staging is None:
            for rid, offset, state in wire.RESERVE_ITEM.iter_unpack(reply):
                if state == wire.RESERVE_OK:
                    rids.append(rid)
                    slots.append(offset)
                else:
                    slots.append(None)
        else:
            for rid, slot, _, state, generation in wire.RESERVE_STAGED_ITEM.iter_unpack(reply):
                if state == wire.RESERVE_OK:
                    rids.append(rid)
                    slots.append(slot)
                    stale |= generation != self._staging_gen
                else:
                    slots.append(None)
        if not rids:
            return rids, slots
        if stale:  # never fill an area the node will not read
            self._send(Op.ABORT, len(rids), wire.pack_ids(rids))
            raise InternalError("the node's staging area and this client's are out of step")
        try:
            with memoryview(target) as rv:
                for offset, value in zip(slots, values, strict=True):
                    if offset is not None:
                        rv[offset : offset + len(value)] = value
        except BaseException:
            self._send(Op.ABORT, len(rids), wire.pack_ids(rids))
            raise
        return rids, slots

    def put_replicated(self, keys: Sequence[bytes], values: Sequence[memoryview],
                       parents: Sequence[bytes | None], pin: bool, copies: int,
                       write_quorum: int, retain_s: float = 0.0
                       ) -> tuple[list[bool], int, str]:
        """A replicated put to the keys' master (RPUT, or RESERVE + RCOMMIT over shared
        memory): (stored flags, copies holding every key, text of failed forwards)."""
        sizes = self._sizes(values)
        if not (self.mode is Mode.SHM and sum(sizes) >= SHM_PUT_MIN_BYTES):
            return self._rput(keys, values, sizes, parents, pin, copies, write_quorum, retain_s)
        rids, slots = self._reserve_and_fill(
            keys, values, wire.pack_put_items(keys, sizes, parents, pin, retain_s))
        stored = [False] * len(keys)
        made, failures = 255, []
        if rids:
            meta = b"".join(wire.RCOMMIT_ITEM.pack(rid, copies, write_quorum) for rid in rids)
            _, reply = self._call(Op.RCOMMIT, len(rids), meta)
            flags, made, text = wire.unpack_repl_reply(reply, len(rids))
            failures.append(text)
            done = iter(flags)
            stored = [False if offset is None else next(done) for offset in slots]
        existed = [i for i, offset in enumerate(slots) if offset is None]
        if existed:
            # Already on the master; its other owners may lack them: forward from the stream.
            _, more, text = self._rput([keys[i] for i in existed], [values[i] for i in existed],
                                       [sizes[i] for i in existed],
                                       [parents[i] for i in existed], pin, copies, write_quorum,
                                       retain_s)
            made = min(made, more)
            failures.append(text)
        return stored, made, "; ".join(f for f in failures if f)

    def _rput(self, keys: Sequence[bytes], values: Sequence[memoryview], sizes: Sequence[int],
              parents: Sequence[bytes | None], pin: bool, copies: int, write_quorum: int,
              retain_s: float = 0.0) -> tuple[list[bool], int, str]:
        meta = wire.pack_rput_items(keys, sizes, parents, pin, copies, write_quorum, retain_s)
        _, reply = self._call(Op.RPUT, len(keys), meta, values)
        return wire.unpack_repl_reply(reply, len(keys))

    # ---- pipelined same-host puts: reserve on every node, then fill, then commit ---------

    def send_reserve(self, keys: Sequence[bytes], values: Sequence[memoryview],
                     parents: Sequence[bytes | None], pin: bool, retain_s: float = 0.0
                     ) -> bool:
        """Sends a same-host put's RESERVE without reading the answer (``fill_and_commit``
        reads it); False, with nothing sent, where ``put`` would not reserve in one part
        (a stream connection, a put under ``SHM_PUT_MIN_BYTES``, or one past a region share):
        the caller makes the ordinary call."""
        sizes = self._sizes(values)
        if self.mode is not Mode.SHM or sum(sizes) < SHM_PUT_MIN_BYTES or len(shm_parts(
                sizes, self.session.region_bytes // SHM_PUT_REGION_SHARE)) != 1:
            return False
        self._send(Op.RESERVE, len(keys), wire.pack_put_items(keys, sizes, parents, pin,
                                                              retain_s))
        return True

    def fill_and_commit(self, keys: Sequence[bytes], values: Sequence[memoryview]
                        ) -> list[int | None]:
        """Reads a sent RESERVE's answer, fills the reserved room and sends the COMMIT
        (when anything was reserved) without reading its answer; each value's slot (None:
        the key was already stored), for ``commit_reply``."""
        rids, slots = self._fill_reserved(keys, values)
        if rids:
            self._send(Op.COMMIT, len(rids), wire.pack_ids(rids))
        return slots

    def commit_reply(self, slots: Sequence[int | None]) -> list[bool]:
        """Reads the answer to ``fill_and_commit``'s COMMIT: per key, stored by this put."""
        if all(slot is None for slot in slots):
            return [False] * len(slots)  # nothing reserved, no COMMIT sent
        _, committed = self._response()
        done = iter(committed)
        return [False if slot is None else bool(next(done)) for slot in slots]

    # ---- pipelined puts (stream mode): send now, read the reply later --------------------

    def send_put(self, keys: Sequence[bytes], values: Sequence[memoryview],
                 parents: Sequence[bytes | None], pin: bool, retain_s: float = 0.0,
                 replicated: tuple[int, int] | None = None) -> None:
        """Sends a PUT (or, with ``replicated=(copies, write_quorum)``, an RPUT) without
        reading its reply: the caller reads it with ``put_reply`` once it has sent what
        else it has to send (requests on one connection are answered in order)."""
        if self.mode is Mode.SHM:
            raise InvalidArgument("a pipelined put needs a stream connection (tcp)")
        sizes = self._sizes(values)
        if replicated is None:
            meta = wire.pack_put_items(keys, sizes, parents, pin, retain_s)
            self._send(Op.PUT, len(keys), meta, values)
        else:
            meta = wire.pack_rput_items(keys, sizes, parents, pin, *replicated, retain_s)
            self._send(Op.RPUT, len(keys), meta, values)

    def put_reply(self, count: int, *, replicated: bool = False
                  ) -> tuple[list[bool], int, str]:
        """The reply to a ``send_put`` of ``count`` keys: (stored flags, copies holding
        every key, text of failed forwards); a plain PUT has 1 copy and no failures."""
        _, reply = self._response()
        if replicated:
            return wire.unpack_repl_reply(reply, count)
        return [bool(b) for b in reply], 1, ""

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        _, meta = self._call(Op.EXISTS, len(keys), wire.pack_keys(keys))
        return [bool(b) for b in meta]

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        count, _ = self._call(Op.PREFIX, len(keys), wire.pack_keys(keys))
        return count

    def remove(self, keys: Sequence[bytes]) -> list[bool]:
        _, meta = self._call(Op.REMOVE, len(keys), wire.pack_keys(keys))
        return [bool(b) for b in meta]

