"""The transfer channel's replicated puts (RPUT, RCOMMIT; format in ``kvstore.protocol.wire``).

The writer sends each block once, to its master. The master holds the blocks'
put slots (or the writer's shared-memory reservations) open while the
``Forwarding`` copies those same bytes to the other owners, and commits them
only when every forward it started has settled: the bytes are forwarded from
where they landed, never read back from a tier, and nothing can evict or reuse
them meanwhile. Only then does the writer get its answer, with the number of
copies that hold every block; below the write quorum the writer raises
``QuorumNotMet`` and the copies made stay (they are correct bytes; repair
completes them). A tenant may ask for at most the cluster's ``--replicas`` copies
(``kvstore.auth.tenancy.check_copies``), and every copy names the tenant it is charged
to on the node that receives it (``BlockCopy.owner``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Protocol

from kvstore.auth import tenancy
from kvstore.auth.security import Principal
from kvstore.core.errors import FailedPrecondition, InvalidArgument, KVStoreError
from kvstore.core.forwarding import BlockCopy, Forwarding, ForwardOutcome
from kvstore.core.keys import BlockKey
from kvstore.node.client_holds import ReservationSet
from kvstore.node.semantics import Node, PutSlot
from kvstore.protocol import wire


class _Connection(Protocol):
    """What these handlers use of the channel server's connection (``kvstore.node.channel_server``
    calls them with its own; typed here so that neither module imports the other)."""

    node: Node
    p: Principal
    reader: wire.FrameReader
    reservations: ReservationSet
    forwarder: Forwarding | None

    def refuse_oversized(self, sizes: list[int]) -> None: ...

    def discard(self, nbytes: int) -> None: ...

    def reply(self, count: int, meta: bytes, values: list[memoryview] | None = None) -> None: ...


def _params(pairs: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The request's (copies, write quorum): the same on every item, 1 <= W <= copies."""
    if not pairs:
        return 1, 1
    copies, quorum = pairs[0]
    if any(p != (copies, quorum) for p in pairs):
        raise InvalidArgument("every item of a replicated put needs the same copies and "
                              "write quorum")
    if copies < 1 or not 1 <= quorum <= copies:
        raise InvalidArgument(f"need 1 <= write_quorum <= copies, got write_quorum={quorum}, "
                              f"copies={copies}")
    return copies, quorum


def _forwarder(conn: _Connection) -> Forwarding:
    fwd = conn.forwarder
    if fwd is None or not fwd.available:
        raise FailedPrecondition("this node is not a cluster member: it cannot forward a "
                                 "replicated put (put, then Replicate)")
    return fwd


def on_rput(conn: _Connection, count: int, meta: bytes) -> None:
    items = list(wire.RPUT_ITEM.iter_unpack(meta))
    conn.refuse_oversized([item[2] for item in items])  # closes the stream
    try:
        copies, quorum = _params([(c, q) for *_, c, q in items])
        fwd = _forwarder(conn)
        tenancy.check_copies(conn.p, copies, fwd.replicas)
    except KVStoreError:
        conn.discard(sum(item[2] for item in items))  # stay in frame for the next request
        raise
    slots: list[PutSlot | None] = []
    cut = _CutThrough(fwd, copies, quorum, sum(item[2] for item in items))
    with contextlib.ExitStack() as stack:  # commits every slot on a clean exit, else aborts
        try:
            outcome = _receive(conn, items, meta, stack, slots, cut)
        finally:  # whatever happened, every part forwarded settles before a slot ends
            cut.settle()
    stored = [s is not None and s.stored for s in slots]
    conn.reply(count, wire.pack_repl_reply(stored, outcome.copies, outcome.failed))


def _receive(conn: _Connection, items: list[tuple[bytes, bytes, int, int, int, int]],
             meta: bytes, stack: contextlib.ExitStack, slots: list[PutSlot | None],
             cut: _CutThrough) -> ForwardOutcome:
    """Reads each block into its slot (``stack`` holds them), forwarding as parts land."""
    node, p, reader = conn.node, conn.p, conn.reader
    failure: KVStoreError | None = None
    for i, (key, parent, nbytes, flags, _, _) in enumerate(items):
        slots.append(None)
        if failure is not None:
            conn.discard(nbytes)
            continue
        raw = BlockKey(key)
        stored_key = p.key(raw)
        par = p.key(BlockKey(parent)) if flags & wire.FLAG_PARENT else None
        pin = bool(flags & wire.FLAG_PIN)
        retain_s = wire.item_retain_s(meta, i, wire.RPUT_ITEM.size)
        try:
            holding = sum(s.reservation.extent.length for s in slots if s is not None)
            slot = stack.enter_context(node.put_slot(stored_key, nbytes, parent=par, pin=pin,
                                                     owner=p.owner, quota=p.quota,
                                                     retain_s=retain_s, holding=holding))
        except KVStoreError as exc:
            failure = exc  # the writer has sent the rest: consume it to stay in frame
            conn.discard(nbytes)
            continue
        if slot is None:
            # Stored here already; the other owners may still lack it, and its bytes
            # are in the stream anyway.
            value = memoryview(bytearray(nbytes))
        else:
            value = slot.view
            slots[-1] = slot
        reader.read_into(value)
        cut.landed(BlockCopy(key=stored_key, place=raw, parent=par, pin=pin,
                             retain_s=retain_s, owner=p.owner, value=value))
    if failure is not None:
        raise failure
    return cut.finish()


CUT_THROUGH_BYTES = 1 << 20
"""A replicated put of more than this is forwarded in parts: each part (at least this
many bytes, at most a quarter of the request) goes to the other owners as soon as it has
landed, while the rest of the request is still arriving."""

_forward_pool: ThreadPoolExecutor | None = None
_forward_pool_lock = threading.Lock()


def _parts_pool() -> ThreadPoolExecutor:
    """The node's threads for forwarding the parts of a request that is still arriving
    (made on first use; a part's own pushes run on the forwarder's pool)."""
    global _forward_pool
    with _forward_pool_lock:
        if _forward_pool is None:
            _forward_pool = ThreadPoolExecutor(max_workers=8,
                                               thread_name_prefix="kvstore-cut-through")
        return _forward_pool


class _CutThrough:
    """Forwards a replicated put's blocks part by part as they land (cut-through).

    Each part is a ``Forwarding.forward`` call of its own (the owners, the failover to the
    next ranked node and the quorum rule are the forwarder's); the request's outcome is
    the fewest copies any part reached, so the writer's acknowledgement still means
    ``write_quorum`` copies of every block. ``settle`` waits for every part started:
    the values are borrowed from the put's slots until then."""

    def __init__(self, fwd: Forwarding, copies: int, quorum: int, total: int) -> None:
        self.fwd, self.copies, self.quorum = fwd, copies, quorum
        self.part_bytes = max(CUT_THROUGH_BYTES, total // 4)
        self.total = total
        self.pending: list[BlockCopy] = []
        self.pending_bytes = 0
        self.seen = 0
        self.started: list[Future[ForwardOutcome]] = []

    def landed(self, block: BlockCopy) -> None:
        self.pending.append(block)
        self.pending_bytes += len(block.value)
        self.seen += len(block.value)
        if self.copies > 1 and self.pending_bytes >= self.part_bytes and self.seen < self.total:
            part, self.pending, self.pending_bytes = self.pending, [], 0
            self.started.append(_parts_pool().submit(
                self.fwd.forward, part, copies=self.copies, write_quorum=self.quorum))

    def finish(self) -> ForwardOutcome:
        """Forwards the last part here, waits for the others; the request's outcome."""
        outcomes = []
        if self.pending or not self.started:
            outcomes.append(self.fwd.forward(self.pending, copies=self.copies,
                                             write_quorum=self.quorum))
        self.pending = []
        outcomes += [f.result() for f in self.settle()]
        return ForwardOutcome(copies=min(o.copies for o in outcomes),
                              stored_on=tuple(dict.fromkeys(
                                  a for o in outcomes for a in o.stored_on)),
                              failed=tuple(f for o in outcomes for f in o.failed))

    def settle(self) -> list[Future[ForwardOutcome]]:
        """Waits until every part started has settled (never raises); returns them."""
        started, self.started = self.started, []
        wait(started)
        return started


def on_rcommit(conn: _Connection, count: int, meta: bytes) -> None:
    items = list(wire.RCOMMIT_ITEM.iter_unpack(meta))
    rids = [rid for rid, _, _ in items]
    node, held = conn.node, conn.reservations
    try:
        copies, quorum = _params([(c, q) for _, c, q in items])
        fwd = _forwarder(conn)
        tenancy.check_copies(conn.p, copies, fwd.replicas)
        reservations = [held.landed(rid) for rid in rids]  # staged bytes into the region
        views = [node.fill_view(r) for r in reservations]
        try:
            # Shared memory carries only unsalted keys (tenants with a salt never map the
            # region), so the stored key is the key placement ranks.
            outcome = fwd.forward(
                [BlockCopy(key=r.key, place=r.key, parent=r.parent, pin=r.pin, value=v,
                           retain_s=r.retain.seconds if r.retain is not None else 0.0,
                           owner=conn.p.owner)
                 for r, v in zip(reservations, views, strict=True)],
                copies=copies, write_quorum=quorum)
        finally:
            for v in views:
                v.release()
    except BaseException:
        for rid in rids:  # the writer learns only the error: nothing of this put stays
            held.abort(rid)
        raise
    stored = [held.commit(rid) for rid in rids]
    conn.reply(count, wire.pack_repl_reply(stored, outcome.copies, outcome.failed))
