"""One client per peer node, shared by everything in a process that talks to peers.

A ``PeerPool`` hands out a ``kvstore.remote.node_client.NodeClient`` per gRPC address, created on
first use and kept until ``retain`` drops addresses that left the membership or
``close`` ends them all. Clients are thread-safe, so one per peer is enough, plus one per
peer and tenant whose blocks this node copies there (``get(addr, charge_to=NAME)``: the
peer charges what that client puts to the tenant, see ``kvstore.auth.tenancy``). A node's
pool (built with ``members``) also drops, whenever it creates a client, the clients of
addresses that are no longer members: a peer that restarts comes back at a new address,
and the old client would keep its gRPC channel and its mapping of the dead peer's
shared-memory region (which keeps that memory allocated) for as long as the node runs.

**Only members.** A node's pool is built with ``members`` (a ``KnownMembers``):
``get`` then refuses, before any connection is made, every address that is not a
member this node knows from its own membership (etcd, or the static
``--members`` list). Replication, repair and hand-off all reach peers through
``get``, so a node never sends blocks or its cluster-role token to an address a
caller made up. Every call to a peer is bounded: ``timeout`` for connecting and
for each gRPC call, and the same bound on any stall of a transfer-channel stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Literal

from kvstore.auth.security import ClientTls
from kvstore.core.errors import PermissionDenied, Unavailable
from kvstore.remote.node_client import NodeClient

PeerFor = Callable[[str | None], NodeClient]
"""A peer's client that charges its puts to the tenant given (None: to nobody)."""


class KnownMembers:
    """The peer addresses a node may contact: a static list plus a live membership view."""

    def __init__(self, static: Iterable[str] = (), *, lag_s: float = 1.0) -> None:
        self._static = frozenset(a for a in static if a)
        self._live: Callable[[], Iterable[str]] | None = None
        self._wait: Callable[[Callable[[], bool], float], bool] | None = None
        self._lag_s = lag_s

    def follow(self, live: Callable[[], Iterable[str]],
               wait: Callable[[Callable[[], bool], float], bool] | None = None) -> None:
        """Adds a live source of addresses (a membership view, read on every check).

        ``wait(ready, timeout)`` blocks until ``ready()`` or the timeout: an address not
        yet in this node's view gets ``lag_s`` to appear (a node that just joined is in
        the writer's view a moment before it is in this one's)."""
        self._live = live
        self._wait = wait

    def addrs(self) -> frozenset[str]:
        live = self._live
        return self._static | frozenset(live()) if live is not None else self._static

    def check(self, addr: str) -> None:
        """PermissionDenied unless ``addr`` is a known member."""
        if addr in self.addrs():
            return
        wait = self._wait
        if wait is None or not wait(lambda: addr in self.addrs(), self._lag_s):
            raise PermissionDenied(f"{addr} is not a member of this node's cluster: a node "
                                   f"sends blocks only to members it knows (etcd or --members)")


class PeerPool:
    def __init__(self, *, transport: str = "auto", timeout: float = 10.0,
                 token: str | None = None, tls: ClientTls | None = None,
                 members: KnownMembers | None = None,
                 io_timeout: float | Literal["timeout"] | None = "timeout") -> None:
        """``members``: None lets ``get`` reach any address (a client's pool, which
        carries the caller's own token); a node passes its ``KnownMembers``.
        ``timeout``: connecting and each gRPC call; ``io_timeout``: how long a
        transfer-channel read or write may stall (``"timeout"``: the same; None: no bound).
        A writer's bound must outlast its master's, which waits up to its own peer
        timeout to replace a stalled replica before it answers."""
        self.transport = transport
        self.timeout = timeout
        self.io_timeout = timeout if io_timeout == "timeout" else io_timeout
        self.members = members
        self._token = token
        self._tls = tls
        self._lock = threading.Lock()
        # guarded by _lock:
        self._clients: dict[tuple[str, str | None], NodeClient] = {}
        self._closed = False

    def get(self, addr: str, *, charge_to: str | None = None) -> NodeClient:
        """The client of ``addr``; with ``charge_to``, one whose puts the peer charges to
        that tenant (the copies of its blocks)."""
        if self.members is not None:
            self.members.check(addr)  # before any connection: the token goes nowhere else
        gone: list[NodeClient] = []
        with self._lock:
            if self._closed:
                raise Unavailable("peer pool is closed")
            client = self._clients.get((addr, charge_to))
            if client is None:
                gone = self._pop_departed()  # the view that just admitted addr is fresh
                client = NodeClient(addr, transport=self.transport, timeout=self.timeout,
                                    token=self._token, tls=self._tls,
                                    io_timeout=self.io_timeout, charge_to=charge_to)
                self._clients[(addr, charge_to)] = client
        for c in gone:  # calls still on them fail as calls to a departed peer do
            c.close()
        return client

    def peer(self, addr: str) -> PeerFor:
        """``addr``'s clients by the tenant they charge (what ``send_copies`` takes);
        PermissionDenied at once, as ``get``, if ``addr`` is not a known member."""
        if self.members is not None:
            self.members.check(addr)
        return lambda owner: self.get(addr, charge_to=owner)

    def drop_departed(self) -> None:
        """Closes the clients of addresses that are no longer members (a node's pool: call
        it on every membership change, so a peer restarted at a new address leaves no
        client, channel or mapping of its dead region behind even if no new client is made
        after it; ``get`` does it too). No-op for a pool without ``members``."""
        with self._lock:
            gone = self._pop_departed()
        for c in gone:
            c.close()

    def _pop_departed(self) -> list[NodeClient]:
        """Under ``_lock``: removes and returns the clients of addresses not in
        ``members`` (none without ``members``)."""
        if self.members is None:
            return []
        known = self.members.addrs()
        return [self._clients.pop(a) for a in list(self._clients) if a[0] not in known]

    def retain(self, addrs: Iterable[str]) -> None:
        """Closes the clients of every address not in ``addrs``."""
        keep = set(addrs)
        with self._lock:
            gone = [a for a in self._clients if a[0] not in keep]
            dropped = [self._clients.pop(a) for a in gone]
        for c in dropped:
            c.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    def __enter__(self) -> PeerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
