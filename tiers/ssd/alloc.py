"""The SSD tier's allocator: an ExtentAllocator that recovery can rebuild from the index.

Recovery reads only the index, never the data, so the allocator must be able to take
the exact set of live extents the index names, and reject a set this tier cannot have
written (overlapping, misaligned, or beyond the region).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiers.allocator import Extent, ExtentAllocator
from tiers.ssd.types import SsdFormatError


class _SsdAllocator(ExtentAllocator):
    """An ExtentAllocator that can be reset to a given set of live extents.

    Recovery knows exactly which extents the index names; the base class can only
    hand out extents of its own choosing. Rebuilding the free list as the gaps
    between the recovered extents is O(n log n) and needs no data scan.
    """

    __slots__ = ()

    def rebuild(self, live: Sequence[Extent]) -> None:
        """Makes exactly ``live`` allocated and everything else free.

        Raises SsdFormatError if the extents overlap, are misaligned or fall outside
        the region: that index cannot have been written by this tier for this file.
        """
        try:
            super().rebuild(live)
        except ValueError as exc:
            raise SsdFormatError(f"index names an impossible extent: {exc}") from exc
