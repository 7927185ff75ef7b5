"""The client of one kvstore node, ``NodeClient``: what ``kvstore.client.Client(addr)``
is, and what the cluster client and a node's peers build on.

Transports (``transport=``):

* ``"grpc"``: every call is a gRPC call; portable, ~1 GB/s at best.
* ``"tcp"``: a transfer channel negotiated over gRPC; values stream over raw TCP.
* ``"shm"``: same host only; the node's DRAM region is mapped into this process
  and values are copied straight from/into it under read leases/reservations.
* ``"auto"`` (default): ``shm`` if the node is on this host, else ``tcp``, else ``grpc``.

Errors: every failure reaches the caller as a ``kvstore.core.errors`` exception,
mapped at one choke point (``_errors``): gRPC status codes by code (refined by the
reason the node sends beside it, such as ``ReplyTooLarge``), socket failures as
``Unavailable``. A gRPC failure the node reported ends with
``(request id ID)``: the id under which the node logged it.

Retry policy: none for errors the node reports. A call that fails with a
transport error is retried once on a fresh connection (every kvstore operation
is idempotent: puts are content-addressed); a second failure is raised.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import grpc

from kvstore.auth.security import ClientTls, charge_to_metadata
from kvstore.core.checks import MAX_BATCH, check_key, check_parent
from kvstore.core.errors import (
    REASON_HEADER,
    BufferTooSmall,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    ReplyTooLarge,
    Unavailable,
    error_for_code,
)
from kvstore.core.keys import BlockKey
from kvstore.core.logs import REQUEST_ID_HEADER
from kvstore.core.prefetch import DEFAULT_PREFETCH_TIER, PrefetchOutcome, check_prefetch
from kvstore.core.retention import RetainOutcome, check_retain, retain_seconds
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol.grpc_options import GRPC_OPTIONS, host_id
from kvstore.protocol.wire import Mode
from kvstore.remote.channel_client import (
    ChannelConnection,
    ChannelSession,
    as_readable,
    as_writable,
)

TRANSPORTS = ("auto", "grpc", "tcp", "shm")
T = TypeVar("T")
_GRPC_BATCH_BYTES = 32 << 20
"""Most value bytes of one BatchPut: a node's request budget is at least twice this
(``kvstore.node.request_budget.MIN_REQUEST_BYTES``), so a batch always fits beside another."""


class BatchCalls(Protocol):
    """The batch calls ``SingleKeyCalls`` is written on (its classes' ``self``)."""

    def put_batch(self, keys: Sequence[bytes], values: Sequence[object], *,
                  parents: Sequence[bytes | None] | None = None, pin: bool = False,
                  retain_s: float | None = None) -> list[bool]: ...

    def get_batch(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    def get_batch_into(self, keys: Sequence[bytes], bufs: Sequence[object]
                       ) -> list[int | None]: ...


class SingleKeyCalls:
    """``put``, ``get`` and ``get_into`` of one key, as the batch calls of one item: the
    single-node ``NodeClient`` and the ``ClusterClient`` share these."""

    def put(self: BatchCalls, key: bytes, value: object, *, parent: bytes | None = None,
            pin: bool = False, retain_s: float | None = None) -> bool:
        """Stores ``value`` under ``key``: True if stored, False if the key already existed
        (cluster-wide: on its master). A put resent after a transport error (or, in a
        cluster, to the next node after its master failed) is True: its first try may have
        stored the key. ``retain_s``: keep the block that many seconds after its last put
        or read (docs/node.md, "Retention"); None asks for nothing."""
        return self.put_batch([key], [value], parents=[parent], pin=pin,
                              retain_s=retain_s)[0]

    def get(self: BatchCalls, key: bytes) -> bytes | None:
        """The value of ``key``, or None on a miss."""
        return self.get_batch([key])[0]

    def get_into(self: BatchCalls, key: bytes, buf: object) -> int | None:
        """Writes the value of ``key`` into ``buf``; its length, or None on a miss."""
        return self.get_batch_into([key], [buf])[0]


class NodeClient(SingleKeyCalls):
    """A connection to one kvstore node. Thread-safe; use as a context manager. Users name
    it ``kvstore.client.Client``; the cluster client and the node's peers use it directly."""

    def __init__(self, addr: str, *, transport: str = "auto", timeout: float | None = 30.0,
                 token: str | None = None, tls: ClientTls | None = None,
                 io_timeout: float | None = None, charge_to: str | None = None) -> None:
        """``token``: the bearer token a node with tenants requires (see
        ``kvstore.auth.security``); ``tls``: connect over TLS (gRPC and the TCP channel);
        ``io_timeout``: seconds a transfer-channel read or write may stall (None: no bound);
        ``charge_to``: the tenant this client's puts are charged to on the node (a node
        copying a tenant's block to its peer; the node allows it the cluster role only)."""
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.addr = addr
        self.timeout = timeout
        self.charge_to = charge_to
        self._io_timeout = io_timeout
        self._requested = transport
        metadata = ((("authorization", f"Bearer {token}"),) if token else ()) + (
            (charge_to_metadata(charge_to),) if charge_to is not None else ())
        self._metadata = metadata or None
        self._tls = tls
        self._grpc_channel = (
            grpc.secure_channel(addr, tls.grpc_credentials(), options=GRPC_OPTIONS) if tls
            else grpc.insecure_channel(addr, options=GRPC_OPTIONS))
        self._stub = pb_grpc.KVStoreStub(self._grpc_channel)
        self._lock = threading.Lock()
        # guarded by _lock:
        self._mode: Mode | None = None  # None: plain gRPC
        self._resolved = False
        self._session: ChannelSession | None = None
        self._idle: list[ChannelConnection] = []
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            session, self._session = self._session, None
        for conn in idle:
            conn.close()
        if session is not None:
            session.close()
        self._grpc_channel.close()

    @property
    def transport(self) -> str:
        """The transport in use: ``"grpc"``, ``"tcp"`` or ``"shm"``."""
        self._resolve()
        return "grpc" if self._mode is None else self._mode.name.lower()

    # ---- error choke point ---------------------------------------------------------------

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except KVStoreError:
            raise
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = exc.details() if hasattr(exc, "details") else str(exc)
            # The cause stays chained: its gRPC debug string tells a log reader what failed.
            raise error_for_code(code, f"{self.addr}: {details}{_request_id_note(exc)}",
                                 _trailing(exc, REASON_HEADER) or "") from exc
        except OSError as exc:
            raise Unavailable(f"{self.addr}: transfer channel failed: {exc}") from exc

    def _grpc(self, method: str, request: Any) -> Any:
        with self._errors():
            try:
                return getattr(self._stub, method)(request, timeout=self.timeout,
                                                   metadata=self._metadata)
            except ValueError:
                # gRPC's word for a call on a closed channel. A pool closes the client of a
                # peer that left while another thread may still call it: that call fails as
                # calls to a departed node do, never as a bad argument.
                if self._closed:
                    raise Unavailable(f"{self.addr}: client is closed") from None
                raise

    # ---- transfer channel ----------------------------------------------------------------

    def _resolve(self) -> None:
        with self._lock:
            if self._resolved:
                return
            if self._closed:
                raise Unavailable("client is closed")
            if self._requested == "grpc":
                self._resolved = True
                return
        info = self._grpc("OpenChannel", pb.OpenChannelRequest(client_host_id=host_id()))
        host = info.tcp_host or self.addr.rpartition(":")[0].strip("[]")
        session = ChannelSession(tcp_host=host, tcp_port=info.tcp_port,
                                 unix_path=info.unix_path, token=info.token,
                                 region_bytes=info.region_bytes,
                                 tls=self._tls.ssl_context() if self._tls else None)
        modes: dict[str, list[Mode | None]] = {"auto": [Mode.SHM, Mode.TCP, None],
                                               "tcp": [Mode.TCP], "shm": [Mode.SHM]}
        candidates = modes[self._requested]
        if not (info.same_host and info.unix_path):
            if self._requested == "shm":
                raise Unavailable(f"{self.addr}: shared memory needs a node on this host")
            candidates = [m for m in candidates if m is not Mode.SHM]
        last: Exception | None = None
        for mode in candidates:
            if mode is None:
                break
            try:
                conn = ChannelConnection(session, mode, timeout=self.timeout,
                                         io_timeout=self._io_timeout)
            except (OSError, KVStoreError) as exc:
                last = exc
                continue
            with self._lock:
                self._session, self._mode, self._resolved = session, mode, True
                self._idle.append(conn)
            return
        if None in candidates:
            with self._lock:
                self._mode, self._resolved = None, True
            return
        raise Unavailable(f"{self.addr}: cannot open a {self._requested} channel: {last}")

    def _channel_call(self, fn: Any, *, resent: Callable[[Any], Any] | None = None) -> Any:
        """Runs ``fn(conn)`` on a pooled connection, retrying once after a transport error.

        ``resent``: maps the retry's result for a request that may have landed on its first
        try (a put the node stored before its answer was lost finds its keys stored)."""
        for attempt in (1, 2):
            self._resolve()
            conn = self._checkout()
            try:
                result = fn(conn)
            except KVStoreError:
                self._checkin(conn)  # the node answered: the stream is in step
                raise
            except OSError as exc:
                conn.close()
                self._invalidate()  # the node may have restarted: negotiate afresh
                if attempt == 2:
                    raise Unavailable(f"{self.addr}: transfer channel failed: {exc}") from exc
                continue
            except BaseException:
                conn.close()  # the stream's state is unknown
                raise
            self._checkin(conn)
            return result if attempt == 1 or resent is None else resent(result)
        raise AssertionError("unreachable")

    def _invalidate(self) -> None:
        with self._lock:
            self._resolved = False
            idle, self._idle = self._idle, []
            # The old session's mapping is left to the garbage collector: another
            # thread may still be copying from it.
            self._session = None
        for conn in idle:
            conn.close()

    def _checkout(self) -> ChannelConnection:
        with self._lock:
            if self._closed:
                raise Unavailable("client is closed")
            if self._idle:
                return self._idle.pop()
            session, mode = self._session, self._mode
        if session is None or mode is None:
            raise Unavailable(f"{self.addr}: transfer channel was reset; retry")
        with self._errors():
            return ChannelConnection(session, mode, timeout=self.timeout,
                                     io_timeout=self._io_timeout)

    def _checkin(self, conn: ChannelConnection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    @property
    def maps_node_memory(self) -> bool:
        """True once this client moves values through the node's shared memory: its
        copies then hold the GIL, so calls to several such nodes gain nothing from
        threads (the cluster client runs them one after another). Never connects."""
        with self._lock:
            return self._resolved and self._mode is Mode.SHM

    def _uses_channel(self) -> bool:
        self._resolve()
        return self._mode is not None

    # ---- API -----------------------------------------------------------------------------

    def put_batch(self, keys: Sequence[bytes], values: Sequence[object], *,
                  parents: Sequence[bytes | None] | None = None, pin: bool = False,
                  retain_s: float | None = None) -> list[bool]:
        """Stores each value under its key; per key as ``put``."""
        return self.put_checked(PutBatch.check(keys, values, parents=parents, pin=pin,
                                               retain_s=retain_s))

    def put_checked(self, batch: PutBatch) -> list[bool]:
        """``put_batch`` of a batch already checked (the cluster client checks once)."""
        ks, views, ps, pin, keep = (batch.keys, batch.values, batch.parents, batch.pin,
                                    batch.retain_s)
        if self._uses_channel():
            out: list[bool] = []
            for lo in range(0, len(ks), MAX_BATCH):
                hi = lo + MAX_BATCH
                out += self._channel_put(ks[lo:hi], views[lo:hi], ps[lo:hi], pin, keep)
            return out
        stored: list[bool] = []
        for lo, hi in _chunks([len(v) for v in views], _GRPC_BATCH_BYTES):
            items = [pb.PutRequest(key=k, value=bytes(v), parent=p or b"", pin=pin,
                                   retain_s=keep)
                     for k, v, p in zip(ks[lo:hi], views[lo:hi], ps[lo:hi], strict=True)]
            stored.extend(self._grpc("BatchPut", pb.BatchPutRequest(items=items)).stored)
        return stored

    def put_batch_replicated(self, keys: Sequence[bytes], values: Sequence[object], *,
                             parents: Sequence[bytes | None] | None = None, pin: bool = False,
                             copies: int, write_quorum: int, retain_s: float | None = None
                             ) -> tuple[list[bool], int, list[str]]:
        """For the cluster client: a put this node, the keys' master, forwards to
        ``copies - 1`` other owners of its own choosing before it answers (one trip from
        here). Returns (stored flags, copies holding every key, failed forwards).
        FailedPrecondition: the node is not an etcd cluster member, or no transfer channel."""
        return self.put_checked_replicated(
            PutBatch.check(keys, values, parents=parents, pin=pin, retain_s=retain_s),
            copies=copies, write_quorum=write_quorum)

    def put_checked_replicated(self, batch: PutBatch, *, copies: int, write_quorum: int
                               ) -> tuple[list[bool], int, list[str]]:
        """``put_batch_replicated`` of a batch already checked."""
        ks, views, ps, pin, keep = (batch.keys, batch.values, batch.parents, batch.pin,
                                    batch.retain_s)
        if not self._uses_channel():
            raise FailedPrecondition(f"{self.addr}: a replicated put needs the transfer channel")
        stored: list[bool] = []
        made, failed = copies, []
        for lo in range(0, len(ks), MAX_BATCH):
            hi = lo + MAX_BATCH
            flags, n, text = self._channel_call(
                lambda c, lo=lo, hi=hi: c.put_replicated(ks[lo:hi], views[lo:hi], ps[lo:hi],
                                                         pin, copies, write_quorum, keep),
                resent=lambda r: (all_stored(r[0]), *r[1:]))
            stored += flags
            made = min(made, n)
            if text:
                failed.append(text)
        return stored, made, failed

    # One key over the transfer channel: the call an engine makes per block. The same
    # checks, errors and retry as the batch of one it stands for, in one frame, without
    # the batch's slicing and split-on-bound (one block always fits a reply).

    def put(self, key: bytes, value: object, *, parent: bytes | None = None,
            pin: bool = False, retain_s: float | None = None) -> bool:
        """Stores ``value`` under ``key``, as ``SingleKeyCalls.put`` (the batch of one)."""
        batch = PutBatch.check([key], [value], parents=[parent], pin=pin, retain_s=retain_s)
        if not self._uses_channel():
            return self.put_checked(batch)[0]
        return self._channel_put(batch.keys, batch.values, batch.parents, pin,
                                 batch.retain_s)[0]

    def _channel_put(self, ks: list[BlockKey], views: list[memoryview],
                     ps: list[BlockKey | None], pin: bool, keep: float) -> list[bool]:
        """One PUT frame of at most MAX_BATCH checked items, resent once after a transport
        error (its flags then ``all_stored``)."""
        return cast("list[bool]", self._channel_call(lambda c: c.put(ks, views, ps, pin, keep),
                                                     resent=all_stored))

    def get(self, key: bytes) -> bytes | None:
        """The value of ``key``, or None on a miss."""
        k = check_key(key)
        if not self._uses_channel():
            return self.get_batch([k])[0]
        return cast("bytes | None", self._channel_call(lambda c: c.get((k,), None))[0])

    def get_into(self, key: bytes, buf: object) -> int | None:
        """Writes the value of ``key`` into ``buf``; its length, or None on a miss."""
        k = check_key(key)
        out = as_writable(buf)
        if not self._uses_channel():
            return self.get_batch_into([k], [out])[0]
        return cast("int | None", self._channel_call(lambda c: c.get((k,), (out,)))[0])

    def get_batch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        ks = [check_key(k) for k in keys]
        if self._uses_channel():
            return self._batched(ks, lambda c, part, lo: c.get(part, None))
        def batch_get(part: list[BlockKey], lo: int) -> list[bytes | None]:
            reply = self._grpc("BatchGet", pb.BatchGetRequest(keys=part))
            return [i.value if i.found else None for i in reply.items]

        out: list[bytes | None] = []
        for lo in range(0, len(ks), MAX_BATCH):
            out += _split_on_bound(batch_get, ks[lo : lo + MAX_BATCH], lo)
        return out

    def _batched(self, ks: list[BlockKey], fn: Any) -> list[Any]:
        """``fn(conn, part, offset)`` over slices of at most MAX_BATCH keys, results joined."""
        out: list[Any] = []
        for lo in range(0, len(ks), MAX_BATCH):
            out += _split_on_bound(
                lambda part, lo: self._channel_call(lambda c: fn(c, part, lo)),
                ks[lo : lo + MAX_BATCH], lo)
        return out

    def get_batch_into(self, keys: Sequence[bytes], bufs: Sequence[object]) -> list[int | None]:
        """Writes each value into its buffer; per key its length, or None on a miss."""
        ks = [check_key(k) for k in keys]
        if len(bufs) != len(ks):
            raise InvalidArgument(f"{len(ks)} keys but {len(bufs)} buffers")
        outs = [as_writable(b) for b in bufs]
        if self._uses_channel():
            return self._batched(ks, lambda c, part, lo: c.get(part, outs[lo : lo + len(part)]))
        results: list[int | None] = []
        for key, value, out in zip(ks, self.get_batch(ks), outs, strict=True):
            if value is None:
                results.append(None)
                continue
            if len(out) < len(value):
                raise BufferTooSmall(f"buffer of {len(out)} bytes for a {len(value)}-byte "
                                     f"value of {key.hex()}")
            out[: len(value)] = value
            results.append(len(value))
        return results

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        ks = [check_key(k) for k in keys]
        if self._uses_channel():
            return self._batched(ks, lambda c, part, lo: c.exists(part))
        out: list[bool] = []
        for lo in range(0, len(ks), MAX_BATCH):
            out += self._grpc("Exists", pb.ExistsRequest(keys=ks[lo : lo + MAX_BATCH])).exists
        return out

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of ``keys`` are stored."""
        ks = [check_key(k) for k in keys]
        matched = 0
        for lo in range(0, max(len(ks), 1), MAX_BATCH):
            part = ks[lo : lo + MAX_BATCH]
            if self._uses_channel():
                n = self._channel_call(lambda c, part=part: c.prefix_match(part))
            else:
                n = self._grpc("PrefixMatch", pb.PrefixMatchRequest(keys=part)).matched
            matched += n
            if n < len(part):
                break
        return matched

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """The tier holding each key (``"hbm"``, ``"dram"``, ``"ssd"``), None if absent."""
        ks = [check_key(k) for k in keys]
        out: list[str | None] = []
        for lo in range(0, len(ks), MAX_BATCH):
            reply = self._grpc("Locate", pb.LocateRequest(keys=ks[lo : lo + MAX_BATCH]))
            out += [t or None for t in reply.tiers]
        return out

    def prefetch(self, keys: Sequence[bytes], tier: str = DEFAULT_PREFETCH_TIER, *,
                 wait: bool = False) -> list[PrefetchOutcome]:
        """Asks the node to bring ``keys`` up to the memory tier ``tier`` (``"dram"``, or
        ``"hbm"`` on a node with one) ahead of their use: one ``PrefetchOutcome`` per key,
        in order. ``wait=False`` answers once the moves are planned (``queued``); ``True``
        once they are done (``promoted``, ``undone``). Not a read. At most
        ``MAX_PREFETCH_KEYS`` keys: more is InvalidArgument, raised before anything is
        sent (never split: the bound is the point). Always over gRPC. Semantics:
        docs/node.md, "Prefetch"."""
        ks, name = check_prefetch(keys, tier)
        reply = self._grpc("Prefetch", pb.PrefetchRequest(keys=ks, tier=name, wait=wait))
        return [PrefetchOutcome(o) for o in reply.outcomes]

    def retain(self, keys: Sequence[bytes], retain_s: float) -> list[RetainOutcome]:
        """Retains the blocks of ``keys`` the node already holds for ``retain_s`` seconds
        after their last put or read, capped and charged as a put's retention is; 0
        releases them to ordinary eviction. One ``RetainOutcome`` per key, in order. At
        most ``MAX_RETAIN_KEYS`` keys (InvalidArgument before anything is sent). Always
        over gRPC; a node older than the call answers KVStoreError (UNIMPLEMENTED).
        Semantics: docs/node.md, "Retaining stored blocks"."""
        ks, seconds = check_retain(keys, retain_s)
        reply = self._grpc("Retain", pb.RetainRequest(keys=ks, retain_s=seconds))
        return [RetainOutcome(o) for o in reply.outcomes]

    def remove(self, key: bytes) -> bool:
        """Removes ``key``: True if it was stored."""
        k = check_key(key)
        if self._uses_channel():
            return self._channel_call(lambda c: c.remove([k]))[0]
        return self._grpc("Remove", pb.RemoveRequest(key=k)).removed

    def replicate(self, keys: Sequence[bytes], targets: Sequence[str], *, copies: int,
                  write_quorum: int, orders: Sequence[Sequence[int]] | None = None
                  ) -> ReplicateOutcome:
        """Asks this node to copy ``keys``, which it holds, to other nodes (a cluster-role
        call): ``copies`` wanted in all, its own included, answering once ``write_quorum``
        hold every key or the targets ran out. ``targets``: the nodes it may copy to, in
        the order to try; ``orders``: per key, that key's targets as indexes into
        ``targets`` (None: every key tries ``targets`` in order)."""
        ks = [check_key(k) for k in keys]
        reply = self._grpc("Replicate", pb.ReplicateRequest(
            keys=ks, targets=list(targets), copies=copies, write_quorum=write_quorum,
            orders=[pb.TargetOrder(index=list(o)) for o in orders or ()]))
        return ReplicateOutcome(copies=reply.copies,
                                missing=[BlockKey(k) for k in reply.missing],
                                stored_on=list(reply.stored_on), failed=list(reply.failed))

    def drain(self) -> DrainOutcome:
        """Asks this node (a cluster member; a cluster-role call) to leave placement, copy
        every block no remaining owner holds to its owners, answer, then stop."""
        reply = self._grpc("Drain", pb.DrainRequest())
        return DrainOutcome(blocks=reply.blocks, copies=reply.copies,
                            bytes_copied=reply.bytes_copied, seconds=reply.seconds)

    def stats(self) -> dict:
        """``{"node": {...}, "tiers": {name: {capacity, used, blocks, hits, misses, evictions,
        ...}}}``."""
        reply = self._grpc("Stats", pb.StatsRequest())
        return {
            "node": {k: json.loads(v) for k, v in reply.node.items()},
            "tiers": {t.name: {"name": t.name, **dict(t.counters)} for t in reply.tiers},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicateOutcome:
    """What a node answered to ``NodeClient.replicate``."""

    copies: int
    """Copies known to hold every key, the node's own included."""
    missing: list[BlockKey]
    """Keys the node does not hold (evicted, or never put): not copied."""
    stored_on: list[str]
    """Targets that hold every key when the node answered."""
    failed: list[str]
    """``"ADDR: reason"`` per target that failed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainOutcome:
    """What a node answered to ``NodeClient.drain`` (it stops after answering)."""

    blocks: int
    """Blocks the node held."""
    copies: int
    """Copies made on owners, of the blocks no remaining owner held."""
    bytes_copied: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PutBatch:
    """A batch put, checked: made by ``PutBatch.check`` (or ``pick`` of a checked batch),
    the one place a put's arguments are checked. Every put call of the node and cluster
    clients makes one from its arguments, then passes it on (``put_checked``) unchecked."""

    keys: list[BlockKey]
    values: list[memoryview]
    parents: list[BlockKey | None]
    pin: bool = False
    retain_s: float = 0.0

    @classmethod
    def check(cls, keys: Sequence[bytes], values: Sequence[object], *,
              parents: Sequence[bytes | None] | None = None, pin: bool = False,
              retain_s: float | None = None) -> PutBatch:
        """InvalidArgument for a malformed key or parent, a value that is not a contiguous
        bytes-like object, unequal lengths, or a ``retain_s`` out of range."""
        ks, views, ps = check_put_batch(keys, values, parents)
        return cls(keys=ks, values=views, parents=ps, pin=pin,
                   retain_s=retain_seconds(retain_s))

    def pick(self, indexes: Sequence[int]) -> PutBatch:
        """The items at ``indexes``, in that order (still checked)."""
        return PutBatch(keys=[self.keys[i] for i in indexes],
                        values=[self.values[i] for i in indexes],
                        parents=[self.parents[i] for i in indexes], pin=self.pin,
                        retain_s=self.retain_s)

    def __len__(self) -> int:
        return len(self.keys)


def check_put_batch(keys: Sequence[bytes], values: Sequence[object],
                    parents: Sequence[bytes | None] | None
                    ) -> tuple[list[BlockKey], list[memoryview], list[BlockKey | None]]:
    """The checked keys, readable views of the values, and checked parents of a batch put
    (``PutBatch.check`` without pin and retention)."""
    ks = [check_key(k) for k in keys]
    if len(values) != len(ks):
        raise InvalidArgument(f"{len(ks)} keys but {len(values)} values")
    ps: list[BlockKey | None] = ([check_parent(p) for p in parents] if parents is not None
                                 else [None] * len(ks))
    if len(ps) != len(ks):
        raise InvalidArgument(f"{len(ks)} keys but {len(ps)} parents")
    return ks, [as_readable(v) for v in values], ps


def _split_on_bound(fn: Any, part: list[BlockKey], lo: int) -> list[Any]:
    """``fn(part, lo)``; a read the node refuses as past its reply bound (``ReplyTooLarge``)
    is asked for again in halves, down to one key (a single block always fits)."""
    try:
        return fn(part, lo)
    except ReplyTooLarge:
        if len(part) < 2:
            raise
    mid = len(part) // 2
    return _split_on_bound(fn, part[:mid], lo) + _split_on_bound(fn, part[mid:], lo + mid)


def all_stored(flags: list[bool]) -> list[bool]:
    """A resent put's flags (the node client's transport retry, the cluster client's put
    through the next node): every key counts as stored. A key the resend found stored may
    be this put's own first try, which landed before its answer was lost; either way the
    key holds a value now (its value, for a content-addressed block)."""
    return [True] * len(flags)


def _chunks(sizes: Sequence[int], max_bytes: int) -> Iterator[tuple[int, int]]:
    """Index ranges of at most MAX_BATCH items and about ``max_bytes`` each (at least one item)."""
    lo, total = 0, 0
    for i, n in enumerate(sizes):
        if i > lo and (total + n > max_bytes or i - lo >= MAX_BATCH):
            yield lo, i
            lo, total = i, 0
        total += n
    if lo < len(sizes) or not sizes:
        yield lo, len(sizes)



def _request_id_note(exc: grpc.RpcError) -> str:
    """`` (request id ID)`` if the node sent the call's id back, for grepping its log."""
    rid = _trailing(exc, REQUEST_ID_HEADER)
    return "" if rid is None else f" (request id {rid})"


def _trailing(exc: grpc.RpcError, key: str) -> str | None:
    """The failed call's trailing-metadata value under ``key``, None if absent."""
    # grpc's stub types the items as objects with .key and .value; grpc hands (key, value)
    # tuples, the value str for a key without the "-bin" suffix.
    trailing = cast("tuple[tuple[str, str | bytes], ...] | None",
                    exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None)
    for k, value in trailing or ():
        if k == key:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


__all__ = ["TRANSPORTS", "DrainOutcome", "NodeClient", "PutBatch", "ReplicateOutcome",
           "SingleKeyCalls", "all_stored", "check_put_batch"]
