"""What every storage medium offers the TierManager.

A tier is a preallocated region plus the allocator that carves it. It knows
nothing of keys, policies or the network: the TierManager owns the index and
decides what lives where. Tiers do no locking; their owner serialises calls
to ``allocate``/``free`` and never lets two writers touch one extent.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tiers.allocator import Extent, ExtentAllocator


@runtime_checkable
class Tier(Protocol):
    """A storage medium with its own allocator."""

    name: str
    """``"hbm"``, ``"dram"`` or ``"ssd"``: how stats and logs name it."""

    @property
    def capacity(self) -> int: ...

    @property
    def used(self) -> int: ...

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

    def allocate(self, nbytes: int) -> Extent | None:
        return self._allocator.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self._allocator.free(extent)
