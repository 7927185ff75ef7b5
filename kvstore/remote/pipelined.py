"""Pipelined puts: a batch's requests to several nodes are all sent before any reply is read.

The cluster client splits a batch by master. ``start_put`` sends one master's part (one
frame per ``MAX_BATCH`` keys) on one of that node's stream connections and returns a
``PendingPut`` without waiting; the caller starts every master's part and only then calls
``finish`` on each. Every master has its whole part before the client waits on any reply,
so the masters store (and forward) their parts at the same time, from one client thread
with no hand-offs between threads. A master answers only once it holds the part (and,
for a replicated put, once ``write_quorum`` copies exist): pipelining changes when the
client reads, never what an answer means.

Only stream connections pipeline (``transport="tcp"``, or a node on another host): a
same-host shared-memory put reserves first, a round trip, and a gRPC-only node has no
channel. ``start_put`` returns None for those, and when the send fails at the transport
(the node may have restarted): the caller then makes the ordinary call, which reconnects.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

from kvstore.core.checks import MAX_BATCH
from kvstore.core.errors import KVStoreError, Unavailable
from kvstore.protocol.wire import Mode
from kvstore.remote.channel_client import ChannelConnection
from kvstore.remote.node_client import NodeClient, PutBatch

K = TypeVar("K", bound=Hashable)

__all__ = ["PendingPut", "finish_all", "start_put", "start_puts"]


@dataclass(slots=True, kw_only=True)
class PendingPut:
    """A put sent to one node whose replies are still to be read (``finish``, once)."""

    client: NodeClient
    conn: ChannelConnection | None
    counts: list[int]  # keys per frame sent, in order
    copies: int  # asked for (1: a plain PUT)

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
              ) -> PendingPut | None:
    """Sends ``batch`` to ``client``'s node (an RPUT asking for ``copies`` copies when
    ``copies > 1``) and returns without reading the reply; None if this node's channel
    does not pipeline or the send failed at the transport (nothing is pending then).
    Errors of the values themselves (larger than the node) are raised before any send."""
    if not client._uses_channel() or client._mode is not Mode.TCP:
        return None
    conn = client._checkout()
    ks, views, ps = batch.keys, batch.values, batch.parents
    counts: list[int] = []
    try:
        conn.check_sizes(views)  # refuses a value before any frame is on the wire
        replicated = (copies, write_quorum) if copies > 1 else None
        for lo in range(0, len(ks), MAX_BATCH):
            hi = lo + MAX_BATCH
            conn.send_put(ks[lo:hi], views[lo:hi], ps[lo:hi], batch.pin, batch.retain_s,
                          replicated=replicated)
            counts.append(len(ks[lo:hi]))
    except KVStoreError:
        client._checkin(conn)  # nothing was sent
        raise
    except OSError:
        conn.close()
        client._invalidate()
        return None
    except BaseException:
        conn.close()
        raise
    return PendingPut(client=client, conn=conn, counts=counts, copies=copies)


def start_puts(parts: dict[K, tuple[NodeClient, PutBatch]], *, copies: int = 1,
               write_quorum: int = 1) -> dict[K, PendingPut]:
    """``start_put`` of every part, each to its own node, before any reply is read; the
    parts that did not start (see ``start_put``, or any error the node's client raised) are
    left out, for the caller's ordinary call, which meets the same error and handles it."""
    sent: dict[K, PendingPut] = {}
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
