"""What a same-host client holds on a node across requests: read leases over mapped
blocks (``LeaseSet``) and reservations it fills in shared memory (``ReservationSet``).
One of each per transfer-channel connection; each item ends on release or commit, on
expiry (``--read-lease-timeout`` after it was granted) or when the connection closes, so
a client that goes away never pins space. Both call only ``Node``'s public methods."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from kvstore.core.errors import InvalidArgument
from kvstore.core.keys import BlockKey
from kvstore.node.semantics import Node
from tiers.records import BlockEntry, Reservation

T = TypeVar("T")


class LeaseSet:
    """Read leases a same-host client holds across requests, ended on release, on expiry
    (``expire``: ``--read-lease-timeout`` after they were granted) or on close."""

    __slots__ = ("_clock", "_leases", "_next_id", "_node")

    def __init__(self, node: Node, clock: Callable[[], float] = time.monotonic) -> None:
        self._node = node
        self._clock = clock
        self._leases: dict[int, tuple[BlockEntry, float]] = {}  # in grant order
        self._next_id = 1

    def acquire(self, key: BlockKey) -> tuple[int, BlockEntry] | None:
        entry = self._node.acquire_read(key)
        if entry is None:
            return None
        lease_id = self._next_id
        self._next_id += 1
        self._leases[lease_id] = (entry, self._clock())
        return lease_id, entry

    def release(self, lease_id: int) -> bool:
        """True if the lease was held (not expired, not unknown) until now."""
        got = self._leases.pop(lease_id, None)
        if got is None:
            return False
        self._node.release_read(got[0])
        return True

    def expire(self, timeout: float) -> int:
        """Releases every lease granted ``timeout`` seconds ago or more; how many."""
        return _expire(self._leases, self._clock() - timeout,
                       lambda got: self._node.release_read(got[0]))

    def close(self) -> None:
        for entry, _ in self._leases.values():
            self._node.release_read(entry)
        self._leases.clear()

    def __len__(self) -> int:
        return len(self._leases)


class ReservationSet:
    """Reservations a same-host client fills in shared memory, aborted if it goes away or
    when they expire (``expire``); a later commit of one fails cleanly."""

    __slots__ = ("_clock", "_next_id", "_node", "_pending")

    def __init__(self, node: Node, clock: Callable[[], float] = time.monotonic) -> None:
        self._node = node
        self._clock = clock
        self._pending: dict[int, tuple[Reservation, float]] = {}  # in grant order
        self._next_id = 1

    def reserve(self, key: BlockKey, nbytes: int, *, parent: BlockKey | None, pin: bool,
                retain_s: float | None = None, owner: str | None = None,
                quota: int | None = None) -> tuple[int, Reservation] | None:
        """``owner``/``quota``: whom the space is charged to (a cluster-role copy charged
        to a tenant: ``kvstore.auth.tenancy.charging``; tenants never map the region)."""
        reservation = self._node.reserve(key, nbytes, parent=parent, pin=pin, retain_s=retain_s,
                                         owner=owner, quota=quota)
        if reservation is None:
            return None
        rid = self._next_id
        self._next_id += 1
        self._pending[rid] = (reservation, self._clock())
        return rid, reservation

    def get(self, rid: int) -> Reservation:
        """A pending reservation, left pending (InvalidArgument if unknown)."""
        got = self._pending.get(rid)
        if got is None:
            raise InvalidArgument(f"reservation {rid} is unknown or expired (the node's "
                                  f"--read-lease-timeout passed before its commit)")
        return got[0]

    def commit(self, rid: int) -> bool:
        got = self._pending.pop(rid, None)
        if got is None:
            raise InvalidArgument(f"reservation {rid} is unknown or expired (the node's "
                                  f"--read-lease-timeout passed before its commit): nothing "
                                  f"of it was stored")
        return self._node.commit(got[0])

    def abort(self, rid: int) -> None:
        got = self._pending.pop(rid, None)
        if got is not None:
            self._node.abort(got[0])

    def expire(self, timeout: float) -> int:
        """Aborts every reservation made ``timeout`` seconds ago or more; how many."""
        return _expire(self._pending, self._clock() - timeout,
                       lambda got: self._node.abort(got[0]))

    def close(self) -> None:
        for reservation, _ in self._pending.values():
            self._node.abort(reservation)
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending)


def _expire(held: dict[int, tuple[T, float]], before: float,
            end: Callable[[tuple[T, float]], None]) -> int:
    """Ends the items of ``held`` (in grant order) granted at or before ``before``."""
    n = 0
    while held:
        first = next(iter(held))
        got = held[first]
        if got[1] > before:
            break
        del held[first]
        end(got)
        n += 1
    return n
