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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.client import Client
from kvstore.errors import InvalidArgument, KVStoreError
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
    source pinned. Read leases last only for the copy.
    """
    sent = 0
    with node.reading_blocks(keys) as blocks:
        for pin in (False, True):
            group = [b for b in blocks if b is not None and b[0].pinned == pin]
            if group:
                peer.put_batch([e.key for e, _ in group], [v for _, v in group],
                               parents=[e.parent for e, _ in group], pin=pin)
                sent += sum(len(v) for _, v in group)
    return sent


class _Round:
    """One replicate call's bookkeeping; every field guarded by ``cond``."""

    __slots__ = ("candidates", "cond", "failed", "running", "stored_on")

    def __init__(self, candidates: list[str]) -> None:
        self.cond = threading.Condition()
        self.candidates = candidates  # not yet started, in order
        self.running = 0
        self.stored_on: list[str] = []
        self.failed: list[str] = []


class Replicator:
    """Forwards blocks from ``node`` to peer nodes; thread-safe."""

    def __init__(self, node: Node, peers: PeerPool, *, self_addr: str = "",
                 max_workers: int = 8) -> None:
        self.node = node
        self.peers = peers
        self.self_addr = self_addr
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="kvstore-replicate")

    def replicate(self, keys: Sequence[BlockKey], targets: Sequence[str], *, copies: int,
                  write_quorum: int) -> ReplicateOutcome:
        if copies < 1 or not 1 <= write_quorum <= copies:
            raise InvalidArgument(f"need 1 <= write_quorum <= copies, got write_quorum="
                                  f"{write_quorum}, copies={copies}")
        if len(targets) > MAX_TARGETS:
            raise InvalidArgument(f"at most {MAX_TARGETS} targets, got {len(targets)}")
        for t in targets:
            host, _, port = t.rpartition(":")
            if not host or not port.isdigit():
                raise InvalidArgument(f"target must be HOST:PORT, got {t!r}")
        held = self.node.exists(keys)
        present = [k for k, h in zip(keys, held, strict=True) if h]
        missing = [k for k, h in zip(keys, held, strict=True) if not h]
        candidates = list(dict.fromkeys(t for t in targets if t != self.self_addr))
        if not present or copies == 1:
            return ReplicateOutcome(copies=1, missing=missing)
        rnd = _Round(candidates)
        need = write_quorum - 1
        with rnd.cond:
            for _ in range(min(copies - 1, len(candidates))):
                self._start(rnd, present)
            while len(rnd.stored_on) < need and (rnd.running or rnd.candidates):
                rnd.cond.wait()
            return ReplicateOutcome(copies=1 + len(rnd.stored_on), missing=missing,
                                    stored_on=list(rnd.stored_on), failed=list(rnd.failed))

    def _start(self, rnd: _Round, keys: list[BlockKey]) -> None:
        """Starts a push to the next candidate; caller holds ``rnd.cond``."""
        addr = rnd.candidates.pop(0)
        try:
            self._pool.submit(self._push, rnd, addr, keys)
        except RuntimeError:  # shut down: the node is stopping
            rnd.failed.append(f"{addr}: node is stopping")
            return
        rnd.running += 1

    def _push(self, rnd: _Round, addr: str, keys: list[BlockKey]) -> None:
        error = ""
        try:
            push_blocks(self.node, self.peers.get(addr), keys)
        except KVStoreError as exc:
            error = str(exc)
        except Exception as exc:  # a bug must not strand the waiting writer
            log.exception("replicating to %s failed", addr)
            error = f"internal error: {exc}"
        with rnd.cond:
            rnd.running -= 1
            if error:
                rnd.failed.append(f"{addr}: {error}")
                if rnd.candidates:
                    self._start(rnd, keys)
            else:
                rnd.stored_on.append(addr)
            rnd.cond.notify_all()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
