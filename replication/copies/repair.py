"""Background repair: copy under-replicated blocks to their owners.

Each node runs one ``RepairWorker``. A pass scans the keys this node holds,
places them over the current live members, asks each other owner which of its
keys it lacks (batched ``Exists``), and pushes the missing blocks to it,
throttled by a token bucket (bytes/s) so repair never floods a node that joined
empty nor starves client traffic. Passes run after every membership change
(debounced) and every ``interval_s`` (to mend writes that met their quorum on a
fallback node, or failed part-way).

Who pushes (so that, normally, one node copies each block, not every holder):
for a key with owners ``O`` (master first), the pusher is the first node of
``O`` that holds it. If no owner holds it, every holder pushes (pushes are
idempotent: keys are content addresses). A holder that is not an owner keeps
its copy; it is a cache and its policy will evict it.

A pass restarts from the beginning when membership changes under it, so it
never places blocks by a stale view for longer than one batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.core.errors import KVStoreError, Unavailable
from kvstore.core.keys import BlockKey
from kvstore.node.semantics import Node
from replication.copies.peers import PeerPool
from replication.copies.ratelimit import TokenBucket
from replication.copies.replicator import push_blocks
from replication.membership import Membership
from replication.placement.rendezvous import Member, NodeId, Placement

log = logging.getLogger("kvstore.repair")

SCAN_BATCH = 1024
PUSH_BATCH = 32
DEBOUNCE_S = 0.2


@dataclass(slots=True, kw_only=True)
class RepairCounters:
    passes: int = 0
    repaired_blocks: int = 0
    repaired_bytes: int = 0
    backlog: int = 0  # keys of the current pass not yet checked
    failures: int = 0
    last_pass_s: float = 0.0
    last_pass_end: float = 0.0  # clock time a pass last completed (0: never)


class RepairWorker:
    """Repairs the blocks ``node`` holds, as member ``self_id`` of ``membership``."""

    def __init__(self, node: Node, membership: Membership, *, self_id: str, peers: PeerPool,
                 replicas: int, bucket: TokenBucket | None = None, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.node = node
        self.membership = membership
        self.self_id = NodeId(self_id)
        self.peers = peers
        self.replicas = replicas
        self.bucket = bucket
        self.interval_s = interval_s
        self._clock = clock
        self._wake = threading.Condition()
        # guarded by _wake:
        self._generation = 0  # bumped on every membership change
        self._done_generation = -1  # the membership the last whole pass ran under
        self._stopped = False
        self._handing_off = False
        self._counters = RepairCounters()
        self._thread = threading.Thread(target=self._run, name="kvstore-repair", daemon=True)
        self._unsubscribe: Callable[[], None] | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._unsubscribe = self.membership.subscribe(self._on_members)
        self._thread.start()

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def trigger(self) -> None:
        """Asks for a pass now (as a membership change does)."""
        self._on_members(())

    def _on_members(self, _view: Sequence[Member]) -> None:
        with self._wake:
            self._generation += 1
            self._wake.notify_all()

    def stats(self) -> dict[str, object]:
        with self._wake:
            c = self._counters
            return {"repair_passes": c.passes,
                    "repair_pending": self._done_generation != self._generation,
                    "repaired_blocks": c.repaired_blocks,
                    "repaired_bytes": c.repaired_bytes, "repair_backlog": c.backlog,
                    "repair_failures": c.failures, "last_repair_pass_s": round(c.last_pass_s, 3)}

    # ---- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        seen = -1
        while True:
            with self._wake:
                if seen == self._generation and not self._stopped:
                    self._wake.wait(self.interval_s)
                if self._stopped:
                    return
                generation = self._generation
            if generation != seen:
                time.sleep(DEBOUNCE_S)  # let a burst of membership events settle
                with self._wake:
                    generation = self._generation
            seen = generation
            try:
                if self.run_pass(generation):
                    with self._wake:
                        self._done_generation = generation
            except Exception:
                log.exception("repair pass failed")
                with self._wake:
                    self._counters.failures += 1

    def _changed(self, generation: int | None) -> bool:
        with self._wake:
            if self._handing_off:
                return False  # a hand-off finishes whatever the membership does
            return self._stopped or (generation is not None and generation != self._generation)

    def run_pass(self, generation: int | None = None) -> bool:
        """One pass over every key; False if it stopped early (membership changed)."""
        view = self.membership.members()
        if self.self_id not in {m.node_id for m in view}:
            return True  # not (yet) a member: nothing is ours to repair
        placement = Placement(view)
        keys = self.node.keys()
        start = self._clock()
        with self._wake:
            self._counters.backlog = len(keys)
        for lo in range(0, len(keys), SCAN_BATCH):
            if self._changed(generation):
                return False
            chunk = keys[lo : lo + SCAN_BATCH]
            self._repair_chunk(placement, chunk)
            with self._wake:
                self._counters.backlog = max(0, len(keys) - lo - len(chunk))
        with self._wake:
            c = self._counters
            c.passes += 1
            c.last_pass_s = self._clock() - start
            c.last_pass_end = self._clock()
        return True

    def hand_off(self) -> dict[str, float]:
        """Copies every block this node holds that no remaining owner holds to its owners,
        as if this node were gone (call it after leaving the membership). Blocks some
        owner already holds are left to that owner's repair. Runs in the caller's thread.
        """
        view = [m for m in self.membership.members() if m.node_id != self.self_id]
        if not view:
            raise Unavailable("no other live node to hand the blocks to")
        placement = Placement(view)
        keys = self.node.keys()
        start = self._clock()
        with self._wake:
            before = (self._counters.repaired_blocks, self._counters.repaired_bytes)
            self._handing_off = True
        try:
            for lo in range(0, len(keys), SCAN_BATCH):
                self._repair_chunk(placement, keys[lo : lo + SCAN_BATCH])
        finally:
            with self._wake:
                self._handing_off = False
                c = self._counters
                blocks, nbytes = c.repaired_blocks - before[0], c.repaired_bytes - before[1]
        return {"blocks": len(keys), "copies": blocks, "bytes_copied": nbytes,
                "seconds": self._clock() - start}

    def _repair_chunk(self, placement: Placement, keys: list[BlockKey]) -> None:
        owners = placement.owners_many(keys, self.replicas)
        asks: dict[NodeId, list[BlockKey]] = {}
        for k, os_ in zip(keys, owners, strict=True):
            for o in os_:
                if o != self.self_id:
                    asks.setdefault(o, []).append(k)
        held: dict[NodeId, set[BlockKey]] = {}
        for o, ks in asks.items():
            try:
                flags = self.peers.get(placement.member(o).addr).exists(ks)
            except KVStoreError as exc:
                log.info("repair: cannot ask %s: %s", o, exc)
                with self._wake:
                    self._counters.failures += 1
                held[o] = set(ks)  # unknown: do not push to it this pass
                continue
            held[o] = {k for k, f in zip(ks, flags, strict=True) if f}
        pushes: dict[NodeId, list[BlockKey]] = {}
        for k, os_ in zip(keys, owners, strict=True):
            holders = [o for o in os_ if o == self.self_id or k in held[o]]
            if holders and holders[0] != self.self_id:
                continue  # a higher-placed owner holds it and pushes
            for o in os_:
                if o != self.self_id and k not in held[o]:
                    pushes.setdefault(o, []).append(k)
        for o, ks in pushes.items():
            self._push(placement.member(o).addr, ks)

    def _push(self, addr: str, keys: list[BlockKey]) -> None:
        """Sends ``keys`` in batches of at most PUSH_BATCH blocks and, when throttled, at
        most one bucket's burst of bytes (or one block), so no batch floods the peer."""
        peer = self.peers.peer(addr)
        budget = self.bucket.burst if self.bucket is not None else float("inf")
        sizes = self.node.block_sizes(keys)
        lo = 0
        while lo < len(keys):
            hi, nbytes = lo + 1, sizes[lo] or 0
            while hi < len(keys) and hi - lo < PUSH_BATCH and nbytes + (sizes[hi] or 0) <= budget:
                nbytes += sizes[hi] or 0
                hi += 1
            part, lo = keys[lo:hi], hi
            if self._changed(None):
                return
            if self.bucket is not None:
                self.bucket.acquire(max(1, nbytes))
            try:
                sent = push_blocks(self.node, peer, part)
            except KVStoreError as exc:
                log.info("repair: push to %s failed: %s", addr, exc)
                with self._wake:
                    self._counters.failures += 1
                return
            with self._wake:
                self._counters.repaired_blocks += len(part)
                self._counters.repaired_bytes += sent
