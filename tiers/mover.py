"""TierMover: runs the TierManager's two-phase moves off the request path.

Each round: plan under the owner's lock (victims leased and marked moving),
copy between tiers with no lock held, finish under the lock, then delete any
durable copies that became garbage, again without the lock. A round ends by
handing the durable tier the retention deadlines that changed (``flush_retention``),
so a restart finds them.

Lock order: the owner's metadata lock, then (inside tier calls, never the other
way round) a tier's own leaf lock. The mover never holds the metadata lock
while it does I/O. Several threads may run rounds at once (a put that finds its
tier full runs one inline): a block marked moving is never planned twice.

Prefetches (``TierManager.plan_prefetch``) run here too: inline for a caller that waits
(``prefetch``), or on the worker (``submit_prefetch``), ahead of its rounds. A plan's
blocks are leased and marked moving from the moment it is planned, so a queued plan is
run or undone (``stop``), never left holding them.

Assumption: at most one durable tier, and it is the last (SSD).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from kvstore.core.keys import BlockKey
from tiers.base import DurableCopy
from tiers.manager import Move, PrefetchPlan, TierManager

# Re-exported: they lived here before tiers.reads, and callers import them from here.
from tiers.reads import leased_block_view as leased_block_view
from tiers.reads import leased_block_views as leased_block_views

log = logging.getLogger("kvstore.tiers.mover")

WRITE_PASSES = 8
"""Writes of one demotion batch to the durable tier at most: after each, the blocks that
did not fit in one piece get more room made for them (``_copy_to_durable``)."""


class Room(enum.Enum):
    """What ``TierMover.room_for`` did for a put that found its tier full."""

    FREED = "freed"  # blocks left the tier: try the put again
    WAITED = "waited"  # nothing could move now, but moves were in flight: they ended
    UNDONE = "undone"  # moves were planned, none took effect (the tier below had no room)
    NONE = "none"  # nothing could move and nothing was moving: the tier is full


class TierMover:
    """Demotes past the high watermark, promotes queued hot blocks, deletes dropped copies."""

    def __init__(self, manager: TierManager, lock: AbstractContextManager[Any], *,
                 interval: float = 0.05, promotion_batch: int = 64) -> None:
        self._m = manager
        self._lock = lock
        self._interval = interval
        self._promotion_batch = promotion_batch
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Rounds whose moves are in flight, and a signal when one ends: a put that
        # finds every victim already moving waits for them instead of failing.
        self._rounds = threading.Condition(threading.Lock())
        self._in_flight = 0  # guarded by _rounds
        self._plans: deque[PrefetchPlan] = deque()  # guarded by _rounds: for the worker
        self._stopped = False  # guarded by _rounds: no worker will run a plan any more

    # ---- the background worker -----------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvstore-tier-mover", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._rounds:
            self._stopped = True
            left = list(self._plans)
            self._plans.clear()
        for plan in left:
            self._undo(plan)

    def nudge(self) -> None:
        """Asks the worker for a round now (after puts push a tier past its high watermark)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            try:
                self.run_prefetches()
                self.run_once()
            except Exception:  # a failed round must not end the worker
                log.exception("tier mover round failed")

    def run_once(self) -> bool:
        """One round: drain every tier past its high watermark, then promote. True if it moved."""
        moved = False
        with self._lock:
            levels = self._m.over_high()
        for level in levels:
            with self._lock:
                need = self._m.target_bytes(level)
            moved |= self.make_room(level, need)
        with self._lock:
            promotions, blocked = self._m.plan_promotions(self._promotion_batch)
        if promotions:
            self._execute(promotions)
            moved = True
        if blocked is not None:
            # Room for the next promotion; it goes in the following round.
            moved |= self.make_room(*blocked)
        self.flush_retention()
        return moved

    # ---- prefetches ----------------------------------------------------------------------

    def prefetch(self, plan: PrefetchPlan) -> None:
        """Runs a planned prefetch and settles it: the room it makes first (demotions),
        then its moves up, the waiting keys' planned once that room exists. Whatever
        fails, every move it planned is finished (undone if not copied) and the plan is
        settled, so no lease, reservation or byte of its bound outlives the call."""
        pending = list(plan.moves)  # planned at once; they wait for the room's I/O
        garbage: list[DurableCopy] = []
        try:
            if plan.room:
                self._execute(plan.room)
            with self._lock:
                pending += self._m.plan_prefetch_rest(plan)
            moves, pending = pending, []
            if moves:
                self._execute(moves)
        finally:
            with self._lock:
                if pending:  # never copied: finishing them undoes them
                    garbage = self._m.finish_moves(pending)
                self._m.settle_prefetch(plan)
            self.delete_durable(garbage)

    def submit_prefetch(self, plan: PrefetchPlan) -> None:
        """Hands a plan to the worker, which runs it ahead of its next round (undone if the
        mover has stopped)."""
        with self._rounds:
            stopped = self._stopped
            if not stopped:
                self._plans.append(plan)
        if stopped:
            self._undo(plan)
        else:
            self._wake.set()

    def run_prefetches(self) -> int:
        """Runs the submitted plans, oldest first (the worker's job; tests call it on a
        mover never started). How many ran."""
        n = 0
        while True:
            with self._rounds:
                if not self._plans:
                    return n
                plan = self._plans.popleft()
            try:
                self.prefetch(plan)
            except Exception:  # one failed plan must not strand the ones behind it
                log.exception("prefetch failed")
            n += 1

    def _undo(self, plan: PrefetchPlan) -> None:
        """Finishes a plan none of whose moves ran: each is undone, the plan settled."""
        with self._lock:
            garbage = self._m.finish_moves([*plan.room, *plan.moves])
            self._m.settle_prefetch(plan)
        self.delete_durable(garbage)

    def flush_retention(self) -> int:
        """Hands the durable tier the retention deadlines that changed since the last
        flush (reads, puts, arrivals); how many entries it updated."""
        with self._lock:
            updates = self._m.drain_retention_updates()
        if not updates:
            return 0
        durable = next(lv.durable_tier for lv in self._m.levels if lv.durable_tier is not None)
        return durable.update_retention(updates)

    # ---- rounds --------------------------------------------------------------------------

    def make_room(self, level: int, nbytes: int) -> bool:
        """Moves at least ``nbytes`` (when possible) out of ``level``; False if no block
        left it (nothing could go, or every move planned was undone)."""
        return self.room_for(level, nbytes, timeout=0.0) is Room.FREED

    def room_for(self, level: int, nbytes: int, *, timeout: float) -> Room:
        """``make_room`` for a put that found ``level`` full. Where nothing can move because
        the blocks that could are being moved by others (another put, a round, a prefetch),
        waits up to ``timeout`` for those moves instead of answering that nothing could go:
        whether any move is in flight is read under the owner's lock together with the
        plan, so a move that ends between the two is never mistaken for a full tier."""
        with self._lock:
            moves = self._m.plan_moves(level, max(nbytes, 1))
            busy = not moves and self._m.moves_in_flight > 0
        if moves:
            return Room.FREED if self._execute(moves) else Room.UNDONE
        if not busy:
            return Room.NONE
        if timeout > 0:
            self.wait_for_moves(timeout)
        return Room.WAITED

    def _execute(self, moves: Sequence[Move]) -> int:
        """Copies and finishes ``moves``; how many took effect (the others were undone)."""
        with self._rounds:
            self._in_flight += 1
        try:
            self._copy(moves)
        finally:
            with self._lock:
                garbage = self._m.finish_moves(moves)
            with self._rounds:
                self._in_flight -= 1
                self._rounds.notify_all()
            self.delete_durable(garbage)
        return sum(m.applied for m in moves)

    def wait_for_moves(self, timeout: float) -> bool:
        """Waits until no round is in flight; False if none was (nothing to wait for)."""
        with self._rounds:
            if not self._in_flight:
                return False
            self._rounds.wait_for(lambda: self._in_flight == 0, timeout)
            return True

    def delete_durable(self, garbage: Sequence[DurableCopy]) -> None:
        if not garbage:
            return
        durable = next(lv.store for lv in self._m.levels if lv.durable)
        durable.delete(list(garbage))

    def _copy(self, moves: Sequence[Move]) -> None:
        m = self._m
        to_durable: list[Move] = []
        for move in moves:
            if move.dst is None:
                move.copied = True  # a drop: nothing to copy
            elif m.levels[move.dst].durable:
                to_durable.append(move)
            else:
                self._copy_to_memory(move)
        if to_durable:
            self._copy_to_durable(to_durable)

    def _source_view(self, move: Move) -> memoryview | None:
        return leased_block_view(self._m, self._lock, move.entry)

    def _copy_to_memory(self, move: Move) -> None:
        m = self._m
        assert move.dst is not None and move.dst_extent is not None
        dst_level = m.levels[move.dst]
        dst = dst_level.tier
        e = move.entry
        src = m.levels[move.src]
        if src.durable and dst_level.mapped:
            # Read straight into the destination's memory.
            out = dst_level.memory.view(move.dst_extent, e.nbytes)
            ok = src.store.read_blocks_into([e.location], [out])[0]
            if not ok:
                with self._lock:
                    m.report_corrupt(e)
            move.copied = ok
            return
        data = self._source_view(move)
        if data is None:
            return
        dst.write(move.dst_extent, data)
        move.copied = True

    def _copy_to_durable(self, moves: Sequence[Move]) -> None:
        m = self._m
        dst_level = moves[0].dst
        assert dst_level is not None
        dst = m.levels[dst_level].store
        # The space the blocks take there (header pages and alignment), not their values.
        need = sum(dst.footprint(mv.entry.nbytes) for mv in moves)
        with self._lock:
            free = dst.capacity - dst.used
            short = m.target_bytes(dst_level, need) if dst.used + need > \
                m.watermarks.high * dst.capacity else 0
        drops = not any(mv.no_drops for mv in moves)
        if (short or free < need) and drops:
            self.make_room(dst_level, max(short, need - free))
        pending = list(moves)
        for _ in range(WRITE_PASSES):
            failed = self._write_durable(pending)
            if not failed or not drops:
                return
            # The tier had the bytes, but not in one piece: the blocks dropped for them were
            # of other sizes (a node serves several models, each with its block size), and
            # the pieces did not join. Drop as much again, and write those again.
            if not self.make_room(dst_level, sum(dst.footprint(mv.entry.nbytes)
                                                 for mv in failed)):
                return
            pending = failed

    def _write_durable(self, moves: Sequence[Move]) -> list[Move]:
        """Writes the moves' blocks to the durable tier in one batch; the moves whose block
        did not fit there."""
        m = self._m
        dst_level = moves[0].dst
        assert dst_level is not None
        items: list[tuple[BlockKey, BlockKey | None, memoryview]] = []
        sources: list[Move] = []
        for mv in moves:
            data = self._source_view(mv)
            if data is not None:
                items.append((mv.entry.key, mv.entry.parent, data))
                sources.append(mv)
        if not items:
            return []
        with self._lock:  # each block's deadline goes with it, for a restart to find
            kept = [m.retention.kept(mv.entry.key) for mv in sources]
        locations = m.levels[dst_level].store.write_blocks(items, kept)
        failed = []
        for mv, loc in zip(sources, locations, strict=True):
            if loc is not None:
                mv.dst_location = loc
                mv.copied = True
            else:
                failed.append(mv)
        return failed
