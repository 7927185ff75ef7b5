"""What a same-host client holds on a node across requests: read leases over mapped
blocks (``LeaseSet``) and reservations it fills in shared memory (``ReservationSet``).
One of each per transfer-channel connection; each item ends on release or commit, on
expiry (``--read-lease-timeout`` after it was granted) or when the connection closes, so
a client that goes away never pins space. Both call only ``Node``'s public methods.

A reservation of a client that stages its puts (``kvstore.node.staging``) remembers the
staging area it was granted in; its bytes are copied into the region (``landed``) only
while it is live, and its expiry retires that area, so a writer that resumes late
writes where nobody reads."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvstore.core.errors import InvalidArgument, ResourceExhausted
from kvstore.core.keys import BlockKey
from kvstore.node.semantics import Node
from kvstore.node.staging import Staging, StagingArea
from tiers.allocator import Extent
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


@dataclass(slots=True, kw_only=True)
class _Held:
    """One live reservation, and where its writer stages its bytes (no area: in the
    region)."""

    reservation: Reservation
    area: StagingArea | None = None
    slot: Extent | None = None
    landed: bool = False


class ReservationSet:
    """Reservations a same-host client fills in shared memory, aborted if it goes away or
    when they expire (``expire``); a later commit of one fails cleanly. With ``staging``
    the client fills them in its staging areas and the node lands the bytes at commit."""

    __slots__ = ("_clock", "_held_bytes", "_next_id", "_node", "_pending", "_staging")

    def __init__(self, node: Node, clock: Callable[[], float] = time.monotonic,
                 staging: Staging | None = None) -> None:
        self._node = node
        self._clock = clock
        self._staging = staging
        self._pending: dict[int, tuple[_Held, float]] = {}  # in grant order
        self._held_bytes = 0  # the landing tier's bytes the pending reservations hold
        self._next_id = 1

    def reserve(self, key: BlockKey, nbytes: int, *, parent: BlockKey | None, pin: bool,
                retain_s: float | None = None, owner: str | None = None,
                quota: int | None = None) -> tuple[int, Reservation] | None:
        """(id, reservation), or None if the key is stored already; ``staged_slot`` says
        where the client fills it. ``owner``/``quota``: whom the space is charged to (a
        cluster-role copy charged to a tenant: ``kvstore.auth.tenancy.charging``; tenants
        never map the region)."""
        reservation = self._node.reserve(key, nbytes, parent=parent, pin=pin, retain_s=retain_s,
                                         owner=owner, quota=quota, holding=self._held_bytes)
        if reservation is None:
            return None
        held = _Held(reservation=reservation)
        if self._staging is not None:
            got = self._staging.grant(nbytes)
            if got is None:
                self._node.abort(reservation)
                raise ResourceExhausted("this connection's staging area is full: commit or "
                                        "abort reservations before making more")
            held.area, held.slot = got
        rid = self._next_id
        self._next_id += 1
        self._pending[rid] = (held, self._clock())
        self._held_bytes += reservation.extent.length
        return rid, reservation

    def staged_slot(self, rid: int) -> tuple[int, int] | None:
        """Where the client fills pending reservation ``rid``: (staging area generation,
        slot offset), or None for the region at the reservation's own offset."""
        held = self._held(rid)
        if held.area is None or held.slot is None:
            return None
        return held.area.generation, held.slot.offset

    def _held(self, rid: int) -> _Held:
        got = self._pending.get(rid)
        if got is None:
            raise InvalidArgument(f"reservation {rid} is unknown or expired (the node's "
                                  f"--read-lease-timeout passed before its commit)")
        return got[0]

    def get(self, rid: int) -> Reservation:
        """A pending reservation, left pending (InvalidArgument if unknown)."""
        return self._held(rid).reservation

    def landed(self, rid: int) -> Reservation:
        """A pending reservation with its bytes in the region (a staged one's are copied
        there now, once), left pending (InvalidArgument if unknown)."""
        held = self._held(rid)
        self._land(held)
        return held.reservation

    def _land(self, held: _Held) -> None:
        if held.area is not None and held.slot is not None and not held.landed:
            view = self._node.fill_view(held.reservation)
            try:
                held.area.land(held.slot, view)
            finally:
                view.release()
            held.landed = True

    def commit(self, rid: int) -> bool:
        got = self._pending.get(rid)
        if got is None:
            raise InvalidArgument(f"reservation {rid} is unknown or expired (the node's "
                                  f"--read-lease-timeout passed before its commit): nothing "
                                  f"of it was stored")
        held = got[0]
        try:
            self._land(held)
        except BaseException:
            self.abort(rid)
            raise
        del self._pending[rid]
        self._done(held, expired=False)
        return self._node.commit(held.reservation)

    def abort(self, rid: int) -> None:
        got = self._pending.pop(rid, None)
        if got is not None:
            self._node.abort(got[0].reservation)
            self._done(got[0], expired=False)

    def _done(self, held: _Held, *, expired: bool) -> None:
        self._held_bytes -= held.reservation.extent.length
        if self._staging is not None and held.area is not None and held.slot is not None:
            self._staging.done(held.area, held.slot, expired=expired)

    def expire(self, timeout: float) -> int:
        """Aborts every reservation made ``timeout`` seconds ago or more; how many. The
        staging area its writer may still write into takes no new reservation."""
        return _expire(self._pending, self._clock() - timeout, self._expired)

    def _expired(self, got: tuple[_Held, float]) -> None:
        self._node.abort(got[0].reservation)
        self._done(got[0], expired=True)

    def close(self) -> None:
        for held, _ in self._pending.values():
            self._node.abort(held.reservation)
        self._pending.clear()
        self._held_bytes = 0
        if self._staging is not None:
            self._staging.close()

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
