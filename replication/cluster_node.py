"""A serving node's part in a cluster: registration in etcd and background repair.

Order of leaving matters: ``leave`` revokes the lease first, so clients stop
placing keys here, then stops repair; the caller drains and stops the servers
afterwards, so requests already routed here still finish.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.auth.security import ClientTls
from kvstore.core.errors import Unavailable
from kvstore.node.semantics import Node
from replication.copies.forwarder import Forwarder
from replication.copies.peers import PeerPool
from replication.copies.ratelimit import TokenBucket
from replication.copies.repair import RepairWorker
from replication.membership.etcd import EtcdMembership
from replication.placement.rendezvous import Member, NodeId

log = logging.getLogger("kvstore.cluster")

REPAIR_BURST_S = 0.25  # the bucket holds this many seconds of repair traffic
REPAIR_MIN_BURST = 64 << 10


@dataclass(slots=True, kw_only=True)
class ClusterSettings:
    etcd: str
    node_id: str
    addr: str  # the gRPC address other nodes and clients use
    zone: str = ""
    weight: float = 1.0
    lease_ttl: int = 10
    replicas: int = 2
    repair_bytes_per_s: int = 100 << 20
    repair_interval_s: float = 30.0
    etcd_tls: ClientTls | None = None


class ClusterRole:
    """Registers ``node`` in etcd and runs its repair worker until ``leave``."""

    def __init__(self, node: Node, peers: PeerPool, settings: ClusterSettings, *,
                 forwarder: Forwarder | None = None) -> None:
        self.settings = settings
        self.forwarder = forwarder  # takes replicated puts while this node is a member
        self.peers = peers
        self.member = Member(node_id=NodeId(settings.node_id), addr=settings.addr,
                             zone=settings.zone, weight=settings.weight)
        self.membership = EtcdMembership(settings.etcd, tls=settings.etcd_tls)
        rate = settings.repair_bytes_per_s
        self.repair = RepairWorker(
            node, self.membership, self_id=settings.node_id, peers=peers,
            replicas=settings.replicas,
            bucket=TokenBucket(rate=rate, burst=max(rate * REPAIR_BURST_S, REPAIR_MIN_BURST)),
            interval_s=settings.repair_interval_s)
        node.add_stat_source(self.stats)
        self._joined = False
        self._unsubscribe_peers: Callable[[], None] | None = None
        self._unsubscribe_view: Callable[[], None] | None = None

    def join(self) -> None:
        try:
            self.membership.register(self.member, ttl=self.settings.lease_ttl)
        except BaseException:
            self.membership.close()
            raise
        self._joined = True
        if self.forwarder is not None:
            self.forwarder.attach(self.membership, self.settings.node_id,
                                  replicas=self.settings.replicas)
        # A departed peer's clients close when the view changes, not only when the next
        # client is made (a restarted peer would otherwise keep its dead region mapped).
        self._unsubscribe_peers = self.membership.subscribe(
            lambda _view: self.peers.drop_departed())
        self.repair.start()
        log.info("joined the cluster at %s as %s (zone %r, weight %.3g)", self.settings.etcd,
                 self.member.node_id, self.member.zone, self.member.weight)

    def watch_view(self, show: Callable[[int], None]) -> None:
        """Calls ``show(members)`` with this node's view now and after every change of it,
        one call at a time, in order: the last call tells the current view. Subscribed
        after ``join``, so the forwarder already forwards by a view when it is shown
        (callbacks run in subscription order). ``leave`` stops it."""
        lock = threading.Lock()

        def changed(view: Sequence[Member]) -> None:
            with lock:
                show(len(view))

        with lock:
            self._unsubscribe_view = self.membership.subscribe(changed)
            show(len(self.membership.members()))

    def leave(self) -> None:
        if not self._joined:
            return
        self._joined = False
        for unsubscribe in (self._unsubscribe_peers, self._unsubscribe_view):
            if unsubscribe is not None:
                unsubscribe()
        self._unsubscribe_peers = self._unsubscribe_view = None
        if self.forwarder is not None:
            self.forwarder.detach()
        try:
            self.membership.leave()
        finally:
            self.repair.stop()
            self.membership.close()

    def drain(self) -> dict[str, float]:
        """Leaves placement (lease revoked: clients and peers stop choosing this node),
        then hands off the blocks no remaining owner holds. The caller stops the node."""
        if not self._joined:
            raise Unavailable("this node is not (or no longer) a cluster member")
        self.membership.leave()
        log.info("draining: left the cluster; handing off blocks")
        result = self.repair.hand_off()
        log.info("drained: %d blocks, %d copies made on their owners in %.1fs",
                 result["blocks"], result["copies"], result["seconds"])
        return result

    def stats(self) -> dict[str, object]:
        return {"node_id": self.member.node_id, "zone": self.member.zone,
                "cluster_members": len(self.membership.members()),
                "etcd_connected": self.membership.connected, **self.repair.stats()}
