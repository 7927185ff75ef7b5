"""Server side of the transfer channel (format in ``kvstore.protocol.wire``).

One thread per connection: blocking ``recv_into``/``sendmsg`` release the GIL
for the whole transfer, and a connection serves one request at a time, so the
per-connection state (leases, reservations, scratch buffers) needs no lock.
Everything a connection holds (read leases, shared-memory reservations, staging
areas) is released when it closes, however it closes. A same-host client that asks for
staged puts (``wire.CAP_STAGED_PUTS``) gets the region read-only and fills its
reservations in staging areas (``kvstore.node.staging``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import socket
import ssl
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from kvstore.auth import tenancy
from kvstore.auth.security import Principal
from kvstore.core.errors import (
    InternalError,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from kvstore.core.keys import BlockKey
from kvstore.node import channel_replicated as replicated
from kvstore.node.client_holds import LeaseSet, ReservationSet
from kvstore.node.semantics import MAX_BATCH, Node
from kvstore.node.staging import Staging
from kvstore.protocol import native_channel, wire
from kvstore.protocol.wire import HEADER, Mode, Op, ProtocolError

if TYPE_CHECKING:
    from kvstore.core.forwarding import Forwarding
    from kvstore.node.metrics import NodeMetrics

log = logging.getLogger("kvstore.channel")

_SCRATCH = 1 << 20
MAX_CONNECTIONS = 1024


_OPS = {int(op): op for op in Op}
_ONE_MISS = wire.pack_ids((wire.MISS,))  # a GET of one key's reply meta on a miss


class _Abandon(Exception):
    """Reply with ``error`` and close: the rest of the request will not be read."""

    def __init__(self, error: KVStoreError) -> None:
        super().__init__(str(error))
        self.error = error


class _Connection:
    """One client stream."""

    def __init__(self, node: Node, sock: socket.socket, mode: Mode, principal: Principal,
                 metrics: NodeMetrics | None = None, stall_s: float | None = None,
                 forwarder: Forwarding | None = None, staging: Staging | None = None) -> None:
        self.node = node
        self.forwarder = forwarder  # replicated puts (RPUT, RCOMMIT); None outside a cluster
        self.sock = sock
        self.lease_timeout = stall_s
        if stall_s is not None:
            # A request whose bytes stop flowing (a stalled or stopped client) ends within
            # this: its reservation is aborted, its read leases released, the stream closed.
            # Half of it, so that an idle same-host connection wakes often enough to expire
            # its leases and reservations at most 1.5 timeouts after they were granted.
            wire.set_stall_timeout(sock, stall_s / 2)
        self.mode = mode
        self.p = principal  # salts every key this connection names
        self.leases = LeaseSet(node)
        self.staging = staging  # None: the client writes its reservations in the region
        self.reservations = ReservationSet(node, staging=staging)
        self.scratch: memoryview | None = None
        self.handlers: dict[int, Callable[[int, bytes], None]] = {
            Op.GET: self.on_get,
            Op.PUT: self.on_put,
            Op.EXISTS: self.on_exists,
            Op.PREFIX: self.on_prefix,
            Op.REMOVE: self.on_remove,
            Op.RPUT: functools.partial(replicated.on_rput, self),
        }
        if mode is Mode.SHM:
            self.handlers |= {
                Op.LEASE: self.on_lease,
                Op.RELEASE: self.on_release,
                Op.RELEASE_CHECK: self.on_release_check,
                Op.RESERVE: self.on_reserve,
                Op.COMMIT: self.on_commit,
                Op.ABORT: self.on_abort,
                Op.RCOMMIT: functools.partial(replicated.on_rcommit, self),
            }
        # Ops whose handler is marked ``@tenancy.cluster_only``: refused to tenants.
        self.cluster_ops = frozenset(op for op, h in self.handlers.items()
                                     if tenancy.is_cluster_only(h))
        # The native helper frames, parses and moves this stream's requests (None: the
        # pure-Python path, the same bytes on the wire).
        self.native = native_channel.server_stream(
            sock, {op: wire.meta_item_size(Op(op)) for op in self.handlers}, MAX_BATCH)
        self.stream: wire.StreamReader | None = None
        if self.native is None:
            self.stream = wire.StreamReader(sock)
            self.reader: wire.FrameReader = self.stream
        else:
            self.reader = self.native
        if metrics is not None:  # each op's dispatch timed under its name
            self.handlers = {op: metrics.timed_channel_op(Op(op).name, handler)
                             for op, handler in self.handlers.items()}

    def serve(self) -> None:
        reader = self.reader
        shm = self.mode is Mode.SHM
        try:
            while True:
                if shm:
                    self.expire()
                try:
                    op, count, meta = self.next_request()
                except wire.PeerClosed:
                    return
                except wire.STALLED:
                    if reader.buffered:
                        return  # stalled inside a frame
                    continue  # idle between requests (SHM: expire what it holds, above)
                except ProtocolError as exc:
                    self.reply_error(InvalidArgument(str(exc)))
                    return
                payload = self.payload_bytes(op, meta)
                try:
                    with self.node.request():
                        if op in self.cluster_ops:
                            tenancy.require_cluster_role(self.p, op.name)
                        payload = 0  # the handler consumes the payload from here on
                        self.handlers[op](count, meta)
                except _Abandon as abandon:
                    self.reply_error(abandon.error)
                    return
                except KVStoreError as exc:
                    if payload > self.node.region_bytes:
                        self.reply_error(exc)
                        return  # not worth draining: the stream is abandoned
                    self.discard(payload)
                    if op not in wire.NO_REPLY_OPS:
                        self.reply_error(exc)
        except (ConnectionError, TimeoutError):
            return
        except OSError as exc:
            log.debug("channel connection ended: %s", exc)
        finally:
            self.leases.close()
            self.reservations.close()

    def next_request(self) -> tuple[Op, int, bytes]:
        """The next request's (op, count, meta), its header checked before the meta is read.
        PeerClosed at a frame boundary, STALLED while idle or inside a frame (``reader.
        buffered``), ProtocolError for a header past its bounds."""
        native = self.native
        if native is not None:
            try:
                code, count, meta = native.next_request()
            except native_channel.FrameRejected as bad:
                self.check_frame(bad.op, bad.count, bad.meta_len)  # words the error
                raise
            return _OPS[code], count, meta
        reader = self.stream
        assert reader is not None
        op_code, count, meta_len = HEADER.unpack(reader.read(HEADER.size))
        op = self.check_frame(op_code, count, meta_len)
        try:
            return op, count, reader.read(meta_len)
        except wire.STALLED as exc:  # inside a frame: never "idle", the stream is lost
            raise ConnectionError("stalled inside a request's metadata") from exc

    def expire(self) -> None:
        """Ends the leases and reservations this client has held past the timeout."""
        timeout = self.lease_timeout
        if timeout is not None and (self.leases or self.reservations):
            n = self.leases.expire(timeout) + self.reservations.expire(timeout)
            if n:
                log.info("expired %d read leases or reservations of a same-host client "
                         "(held past --read-lease-timeout %gs)", n, timeout)

    @staticmethod
    def payload_bytes(op: Op, meta: bytes) -> int:
        if op is Op.RPUT:
            return sum(item[2] for item in wire.RPUT_ITEM.iter_unpack(meta))
        if op is not Op.PUT:
            return 0
        return sum(item[2] for item in wire.PUT_ITEM.iter_unpack(meta))

    def check_frame(self, op_code: int, count: int, meta_len: int) -> Op:
        if op_code not in self.handlers:
            known = op_code in Op._value2member_map_
            raise ProtocolError(f"op {Op(op_code).name} is not available in {self.mode.name} mode"
                                if known else f"unknown op {op_code}")
        op = Op(op_code)
        if count > MAX_BATCH:
            raise ProtocolError(f"at most {MAX_BATCH} items per request, got {count}")
        expected = count * wire.meta_item_size(op)
        if meta_len != expected or meta_len > wire.MAX_META:
            raise ProtocolError(f"{op.name} with {count} items needs {expected} meta bytes, "
                                f"got {meta_len}")
        return op

    def reply(self, count: int, meta: bytes, values: list[memoryview] | None = None) -> None:
        if self.native is not None:
            self.native.send_frame(0, count, meta, values or ())
            return
        frames: list[bytes | memoryview] = [HEADER.pack(0, count, len(meta)), meta]
        if values:
            frames.extend(values)
        wire.send_buffers(self.sock, frames)

    def reply_error(self, exc: KVStoreError) -> None:
        self.sock.sendall(wire.error_frame(wire.status_of(exc), str(exc), exc.reason))

    # ---- ops -----------------------------------------------------------------------------

    def on_get(self, count: int, meta: bytes) -> None:
        node = self.node
        if count == 1:  # one block, the call an engine makes per block: fewer steps
            self.get_one(self.p.key(cast(BlockKey, meta)))  # meta: 16 bytes, checked
            return
        entries = node.acquire_reads(self.p.keys(wire.unpack_keys(meta, count)))
        try:
            tenancy.check_reply_bytes([None if e is None else e.nbytes for e in entries],
                                      wire.MAX_REPLY_BYTES, "GET")
            views = node.block_views(entries)
            lengths = wire.pack_ids([wire.MISS if v is None else len(v) for v in views])
            self.reply(count, lengths, [v for v in views if v is not None])
        finally:
            node.release_reads(entries)

    def get_one(self, key: BlockKey) -> None:
        """``on_get`` of one key: the same checks, lease and reply bytes as the batch of
        one, without its lists."""
        node = self.node
        entry = node.acquire_read(key)
        if entry is None:
            self.reply(1, _ONE_MISS)
            return
        try:
            tenancy.check_reply_bytes((entry.nbytes,), wire.MAX_REPLY_BYTES, "GET")
            view = node.block_view(entry)
            if view is None:  # failed its checksum: a miss, as in the batch
                self.reply(1, _ONE_MISS)
            else:
                self.reply(1, wire.pack_ids((len(view),)), [view])
        finally:
            node.release_read(entry)

    def on_put(self, count: int, meta: bytes) -> None:
        items = list(wire.PUT_ITEM.iter_unpack(meta))
        self.refuse_oversized([item[2] for item in items])
        results = bytearray(count)
        failure: KVStoreError | None = None
        for i, (key, parent, nbytes, flags) in enumerate(items):
            if failure is not None:
                self.discard(nbytes)
                continue
            try:
                p = self.p
                with self.node.put_slot(
                    p.key(BlockKey(key)), nbytes,
                    parent=p.key(BlockKey(parent)) if flags & wire.FLAG_PARENT else None,
                    pin=bool(flags & wire.FLAG_PIN), owner=p.owner, quota=p.quota,
                    retain_s=wire.item_retain_s(meta, i, wire.PUT_ITEM.size),
                ) as slot:
                    if slot is None:
                        self.discard(nbytes)
                        continue
                    self.reader.read_into(slot.view)
                results[i] = slot.stored
            except KVStoreError as exc:
                # The client has sent the rest already: consume it to stay in frame.
                failure = exc
                self.discard(nbytes)
        if failure is not None:
            raise failure
        self.reply(count, bytes(results))

    def refuse_oversized(self, sizes: list[int]) -> None:
        limit = self.node.region_bytes
        for n in sizes:
            if n > limit:
                # Larger than the node could ever hold: refuse without reading it.
                raise _Abandon(ResourceExhausted(
                    f"value of {n} bytes exceeds the node's capacity of {limit} bytes"))

    def discard(self, nbytes: int) -> None:
        if self.scratch is None:
            self.scratch = memoryview(bytearray(_SCRATCH))
        self.reader.discard(nbytes, self.scratch)

    def on_exists(self, count: int, meta: bytes) -> None:
        keys = self.p.keys([BlockKey(k) for k in wire.unpack_keys(meta, count)])
        self.reply(count, bytes(self.node.exists(keys)))

    def on_prefix(self, count: int, meta: bytes) -> None:
        keys = self.p.keys([BlockKey(k) for k in wire.unpack_keys(meta, count)])
        self.reply(self.node.prefix_match(keys), b"")

    def on_remove(self, count: int, meta: bytes) -> None:
        keys = self.p.keys([BlockKey(k) for k in wire.unpack_keys(meta, count)])
        self.reply(count, bytes(self.node.remove(k) for k in keys))

    def on_lease(self, count: int, meta: bytes) -> None:
        out = bytearray()
        for key in wire.unpack_keys(meta, count):
            got = self.leases.acquire(BlockKey(key))
            if got is None:
                out += wire.LEASE_ITEM.pack(0, 0, 0)
            else:
                lease_id, entry = got
                if self.node.is_mapped(entry):
                    extent = entry.extent
                    assert extent is not None  # a leased block in a mapped tier has one
                    out += wire.LEASE_ITEM.pack(lease_id, extent.offset, entry.nbytes)
                else:
                    # Not in shared memory (HBM or SSD): the client fetches it with GET.
                    self.leases.release(lease_id)
                    out += wire.LEASE_ITEM.pack(0, 0, entry.nbytes)
        self.reply(count, bytes(out))

    def on_release(self, count: int, meta: bytes) -> None:
        for lease_id in wire.unpack_ids(meta, count):
            self.leases.release(lease_id)

    def on_release_check(self, count: int, meta: bytes) -> None:
        self.reply(count, bytes(self.leases.release(i) for i in wire.unpack_ids(meta, count)))

    def on_reserve(self, count: int, meta: bytes) -> None:
        out = bytearray()
        made: list[int] = []
        staged = self.staging is not None
        try:
            for i, (key, parent, nbytes, flags) in enumerate(wire.PUT_ITEM.iter_unpack(meta)):
                got = self.reservations.reserve(
                    BlockKey(key), nbytes,
                    parent=BlockKey(parent) if flags & wire.FLAG_PARENT else None,
                    pin=bool(flags & wire.FLAG_PIN),
                    retain_s=wire.item_retain_s(meta, i, wire.PUT_ITEM.size),
                    owner=self.p.owner, quota=self.p.quota,
                )
                if got is None:
                    out += (wire.RESERVE_STAGED_ITEM.pack(0, 0, 0, wire.RESERVE_EXISTED, 0)
                            if staged else wire.RESERVE_ITEM.pack(0, 0, wire.RESERVE_EXISTED))
                    continue
                rid, reservation = got
                made.append(rid)
                where = self.reservations.staged_slot(rid)
                if where is None:
                    out += wire.RESERVE_ITEM.pack(rid, reservation.extent.offset,
                                                  wire.RESERVE_OK)
                else:
                    generation, slot = where
                    out += wire.RESERVE_STAGED_ITEM.pack(rid, slot, reservation.extent.offset,
                                                         wire.RESERVE_OK, generation)
        except BaseException:
            # The client learns only the error: nothing of this request stays reserved.
            for rid in made:
                self.reservations.abort(rid)
            raise
        fresh = self.staging.to_send() if self.staging is not None else None
        if fresh is None:
            self.reply(count, bytes(out))
        else:  # a new staging area: its memfd rides with the reply's first bytes
            socket.send_fds(self.sock, [HEADER.pack(0, count, len(out))], [fresh[0]])
            self.sock.sendall(bytes(out))

    def on_commit(self, count: int, meta: bytes) -> None:
        results = bytearray()
        void: KVStoreError | None = None
        for rid in wire.unpack_ids(meta, count):
            try:  # every known reservation is settled, even when one of them expired
                results.append(self.reservations.commit(rid))
            except KVStoreError as exc:
                void = void or exc
            except OSError as exc:  # its staged bytes could not be copied: not stored
                void = void or InternalError(f"reservation {rid}: {exc}")
        if void is not None:
            raise void
        self.reply(count, bytes(results))

    def on_abort(self, count: int, meta: bytes) -> None:
        for rid in wire.unpack_ids(meta, count):
            self.reservations.abort(rid)


class ChannelServer:
    """Accepts transfer-channel connections on TCP and (same host) a Unix socket."""

    def __init__(self, node: Node, *, host: str, port: int, unix_name: str | None,
                 ssl_context: ssl.SSLContext | None = None,
                 metrics: NodeMetrics | None = None, stall_s: float | None = None,
                 max_connections: int = MAX_CONNECTIONS, forwarder: Forwarding | None = None
                 ) -> None:
        """``stall_s``: how long a request may wait on its client's bytes (the node's
        ``--read-lease-timeout``); None: forever. ``max_connections``: open connections
        (each has a thread) past which new ones are closed at once. ``forwarder``:
        replicated puts (RPUT, RCOMMIT); None outside a cluster (a cluster role sets it)."""
        self.node = node
        self.forwarder = forwarder
        self._max_connections = max_connections
        self._live = 0  # connections with a thread; guarded by _lock
        self._stall_s = stall_s
        self._ssl = ssl_context  # TLS for the TCP listener (never the Unix socket)
        self._metrics = metrics
        # HELLO token -> the principal it was issued to (one per tenant, and per tenant a
        # cluster-role caller charges, by OpenChannel, which is authenticated); guarded by
        # _lock.
        self._principals: dict[bytes, Principal] = {}
        self._tokens: dict[tuple[str, str | None], bytes] = {}
        self._tcp = socket.create_server((host, port), backlog=128)
        self._unix: socket.socket | None = None
        self.unix_path = ""
        if unix_name is not None:
            self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._unix.bind("\0" + unix_name)  # abstract: nothing left on disk after a crash
            self._unix.listen(128)
            self.unix_path = "@" + unix_name
        self._lock = threading.Lock()
        self._region_ro = -1  # the region's memfd, read-only (lazily); guarded by _lock
        self._conns: set[socket.socket] = set()  # guarded by _lock
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    def token_for(self, principal: Principal) -> bytes:
        """The HELLO token of ``principal``'s connections (made on first use)."""
        name = ("" if principal.tenant is None else principal.tenant.name,
                None if principal.charged is None else principal.charged.name)
        with self._lock:
            token = self._tokens.get(name)
            if token is None:
                token = self._tokens[name] = secrets.token_bytes(wire.TOKEN_BYTES)
                self._principals[token] = principal
            return token

    @property
    def tcp_address(self) -> tuple[str, int]:
        host, port = self._tcp.getsockname()[:2]
        return host, port

    def start(self) -> None:
        for listener in (self._tcp, self._unix):
            if listener is not None:
                t = threading.Thread(target=self._accept_loop, args=(listener,),
                                     name="kvstore-channel-accept", daemon=True)
                t.start()
                self._threads.append(t)

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                full = self._live >= self._max_connections
                if not full:
                    self._live += 1
            if full:
                # One thread per connection: past the cap, refuse rather than run the
                # process out of threads (and address space) for every other client.
                log.warning("refused a channel connection: %d open (the cap)",
                            self._max_connections)
                sock.close()
                continue
            try:
                threading.Thread(target=self.serve_connection, args=(sock,),
                                 name="kvstore-channel", daemon=True).start()
            except RuntimeError:  # no thread to be had: refuse this one, keep accepting
                log.warning("refused a channel connection: cannot start a thread")
                self._ended()
                sock.close()

    def _ended(self) -> None:
        with self._lock:
            self._live -= 1

    def serve_connection(self, sock: socket.socket) -> None:
        """Serves one accepted connection, on the calling thread (each has its own), until
        it ends. A subclass may wrap it (``benchmarks/put_profile.py`` profiles it)."""
        try:
            self._serve_socket(sock)
        finally:
            self._ended()

    def _serve_socket(self, sock: socket.socket) -> None:
        with self._lock:
            if self._stopping.is_set():
                sock.close()
                return
            self._conns.add(sock)
        try:
            if sock.family == socket.AF_INET or sock.family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ssl is not None:
                    sock.settimeout(10.0)
                    tls = self._ssl.wrap_socket(sock, server_side=True)
                    with self._lock:
                        self._conns.discard(sock)
                        self._conns.add(tls)
                    sock = tls
            accepted = self._handshake(sock)
            if accepted is not None:
                mode, principal, staging = accepted
                _Connection(self.node, sock, mode, principal, metrics=self._metrics,
                            stall_s=self._stall_s, forwarder=self.forwarder,
                            staging=staging).serve()
        except (OSError, ConnectionError):
            pass
        except Exception:  # a bug must not take the node down with it
            log.exception("channel connection failed")
            with contextlib.suppress(OSError):
                sock.sendall(wire.error_frame(wire.status_of(InternalError), "internal error"))
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _handshake(self, sock: socket.socket
                   ) -> tuple[Mode, Principal, Staging | None] | None:
        sock.settimeout(10.0)  # a silent peer must not hold a thread forever
        hello = wire.recv_exact(sock, wire.HELLO_CAPS.size)
        sock.settimeout(None)
        magic, token, mode_code, caps = wire.HELLO_CAPS.unpack(hello)
        with self._lock:
            principal = self._principals.get(token) if magic == wire.MAGIC else None
        if principal is None:
            _refuse(sock, Unauthenticated)
            return None
        try:
            mode = Mode(mode_code)
        except ValueError:
            _refuse(sock, InvalidArgument)
            return None
        if mode is Mode.SHM and sock.family != socket.AF_UNIX:
            _refuse(sock, InvalidArgument)  # shared memory only on this host
            return None
        if mode is Mode.SHM and not principal.may_map_region:
            _refuse(sock, PermissionDenied)  # the region holds other tenants' bytes
            return None
        if mode is not Mode.SHM:
            sock.sendall(wire.HELLO_REPLY.pack(0, self.node.region_bytes))
            return mode, principal, None
        if not caps & wire.CAP_STAGED_PUTS:  # a client that writes into the region
            socket.send_fds(sock, [wire.HELLO_REPLY.pack(0, self.node.region_bytes)],
                            [self.node.region_fd])
            return mode, principal, None
        staging = Staging(self.node.region_bytes)
        try:
            first = staging.to_send()
            assert first is not None
            socket.send_fds(sock, [wire.HELLO_REPLY_CAPS.pack(0, wire.CAP_STAGED_PUTS,
                                                              self.node.region_bytes)],
                            [self._readonly_region_fd(), first[0]])
        except BaseException:
            staging.close()
            raise
        return mode, principal, staging

    def _readonly_region_fd(self) -> int:
        """The region's memfd opened read-only (a client's map of it cannot write), or the
        region's own if /proc cannot reopen it."""
        with self._lock:
            if self._region_ro < 0:
                try:
                    self._region_ro = os.open(f"/proc/self/fd/{self.node.region_fd}",
                                              os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    log.warning("cannot reopen the region read-only; same-host clients map "
                                "it writable")
                    return self.node.region_fd
            return self._region_ro

    def stop(self) -> None:
        """Stops accepting and ends every connection (their leases and reservations go too)."""
        self._stopping.set()
        for listener in (self._tcp, self._unix):
            if listener is not None:
                with contextlib.suppress(OSError):
                    listener.shutdown(socket.SHUT_RDWR)
                listener.close()
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            ro, self._region_ro = self._region_ro, -1
        if ro >= 0:
            os.close(ro)


def _refuse(sock: socket.socket, error: type[KVStoreError]) -> None:
    """Answers a HELLO with ``error``'s status (and no region); the caller closes."""
    sock.sendall(wire.HELLO_REPLY.pack(wire.status_of(error), 0))
