"""The records the TierManager keeps: blocks, reservations, moves, per-tier counters.

Plain data with no behaviour beyond validation; the manager owns every mutation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore.core.keys import BlockKey
from kvstore.core.prefetch import PrefetchOutcome
from tiers.allocator import Extent
from tiers.base import DurableTier, MappedTier, Tier
from tiers.errors import TierError
from tiers.policy import EvictionQueue
from tiers.retention import RetainAsk


class NeedsRoom(TierError):
    """The landing tier is full and its victims must be demoted first (I/O, outside the lock)."""

    def __init__(self, level: int, nbytes: int) -> None:
        super().__init__(f"tier {level} needs {nbytes} bytes moved out first")
        self.level = level
        self.nbytes = nbytes


PINNED = 1
MOVING = 2
UNLINKED = 4


class BlockEntry:
    """Metadata of one stored block: one slotted object, no other object per block.

    Compact on purpose (a node indexes millions of blocks): the three booleans share
    ``flags`` (``PINNED | MOVING | UNLINKED``; any bit set makes a block ineligible for
    eviction), and the block's place is ``place`` plus ``length``: the extent's offset and
    length in a memory tier (no ``Extent`` object is kept), or the durable tier's own
    location record with ``length == 0``. ``extent``, ``location``, ``pinned``, ``moving``
    and ``unlinked`` are views of those slots for callers.
    """

    __slots__ = ("children", "flags", "hits", "key", "last_access", "length", "level",
                 "nbytes", "parent", "place", "queue_priority", "queue_seq", "readers",
                 "tier_hits")

    def __init__(self, *, key: BlockKey, parent: BlockKey | None, nbytes: int, level: int = 0,
                 extent: Extent | None = None, location: Any = None, pinned: bool = False,
                 children: int = 0, last_access: int = 0) -> None:
        self.key = key
        self.parent = parent
        self.nbytes = nbytes
        self.level = level  # index of the tier holding it
        if extent is not None:
            self.place: Any = extent.offset
            self.length = extent.length
        else:
            self.place = location
            self.length = 0
        self.flags = PINNED if pinned else 0
        self.readers = 0
        self.children = children
        self.hits = 0
        self.tier_hits = 0  # hits since it entered its current tier
        self.last_access = last_access
        self.queue_seq: Any = 0
        self.queue_priority: Any = 0

    def __repr__(self) -> str:
        return (f"BlockEntry(key={self.key!r}, parent={self.parent!r}, nbytes={self.nbytes}, "
                f"level={self.level}, extent={self.extent}, location={self.location!r}, "
                f"flags={self.flags}, readers={self.readers}, children={self.children}, "
                f"hits={self.hits}, tier_hits={self.tier_hits}, "
                f"last_access={self.last_access}, queue_seq={self.queue_seq})")

    @property
    def extent(self) -> Extent | None:
        """Where the bytes are in a memory tier (None in a durable tier or once freed)."""
        return Extent(self.place, self.length) if self.length else None

    @extent.setter
    def extent(self, extent: Extent | None) -> None:
        if extent is not None:
            self.place, self.length = extent.offset, extent.length
        elif self.length:
            self.place, self.length = None, 0

    @property
    def location(self) -> Any:
        """The durable tier's location record (None in a memory tier or once freed)."""
        return None if self.length else self.place

    @location.setter
    def location(self, location: Any) -> None:
        if location is not None:
            self.place, self.length = location, 0
        elif not self.length:
            self.place = None

    def _flag(self, bit: int, on: bool) -> None:
        self.flags = self.flags | bit if on else self.flags & ~bit

    @property
    def pinned(self) -> bool:
        return bool(self.flags & PINNED)

    @pinned.setter
    def pinned(self, on: bool) -> None:
        self._flag(PINNED, on)

    @property
    def moving(self) -> bool:
        return bool(self.flags & MOVING)

    @moving.setter
    def moving(self, on: bool) -> None:
        self._flag(MOVING, on)

    @property
    def unlinked(self) -> bool:
        """Removed from the index; freed when ``readers`` reaches 0."""
        return bool(self.flags & UNLINKED)

    @unlinked.setter
    def unlinked(self, on: bool) -> None:
        self._flag(UNLINKED, on)

    # Back-compat name for single-tier callers.
    @property
    def tier(self) -> int:
        return self.level


@dataclass(slots=True, kw_only=True)
class Reservation:
    """Space held for a put between reserve and commit/abort."""

    key: BlockKey
    parent: BlockKey | None
    nbytes: int
    extent: Extent
    pin: bool
    retain: RetainAsk | None = None  # granted at commit (``tiers.retention``)


@dataclass(slots=True, kw_only=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    checksum_failures: int = 0
    puts: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(slots=True, kw_only=True)
class Watermarks:
    """Fractions of capacity: past ``high``, move out (or evict) down to ``low``."""

    high: float = 0.95
    low: float = 0.90

    def __post_init__(self) -> None:
        if not 0.0 < self.low <= self.high <= 1.0:
            raise ValueError(f"need 0 < low <= high <= 1, got low={self.low} high={self.high}")


@dataclass(slots=True, kw_only=True)
class Level:
    """One tier of the hierarchy with its own queue and counters."""

    tier: Tier
    queue: EvictionQueue
    counters: TierCounters = field(default_factory=TierCounters)
    blocks: int = 0
    durable: bool = False  # blocks carry a ``location`` and survive restarts
    mapped_tier: MappedTier | None = None  # ``tier`` when it is a MappedTier
    durable_tier: DurableTier | None = None  # ``tier`` when it is a DurableTier

    @classmethod
    def of(cls, tier: Tier, queue: EvictionQueue, *, durable: bool | None = None) -> Level:
        """The level of ``tier``, typed by its protocols. ``durable`` overrides the
        protocol's answer (a metadata-only tier standing in for a durable one in tests)."""
        durable_tier = tier if isinstance(tier, DurableTier) else None
        return cls(tier=tier, queue=queue,
                   durable=durable_tier is not None if durable is None else durable,
                   mapped_tier=tier if isinstance(tier, MappedTier) else None,
                   durable_tier=durable_tier)

    @property
    def mapped(self) -> bool:
        """Whether the tier's bytes are addressable memory (readers use views, not copies)."""
        return self.mapped_tier is not None

    @property
    def memory(self) -> MappedTier:
        """The tier as a MappedTier; only for a ``mapped`` level."""
        if self.mapped_tier is None:
            raise TypeError(f"the {self.tier.name} tier is not addressable memory")
        return self.mapped_tier

    @property
    def store(self) -> DurableTier:
        """The tier as a DurableTier; only for a level whose tier is one."""
        if self.durable_tier is None:
            raise TypeError(f"the {self.tier.name} tier is not a durable tier")
        return self.durable_tier

    def stats(self) -> dict[str, int | str]:
        """The tier's capacity and use with this level's block count and counters."""
        c = self.counters
        return {
            "name": self.tier.name,
            "capacity": self.tier.capacity,
            "used": self.tier.used,
            "blocks": self.blocks,
            "hits": c.hits,
            "misses": c.misses,
            "evictions": c.evictions,
            "demotions": c.demotions,
            "promotions": c.promotions,
            "checksum_failures": c.checksum_failures,
            "puts": c.puts,
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
        }


@dataclass(slots=True, kw_only=True)
class Move:
    """One planned move of ``entry`` from ``src`` to ``dst`` (None: drop it)."""

    entry: BlockEntry
    src: int
    dst: int | None
    dst_extent: Extent | None = None  # reserved when ``dst`` is a memory tier
    dst_location: Any = None  # filled by the mover when ``dst`` is durable
    copied: bool = False
    applied: bool = False  # set by ``finish_moves`` when the move (or drop) took effect
    # Room a prefetch makes: a copy into a durable tier never makes room there in turn
    # (no drop); if it does not fit, the move is undone.
    no_drops: bool = False


@dataclass(slots=True, kw_only=True)
class PrefetchPlan:
    """One prefetch call's plan (``TierManager.plan_prefetch``), run by the mover
    (``TierMover.prefetch``) and closed by ``TierManager.settle_prefetch``.

    ``outcomes`` holds one outcome per distinct key: final ones from the start, QUEUED
    for the keys with a move to come until ``settle_prefetch`` replaces it."""

    level: int
    keys: list[BlockKey]
    outcomes: dict[BlockKey, PrefetchOutcome] = field(default_factory=dict)
    moves: list[Move] = field(default_factory=list)  # promotions planned (room reserved)
    waiting: list[BlockKey] = field(default_factory=list)  # QUEUED keys that need room first
    room: list[Move] = field(default_factory=list)  # demotions planned to make that room
    nbytes: int = 0  # counted against the node's prefetch bytes in flight until settled

    @property
    def has_work(self) -> bool:
        return bool(self.moves or self.waiting)

    def answer(self) -> list[PrefetchOutcome]:
        """Each named key's outcome now, in the order named (repeats included)."""
        return [self.outcomes[k] for k in self.keys]
