"""Master-side replication: copy blocks this node holds to their replicas.

Two ways in. The one-trip path: a writer's replicated put (``RPUT``/``RCOMMIT``
on the transfer channel) reaches the master, which forwards the bytes it just
received (``replication/copies/forwarder.py``). The older path, kept for nodes outside
an etcd cluster (a static member list) and for hot-block fan-out: the writer puts,
then asks the master to ``Replicate``; the master reads the blocks it holds and
forwards them here. Either way the pushes run in parallel and the answer comes
once ``write_quorum`` copies (the master's included) exist (``replication/copies/quorum.py``).
Keys are content addresses and values immutable, so replicas never disagree and
a put that lands twice is a no-op.

Bounds on ``Replicate`` (a caller must not be able to tie up the node): at most
``max_calls`` replicate calls wait at once (more are refused with
RESOURCE_EXHAUSTED, so the gRPC handler threads stay free for other clients); each
waits at most ``wait_s``; ``close`` (the node stopping) wakes every waiting call at
once, which answers with what is stored so far. Targets are whatever the caller
names, but ``PeerPool`` contacts only members this node knows.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from kvstore.core.errors import InvalidArgument, ResourceExhausted
from kvstore.core.forwarding import BlockCopy
from kvstore.core.keys import BlockKey
from kvstore.node.semantics import Node
from kvstore.remote.node_client import PutBatch
from kvstore.remote.pipelined import PendingPut, PendingShmPut, finish_all, start_put
from replication.copies import quorum
from replication.copies.peers import PeerFor, PeerPool

MAX_TARGETS = 64


@dataclass(slots=True, kw_only=True)
class ReplicateOutcome:
    copies: int  # copies holding every present key, this node's included
    missing: list[BlockKey] = field(default_factory=list)
    stored_on: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "ADDR: reason"


def send_copies(peer: PeerFor, blocks: Sequence[BlockCopy]) -> int:
    """Puts ``blocks`` on the peer (``peer(owner)``: its client that charges puts to
    ``owner``); bytes sent. Blocks go in batches of one tenant, one pin flag and one
    retention, so the peer charges, pins and retains what the source did."""
    start_copies(peer, blocks)()
    return sum(len(b.value) for b in blocks)


def start_copies(peer: PeerFor, blocks: Sequence[BlockCopy]) -> quorum.Finish:
    """``send_copies`` in two halves: sends every batch (on a stream connection, without
    waiting for its answer; through a same-host peer's shared memory, its room reserved
    with the others' sends and filled once all are sent; a peer reached through gRPC, or a
    replicated same-host put, is called whole here) and returns what reads the answers.
    Once this returns, ``blocks``' values are no longer read. Raises, with every batch
    already sent answered and read, if a send fails."""
    groups: dict[tuple[str, bool, float], list[BlockCopy]] = {}
    for b in blocks:
        groups.setdefault((b.owner or "", b.pin, b.retain_s), []).append(b)
    pending: list[PendingPut | PendingShmPut] = []
    try:
        for (owner, pin, keep), group in sorted(groups.items()):
            client = peer(owner or None)
            batch = PutBatch.check([b.key for b in group], [b.value for b in group],
                                   parents=[b.parent for b in group], pin=pin,
                                   retain_s=keep or None)
            sent = start_put(client, batch)
            if sent is None:
                client.put_checked(batch)
            else:
                pending.append(sent)
        for p in pending:  # a same-host peer's room filled now: no value is read later
            p.advance()
    except BaseException:
        with contextlib.suppress(Exception):  # their answers read; the send's error wins
            finish_all([p.finish for p in pending])
        raise
    return partial(finish_all, [p.finish for p in pending])


def push_blocks(node: Node, peer: PeerFor, keys: Sequence[BlockKey]) -> int:
    """Copies the blocks of ``keys`` that ``node`` holds to the peer (``send_copies``); bytes sent.

    The node hands frozen copies whose bytes stay leased only for the copy, and are
    not counted as reads (no hits, no recency, no promotion): the cluster copying a
    block is not a user reading it.
    """
    with node.copying(keys) as copies:
        return send_copies(peer, [c for c in copies if c is not None])


class Replicator:
    """Forwards blocks from ``node`` to peer nodes; thread-safe."""

    def __init__(self, node: Node, peers: PeerPool, *, self_addr: str = "",
                 max_workers: int = 8, max_calls: int = 8, wait_s: float = 30.0) -> None:
        self.node = node
        self.peers = peers
        self.self_addr = self_addr
        self.wait_s = wait_s
        self._calls = threading.BoundedSemaphore(max_calls)
        self._max_calls = max_calls
        self._cancel = quorum.Cancel()
        self._active = 0  # guarded by _active_lock
        self._active_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="kvstore-replicate")

    def replicate(self, keys: Sequence[BlockKey], targets: Sequence[str], *, copies: int,
                  write_quorum: int, orders: Sequence[Sequence[int]] | None = None
                  ) -> ReplicateOutcome:
        """Copies ``keys`` to ``copies - 1`` targets each; see ``replication/copies/quorum.py``.
        RESOURCE_EXHAUSTED when ``max_calls`` calls already wait.

        ``orders`` (optional, one per key) lists indexes into ``targets``: the key's own
        candidates in the order to try. Keys with equal orders travel together.
        """
        if copies < 1 or not 1 <= write_quorum <= copies:
            raise InvalidArgument(f"need 1 <= write_quorum <= copies, got write_quorum="
                                  f"{write_quorum}, copies={copies}")
        if len(targets) > MAX_TARGETS:
            raise InvalidArgument(f"at most {MAX_TARGETS} targets, got {len(targets)}")
        for t in targets:
            host, _, port = t.rpartition(":")
            if not host or not port.isdigit():
                raise InvalidArgument(f"target must be HOST:PORT, got {t!r}")
        if orders is not None:
            if len(orders) != len(keys):
                raise InvalidArgument(f"{len(orders)} target orders for {len(keys)} keys")
            if any(not 0 <= i < len(targets) for o in orders for i in o):
                raise InvalidArgument("a target order names a target index out of range")
        if not self._calls.acquire(blocking=False):
            raise ResourceExhausted(f"this node already runs {self._max_calls} replicate calls; "
                                    f"retry later")
        with self._active_lock:
            self._active += 1
        try:
            return self._replicate(keys, targets, copies=copies, write_quorum=write_quorum,
                                   orders=orders)
        finally:
            with self._active_lock:
                self._active -= 1
            self._calls.release()

    @property
    def active(self) -> int:
        """Replicate calls running now (each holds one of the ``max_calls`` slots)."""
        with self._active_lock:
            return self._active

    def _replicate(self, keys: Sequence[BlockKey], targets: Sequence[str], *, copies: int,
                   write_quorum: int, orders: Sequence[Sequence[int]] | None) -> ReplicateOutcome:
        held = self.node.exists(keys)
        missing = [k for k, h in zip(keys, held, strict=True) if not h]
        groups: dict[tuple[str, ...], list[BlockKey]] = {}
        for n, (k, h) in enumerate(zip(keys, held, strict=True)):
            if h:
                order = targets if orders is None else [targets[i] for i in orders[n]]
                cands = tuple(dict.fromkeys(t for t in order if t != self.self_addr))
                groups.setdefault(cands, []).append(k)
        out = quorum.run(
            self._pool,
            [(cands, partial(self._push, keys=ks)) for cands, ks in groups.items()],
            copies=copies, write_quorum=write_quorum, wait_s=self.wait_s, cancel=self._cancel)
        return ReplicateOutcome(copies=out.copies, missing=missing, stored_on=out.stored_on,
                                failed=out.failed)

    def _push(self, addr: str, keys: list[BlockKey]) -> None:
        push_blocks(self.node, self.peers.peer(addr), keys)

    def close(self) -> None:
        """Cancels queued pushes and wakes every waiting replicate call (it answers with
        what is stored so far)."""
        self._cancel.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
