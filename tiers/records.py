"""The records the TierManager keeps: blocks, reservations, moves, per-tier counters.

Plain data with no behaviour beyond validation; the manager owns every mutation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore.keys import BlockKey
from tiers.allocator import Extent
from tiers.base import Tier
from tiers.errors import TierError
from tiers.policy import EvictionQueue


class NeedsRoom(TierError):
    """The landing tier is full and its victims must be demoted first (I/O, outside the lock)."""

    def __init__(self, level: int, nbytes: int) -> None:
        super().__init__(f"tier {level} needs {nbytes} bytes moved out first")
        self.level = level
        self.nbytes = nbytes


@dataclass(slots=True, kw_only=True)
class BlockEntry:
    """Metadata of one stored block."""

    key: BlockKey
    parent: BlockKey | None
    nbytes: int
    level: int = 0  # index of the tier holding it
    extent: Extent | None = None  # memory tiers
    location: Any = None  # durable tiers: the tier's own location record
    pinned: bool = False
    readers: int = 0
    unlinked: bool = False  # removed from the index; freed when readers reaches 0
    moving: bool = False
    children: int = 0
    hits: int = 0
    tier_hits: int = 0  # hits since it entered its current tier
    last_access: int = 0
    queue_seq: int = 0
    queue_priority: float = 0.0

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

    @property
    def mapped(self) -> bool:
        return hasattr(self.tier, "view")


@dataclass(slots=True, kw_only=True)
class Move:
    """One planned move of ``entry`` from ``src`` to ``dst`` (None: drop it)."""

    entry: BlockEntry
    src: int
    dst: int | None
    dst_extent: Extent | None = None  # reserved when ``dst`` is a memory tier
    dst_location: Any = None  # filled by the mover when ``dst`` is durable
    copied: bool = False
