"""Master-side replication: copy blocks this node holds to their replicas.

A cluster put goes to the key's master (the top-ranked live node), which stores
it; the writer then asks the master to ``replicate``: the master forwards the
bytes to the replicas in parallel and answers once ``write_quorum`` copies
(its own included) exist. Keys are content addresses and values immutable, so
replicas never disagree and a put that lands twice is a no-op.

Target order and fallback: ``targets`` lists candidate nodes in placement order.
The first ``copies - 1`` are tried at once; each one that fails is replaced by
the next unused candidate (a sloppy quorum: a copy on a lower-ranked node still
counts, and repair later moves it to its owner). The answer comes when enough
targets succeeded or none is left; the other pushes finish in the background,
each holding read leases on its blocks only while it sends them.

Bounds (a caller must not be able to tie up the node): at most ``max_calls``
replicate calls wait at once (more are refused with RESOURCE_EXHAUSTED, so the
gRPC handler threads stay free for other clients); each waits at most ``wait_s``
(pushes still running then are reported failed as timed out); ``close`` (the node
stopping) wakes every waiting call at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.client import Client
from kvstore.errors import InvalidArgument, KVStoreError, ResourceExhausted
from kvstore.keys import BlockKey
from kvstore.node import Node
from replication.peers import PeerPool

log = logging.getLogger("kvstore.replicator")

MAX_TARGETS = 64


@dataclass(slots=True, kw_only=True)
class ReplicateOutcome:
    copies: int  # copies holding every present key, this node's included
    missing: list[BlockKey] = field(default_factory=list)
    stored_on: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "ADDR: reason"


def push_blocks(node: Node, peer: Client, keys: Sequence[BlockKey]) -> int:
    """Copies the blocks of ``keys`` that ``node`` holds to ``peer`` (a Client); bytes sent.

    Pinned and unpinned blocks go in separate batches so the peer pins what the
    source pinned. Read leases last only for the copy, and are not counted as reads
    (no hits, no recency, no promotion): the cluster copying a block is not a user
    reading it.
    """
    sent = 0
    with node.reading_blocks(keys, access=False) as blocks:
        for pin in (False, True):
            group = [b for b in blocks if b is not None and b[0].pinned == pin]
            if group:
                peer.put_batch([e.key for e, _ in group], [v for _, v in group],
                               parents=[e.parent for e, _ in group], pin=pin)
                sent += sum(len(v) for _, v in group)
    return sent


class _Round:
    """One group of keys with the same target order; fields guarded by the shared ``cond``."""

    __slots__ = ("candidates", "cond", "failed", "inflight", "keys", "running", "stored_on")

    def __init__(self, cond: threading.Condition, keys: list[BlockKey], candidates: list[str]
                 ) -> None:
        self.cond = cond
        self.keys = keys
        self.candidates = candidates  # not yet started, in order
        self.running = 0
        self.inflight: list[str] = []  # addresses of the pushes running
        self.stored_on: list[str] = []
        self.failed: list[str] = []

    def settled(self, need: int) -> bool:
        return len(self.stored_on) >= need or not (self.running or self.candidates)


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
        self._closed = threading.Event()
        self._waiting: set[threading.Condition] = set()  # guarded by _waiting_lock
        self._waiting_lock = threading.Lock()
        self._active = 0  # guarded by _waiting_lock
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="kvstore-replicate")

    def replicate(self, keys: Sequence[BlockKey], targets: Sequence[str], *, copies: int,
                  write_quorum: int, orders: Sequence[Sequence[int]] | None = None
                  ) -> ReplicateOutcome:
        """Copies ``keys`` to ``copies - 1`` targets each; see the module docstring."""
        if not self._calls.acquire(blocking=False):
            raise ResourceExhausted(f"this node already runs {self._max_calls} replicate calls; "
                                    f"retry later")
        with self._waiting_lock:
            self._active += 1
        try:
            return self._replicate(keys, targets, copies=copies, write_quorum=write_quorum,
                                   orders=orders)
        finally:
            with self._waiting_lock:
                self._active -= 1
            self._calls.release()

    @property
    def active(self) -> int:
        """Replicate calls running now (each holds one of the ``max_calls`` slots)."""
        with self._waiting_lock:
            return self._active

    def _replicate(self, keys: Sequence[BlockKey], targets: Sequence[str], *, copies: int,
                   write_quorum: int, orders: Sequence[Sequence[int]] | None = None
                   ) -> ReplicateOutcome:
        """``orders`` (optional, one per key) lists indexes into ``targets``: the key's own
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
        held = self.node.exists(keys)
        missing = [k for k, h in zip(keys, held, strict=True) if not h]
        groups: dict[tuple[str, ...], list[BlockKey]] = {}
        for n, (k, h) in enumerate(zip(keys, held, strict=True)):
            if h:
                order = targets if orders is None else [targets[i] for i in orders[n]]
                cands = tuple(dict.fromkeys(t for t in order if t != self.self_addr))
                groups.setdefault(cands, []).append(k)
        if not groups or copies == 1:
            return ReplicateOutcome(copies=1, missing=missing)
        cond = threading.Condition()
        rounds = [_Round(cond, ks, list(cands)) for cands, ks in groups.items()]
        need = write_quorum - 1
        with self._waiting_lock:
            self._waiting.add(cond)
        try:
            with cond:
                for rnd in rounds:
                    for _ in range(min(copies - 1, len(rnd.candidates))):
                        self._start(rnd)
                settled = cond.wait_for(lambda: self._closed.is_set() or all(
                    r.settled(need) for r in rounds), timeout=self.wait_s)
                if not settled or self._closed.is_set():
                    why = "node is stopping" if self._closed.is_set() else "timed out"
                    for r in rounds:
                        r.failed += [f"{a}: {why}" for a in r.candidates]
                        r.candidates.clear()
                        r.failed += [f"{a}: still sending, {why}" for a in r.inflight]
                return self._outcome(rounds, missing)
        finally:
            with self._waiting_lock:
                self._waiting.discard(cond)

    @staticmethod
    def _outcome(rounds: list[_Round], missing: list[BlockKey]) -> ReplicateOutcome:
        """The answer from ``rounds``' state; caller holds their ``cond``."""
        stored = set.intersection(*(set(r.stored_on) for r in rounds))
        return ReplicateOutcome(
            copies=1 + min(len(r.stored_on) for r in rounds), missing=missing,
            stored_on=[t for t in rounds[0].stored_on if t in stored],
            failed=[f for r in rounds for f in r.failed])

    def _start(self, rnd: _Round) -> None:
        """Starts a push to the next candidate; caller holds ``rnd.cond``."""
        addr = rnd.candidates.pop(0)
        try:
            self._pool.submit(self._push, rnd, addr)
        except RuntimeError:  # shut down: the node is stopping
            rnd.failed.append(f"{addr}: node is stopping")
            return
        rnd.running += 1
        rnd.inflight.append(addr)

    def _push(self, rnd: _Round, addr: str) -> None:
        error = ""
        try:
            push_blocks(self.node, self.peers.get(addr), rnd.keys)
        except KVStoreError as exc:
            error = str(exc)
        except Exception as exc:  # a bug must not strand the waiting writer
            log.exception("replicating to %s failed", addr)
            error = f"internal error: {exc}"
        with rnd.cond:
            rnd.running -= 1
            rnd.inflight.remove(addr)
            if error:
                rnd.failed.append(f"{addr}: {error}")
                if rnd.candidates:
                    self._start(rnd)
            else:
                rnd.stored_on.append(addr)
            rnd.cond.notify_all()

    def close(self) -> None:
        """Cancels queued pushes and wakes every waiting replicate call (it answers with
        what is stored so far)."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._waiting_lock:
            waiting = list(self._waiting)
        for cond in waiting:
            with cond:
                cond.notify_all()
