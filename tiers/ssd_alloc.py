"""The SSD tier's allocator: an ExtentAllocator that recovery can rebuild from the index.

Recovery reads only the index, never the data, so the allocator must be able to take
the exact set of live extents the index names, and reject a set this tier cannot have
written (overlapping, misaligned, or beyond the region).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiers.allocator import Extent, ExtentAllocator
from tiers.ssd_types import SsdFormatError


class _SsdAllocator(ExtentAllocator):
    """An ExtentAllocator that can be reset to a given set of live extents.

    Recovery knows exactly which extents the index names; the base class can only
    hand out extents of its own choosing. Rebuilding the free list as the gaps
    between the recovered extents is O(n log n) and needs no data scan.
    """

    __slots__ = ()

    def rebuild(self, live: Sequence[Extent]) -> None:
        """Makes exactly ``live`` allocated and everything else free.

        Only valid on an allocator with nothing allocated. Raises SsdFormatError
        if the extents overlap, are misaligned or fall outside the region: that
        index cannot have been written by this tier for this file.
        """
        if self.live_count:
            raise RuntimeError("rebuild() needs an allocator with no live extents")
        a, cap = self.alignment, self.capacity
        ordered = sorted(live, key=lambda e: e.offset)
        prev_end = 0
        for e in ordered:
            if e.length <= 0 or e.offset % a or e.length % a:
                raise SsdFormatError(f"index names a misaligned extent {e}")
            if e.offset < prev_end:
                raise SsdFormatError(f"index names overlapping extents near offset {e.offset}")
            if e.end > cap:
                raise SsdFormatError(f"index names extent {e} beyond the region ({cap} bytes)")
            prev_end = e.end
        # Reset the base class's state (see its invariants): no free extents, no live ones.
        self._free_by_start.clear()
        self._free_by_end.clear()
        for b in self._bins:
            b.clear()
        self._live.clear()
        cursor = 0
        used = 0
        for e in ordered:
            if e.offset > cursor:
                self._insert_free(cursor, e.offset - cursor)
            self._live[e.offset] = e.length
            used += e.length
            cursor = e.end
        if cursor < cap:
            self._insert_free(cursor, cap - cursor)
        self._used = used
