"""Pipelined puts: a batch's requests to several nodes are all sent before any reply is read.

The cluster client splits a batch by master. ``start_put`` sends one master's part (one
frame per ``MAX_BATCH`` keys) on one of that node's stream connections and returns a
``PendingPut`` without waiting; the caller starts every master's part and only then calls
``finish`` on each. Every master has its whole part before the client waits on any reply,
so the masters store (and forward) their parts at the same time, from one client thread
with no hand-offs between threads. A master answers only once it holds the part (and,
for a replicated put, once ``write_quorum`` copies exist): pipelining changes when the
client reads, never what an answer means.

A same-host shared-memory put is three steps on its connection: a RESERVE (a round
trip), the copy into the reserved room, a COMMIT (a round trip). Pipelined
(``PendingShmPut``), every node is sent its RESERVE first; then each one's answer is read,
its room filled and its COMMIT sent (``advance``); then every COMMIT's answer is read
(``finish``): the nodes reserve and commit at the same time instead of one after another.
Only a plain put (``copies == 1``) of one frame pipelines so; a replicated same-host put,
a gRPC-only node, and a send that fails at the transport (the node may have restarted)
get None from ``start_put``: the caller then makes the ordinary call, which reconnects.

Gets pipeline too (``start_get``): every node is sent its GET (over shared memory, its
LEASE) before any answer is read, so the nodes look their keys up and answer at the same
time, and the client reads each answer in turn from one thread, with no hand-offs
between threads. Over a stream the answer carries the values, and a thread per node
copies them out of the kernel on every core at once: that wins once a node's part is
large, so a stream get pipelines only up to ``PIPELINED_STREAM_GET_BYTES`` of buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvstore.core.checks import MAX_BATCH
from kvstore.core.errors import KVStoreError, Unavailable
from kvstore.core.keys import BlockKey
from kvstore.protocol.wire import Mode
from kvstore.remote.channel_client import ChannelConnection
from kvstore.remote.node_client import NodeClient, PutBatch

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

PIPELINED_STREAM_GET_BYTES = 2 << 20
"""The most buffer bytes a pipelined stream get asks one node for. Measured with ``kvstore
bench cluster --transports tcp`` (3 nodes, batches of 32, so about 11 values a node): at
64 KiB values (0.7 MiB a node) pipelined gets ran 1.1-1.35x the threads' throughput, at
256 KiB (2.8 MiB) 0.9-1.05x, at 1 MiB (11 MiB) 0.7-0.85x."""

__all__ = ["PIPELINED_STREAM_GET_BYTES", "PendingGet", "PendingPut", "PendingShmPut",
           "finish_all", "start_get", "start_put", "start_puts"]


@dataclass(slots=True, kw_only=True)
class PendingPut:
    """A put sent to one node whose replies are still to be read (``finish``, once)."""

    client: NodeClient
    conn: ChannelConnection | None
    counts: list[int]  # keys per frame sent, in order
    copies: int  # asked for (1: a plain PUT)

    def advance(self) -> None:
        """Nothing to do between sending and reading (see ``PendingShmPut.advance``)."""

    def finish(self) -> tuple[list[bool], int, list[str]]:
        """Reads every frame's reply: (stored flags, copies holding every key, text of
        failed forwards). Unavailable if the stream broke (the connection is dropped); an
        error the node answered with is raised after every reply was read."""
        conn, self.conn = self.conn, None
        if conn is None:
            raise RuntimeError("PendingPut.finish called twice")
        stored: list[bool] = []
        made, failed = self.copies, []
        answered: KVStoreError | None = None
        try:
            for count in self.counts:
                try:
                    flags, n, text = conn.put_reply(count, replicated=self.copies > 1)
                except KVStoreError as exc:  # the node answered: the stream is in step
                    answered = answered or exc
                    continue
                stored += flags
                made = min(made, n)
                if text:
                    failed.append(text)
        except OSError as exc:
            conn.close()
            self.client._invalidate()
            raise Unavailable(f"{self.client.addr}: transfer channel failed: {exc}") from exc
        except BaseException:
            conn.close()  # the stream's state is unknown
            raise
        self.client._checkin(conn)
        if answered is not None:
            raise answered
        return stored, made, failed


def start_put(client: NodeClient, batch: PutBatch, *, copies: int = 1, write_quorum: int = 1
              ) -> PendingPut | PendingShmPut | None:
    """Sends ``batch`` to ``client``'s node (an RPUT asking for ``copies`` copies when
    ``copies > 1``) and returns without reading the reply; None if this node's channel
    does not pipeline or the send failed at the transport (nothing is pending then).
    Errors of the values themselves (larger than the node) are raised before any send."""
    if not client._uses_channel():
        return None
    if client._mode is Mode.SHM:
        return _start_shm_put(client, batch) if copies == 1 else None
    if client._mode is not Mode.TCP:
        return None
    ks, views, ps = batch.keys, batch.values, batch.parents

    def send(conn: ChannelConnection) -> list[int]:
        conn.check_sizes(views)  # refuses a value before any frame is on the wire
        replicated = (copies, write_quorum) if copies > 1 else None
        counts: list[int] = []
        for lo in range(0, len(ks), MAX_BATCH):
            hi = lo + MAX_BATCH
            conn.send_put(ks[lo:hi], views[lo:hi], ps[lo:hi], batch.pin, batch.retain_s,
                          replicated=replicated)
            counts.append(len(ks[lo:hi]))
        return counts

    sent = _sent(client, send)
    if sent is None:
        return None
    conn, counts = sent
    return PendingPut(client=client, conn=conn, counts=counts, copies=copies)


def _sent(client: NodeClient, send: Callable[[ChannelConnection], T]
          ) -> tuple[ChannelConnection, T] | None:
    """Runs ``send`` on a connection checked out of ``client``: the connection and what
    ``send`` returned, or None when the send failed at the transport (the connection is
    dropped and the client negotiates afresh; nothing is pending). An error of the request
    itself (a ``KVStoreError``, raised before anything is on the wire) returns the
    connection to the pool and propagates."""
    conn = client._checkout()
    try:
        return conn, send(conn)
    except KVStoreError:
        client._checkin(conn)  # nothing was sent
        raise
    except OSError:
        conn.close()
        client._invalidate()
        return None
    except BaseException:
        conn.close()  # the stream's state is unknown
        raise


@dataclass(slots=True, kw_only=True)
class PendingShmPut:
    """A same-host put whose RESERVE is sent: ``advance`` (fill, send the COMMIT), then
    ``finish`` (read the COMMIT's answer), each once, in that order."""

    client: NodeClient
    conn: ChannelConnection | None
    batch: PutBatch
    slots: list[int | None] | None = None  # each value's reserved slot, once advanced
    error: Exception | None = None  # what ``advance`` met, raised by ``finish``
    broken: bool = False  # the connection was closed: nothing to read, nothing to return

    def advance(self) -> None:
        """Reads the RESERVE's answer, fills the room and sends the COMMIT. Never raises
        an error of the node or the transport (``finish`` does): the caller advances every
        node's put whatever the others met."""
        conn = self.conn
        if conn is None or self.slots is not None or self.error is not None:
            return
        try:
            self.slots = conn.fill_and_commit(self.batch.keys, self.batch.values)
        except KVStoreError as exc:  # the node answered (or the room was aborted): in step
            self.error = exc
        except OSError as exc:
            self._drop()
            self.error = Unavailable(f"{self.client.addr}: transfer channel failed: {exc}")
        except Exception as exc:
            self._drop()
            self.error = exc

    def _drop(self) -> None:
        assert self.conn is not None
        self.conn.close()
        self.client._invalidate()
        self.broken = True

    def finish(self) -> tuple[list[bool], int, list[str]]:
        """Reads the COMMIT's answer: (stored flags, 1 copy, no failed forwards), as
        ``PendingPut.finish``; what ``advance`` met is raised here."""
        self.advance()
        conn, self.conn = self.conn, None
        if conn is None:
            raise RuntimeError("PendingShmPut.finish called twice")
        if self.error is not None:
            if not self.broken:
                self.client._checkin(conn)
            raise self.error
        assert self.slots is not None
        try:
            flags = conn.commit_reply(self.slots)
        except KVStoreError:
            self.client._checkin(conn)  # the node answered: the stream is in step
            raise
        except OSError as exc:
            conn.close()
            self.client._invalidate()
            raise Unavailable(f"{self.client.addr}: transfer channel failed: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        self.client._checkin(conn)
        return flags, 1, []


def _start_shm_put(client: NodeClient, batch: PutBatch) -> PendingShmPut | None:
    """``start_put`` over shared memory: the RESERVE sent, or None (see there)."""
    if len(batch.keys) > MAX_BATCH:
        return None
    sent = _sent(client, lambda conn: conn.send_reserve(
        batch.keys, batch.values, batch.parents, batch.pin, batch.retain_s))
    if sent is None:
        return None
    conn, reserving = sent
    if not reserving:  # not a put that reserves in one part: nothing was sent
        client._checkin(conn)
        return None
    return PendingShmPut(client=client, conn=conn, batch=batch)


def start_puts(parts: dict[K, tuple[NodeClient, PutBatch]], *, copies: int = 1,
               write_quorum: int = 1) -> dict[K, PendingPut | PendingShmPut]:
    """``start_put`` of every part, each to its own node, before any reply is read; the
    parts that did not start (see ``start_put``, or any error the node's client raised) are
    left out, for the caller's ordinary call, which meets the same error and handles it."""
    sent: dict[K, PendingPut | PendingShmPut] = {}
    for name, (client, batch) in parts.items():
        try:
            p = start_put(client, batch, copies=copies, write_quorum=write_quorum)
        except KVStoreError:
            p = None
        if p is not None:
            sent[name] = p
    return sent


def finish_all(calls: list[Callable[[], object]]) -> None:
    """Runs every call (each reads one pending put's replies, which must be read whatever
    the others do); then re-raises the first error."""
    first: BaseException | None = None
    for call in calls:
        try:
            call()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first


@dataclass(slots=True, kw_only=True)
class PendingGet:
    """A get sent to one node (a GET, or over shared memory a LEASE) whose answer is
    still to be read (``finish``, once)."""

    client: NodeClient
    conn: ChannelConnection | None
    keys: Sequence[BlockKey]
    outs: Sequence[memoryview] | None
    started: float  # before the node could grant a lease (``ChannelConnection.send_get``)

    def finish(self) -> list[bytes | int | None] | None:
        """Reads the answer and copies the values out (per key as ``NodeClient.
        get_batch_into``, or the bytes for ``outs=None``); None if the stream broke (the
        connection is dropped, nothing was copied that counts): the caller then makes the
        ordinary call, which reconnects, as it would for a node that restarted. An error
        the node answered with is raised."""
        conn, self.conn = self.conn, None
        if conn is None:
            raise RuntimeError("PendingGet.finish called twice")
        try:
            results = conn.get_reply(self.keys, self.outs, self.started)
        except KVStoreError:
            self.client._checkin(conn)  # the node answered (leases released): in step
            raise
        except OSError:
            conn.close()
            self.client._invalidate()
            return None
        except BaseException:
            conn.close()  # the stream's state is unknown
            raise
        self.client._checkin(conn)
        return results


def start_get(client: NodeClient, keys: Sequence[BlockKey],
              outs: Sequence[memoryview] | None) -> PendingGet | None:
    """Sends ``client``'s node a get of ``keys`` and returns without reading the answer;
    None where this get does not pipeline (a gRPC-only node, more than one frame's keys, a
    stream get whose buffers are not given or exceed ``PIPELINED_STREAM_GET_BYTES``, or the
    send failed at the transport): the caller then makes the ordinary call. ``outs``: a
    writable buffer per key, or None for new bytes."""
    if len(keys) > MAX_BATCH:
        return None
    try:
        if not client._uses_channel():
            return None
        if client._mode is Mode.TCP and (
                outs is None or sum(len(o) for o in outs) > PIPELINED_STREAM_GET_BYTES):
            return None
        sent = _sent(client, lambda conn: conn.send_get(keys))
    except KVStoreError:
        return None  # the ordinary call meets the same error and handles it
    if sent is None:
        return None
    conn, started = sent
    return PendingGet(client=client, conn=conn, keys=keys, outs=outs, started=started)
