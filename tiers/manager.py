"""TierManager: which block lives in which tier, and what moves when space runs out.

The manager is pure and single-owner, like an allocator: no I/O, no locks, no
threads. Its owner (the node) calls it under one lock and does every byte copy
outside that lock, holding a *reservation* (space being filled by a put) or a
*read lease* (a block being read or moved). That split lets readers, writers
and the tier mover move bytes in parallel while the index stays consistent.

Tiers are ordered fastest first (e.g. HBM, DRAM, SSD). New blocks land in the
*landing* tier (DRAM: the tier network transfers read and write in place).

Moves between tiers are two-phase (``plan_moves`` / ``plan_promotions``, copy,
``finish_moves``), run by ``tiers.mover.TierMover`` off the request path:

1. plan, under the owner's lock: pick victims by policy, mark them ``moving``,
   take a read lease on each (so their bytes cannot be freed while copied), and
   reserve destination space where the destination is memory;
2. copy, without the lock;
3. finish, under the lock: a move takes effect only if the block is still
   indexed and the mover is its only reader; otherwise it is undone (the
   destination copy is returned for deletion) and the block stays where it was.

Demotion sends a tier's victims to the next tier; the last tier drops them.
Promotion rule: a block read twice since it entered a tier below the top is
queued to move one tier up. When the destination has no room below its high
watermark, the mover first demotes the destination's coldest blocks (a block
read twice is hotter than the tail of the tier above), then promotes.

Prefetch (``plan_prefetch``, planned by ``tiers.prefetch.PrefetchPlanner``): a caller
names blocks it will read soon and a memory tier; each moves up by the same two-phase move
(``plan_up``, the one rule of every move up), into room whose making never drops a block
from the node.

Invariants, checked by tests:

* a key is in the index only after its put committed, so no reader sees a
  partial block; an aborted reservation returns its extent at once;
* a block with readers is never freed nor moved: eviction defers it, ``remove``
  unlinks it but frees its space when the last lease ends;
* pinned blocks are never evicted or demoted (only removed explicitly);
* retained blocks (``tiers.retention``) may be demoted but are never dropped from the
  last tier while retained; a prefetch never demotes them; a retained block in a durable
  tier whose deadline changed (a read, a put, its arrival there) is queued for its tier to
  record (``drain_retention_updates``);
* for every key ``P``: ``_blocks[P].children`` (or ``_orphans[P]`` while ``P``
  is absent) equals the number of indexed blocks whose parent is ``P``; the
  prefix-aware policy evicts only blocks with no children;
* each indexed block is queued (if eligible) in its own tier's queue only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent
from tiers.base import DurableCopy, Tier
from tiers.block_table import BlockTable, make_table
from tiers.errors import BlockTooLarge, OutOfSpace
from tiers.observer import TierObserver
from tiers.policy import Eligibility, EvictionPolicy, EvictionQueue, make_policy
from tiers.prefetch import PrefetchPlanner
from tiers.records import (
    MOVING,
    PINNED,
    UNLINKED,
    BlockEntry,
    Level,
    Move,
    NeedsRoom,
    PrefetchPlan,
    Reservation,
    TierCounters,
    Watermarks,
)
from tiers.retention import RetainAsk, Retention, RetentionBook

PROMOTE_AFTER_HITS = 2

AdoptedBlock = tuple[BlockKey, BlockKey | None, int, Any, Retention | None]
"""What ``TierManager.adopt_many`` indexes of a block a durable tier kept: its key, its
parent, its value's bytes, its location in that tier, and its retention."""

SPARE_SCAN = 8192
"""Most spared blocks (retained, or named by the call) one prefetch's room looks past for
its victims. Under the node's lock, on every prefetch: a DRAM full of retained blocks
must not cost a scan of all of them each time. Past it the prefetch reports no room."""


class _ScanBound(Exception):
    """A prefetch's room looked past ``SPARE_SCAN`` spared blocks (``plan_moves``)."""

__all__ = ["AdoptedBlock", "BlockEntry", "Level", "Move", "NeedsRoom", "PrefetchPlan",
           "Reservation", "TierCounters", "TierManager", "Watermarks"]



@dataclass(slots=True, kw_only=True)
class _State:
    blocks: BlockTable  # key -> entry, and the entries' queues (``tiers.block_table``)
    orphans: dict[BlockKey, int] = field(default_factory=dict)
    evicted: list[BlockKey] = field(default_factory=list)  # events for the owner to drain
    promote: dict[BlockKey, None] = field(default_factory=dict)  # ordered set
    # Durable blocks whose retention changed since their tier last recorded it.
    kept_dirty: dict[BlockKey, None] = field(default_factory=dict)


class TierManager:
    """Index, two-phase puts, read leases, eviction and moves over ordered tiers."""

    def __init__(
        self,
        tiers: Tier | Sequence[Tier],
        policy: EvictionPolicy,
        *,
        watermarks: Watermarks | None = None,
        landing: int | None = None,
        durable: Sequence[bool] | None = None,
        retention: RetentionBook | None = None,
        index: str | None = None,
    ) -> None:
        """``index``: ``"python"`` or ``"native"`` (``tiers.block_table.make_table``)."""
        tier_list = [tiers] if not isinstance(tiers, Sequence) else list(tiers)
        if not tier_list:
            raise ValueError("a TierManager needs at least one tier")
        flags: list[bool | None] = [None] * len(tier_list) if durable is None else list(durable)
        self.policy = policy
        self.watermarks = watermarks or Watermarks()
        # One clock stamps accesses (``last_access``) and orders every queue's pushes:
        # an access pushed at once uses its tick as the heap seq (one int, not two).
        self._clock = itertools.count(1)
        self._s = _State(blocks=make_table(index))
        # The first tier uses the given policy object (tests inspect its state);
        # the others get fresh instances of the same policy.
        # ``durable`` (tests) overrides what each tier's protocol says.
        self.levels = [Level.of(t, self._s.blocks.make_queue(
            policy if i == 0 else make_policy(policy.name), clock=self._clock, level=i),
            durable=flags[i]) for i, t in enumerate(tier_list)]
        if landing is None:
            landing = next((i for i, lv in enumerate(self.levels) if lv.tier.name == "dram"), 0)
        if not self.levels[landing].mapped:
            raise ValueError("the landing tier must be addressable memory")
        self.landing = landing
        # Retained blocks (``tiers.retention``): demotable, but never dropped while held.
        self.retention = retention if retention is not None else RetentionBook()
        self.observer: TierObserver | None = None  # told of commits, unlinks and moves
        self._moving = 0  # blocks marked moving: planned moves not finished yet
        self._reserved = 0  # bytes of the landing tier held by puts not committed yet
        self.prefetches = PrefetchPlanner(self)  # plans, their byte bound, settled counts
        self._end_read = self._s.blocks.end_read  # bound once: one call per lease
        # The native table runs ``acquire_read``'s hit path in one C call when the queues
        # order by recency (``NativeBlockTable.read_hit``); None: the Python path.
        self._read_hit: Callable[..., tuple[BlockEntry, int, bool] | None] | None = \
            getattr(self._s.blocks, "read_hit", None) if policy.by_recency else None
        # And indexes a new block in one (``NativeBlockTable.insert``), on the same terms.
        self._insert: Callable[..., bool] | None = \
            getattr(self._s.blocks, "insert", None) if policy.by_recency else None

    # ---- single-tier compatibility ---------------------------------------------------------

    @property
    def tier(self) -> Tier:
        return self.levels[self.landing].tier

    @property
    def counters(self) -> TierCounters:
        return self.levels[self.landing].counters

    # ---- queries -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._s.blocks)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._s.blocks

    def keys(self) -> list[BlockKey]:
        return list(self._s.blocks)

    def entry(self, key: BlockKey) -> BlockEntry | None:
        """The entry of ``key`` without counting an access (for tests and stats)."""
        return self._s.blocks.get(key)

    def prefix_length(self, keys: list[BlockKey]) -> int:
        return self._s.blocks.prefix_length(keys)

    def is_mapped(self, entry: BlockEntry) -> bool:
        return self.levels[entry.level].mapped

    def level_of(self, entry: BlockEntry) -> Level:
        return self.levels[entry.level]

    def _has_lower(self, level: int) -> bool:
        return level + 1 < len(self.levels)

    def _needs_mover(self, level: int) -> bool:
        """Whether making room in ``level`` takes I/O (a lower tier or a durable tier)."""
        return self._has_lower(level) or self.levels[level].durable

    # ---- puts ----------------------------------------------------------------------------

    def reserve(
        self, key: BlockKey, nbytes: int, *, parent: BlockKey | None = None, pin: bool = False,
        retain: RetainAsk | None = None,
    ) -> Reservation | None:
        """Space in the landing tier for a new block, or None if ``key`` is already stored.

        With no tier below it, evicts by policy when the allocation would pass the
        high watermark. With one, raises NeedsRoom when nothing fits: the owner
        then demotes outside its lock (``TierMover.make_room``) and retries.
        Raises BlockTooLarge if it could never fit, OutOfSpace if everything left
        is pinned, being read or being written.
        """
        if nbytes <= 0:
            raise ValueError(f"block size must be positive, got {nbytes}")
        if key in self._s.blocks:
            if retain is not None:  # a put of a stored block refreshes its retention
                entry = self._s.blocks[key]
                if self.retention.grant(key, entry.nbytes, retain):
                    self._note_kept(entry)
            return None
        level = self.landing
        lv = self.levels[level]
        tier = lv.tier
        capacity = tier.capacity
        if nbytes > capacity:
            raise BlockTooLarge(f"block of {nbytes} bytes exceeds {tier.name} tier capacity "
                                f"{capacity}")
        if level + 1 < len(self.levels) or lv.durable:  # _needs_mover(level), inlined
            extent = tier.allocate(nbytes)
            if extent is None:
                raise NeedsRoom(level, nbytes)
            self._reserved += extent.length
            return Reservation(key=key, parent=parent, nbytes=nbytes, extent=extent, pin=pin,
                               retain=retain)
        # The parent of the block being written stays: evicting it would strand its child.
        protect = parent
        size = tier.footprint(nbytes)  # in the tier's used bytes, alignment included
        if tier.used + size > self.watermarks.high * capacity:
            # Until ``tier.used + size <= low``, as a threshold (no callback per victim).
            self._evict_until(level, None, strict=False, protect=protect,
                              until_used=self.watermarks.low * capacity - size)
        extent = tier.allocate(nbytes)
        if extent is None:
            # Fragmentation or reservations in flight: keep evicting until it fits.
            holder: list[Extent] = []

            def fits() -> bool:
                got = tier.allocate(nbytes)
                if got is not None:
                    holder.append(got)
                return got is not None

            self._evict_until(level, fits, strict=True, protect=protect)
            extent = holder[0]
        self._reserved += extent.length
        return Reservation(key=key, parent=parent, nbytes=nbytes, extent=extent, pin=pin,
                           retain=retain)

    def fill_view(self, reservation: Reservation) -> memoryview:
        """Where the put's bytes go; valid until commit or abort."""
        return self.levels[self.landing].memory.view(reservation.extent, reservation.nbytes)

    def commit(self, reservation: Reservation) -> bool:
        """Publishes the block; False (and the space returned) if another put of the key won."""
        s = self._s
        blocks = s.blocks
        key = reservation.key
        level = self.levels[self.landing]
        self._reserved -= reservation.extent.length
        if key in blocks:
            level.tier.free(reservation.extent)
            if reservation.retain is not None:
                self.retention.grant(key, blocks[key].nbytes, reservation.retain)
            return False
        parent, nbytes = reservation.parent, reservation.nbytes
        self._index_new(key, parent, nbytes, self.landing, next(self._clock),
                        extent=reservation.extent, pinned=reservation.pin)
        if reservation.retain is not None:
            self.retention.grant(key, nbytes, reservation.retain)
        if self.observer is not None:
            self.observer.stored(key, parent, self.landing)
        level.counters.puts += 1
        level.counters.bytes_in += nbytes
        return True

    def abort(self, reservation: Reservation) -> None:
        self._reserved -= reservation.extent.length
        self.levels[self.landing].tier.free(reservation.extent)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the landing tier held by reservations not committed nor aborted yet
        (no move can free them: they are not blocks yet)."""
        return self._reserved

    def adopt(self, key: BlockKey, parent: BlockKey | None, nbytes: int, *, level: int,
              location: Any, retention: Retention | None = None) -> bool:
        """Indexes a block already stored in a durable tier (restart recovery), retained
        until the deadline it kept if that has not passed."""
        return self.adopt_many(level, [(key, parent, nbytes, location, retention)]) == 1

    def adopt_many(self, level: int, blocks: Iterable[AdoptedBlock]) -> int:
        """``adopt`` of each (key, parent, nbytes, location, retention) at ``level``, in
        order; how many were indexed (a key indexed already is skipped, as ``adopt``
        skips it). A restart's thousands to millions of blocks take this path: the level's
        queue is compacted once, after them, not checked after each."""
        table, clock, restore = self._s.blocks, self._clock, self.retention.restore
        index_new = self._index_new
        adopted = 0
        for key, parent, nbytes, location, retention in blocks:
            if key in table:
                continue
            index_new(key, parent, nbytes, level, next(clock), location=location,
                      compact=False)
            if retention is not None:
                restore(key, nbytes, retention)
            adopted += 1
        self._compact(level)
        return adopted

    def retain(self, key: BlockKey, ask: RetainAsk) -> bool | None:
        """Retains the stored block ``key`` as a put of it with ``ask`` would: True if
        retained, False if a cap refused it, None if not stored (``tiers.retention``)."""
        entry = self._s.blocks.get(key)
        if entry is None:
            return None
        if not self.retention.grant(key, entry.nbytes, ask):
            return False
        self._note_kept(entry)
        return True

    def release(self, key: BlockKey) -> bool:
        """Ends the stored block ``key``'s retention now (it rejoins eviction); False if not
        stored."""
        entry = self._s.blocks.get(key)
        if entry is None:
            return False
        if self.retention.release(key):
            self._note_kept(entry)
        return True

    def _note_kept(self, entry: BlockEntry) -> None:
        """Queues a durable block's changed retention for its tier to record."""
        if self.levels[entry.level].durable:
            self._s.kept_dirty[entry.key] = None

    def drain_retention_updates(self) -> list[tuple[BlockKey, Any, Retention | None]]:
        """(key, location, retention) of the durable blocks whose retention changed since
        the last call, for their tier's ``update_retention`` (I/O: outside the lock)."""
        s = self._s
        if not s.kept_dirty:
            return []
        out = []
        for key in s.kept_dirty:
            e = s.blocks.get(key)
            if (e is not None and self.levels[e.level].durable_tier is not None
                    and e.location is not None):
                out.append((key, e.location, self.retention.kept(key)))
        s.kept_dirty = {}
        return out

    def _index_new(self, key: BlockKey, parent: BlockKey | None, nbytes: int, level: int,
                   tick: int, *, extent: Extent | None = None, location: Any = None,
                   pinned: bool = False, compact: bool = True) -> None:
        """Indexes a new block whose last access is ``tick``, just drawn from the clock: its
        entry (with the children counted while it was an orphan's parent), its count as
        its parent's child, its place in its level's queue unless pinned (``compact``:
        False where the caller compacts that queue itself)."""
        s = self._s
        orphans = s.orphans
        children = orphans.get(key, 0) if orphans else 0
        lv = self.levels[level]
        if self._insert is not None:  # one C call (NativeBlockTable.insert), same rules
            counted = self._insert(key=key, parent=parent, nbytes=nbytes, level=level,
                                   tick=tick, extent=extent, location=location,
                                   pinned=pinned, children=children)
            if children:
                del orphans[key]
            lv.blocks += 1
            if parent is not None and not counted:
                self._count_orphan(parent)
            return
        entry = s.blocks.new_entry(key=key, parent=parent, nbytes=nbytes, level=level,
                                   extent=extent, location=location, pinned=pinned,
                                   last_access=tick, children=children)
        s.blocks[key] = entry
        if children:
            del orphans[key]
        lv.blocks += 1
        if parent is not None:
            self._add_child(parent)
        if not pinned:
            lv.queue.push(key, entry, tick)
            if compact:
                self._compact(level)

    # ---- reads ---------------------------------------------------------------------------

    def acquire_read(self, key: BlockKey, *, access: bool = True) -> BlockEntry | None:
        """A read lease on ``key`` (counted as a hit), or None (a miss).

        ``access=False`` leases without counting a hit, a miss or recency, and never
        promotes: for copies the cluster makes (replication, repair), which are not reads
        of the block by a user. The caller must hand the entry to ``release_read`` exactly
        once.
        """
        s = self._s
        if access and self._read_hit is not None:
            return self._native_read(key)
        entry = s.blocks.get(key)
        if not access:
            if entry is not None:
                entry.readers += 1
            return entry
        if entry is None:
            self.levels[self.landing].counters.misses += 1
            return None
        entry.readers += 1
        entry.hits += 1
        entry.tier_hits += 1
        tick = next(self._clock)
        entry.last_access = tick
        level = self.levels[entry.level]
        if self.retention.held and self.retention.touch(key) and level.durable:
            s.kept_dirty[key] = None
        # An indexed entry is never unlinked: any flag means pinned or moving.
        if not (entry.flags or (self.policy.leaves_only and entry.children > 0)):
            level.queue.push(key, entry, tick)
            self._compact(entry.level)
        if entry.level > 0 and entry.tier_hits >= PROMOTE_AFTER_HITS and \
                not entry.flags & MOVING:
            s.promote[key] = None
        level.counters.hits += 1
        level.counters.bytes_out += entry.nbytes
        return entry

    def _native_read(self, key: BlockKey) -> BlockEntry | None:
        """``acquire_read``'s path above, its entry's part in C (``read_hit``: the same
        rules, run by the same tests). The tick is drawn before the lookup: a miss skips
        one, which orders nothing differently."""
        assert self._read_hit is not None
        hit = self._read_hit(key, next(self._clock), leaves_only=self.policy.leaves_only,
                             promote_after=PROMOTE_AFTER_HITS)
        if hit is None:
            self.levels[self.landing].counters.misses += 1
            return None
        entry, at, promote = hit
        level = self.levels[at]
        if self.retention.held and self.retention.touch(key) and level.durable:
            self._s.kept_dirty[key] = None
        if promote:
            self._s.promote[key] = None
        level.counters.hits += 1
        level.counters.bytes_out += entry.nbytes
        return entry

    def read_view(self, entry: BlockEntry) -> memoryview:
        """The bytes of a block in a memory-mapped tier (see ``is_mapped``)."""
        extent = entry.extent
        assert extent is not None  # a leased block of a memory tier holds its extent
        return self.levels[entry.level].memory.view(extent, entry.nbytes)

    def release_read(self, entry: BlockEntry) -> DurableCopy | None:
        """Ends a lease. Returns a durable copy to delete (outside the lock), or None."""
        return self._free_space(entry) if self._end_read(entry) else None

    def report_corrupt(self, entry: BlockEntry) -> None:
        """A read found the block torn or corrupted: it leaves the index (freed on release)."""
        self.levels[entry.level].counters.checksum_failures += 1
        if not entry.flags & UNLINKED:
            self._unlink(entry)

    # ---- removal and eviction ------------------------------------------------------------

    def remove(self, key: BlockKey) -> bool | DurableCopy:
        """Unlinks ``key``. False if absent; True, or the durable copy to delete (outside
        the lock), if removed."""
        entry = self._s.blocks.get(key)
        if entry is None:
            return False
        gone = self._unlink(entry)
        return True if gone is None else gone

    def _unlink(self, entry: BlockEntry) -> DurableCopy | None:
        s = self._s
        key, level = entry.key, entry.level
        s.blocks.unlink(entry)  # out of the index and its queue, flagged UNLINKED
        self.levels[level].blocks -= 1
        if s.promote:
            s.promote.pop(key, None)
        if self.retention.held:
            self.retention.forget(key)
        children = entry.children
        if children:
            s.orphans[key] = s.orphans.get(key, 0) + children
        parent = entry.parent
        if parent is not None:
            self._drop_child(parent)
        if self.observer is not None:
            self.observer.removed(key, level)
        if entry.readers == 0:
            length = entry.length
            if length:  # the memory-tier case of ``_free_space``, inlined
                self.levels[level].tier.free(Extent(entry.place, length))
                entry.place = None
                entry.length = 0
                s.blocks.retire(entry)
                return None
            return self._free_space(entry)
        return None

    def _free_space(self, entry: BlockEntry) -> DurableCopy | None:
        """Frees a memory extent now; returns a durable copy for the owner to delete. An
        unlinked entry is then retired (``BlockTable.retire``): nothing reads it again."""
        location, level = entry.place, entry.level
        entry.place = None
        length, entry.length = entry.length, 0
        if entry.flags & UNLINKED:
            self._s.blocks.retire(entry)
        if length:
            self.levels[level].tier.free(Extent(location, length))
            return None
        return DurableCopy(entry.key, location) if location is not None else None

    def _held_by_children(self, entry: BlockEntry) -> bool:
        return self.policy.leaves_only and entry.children > 0

    def _eligibility(self, entry: BlockEntry) -> Eligibility:
        if entry.flags or self._held_by_children(entry):  # pinned or moving
            return Eligibility.DROP
        if entry.readers:
            return Eligibility.DEFER
        return Eligibility.EVICT

    def _drop_eligibility(self, entry: BlockEntry) -> Eligibility:
        """As ``_eligibility``, for a drop from the last tier: a retained block leaves the
        queue (so rounds never rescan it) until ``_requeue_expired`` puts it back."""
        verdict = self._eligibility(entry)
        if verdict is Eligibility.EVICT and self.retention.retains(entry.key):
            return Eligibility.DROP
        return verdict

    def _requeue_expired(self) -> None:
        """Blocks whose retention ended rejoin their tier's queue at their policy priority
        (for LRU their last access), so they leave in plain policy order."""
        blocks = self._s.blocks
        for key in self.retention.drain_ended():
            e = blocks.get(key)
            if e is not None and not e.flags and not e.queue_seq and \
                    not self._held_by_children(e):
                self.levels[e.level].queue.push(key, e)

    def _evict_until(self, level: int, done: Callable[[], bool] | None, *, strict: bool,
                     protect: BlockKey | None = None, until_used: float = 0.0) -> None:
        """Drops victims of a memory-only last tier until ``done()`` (no I/O involved).

        With ``done`` None, until the tier's used bytes are at most ``until_used``.
        """
        s = self._s
        lv = self.levels[level]
        tier = lv.tier
        blocks = s.blocks
        queue = lv.queue
        leaves_only = self.policy.leaves_only
        retains = self.retention.retains
        self._requeue_expired()
        deferred: list[tuple[float, int, BlockKey]] = []

        def eligibility(entry: BlockEntry) -> Eligibility:
            # ``_eligibility`` inlined, after the protection of the put's parent.
            flags = entry.flags
            if entry.key == protect and not flags & PINNED:
                return Eligibility.DEFER
            if flags or (leaves_only and entry.children > 0):  # pinned or moving
                return Eligibility.DROP
            if retains(entry.key):
                return Eligibility.DROP  # back in the queue when it expires
            if entry.readers:
                return Eligibility.DEFER
            return Eligibility.EVICT

        try:
            while (tier.used > until_used) if done is None else not done():
                key = queue.pop_victim(blocks, eligibility, deferred)
                if key is None:
                    if strict:
                        raise OutOfSpace(
                            f"{lv.tier.name} tier full: {lv.tier.used} of "
                            f"{lv.tier.capacity} bytes are pinned, retained, being read or "
                            f"being written")
                    return
                self._unlink(blocks[key])
                lv.counters.evictions += 1
                s.evicted.append(key)
        finally:
            if deferred:
                queue.restore(deferred)
            self._compact(level)

    def _compact(self, level: int) -> None:
        """Drops a level queue's stale heap items once they outnumber its blocks. Every
        access and put re-queues a block and only eviction pops: without this a cache that
        never fills would grow its heap by one item per access, for ever."""
        lv = self.levels[level]
        if lv.queue.needs_compaction(lv.blocks):
            lv.queue.compact({k: e for k, e in self._s.blocks.items() if e.level == level})

    # ---- moves between tiers -------------------------------------------------------------

    def over_high(self) -> list[int]:
        """Levels past their high watermark that the mover should drain."""
        hw = self.watermarks.high
        return [i for i, lv in enumerate(self.levels)
                if self._needs_mover(i) and lv.tier.used > hw * lv.tier.capacity]

    def target_bytes(self, level: int, extra: int = 0) -> int:
        """Bytes to move out of ``level`` to get (``extra`` included) under its low watermark."""
        tier = self.levels[level].tier
        return max(0, int(tier.used + extra - self.watermarks.low * tier.capacity))

    def plan_moves(self, level: int, nbytes: int, *,
                   spare: Collection[BlockKey] | None = None) -> list[Move]:
        """Victims of ``level`` that free ``nbytes`` of its used bytes (each counted by the
        tier's ``footprint``, not its value's length), leased and marked moving (phase 1).

        With ``spare``, the room a prefetch makes (``plan_prefetch``): never a retained
        block nor a key of ``spare``, never a drop, and only as much as the tier below has
        room for under its high watermark (its moves are ``no_drops``), so nothing leaves
        the node for it. Fewer bytes than asked, or none, when that is all there is or
        when ``SPARE_SCAN`` spared blocks were looked past."""
        s = self._s
        lv = self.levels[level]
        dst = level + 1 if self._has_lower(level) else None
        if spare is not None and dst is None:
            return []  # the room would have to come from drops
        dst_tier = self.levels[dst].tier if dst is not None else None
        dst_memory = dst is not None and not self.levels[dst].durable
        eligibility: Callable[[BlockEntry], Eligibility] = (
            self._eligibility if dst is not None else self._drop_eligibility)
        below = None  # bytes the tier below may take (None: no bound but its space)
        taken = 0  # of ``below``: the victims' footprints in the tier below
        passed: list[BlockEntry] = []  # spared blocks looked at (the last one: not queued)
        if spare is not None:
            assert dst is not None
            below = self.headroom(dst)
            retains = self.retention.retains

            def spared(entry: BlockEntry) -> Eligibility:
                verdict = self._eligibility(entry)
                if verdict is Eligibility.EVICT and (entry.key in spare
                                                     or retains(entry.key)):
                    passed.append(entry)
                    if len(passed) > SPARE_SCAN:
                        raise _ScanBound
                    return Eligibility.DEFER  # stays queued for ordinary rounds
                return verdict

            eligibility = spared
        moves: list[Move] = []
        deferred: list[tuple[float, int, BlockKey]] = []
        planned = 0
        self._requeue_expired()
        try:
            while planned < nbytes:
                try:
                    key = lv.queue.pop_victim(s.blocks, eligibility, deferred)
                except _ScanBound:
                    last = passed[-1]  # popped, neither deferred nor a victim: queue it again
                    lv.queue.push(last.key, last)
                    break
                if key is None:
                    break
                entry = s.blocks[key]
                if below is not None:
                    assert dst_tier is not None
                    taken += dst_tier.footprint(entry.nbytes)
                    if taken > below:
                        lv.queue.push(key, entry)  # the tier below has no more room for it
                        break
                move = Move(entry=entry, src=level, dst=dst, no_drops=spare is not None)
                if dst_memory:
                    assert dst_tier is not None
                    move.dst_extent = dst_tier.allocate(entry.nbytes)
                    if move.dst_extent is None:
                        lv.queue.push(key, entry)  # the tier below is full: try later
                        break
                entry.flags |= MOVING
                entry.readers += 1
                self._moving += 1
                moves.append(move)
                planned += lv.tier.footprint(entry.nbytes)  # what it frees here
        finally:
            lv.queue.restore(deferred)
        return moves

    @property
    def moves_in_flight(self) -> int:
        """Blocks planned to move (phase 1) whose move has not finished (phase 3)."""
        return self._moving

    def plan_promotions(self, limit: int) -> tuple[list[Move], tuple[int, int] | None]:
        """Up to ``limit`` queued promotions, in queue order, into room below the
        destination's high watermark.

        Stops at the first one that does not fit and returns ``(level, bytes)``
        the mover must first demote out of that level; that block stays queued.
        """
        s = self._s
        moves: list[Move] = []
        while s.promote and len(moves) < limit:
            key = next(iter(s.promote))
            entry = s.blocks.get(key)
            if entry is None or entry.flags & MOVING or entry.level == 0:
                del s.promote[key]
                continue
            dst = entry.level - 1
            if self.levels[dst].durable:
                del s.promote[key]
                continue
            move = self.plan_up(entry, dst)
            if move is None:
                return moves, (dst, self.target_bytes(
                    dst, self.levels[dst].tier.footprint(entry.nbytes)))
            del s.promote[key]
            moves.append(move)
        return moves, None

    def plan_up(self, entry: BlockEntry, dst: int) -> Move | None:
        """A move of ``entry`` up to the memory level ``dst``, into room below its high
        watermark (phase 1: destination reserved, block leased and marked moving), or None
        when there is no such room. The one rule of every move up: the promotion rule's
        and a prefetch's."""
        tier = self.levels[dst].tier
        if tier.used + tier.footprint(entry.nbytes) > self.watermarks.high * tier.capacity:
            return None
        extent = tier.allocate(entry.nbytes)
        if extent is None:
            return None
        entry.flags |= MOVING
        entry.readers += 1
        self._moving += 1
        EvictionQueue.forget(entry)
        return Move(entry=entry, src=entry.level, dst=dst, dst_extent=extent)

    def headroom(self, level: int) -> int:
        """Bytes ``level`` may take before it passes its high watermark (<= 0: none)."""
        tier = self.levels[level].tier
        return int(self.watermarks.high * tier.capacity) - tier.used

    # ---- prefetch ------------------------------------------------------------------------

    def memory_level(self, name: str) -> int:
        """The level of the memory tier named ``name``; ValueError if there is none."""
        for i, lv in enumerate(self.levels):
            if lv.tier.name == name and not lv.durable:
                return i
        memory = [lv.tier.name for lv in self.levels if not lv.durable]
        raise ValueError(f"no memory tier named {name!r} here to prefetch to; this node has "
                         f"{', '.join(repr(n) for n in memory)}")

    def plan_prefetch(self, keys: Sequence[BlockKey], level: int, *, max_bytes: int
                      ) -> PrefetchPlan:
        """``tiers.prefetch.PrefetchPlanner.plan`` (phase 1 of a prefetch)."""
        return self.prefetches.plan(keys, level, max_bytes=max_bytes)

    def plan_prefetch_rest(self, plan: PrefetchPlan) -> list[Move]:
        """``tiers.prefetch.PrefetchPlanner.plan_rest``."""
        return self.prefetches.plan_rest(plan)

    def settle_prefetch(self, plan: PrefetchPlan) -> None:
        """``tiers.prefetch.PrefetchPlanner.settle``."""
        self.prefetches.settle(plan)

    def prefetch_stats(self) -> dict[str, int | dict[str, int]]:
        """``tiers.prefetch.PrefetchPlanner.stats``."""
        return self.prefetches.stats()

    def stamp_use(self, entry: BlockEntry) -> None:
        """A coming use of ``entry``: the policy's recency only, not a read."""
        tick = next(self._clock)
        entry.last_access = tick
        if not (entry.flags or self._held_by_children(entry)):
            self.levels[entry.level].queue.push(entry.key, entry, tick)

    def finish_moves(self, moves: Sequence[Move]) -> list[DurableCopy]:
        """Applies the copied moves (phase 3); returns durable copies to delete."""
        s = self._s
        to_delete: list[DurableCopy] = []
        for m in moves:
            e = m.entry
            e.flags &= ~MOVING
            e.readers -= 1
            self._moving -= 1
            unlinked = e.flags & UNLINKED
            src = self.levels[m.src]
            ok = m.copied and not unlinked and e.readers == 0
            if m.dst is None:
                # A drop from the last tier: unlink (space freed now or on last release).
                if not unlinked:
                    if e.readers == 0 and not self.retention.retains(e.key):
                        gone = self._unlink(e)
                        if gone is not None:
                            to_delete.append(gone)
                        m.applied = True
                        src.counters.evictions += 1
                        s.evicted.append(e.key)
                    else:
                        src.queue.push(e.key, e)
                elif e.readers == 0:
                    gone = self._free_space(e)
                    if gone is not None:
                        to_delete.append(gone)
                continue
            dst = self.levels[m.dst]
            if not ok:
                # Undo: drop the copy, keep (or finish freeing) the block at its source.
                if m.dst_extent is not None:
                    dst.tier.free(m.dst_extent)
                if m.dst_location is not None:
                    to_delete.append(DurableCopy(e.key, m.dst_location))
                if unlinked:
                    if e.readers == 0:
                        gone = self._free_space(e)
                        if gone is not None:
                            to_delete.append(gone)
                elif not (e.flags & PINNED or self._held_by_children(e)):
                    src.queue.push(e.key, e)
                continue
            old = self._free_space(e)
            if old is not None:
                to_delete.append(old)
            m.applied = True
            src.blocks -= 1
            dst.blocks += 1
            e.level = m.dst
            if m.dst_extent is not None:
                e.place, e.length = m.dst_extent.offset, m.dst_extent.length
            else:
                e.place, e.length = m.dst_location, 0
            e.tier_hits = 0
            if dst.durable and self.retention.held and self.retention.retains(e.key):
                # Its tier recorded the deadline as the copy began; reads since moved it.
                s.kept_dirty[e.key] = None
            if self.observer is not None:
                self.observer.moved(e.key, e.parent, m.src, m.dst)
            if m.dst < m.src:
                dst.counters.promotions += 1
            else:
                src.counters.demotions += 1
            if not (e.flags & PINNED or self._held_by_children(e)):
                dst.queue.push(e.key, e)
        return to_delete

    # ---- prefix chains -------------------------------------------------------------------

    def _add_child(self, parent: BlockKey) -> None:
        if not self._s.blocks.add_child(parent):
            self._count_orphan(parent)

    def _count_orphan(self, parent: BlockKey) -> None:
        """One more child of ``parent``, which is not indexed: counted until it is."""
        orphans = self._s.orphans
        orphans[parent] = orphans.get(parent, 0) + 1

    def _drop_child(self, parent: BlockKey) -> None:
        s = self._s
        left = s.blocks.drop_child(parent)
        if left < 0:  # not indexed: an orphan count
            left = s.orphans[parent] - 1
            if left:
                s.orphans[parent] = left
            else:
                del s.orphans[parent]
            return
        if left == 0 and self.policy.leaves_only:
            p = s.blocks[parent]
            if not p.flags and not p.queue_seq:  # not pinned or moving, not queued
                # It became a leaf: eligible again, at the priority of its last access.
                self.levels[p.level].queue.push(parent, p)

    def drain_evicted(self) -> list[BlockKey]:
        """Keys evicted (dropped from the last tier) since the last call, in order."""
        out, self._s.evicted = self._s.evicted, []
        return out

    def children_of(self, key: BlockKey) -> int:
        """Indexed blocks whose parent is ``key`` (whether or not ``key`` is stored)."""
        entry = self._s.blocks.get(key)
        return entry.children if entry is not None else self._s.orphans.get(key, 0)

    def pending_promotions(self) -> int:
        return len(self._s.promote)

    # ---- stats ---------------------------------------------------------------------------

    def level_stats(self, level: int) -> dict[str, int | str]:
        return self.levels[level].stats()

    def tier_stats(self) -> dict[str, int | str]:
        """Stats of the landing tier (single-tier callers)."""
        return self.level_stats(self.landing)
