"""TierMover: runs the TierManager's two-phase moves off the request path.

Each round: plan under the owner's lock (victims leased and marked moving),
copy between tiers with no lock held, finish under the lock, then delete any
durable copies that became garbage, again without the lock.

Lock order: the owner's metadata lock, then (inside tier calls, never the other
way round) a tier's own leaf lock. The mover never holds the metadata lock
while it does I/O. Several threads may run rounds at once (a put that finds its
tier full runs one inline): a block marked moving is never planned twice.

Assumption: at most one durable tier, and it is the last (SSD).
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from tiers.manager import BlockEntry, Move, TierManager

log = logging.getLogger("kvstore.tiers.mover")

_PAGE = mmap.PAGESIZE


def leased_block_view(manager: TierManager, lock: AbstractContextManager[Any],
                      entry: BlockEntry) -> memoryview | None:
    """The bytes of a block the caller holds a lease on (or is moving).

    In place for a mapped tier; otherwise read into a new buffer without ``lock``.
    None if the copy failed its checksum: the block is then reported corrupt under
    ``lock`` (counted, and dropped from the index) and must be treated as a miss.
    """
    return leased_block_views(manager, lock, [entry])[0]


def leased_block_views(manager: TierManager, lock: AbstractContextManager[Any],
                       entries: Sequence[BlockEntry | None]) -> list[memoryview | None]:
    """``leased_block_view`` of each entry (None stays None), reading the blocks of a
    durable tier in one batch: one ``read_blocks_into`` call keeps the tier's queue
    as deep as the batch, where one call per block would read at queue depth 1.

    The batch lands in one page-aligned buffer (each block at a page boundary), so
    O_DIRECT reads go straight into it instead of through a bounce buffer.
    """
    out: list[memoryview | None] = [None] * len(entries)
    durable: dict[int, list[int]] = {}  # level -> positions
    for i, e in enumerate(entries):
        if e is None:
            continue
        if manager.is_mapped(e):
            out[i] = manager.read_view(e)
            continue
        level = manager.level_of(e)
        if level.durable:
            durable.setdefault(e.level, []).append(i)
        else:
            buf = memoryview(bytearray(e.nbytes))
            level.tier.read_into(e.extent, e.nbytes, buf)  # type: ignore[attr-defined]
            out[i] = buf
    for level_index, positions in durable.items():
        tier: Any = manager.levels[level_index].tier
        spans = [-(-entries[i].nbytes // _PAGE) * _PAGE for i in positions]  # type: ignore[union-attr]
        arena = memoryview(mmap.mmap(-1, max(sum(spans), _PAGE)))
        bufs, at = [], 0
        for i, span in zip(positions, spans, strict=True):
            bufs.append(arena[at:at + entries[i].nbytes])  # type: ignore[union-attr]
            at += span
        ok = tier.read_blocks_into([entries[i].location for i in positions],  # type: ignore[union-attr]
                                   bufs)
        corrupt = []
        for i, buf, good in zip(positions, bufs, ok, strict=True):
            if good:
                out[i] = buf
            else:
                corrupt.append(entries[i])
        if corrupt:
            with lock:
                for e in corrupt:
                    manager.report_corrupt(e)
    return out


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

    # ---- the background worker -----------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvstore-tier-mover", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def nudge(self) -> None:
        """Asks the worker for a round now (after puts push a tier past its high watermark)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            try:
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
        return moved

    # ---- rounds --------------------------------------------------------------------------

    def make_room(self, level: int, nbytes: int) -> bool:
        """Moves at least ``nbytes`` (when possible) out of ``level``; False if nothing could go."""
        with self._lock:
            moves = self._m.plan_moves(level, max(nbytes, 1))
        if not moves:
            return False
        self._execute(moves)
        return True

    def _execute(self, moves: Sequence[Move]) -> None:
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

    def wait_for_moves(self, timeout: float) -> bool:
        """Waits until no round is in flight; False if none was (nothing to wait for)."""
        with self._rounds:
            if not self._in_flight:
                return False
            self._rounds.wait_for(lambda: self._in_flight == 0, timeout)
            return True

    def delete_durable(self, garbage: Sequence[tuple[Any, Any]]) -> None:
        if not garbage:
            return
        durable = next(lv.tier for lv in self._m.levels if lv.durable)
        durable.delete(list(garbage))  # type: ignore[attr-defined]

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
        dst = m.levels[move.dst].tier
        e = move.entry
        src = m.levels[move.src]
        if src.durable and m.levels[move.dst].mapped:
            # Read straight into the destination's memory.
            out = dst.view(move.dst_extent, e.nbytes)  # type: ignore[attr-defined]
            ok = src.tier.read_blocks_into([e.location], [out])[0]  # type: ignore[attr-defined]
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
        dst = m.levels[dst_level].tier
        need = sum(mv.entry.nbytes for mv in moves)
        with self._lock:
            free = dst.capacity - dst.used
            short = m.target_bytes(dst_level, need) if dst.used + need > \
                m.watermarks.high * dst.capacity else 0
        if short or free < need:
            self.make_room(dst_level, max(short, need - free))
        items: list[tuple[Any, Any, memoryview]] = []
        sources: list[Move] = []
        for mv in moves:
            data = self._source_view(mv)
            if data is not None:
                items.append((mv.entry.key, mv.entry.parent, data))
                sources.append(mv)
        if not items:
            return
        locations = dst.write_blocks(items)  # type: ignore[attr-defined]
        for mv, loc in zip(sources, locations, strict=True):
            if loc is not None:
                mv.dst_location = loc
                mv.copied = True
