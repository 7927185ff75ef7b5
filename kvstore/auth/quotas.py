"""Per-tenant byte counts (and quotas) of one node.

A ``QuotaBook`` is pure and single-owner: the node calls it under its metadata
lock, in the same critical section as the reservation it charges, so a check and
its charge can never interleave with another put.

Invariant: ``used(owner)`` is the sum of the bytes of the owner's open
reservations plus the bytes of the owner's stored blocks. A reservation is
charged when its space is reserved (``charge_reservation``) and its charge ends
when it is aborted, or when its commit loses to another put of the same key
(``settle(stored=False)``); a commit that stores the block moves the charge onto
the key (``settle(stored=True)``), where it stays until the block leaves the node
(eviction, removal: ``release``). Two puts of one key may hold two reservations
at once (a same-key race): each carries its own charge, so whichever wins, the
loser's bytes come back exactly. A key is charged to at most one tenant (keys are
salted per tenant, so two tenants never share one).

The quota check passes a put whose key already has an open reservation: that is a
same-key race, at most one of the racers stores the block and the others' charges
come back at their commit, so refusing it would turn a race into an error. Stored
bytes never pass the quota this way; open charges may, for as long as the race lasts.
"""

from __future__ import annotations

from kvstore.core.errors import ResourceExhausted
from kvstore.core.keys import BlockKey
from kvstore.core.sizes import format_size


class QuotaBook:
    def __init__(self) -> None:
        self._used: dict[str, int] = {}
        self._charged: dict[BlockKey, tuple[str, int]] = {}  # stored blocks
        # id(reservation) -> (owner, bytes, key or None)
        self._pending: dict[int, tuple[str, int, BlockKey | None]] = {}
        self._racing: dict[BlockKey, int] = {}  # key -> its open reservations

    def check(self, owner: str, quota: int, nbytes: int, *, key: BlockKey | None = None
              ) -> None:
        if key is not None and key in self._racing:
            return  # a same-key race: see the module docstring
        used = self._used.get(owner, 0)
        if used + nbytes > quota:
            raise ResourceExhausted(
                f"namespace {owner!r} is over its quota on this node: {format_size(used)} used "
                f"+ {format_size(nbytes)} > {format_size(quota)}")

    def charge_reservation(self, owner: str, reservation: object, nbytes: int, *,
                           key: BlockKey | None = None) -> None:
        rid = id(reservation)
        if rid in self._pending:
            raise AssertionError("reservation charged twice")
        self._pending[rid] = (owner, nbytes, key)
        self._used[owner] = self._used.get(owner, 0) + nbytes
        if key is not None:
            self._racing[key] = self._racing.get(key, 0) + 1

    def settle(self, reservation: object, key: BlockKey, *, stored: bool) -> None:
        """Ends a reservation's charge: onto ``key`` if it ``stored`` the block, else gone."""
        got = self._pending.pop(id(reservation), None)
        if got is None:
            return
        owner, nbytes, racing = got
        if racing is not None:
            left = self._racing[racing] - 1
            if left:
                self._racing[racing] = left
            else:
                del self._racing[racing]
        if stored and key not in self._charged:
            self._charged[key] = (owner, nbytes)
        else:
            self._drop((owner, nbytes))

    def release(self, key: BlockKey) -> None:
        """The stored block ``key`` left the node."""
        got = self._charged.pop(key, None)
        if got is not None:
            self._drop(got)

    def _drop(self, charge: tuple[str, int]) -> None:
        owner, nbytes = charge
        left = self._used[owner] - nbytes
        if left:
            self._used[owner] = left
        else:
            del self._used[owner]

    def owner_of(self, key: BlockKey) -> str | None:
        """The tenant the stored block ``key`` is charged to (None: nobody)."""
        got = self._charged.get(key)
        return None if got is None else got[0]

    def used(self) -> dict[str, int]:
        return dict(self._used)

    def open_reservations(self) -> int:
        return len(self._pending)
