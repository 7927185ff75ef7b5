"""What every storage medium offers the TierManager.

A tier is a preallocated region plus the allocator that carves it. It knows
nothing of policies or the network: the TierManager owns the index and decides
what lives where. Tiers do no locking; their owner serialises calls to
``allocate``/``free`` and never lets two writers touch one extent.

Two refinements, decided by protocol (``isinstance``, once, when the manager is
built), never by probing for a method: a ``MappedTier``'s bytes are addressable
memory (DRAM), read and written through views; a ``DurableTier``'s blocks survive
restarts (SSD), so it keeps its own index of keys and locations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent, ExtentAllocator
from tiers.retention import Retention


@runtime_checkable
class Tier(Protocol):
    """A storage medium with its own allocator."""

    name: str
    """``"hbm"``, ``"dram"`` or ``"ssd"``: how stats and logs name it."""

    @property
    def capacity(self) -> int: ...

    @property
    def used(self) -> int: ...

    def footprint(self, nbytes: int) -> int:
        """The ``used`` bytes a block of ``nbytes`` value bytes takes here (alignment and
        any per-block header included): what storing it adds and what dropping it frees.
        Every comparison of blocks against ``used``, ``capacity`` or a watermark counts
        this, never the value's length."""

    def allocate(self, nbytes: int) -> Extent | None:
        """Space for ``nbytes``, or None when no free extent fits."""

    def free(self, extent: Extent) -> None: ...

    def write(self, extent: Extent, data: memoryview) -> None:
        """Copies ``data`` (at most ``extent.length`` bytes) to the start of ``extent``."""

    def read_into(self, extent: Extent, nbytes: int, out: memoryview) -> None:
        """Copies the first ``nbytes`` of ``extent`` into ``out``."""

    def close(self) -> None: ...


@runtime_checkable
class MappedTier(Tier, Protocol):
    """A tier whose bytes are addressable memory: readers and writers use views, not copies."""

    def view(self, extent: Extent, nbytes: int) -> memoryview:
        """A writable view of the first ``nbytes`` of ``extent``; valid while the extent is held."""


class DurableCopy(NamedTuple):
    """A block's copy in a durable tier that nobody indexes any more: the owner deletes it
    (I/O, outside its lock). ``location`` is the tier's own record, opaque to the manager."""

    key: BlockKey
    location: Any


class DurableRecord(Protocol):
    """One block a durable tier kept across a restart, as ``recover`` returns it."""

    @property
    def key(self) -> BlockKey: ...

    @property
    def parent(self) -> BlockKey | None: ...

    @property
    def location(self) -> Any:
        """The tier's location record; its ``nbytes`` is the value's length."""

    @property
    def retention(self) -> Retention | None:
        """The retention the block had when it was last written or refreshed."""


@runtime_checkable
class DurableTier(Tier, Protocol):
    """A tier whose blocks survive restarts: written and read in batches by location, kept
    in an index of its own, and deleted by key and location.

    Its blocks carry a ``location`` (never an extent the manager frees): their space
    returns only through ``delete``, after the index forgot them.
    """

    def write_blocks(
        self, items: Sequence[tuple[BlockKey, BlockKey | None, memoryview]],
        retention: Sequence[Retention | None] | None = None,
    ) -> list[Any]:
        """Stores each (key, parent, value) durably, with its ``retention`` if given; its
        location, or None where it did not fit."""

    def update_retention(self, updates: Sequence[tuple[BlockKey, Any, Retention | None]]
                         ) -> int:
        """Sets the retention each (key, location) keeps across a restart (not synced);
        how many changed."""

    def read_blocks_into(self, locations: Sequence[Any], outs: Sequence[memoryview]
                         ) -> list[bool]:
        """Reads each block into its ``out``; False where it failed its checksum."""

    def delete(self, keys_and_locations: Sequence[tuple[BlockKey, Any]]) -> None: ...

    def recover(self) -> Sequence[DurableRecord]:
        """Every block kept across a restart; once, before any allocation."""


class AllocatorBacked:
    """Space accounting every in-memory tier shares: one ExtentAllocator owns the region's
    extents, and the tier's capacity, use, allocations and frees are its.

    Subclasses set ``self._allocator`` in ``__init__``.
    """

    _allocator: ExtentAllocator

    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def used(self) -> int:
        return self._allocator.used

    @property
    def allocator(self) -> ExtentAllocator:
        return self._allocator

    def footprint(self, nbytes: int) -> int:
        """The value rounded up to the allocator's alignment."""
        return self._allocator.rounded(nbytes)

    def allocate(self, nbytes: int) -> Extent | None:
        return self._allocator.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self._allocator.free(extent)
