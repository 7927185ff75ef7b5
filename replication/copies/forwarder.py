"""The master's side of a one-trip replicated put: forward what a writer just sent.

The channel server (``kvstore/node/channel_replicated.py``) hands ``forward`` the
blocks it received, as frozen ``BlockCopy`` values. The targets come from this
node's own membership and placement, never from the writer: each block's
candidates are its owners for ``copies`` copies, then every other live node in
ranking order, this node left out. Blocks with equal candidate orders form a group;
each group goes to its first ``copies - 1`` candidates over node-to-node transfer
channels (``PeerPool`` clients, which present the node's peer token), the groups bound
for one target in one push, and a failed target is replaced by the group's next
candidate (``replication/copies/quorum.py``, ``run_lent``: a dead target is tried once
per forward). Every push runs in the handler's own thread: every target is sent its
blocks before any answer is read, so the targets store at the same time, with no
hand-off to another thread (on two shared cores a pool's hand-offs cost the nodes about
a fifth of their CPU per replicated 64 KiB block). Pushes of large blocks may take
another pool (``large_peers``: a node uses same-host shared memory there, which copies
1 MiB blocks for less CPU than a socket; it does not pipeline, and need not at that
size). ``forward`` returns once every push it started has settled: the values are
borrowed from the put's slots, which commit after.
``write_quorum`` is the writer's to check against the copies made (every push runs to
its end either way).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvstore.core.forwarding import BlockCopy, ForwardOutcome
from replication.copies import quorum
from replication.copies.peers import PeerPool
from replication.copies.replicator import start_copies
from replication.membership import Membership
from replication.placement.candidates import CandidateCache
from replication.placement.rendezvous import Member, NodeId, Placement

LARGE_BLOCK_BYTES = 512 << 10
"""Pushes whose blocks average at least this go through ``large_peers``."""


class Forwarder:
    """Implements ``kvstore.core.forwarding.Forwarding``; thread-safe. Inert until ``attach``.

    Owns ``peers`` and ``large_peers`` (``close`` closes them)."""

    def __init__(self, peers: PeerPool, *, large_peers: PeerPool | None = None) -> None:
        """``peers``: stream connections (pipelined); ``large_peers``: for pushes of large
        blocks (``LARGE_BLOCK_BYTES``), typically same-host shared memory; None: ``peers``."""
        self.peers = peers
        self.large_peers = large_peers
        self._pools = (peers,) if large_peers is None else (peers, large_peers)
        self._lock = threading.Lock()
        # guarded by _lock:
        self._self_id: NodeId | None = None
        # Each block's targets under the current view (keys repeat: re-puts, fan-out);
        # None while detached.
        self._targets: CandidateCache[tuple[str, ...]] | None = None
        self._replicas = 1
        self._addrs: dict[NodeId, str] = {}
        self._unsubscribe: Callable[[], None] | None = None

    def attach(self, membership: Membership, self_id: str, *, replicas: int) -> None:
        """Forward by ``membership``'s live view from now on, as node ``self_id`` of a
        cluster that keeps ``replicas`` copies of a block (the cap on a tenant's puts)."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        with self._lock:
            self._self_id = NodeId(self_id)
            self._replicas = replicas
        self._on_members(membership.members())
        unsubscribe = membership.subscribe(self._on_members)
        with self._lock:
            self._unsubscribe = unsubscribe

    def detach(self) -> None:
        with self._lock:
            unsubscribe, self._unsubscribe = self._unsubscribe, None
            self._targets, self._addrs = None, {}
        if unsubscribe is not None:
            unsubscribe()

    def _on_members(self, view: Sequence[Member]) -> None:
        for pool in self._pools:  # a departed peer's clients go with the view that lost it
            pool.drop_departed()
        members = tuple(view)
        addrs = {m.node_id: m.addr for m in members}
        with self._lock:
            me = self._self_id

            def targets(owners: list[NodeId], rest: list[NodeId]) -> tuple[str, ...]:
                return tuple(addrs[n] for n in owners + rest if n != me)

            # A new cache: forwards in flight keep the old view's.
            self._targets = CandidateCache(Placement(members), targets)
            self._addrs = addrs

    @property
    def available(self) -> bool:
        with self._lock:
            return self._targets is not None and bool(self._addrs)

    @property
    def replicas(self) -> int:
        with self._lock:
            return self._replicas

    def forward(self, blocks: Sequence[BlockCopy], *, copies: int, write_quorum: int
                ) -> ForwardOutcome:
        with self._lock:
            targets, nodes = self._targets, len(self._addrs)
        if targets is None or copies == 1 or not blocks:
            return ForwardOutcome(copies=1)
        groups: dict[tuple[str, ...], list[BlockCopy]] = {}
        r = min(copies, nodes)
        for b in blocks:
            groups.setdefault(targets.get(b.place, r), []).append(b)
        out = quorum.run_lent(list(groups.items()), self._start_push, copies=copies)
        return ForwardOutcome(copies=out.copies, stored_on=tuple(out.stored_on),
                              failed=tuple(out.failed))

    def _start_push(self, addr: str, blocks: list[BlockCopy]) -> quorum.Finish:
        pool = self.peers
        if (self.large_peers is not None
                and sum(len(b.value) for b in blocks) >= LARGE_BLOCK_BYTES * len(blocks)):
            pool = self.large_peers
        return start_copies(pool.peer(addr), blocks)

    def close(self) -> None:
        """Pushes under way end with their peer clients (a handler still reads every
        answer it started, each ending within the peer stream's stall timeout)."""
        self.detach()
        for pool in self._pools:
            pool.close()
