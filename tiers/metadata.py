"""A tier that accounts for space but holds no bytes: trace replay and capacity planning.

It runs the real allocator, index and policies at the cost of metadata only, so a
replay of millions of block lookups measures exactly what a node would keep.
"""

from __future__ import annotations

from tiers.allocator import Extent, ExtentAllocator
from tiers.base import AllocatorBacked


class MetadataTier(AllocatorBacked):
    """A ``MappedTier`` whose views are unavailable: only sizes are tracked."""

    name = "metadata"

    def __init__(self, capacity: int, *, alignment: int = 1, index: str | None = None) -> None:
        self._allocator = ExtentAllocator(capacity, alignment=alignment, index=index)

    def view(self, extent: Extent, nbytes: int) -> memoryview:
        raise TypeError("a metadata-only tier holds no bytes")

    def write(self, extent: Extent, data: memoryview) -> None:
        raise TypeError("a metadata-only tier holds no bytes")

    def read_into(self, extent: Extent, nbytes: int, out: memoryview) -> None:
        raise TypeError("a metadata-only tier holds no bytes")

    def close(self) -> None:
        pass
