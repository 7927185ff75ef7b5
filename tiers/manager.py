"""TierManager: which block lives where, and what leaves when space runs out.

The manager is pure and single-owner, like an allocator: no I/O, no locks, no
threads. Its owner (the node) calls it under one lock and does every byte copy
outside that lock, holding either a *reservation* (space being filled by a
put) or a *read lease* (a block being read). That split is what lets readers
and writers move bytes in parallel while the index stays consistent.

Invariants, checked by tests:

* a key is in ``_blocks`` only after its put committed, so no reader sees a
  partial block; an aborted reservation returns its extent at once;
* a block with readers is never freed: eviction skips it, and ``remove``
  unlinks it from the index but frees its extent only when the last lease ends;
* pinned blocks are never evicted (only removed explicitly);
* for every key ``P``: ``_blocks[P].children`` (or ``_orphans[P]`` while ``P``
  is absent) equals the number of indexed blocks whose parent is ``P``. The
  prefix-aware policy evicts only blocks with no children.

This version manages one tier, the landing tier; demotion to lower tiers is
added with the tier hierarchy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.keys import BlockKey
from tiers.allocator import Extent
from tiers.base import MappedTier
from tiers.errors import BlockTooLarge, OutOfSpace
from tiers.policy import Eligibility, EvictionPolicy, EvictionQueue


@dataclass(slots=True, kw_only=True)
class BlockEntry:
    """Metadata of one stored block."""

    key: BlockKey
    parent: BlockKey | None
    nbytes: int
    extent: Extent
    pinned: bool = False
    readers: int = 0
    unlinked: bool = False  # removed from the index; freed when readers reaches 0
    children: int = 0
    hits: int = 0
    last_access: int = 0
    queue_seq: int = 0
    queue_priority: float = 0.0


@dataclass(slots=True, kw_only=True)
class Reservation:
    """Space held for a put between reserve and commit/abort."""

    key: BlockKey
    parent: BlockKey | None
    nbytes: int
    extent: Extent
    pin: bool


@dataclass(slots=True, kw_only=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    puts: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(slots=True, kw_only=True)
class Watermarks:
    """Fractions of capacity: past ``high`` after an allocation, evict down to ``low``."""

    high: float = 0.95
    low: float = 0.90

    def __post_init__(self) -> None:
        if not 0.0 < self.low <= self.high <= 1.0:
            raise ValueError(f"need 0 < low <= high <= 1, got low={self.low} high={self.high}")


@dataclass(slots=True, kw_only=True)
class _State:
    blocks: dict[BlockKey, BlockEntry] = field(default_factory=dict)
    orphans: dict[BlockKey, int] = field(default_factory=dict)
    tick: int = 0
    evicted: list[BlockKey] = field(default_factory=list)  # events for the owner to drain


class TierManager:
    """Index, two-phase puts, read leases and eviction over the landing tier."""

    def __init__(
        self, tier: MappedTier, policy: EvictionPolicy, *, watermarks: Watermarks | None = None
    ) -> None:
        self.tier = tier
        self.policy = policy
        self.watermarks = watermarks or Watermarks()
        self.counters = TierCounters()
        self._queue = EvictionQueue(policy)
        self._s = _State()

    # ---- queries -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._s.blocks)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._s.blocks

    def entry(self, key: BlockKey) -> BlockEntry | None:
        """The entry of ``key`` without counting an access (for tests and stats)."""
        return self._s.blocks.get(key)

    def prefix_length(self, keys: list[BlockKey]) -> int:
        blocks = self._s.blocks
        n = 0
        for k in keys:
            if k not in blocks:
                break
            n += 1
        return n

    # ---- puts ----------------------------------------------------------------------------

    def reserve(
        self, key: BlockKey, nbytes: int, *, parent: BlockKey | None = None, pin: bool = False
    ) -> Reservation | None:
        """Space for a new block, or None if ``key`` is already stored.

        Evicts by policy when the allocation would pass the high watermark.
        Raises BlockTooLarge if no amount of eviction could fit it, OutOfSpace if
        everything evictable is gone and it still does not fit.
        """
        if nbytes <= 0:
            raise ValueError(f"block size must be positive, got {nbytes}")
        if key in self._s.blocks:
            return None
        tier = self.tier
        if nbytes > tier.capacity:
            raise BlockTooLarge(f"block of {nbytes} bytes exceeds {tier.name} tier capacity "
                                f"{tier.capacity}")
        high = self.watermarks.high * tier.capacity
        # The parent of the block being written stays: evicting it would strand its child.
        protect = parent
        if tier.used + nbytes > high:
            low = self.watermarks.low * tier.capacity
            self._evict_until(lambda: tier.used + nbytes <= low, strict=False, protect=protect)
        extent = tier.allocate(nbytes)
        if extent is None:
            # Fragmentation or reservations in flight: keep evicting until it fits.
            holder: list[Extent] = []

            def fits() -> bool:
                got = tier.allocate(nbytes)
                if got is not None:
                    holder.append(got)
                return got is not None

            self._evict_until(fits, strict=True, protect=protect)
            extent = holder[0]
        return Reservation(key=key, parent=parent, nbytes=nbytes, extent=extent, pin=pin)

    def fill_view(self, reservation: Reservation) -> memoryview:
        """Where the put's bytes go; valid until commit or abort."""
        return self.tier.view(reservation.extent, reservation.nbytes)

    def commit(self, reservation: Reservation) -> bool:
        """Publishes the block; False (and the space returned) if another put of the key won."""
        s = self._s
        if reservation.key in s.blocks:
            self.tier.free(reservation.extent)
            return False
        s.tick += 1
        entry = BlockEntry(
            key=reservation.key,
            parent=reservation.parent,
            nbytes=reservation.nbytes,
            extent=reservation.extent,
            pinned=reservation.pin,
            last_access=s.tick,
            children=s.orphans.pop(reservation.key, 0),
        )
        s.blocks[entry.key] = entry
        if entry.parent is not None:
            self._add_child(entry.parent)
        if not entry.pinned:
            self._queue.push(entry.key, entry)
        self.counters.puts += 1
        self.counters.bytes_in += entry.nbytes
        return True

    def abort(self, reservation: Reservation) -> None:
        self.tier.free(reservation.extent)

    # ---- reads ---------------------------------------------------------------------------

    def acquire_read(self, key: BlockKey) -> BlockEntry | None:
        """A read lease on ``key`` (counted as a hit), or None (a miss).

        The caller must hand the entry to ``release_read`` exactly once.
        """
        s = self._s
        entry = s.blocks.get(key)
        if entry is None:
            self.counters.misses += 1
            return None
        entry.readers += 1
        entry.hits += 1
        s.tick += 1
        entry.last_access = s.tick
        if entry.queue_seq or not (entry.pinned or self._held_by_children(entry)):
            self._queue.push(key, entry)
        self.counters.hits += 1
        self.counters.bytes_out += entry.nbytes
        return entry

    def read_view(self, entry: BlockEntry) -> memoryview:
        return self.tier.view(entry.extent, entry.nbytes)

    def release_read(self, entry: BlockEntry) -> None:
        if entry.readers <= 0:
            raise RuntimeError(f"release of a read lease not held: {entry.key.hex()}")
        entry.readers -= 1
        if entry.readers == 0 and entry.unlinked:
            self.tier.free(entry.extent)

    # ---- removal and eviction ------------------------------------------------------------

    def remove(self, key: BlockKey) -> bool:
        entry = self._s.blocks.get(key)
        if entry is None:
            return False
        self._unlink(entry)
        return True

    def _unlink(self, entry: BlockEntry) -> None:
        s = self._s
        del s.blocks[entry.key]
        EvictionQueue.forget(entry)
        if entry.children:
            s.orphans[entry.key] = s.orphans.get(entry.key, 0) + entry.children
        if entry.parent is not None:
            self._drop_child(entry.parent)
        entry.unlinked = True
        if entry.readers == 0:
            self.tier.free(entry.extent)

    def _held_by_children(self, entry: BlockEntry) -> bool:
        return self.policy.leaves_only and entry.children > 0

    def _eligibility(self, entry: BlockEntry) -> Eligibility:
        if entry.pinned or self._held_by_children(entry):
            return Eligibility.DROP
        if entry.readers:
            return Eligibility.DEFER
        return Eligibility.EVICT

    def _evict_until(self, done: Callable[[], bool], *, strict: bool,
                     protect: BlockKey | None = None) -> None:
        """Evicts in policy order until ``done()``; OutOfSpace if ``strict`` and it never is.

        ``protect`` is deferred for this round like a block being read.
        """
        s = self._s
        deferred: list = []

        def eligibility(entry: BlockEntry) -> Eligibility:
            if entry.key == protect and not entry.pinned:
                return Eligibility.DEFER
            return self._eligibility(entry)

        try:
            while not done():
                key = self._queue.pop_victim(s.blocks, eligibility, deferred)
                if key is None:
                    if strict:
                        raise OutOfSpace(
                            f"{self.tier.name} tier full: {self.tier.used} of "
                            f"{self.tier.capacity} bytes are pinned, being read or being written")
                    return
                self._unlink(s.blocks[key])
                self.counters.evictions += 1
                s.evicted.append(key)
        finally:
            self._queue.restore(deferred)
            self._queue.compact(s.blocks)

    def _add_child(self, parent: BlockKey) -> None:
        s = self._s
        p = s.blocks.get(parent)
        if p is None:
            s.orphans[parent] = s.orphans.get(parent, 0) + 1
        else:
            p.children += 1

    def _drop_child(self, parent: BlockKey) -> None:
        s = self._s
        p = s.blocks.get(parent)
        if p is None:
            left = s.orphans[parent] - 1
            if left:
                s.orphans[parent] = left
            else:
                del s.orphans[parent]
            return
        p.children -= 1
        if p.children == 0 and self.policy.leaves_only and not p.pinned and not p.queue_seq:
            # It became a leaf: eligible again, at the priority of its last access.
            self._queue.push(p.key, p)

    def drain_evicted(self) -> list[BlockKey]:
        """Keys evicted since the last call, in eviction order."""
        out, self._s.evicted = self._s.evicted, []
        return out

    def children_of(self, key: BlockKey) -> int:
        """Indexed blocks whose parent is ``key`` (whether or not ``key`` is stored)."""
        entry = self._s.blocks.get(key)
        return entry.children if entry is not None else self._s.orphans.get(key, 0)

    # ---- stats ---------------------------------------------------------------------------

    def tier_stats(self) -> dict[str, int | str]:
        c = self.counters
        return {
            "name": self.tier.name,
            "capacity": self.tier.capacity,
            "used": self.tier.used,
            "blocks": len(self._s.blocks),
            "hits": c.hits,
            "misses": c.misses,
            "evictions": c.evictions,
            "puts": c.puts,
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
        }
