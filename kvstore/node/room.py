"""Room for a put that found the node's landing tier (DRAM) full.

The tier mover keeps DRAM under its high watermark by demoting to the tier below (SSD),
but puts can outrun it. A put that finds no room then makes it itself, outside the
node's lock (``TierMover.room_for``), and tries again, for as long as room can come:

* blocks left DRAM (``Room.FREED``): try again, even when puts running at once took the
  room first (a put used to give up after 8 such rounds, so under many writers puts
  failed while the SSD still had room);
* nothing could move because others were moving it (``Room.WAITED``): their moves ended,
  try again;
* nothing could move and nothing was moving, but puts not committed yet hold DRAM (a
  same-host client reserves a batch, fills it in shared memory, then commits): wait for
  one of them to be committed or aborted (then its block can move), unless the only such
  reservations are the caller's own, which cannot end while it waits;
* moves were planned but none took effect (``Room.UNDONE``: the tier below is full of
  blocks it may not drop) ``FRUITLESS_ROUNDS`` times in a row, or nothing could move and
  nobody else holds a reservation: the node is full (``ResourceExhausted``).

Every wait ends by ``ROOM_WAIT_S`` after the put first found DRAM full.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from kvstore.core.errors import ResourceExhausted
from tiers.manager import NeedsRoom, TierManager
from tiers.mover import Room, TierMover

ROOM_WAIT_S = 10.0
"""How long a put that finds DRAM full keeps making room, or waiting for it, at most."""

FRUITLESS_ROUNDS = 8
"""Rounds in a row whose planned moves all were undone before a put gives up."""


@dataclass(slots=True, kw_only=True)
class RoomTries:
    """One put's attempts at room: its deadline and its fruitless rounds in a row."""

    deadline: float
    fruitless: int = 0


class PutRoom:
    """Makes, or waits for, room for puts (see the module docstring). Thread-safe: the
    owner's ``lock`` guards the manager; a leaf condition counts settled reservations."""

    def __init__(self, manager: TierManager, lock: AbstractContextManager[Any],
                 mover: TierMover, *, wait_s: float | None = None) -> None:
        self._m = manager
        self._lock = lock
        self._mover = mover
        self._wait_s = ROOM_WAIT_S if wait_s is None else wait_s
        self._cond = threading.Condition(threading.Lock())
        self._settled = 0  # guarded by _cond: reservations committed or aborted so far
        self._waiting = 0  # guarded by _cond: puts waiting for one

    def settled(self) -> None:
        """A reservation was committed or aborted (called after, outside the owner's lock)."""
        with self._cond:
            self._settled += 1
            if self._waiting:
                self._cond.notify_all()

    def start(self) -> RoomTries:
        return RoomTries(deadline=time.monotonic() + self._wait_s)

    def make(self, need: NeedsRoom, tries: RoomTries, *, holding: int = 0) -> None:
        """One round of room for a put that got ``need``; returns when it is worth trying
        the put again, raises ResourceExhausted when no room will come. ``holding``: bytes
        of reservations the caller itself holds (they cannot end while it waits)."""
        now = time.monotonic()
        left = tries.deadline - now
        if left <= 0:
            raise ResourceExhausted(f"no room within {self._wait_s:g} s: the room made by "
                                    "demoting blocks kept going to other puts")
        with self._cond:
            mark = self._settled  # before the plan: a commit after it is never missed
        with self._lock:
            size = self._m.levels[need.level].tier.footprint(need.nbytes)
            want = self._m.target_bytes(need.level, size)
        room = self._mover.room_for(need.level, max(want, size), timeout=left)
        tries.fruitless = tries.fruitless + 1 if room is Room.UNDONE else 0
        if tries.fruitless >= FRUITLESS_ROUNDS:
            raise ResourceExhausted("no room: the tier below has no room for the blocks "
                                    "that could move (retained, pinned or being read)")
        if room is not Room.NONE:
            return
        with self._lock:
            others = self._m.reserved_bytes - holding
        if others <= 0:
            raise ResourceExhausted("no room: every block that could move is pinned or "
                                    "being read")
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: self._settled != mark, left)
            finally:
                self._waiting -= 1
