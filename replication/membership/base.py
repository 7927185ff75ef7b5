"""Cluster membership: which nodes are live, kept in etcd under leases.

Each live node stores one key, ``<prefix><node_id>``, whose value is the JSON
object ``{"node_id", "addr", "zone", "weight"}`` (a ``placement.Member``), attached
to an etcd lease the node keeps alive. A node that stops refreshing (crash, kill,
SIGSTOP, partition) loses its lease after ``ttl`` seconds and etcd deletes the key;
a node that leaves revokes the lease and the key goes at once. Every process
watches the prefix to keep its view of the live members.

This module holds what every membership shares: the interface, the value format, the
view broadcast and the static list. The etcd implementation (threads, retry policy, what
its callers can rely on) is ``replication/membership/etcd.py``, which builds on this one;
``replication.membership`` offers both under one name.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from kvstore.core.errors import KVStoreError, Unavailable
from replication.placement.rendezvous import Member, NodeId

log = logging.getLogger("kvstore.membership")

DEFAULT_PREFIX = "/kvstore/v1/members/"

View = tuple[Member, ...]
Callback = Callable[[View], None]
class MembershipError(KVStoreError):
    """A membership operation failed for a reason retrying unchanged will not fix."""


class MembershipUnavailable(MembershipError, Unavailable):
    """etcd did not answer in time (down, restarting or unreachable); a retry may succeed."""


# ---- the value format -----------------------------------------------------------------------


def encode_member(member: Member) -> bytes:
    """The etcd value for ``member`` (compact JSON, UTF-8)."""
    doc = {"node_id": member.node_id, "addr": member.addr, "zone": member.zone,
           "weight": member.weight}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def decode_member(node_id: str, raw: bytes) -> Member:
    """The member stored under key ``node_id``; ``ValueError`` if ``raw`` is not one."""
    doc = json.loads(raw)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("node_id") != node_id:
        raise ValueError(f"node_id {doc.get('node_id')!r} does not match the key")
    addr, zone, weight = doc.get("addr"), doc.get("zone", ""), doc.get("weight", 1.0)
    if not isinstance(addr, str) or not addr or not isinstance(zone, str):
        raise ValueError("addr must be a non-empty string and zone a string")
    return Member(node_id=NodeId(node_id), addr=addr, zone=zone, weight=weight)


# ---- the interface ------------------------------------------------------------------------


class Membership(Protocol):
    """The live members of the cluster, as one process sees them."""

    def members(self) -> View:
        """The current view, sorted by ``node_id``."""
        ...

    def subscribe(self, callback: Callback) -> Callable[[], None]:
        """Calls ``callback(view)`` after every change (from a background thread).

        Returns a function that unsubscribes; a call already running is not waited for.
        """
        ...

    def wait_for(self, predicate: Callable[[View], bool], timeout: float) -> bool:
        """Blocks until ``predicate(view)`` holds (True) or ``timeout`` s pass (False)."""
        ...

    def close(self) -> None:
        """Releases threads and connections; idempotent."""
        ...


class ViewBroadcast:
    """The current view plus the subscribers it is delivered to.

    Invariant: ``view`` only changes through ``publish``; each change is queued once to
    a single dispatcher thread, so callbacks see changes in order and never overlap.
    """

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._view: View = ()
        self._subs: dict[int, Callback] = {}
        self._next_sub = 0
        self._queue: queue.SimpleQueue[View | None] = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def view(self) -> View:
        return self._view

    def publish(self, view: View) -> None:
        with self._cond:
            if view == self._view:
                return
            self._view = view
            self._cond.notify_all()
            if self._subs and not self._closed:
                self._queue.put(view)

    def subscribe(self, callback: Callback) -> Callable[[], None]:
        with self._cond:
            if self._closed:
                raise MembershipError("membership is closed")
            sub = self._next_sub
            self._next_sub += 1
            self._subs[sub] = callback
            if self._thread is None:
                self._thread = threading.Thread(target=self._dispatch, name=self._name,
                                                 daemon=True)
                self._thread.start()

        def unsubscribe() -> None:
            with self._cond:
                self._subs.pop(sub, None)

        return unsubscribe

    def wait_for(self, predicate: Callable[[View], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self._view), timeout)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._subs.clear()
            thread = self._thread
        self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _dispatch(self) -> None:
        while (view := self._queue.get()) is not None:
            with self._cond:
                callbacks = list(self._subs.values())
            for callback in callbacks:
                try:
                    callback(view)
                except Exception:
                    log.exception("membership callback %r failed", callback)


class StaticMembership:
    """A fixed member list: single-node embedded mode, and tests. It never changes."""

    def __init__(self, members: Iterable[Member]) -> None:
        view = tuple(sorted(members, key=lambda m: m.node_id))
        ids = [m.node_id for m in view]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate node ids in {ids}")
        self._view = view

    def members(self) -> View:
        return self._view

    def subscribe(self, callback: Callback) -> Callable[[], None]:
        return lambda: None  # nothing ever changes, so there is nothing to deliver

    def wait_for(self, predicate: Callable[[View], bool], timeout: float) -> bool:
        return predicate(self._view)

    def close(self) -> None:
        pass
