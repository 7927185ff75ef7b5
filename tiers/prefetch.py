"""Prefetch planning: bringing named blocks up to a memory tier ahead of their reads.

A caller names blocks it will read soon and a memory tier; each block below that tier
moves straight up to it by the manager's two-phase move into room below the destination's
high watermark (``TierManager.plan_up``, shared with the promotion rule). Where there is
no such room, the room is made by demoting the destination's coldest blocks
(``TierManager.plan_moves`` with ``spare``) under stricter rules than the promotion
rule's, because a prefetch is a guess about the future, not a read: it never demotes a
retained block or a block the call names, and it demotes only into room the tier below
has under its high watermark, so nothing is ever dropped from the node for it. What still
does not fit is reported (``NO_ROOM``) and left where it is. A prefetch is not a read (no
hits, no retention refresh, no count toward the promotion rule) but refreshes the
policy's recency of every block it finds (``TierManager.stamp_use``), so what it brings
up is not the destination's next victim.

Like the manager, the planner is pure and single-owner: its owner calls it under the
lock it calls the manager under (``TierManager.plan_prefetch`` and its siblings delegate
here). Invariant: the bytes in flight (``stats``) are the sum of ``plan.nbytes`` over the
plans not yet settled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import Protocol

from kvstore.core.keys import BlockKey
from kvstore.core.prefetch import PrefetchOutcome
from tiers.records import MOVING, BlockEntry, Level, Move, PrefetchPlan

FINAL_OUTCOMES = (PrefetchOutcome.PRESENT, PrefetchOutcome.PROMOTED, PrefetchOutcome.MISSING,
                  PrefetchOutcome.NO_ROOM, PrefetchOutcome.BUSY, PrefetchOutcome.UNDONE)
"""The outcomes a settled prefetch counts, each block once (QUEUED is never final)."""


class PrefetchHost(Protocol):
    """What the planner asks of the tier index (``TierManager``)."""

    levels: list[Level]

    def entry(self, key: BlockKey) -> BlockEntry | None: ...

    def stamp_use(self, entry: BlockEntry) -> None: ...

    def plan_up(self, entry: BlockEntry, dst: int) -> Move | None: ...

    def headroom(self, level: int) -> int: ...

    def plan_moves(self, level: int, nbytes: int, *,
                   spare: Collection[BlockKey] | None = None) -> list[Move]: ...


class PrefetchPlanner:
    """Plans prefetches over ``host``, bounds the bytes they have on the move, and counts
    their settled outcomes."""

    __slots__ = ("_bytes", "_host", "_settled")

    def __init__(self, host: PrefetchHost) -> None:
        self._host = host
        self._bytes = 0  # of plans not yet settled
        self._settled: Counter[PrefetchOutcome] = Counter()  # per block

    def _nbytes(self, key: BlockKey) -> int:
        entry = self._host.entry(key)
        assert entry is not None  # a waiting key was found, under the same lock
        return entry.nbytes

    def plan(self, keys: Sequence[BlockKey], level: int, *, max_bytes: int) -> PrefetchPlan:
        """Phase 1 of bringing ``keys`` up to the memory ``level`` (see the module's
        docstring): each key's outcome where it is final, moves for the blocks that fit
        now, and for the rest (in the order named: the first blocks of a prefix matter
        most) the room the rules allow, or NO_ROOM.

        At most ``max_bytes`` of blocks are planned across every unsettled plan (BUSY past
        it). The caller runs the plan (``TierMover.prefetch``) and must settle it
        (``settle``), whatever happens, or its bytes stay counted.
        """
        host = self._host
        if host.levels[level].durable:
            raise ValueError("a prefetch brings blocks up to a memory tier")
        plan = PrefetchPlan(level=level, keys=list(keys))
        outcomes = plan.outcomes
        footprint = host.levels[level].tier.footprint
        need = 0  # the waiting blocks' footprints in ``level`` (plan.nbytes: their values)
        for key in plan.keys:
            if key in outcomes:
                continue  # a repeat: one block, one outcome
            e = host.entry(key)
            if e is None:
                outcomes[key] = PrefetchOutcome.MISSING
                continue
            host.stamp_use(e)
            if e.flags & MOVING:
                outcomes[key] = PrefetchOutcome.BUSY  # on its way up or down already
            elif e.level <= level:
                outcomes[key] = PrefetchOutcome.PRESENT
            elif self._bytes + plan.nbytes + e.nbytes > max_bytes:
                outcomes[key] = PrefetchOutcome.BUSY
            else:
                move = None if plan.waiting else host.plan_up(e, level)
                if move is not None:
                    plan.moves.append(move)
                else:
                    plan.waiting.append(key)
                    need += footprint(e.nbytes)
                outcomes[key] = PrefetchOutcome.QUEUED
                plan.nbytes += e.nbytes
        if plan.waiting:
            headroom = host.headroom(level)
            if need > headroom:
                plan.room = host.plan_moves(level, need - headroom, spare=outcomes.keys())
            room = headroom + sum(footprint(m.entry.nbytes) for m in plan.room)
            taken = 0
            for key in plan.waiting:
                n = self._nbytes(key)
                if taken + footprint(n) <= room:
                    taken += footprint(n)
                else:
                    outcomes[key] = PrefetchOutcome.NO_ROOM
                    plan.nbytes -= n
            plan.waiting = [k for k in plan.waiting if outcomes[k] is PrefetchOutcome.QUEUED]
        self._bytes += plan.nbytes
        return plan

    def plan_rest(self, plan: PrefetchPlan) -> list[Move]:
        """Once the plan's room moves finished: moves for its waiting keys (added to
        ``plan.moves`` and returned); a key that no longer fits is NO_ROOM."""
        outcomes = plan.outcomes
        moves: list[Move] = []
        for key in plan.waiting:
            e = self._host.entry(key)
            if e is None:
                outcomes[key] = PrefetchOutcome.MISSING  # removed or evicted meanwhile
            elif e.flags & MOVING:
                outcomes[key] = PrefetchOutcome.BUSY
            elif e.level <= plan.level:
                outcomes[key] = PrefetchOutcome.PRESENT
            else:
                move = self._host.plan_up(e, plan.level)
                if move is None:
                    outcomes[key] = PrefetchOutcome.NO_ROOM
                else:
                    moves.append(move)
        plan.waiting = []
        plan.moves += moves
        return moves

    def settle(self, plan: PrefetchPlan) -> None:
        """Closes a plan whose moves are all finished (or never planned): each planned key
        is PROMOTED or UNDONE, every key's final outcome is counted once, and the plan's
        bytes leave the bound."""
        outcomes = plan.outcomes
        for m in plan.moves:
            outcomes[m.entry.key] = (PrefetchOutcome.PROMOTED if m.applied
                                     else PrefetchOutcome.UNDONE)
        for key in plan.waiting:  # never planned: the run ended before their room was made
            outcomes[key] = PrefetchOutcome.UNDONE
        plan.waiting = []
        self._settled.update(outcomes.values())
        self._bytes -= plan.nbytes
        plan.nbytes = 0

    def stats(self) -> dict[str, int | dict[str, int]]:
        """``prefetch_blocks`` (settled blocks per final outcome, every outcome named) and
        ``prefetch_bytes_in_flight`` (of plans not yet settled)."""
        return {"prefetch_blocks": {o.value: self._settled[o] for o in FINAL_OUTCOMES},
                "prefetch_bytes_in_flight": self._bytes}
