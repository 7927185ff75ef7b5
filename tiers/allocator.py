"""Extent allocator over one preallocated region.

Why extents and not size classes: KV blocks of one deployment share a size (a
model's block is fixed), but a node serves many models and the API accepts any
size up to the tier. Size classes would waste up to half of every block whose
size falls between classes; extents with coalescing waste only the alignment
padding, and with uniform block sizes freed extents are reused exactly.

Free extents are found by *segregated fit*: bin ``k`` holds the free extents
whose length lies in ``[2**k, 2**(k+1))``. A request of ``n`` bytes is served
from the lowest non-empty bin above ``floor(log2(n))`` (every extent there
fits), or, failing that, by a first-fit scan of bin ``floor(log2(n))`` itself.
Freed extents coalesce with free neighbours, so two adjacent free extents
never coexist in the coalesced view, with one exception kept off that view:
the *recent* lists. A freed extent waits there, uncoalesced, for the next
allocation of exactly its length (KV blocks of one model share a size, so an
eviction is usually followed by a put of the same size): that pair costs a
list append and a pop instead of a coalesce and a bin search. The lists are
bounded (``MAX_RECENT`` extents in all; past it a free coalesces at once) and
are merged into the coalesced view before every answer that depends on it: an
allocation that finds no fit, ``largest_free``, ``free_extents``, ``rebuild``.
So an allocation fails only when no coalesced free extent fits.

The allocator is pure and single-owner: no I/O, no locks, no callbacks. Its
owner serialises access. Broken invariants (double free, foreign extent) raise
AllocatorError; they are never clamped.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

from tiers.live_table import LiveTable, make_live_table

_MAX_SHARED_LENGTHS = 256
MAX_RECENT = 1024


class AllocatorError(RuntimeError):
    """An extent was freed twice or never came from this allocator."""


@dataclass(frozen=True, slots=True)
class Extent:
    """``length`` bytes at ``offset`` of a region; ``length`` is a multiple of the alignment."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


_offset_of = operator.attrgetter("offset")


class ExtentAllocator:
    """Hands out aligned, non-overlapping extents of ``[0, capacity)``."""

    __slots__ = ("_alignment", "_bins", "_capacity", "_free_by_end", "_free_by_start", "_lengths",
                 "_live", "_nonempty", "_recent", "_recent_count", "_used")

    def __init__(self, capacity: int, *, alignment: int = 64, index: str | None = None
                 ) -> None:
        """``index``: the live table's kind (``tiers.index_kind``; None: the environment's)."""
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._alignment = alignment
        self._capacity = capacity - capacity % alignment
        # Invariant: _free_by_start and _free_by_end describe the same free extents,
        # and each free extent's start is in exactly one bin, by its length.
        self._free_by_start: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        self._bins: list[set[int]] = [set() for _ in range(max(1, self._capacity.bit_length()))]
        self._nonempty = 0  # bit k set iff bins[k] is non-empty: finds a bin without a scan
        # offset -> length of every live allocation: the proof that a free is legitimate.
        self._live: LiveTable = make_live_table(index, alignment=alignment,
                                                capacity=self._capacity)
        # One int object per distinct extent length: the lengths of live extents (here and
        # in their owners' records) share it instead of holding one int each (bounded).
        self._lengths: dict[int, int] = {}
        # length -> offsets of freed extents not yet coalesced (see the module docstring).
        # Invariant: each is free (out of ``_used`` and ``_live``) and in no bin.
        self._recent: dict[int, list[int]] = {}
        self._recent_count = 0
        self._used = 0
        if self._capacity:
            self._insert_free(0, self._capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used(self) -> int:
        """Bytes in live extents, alignment padding included."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def live_count(self) -> int:
        return len(self._live)

    def rounded(self, nbytes: int) -> int:
        """The extent length a request of ``nbytes`` takes."""
        a = self._alignment
        return (nbytes + a - 1) // a * a

    def largest_free(self) -> int:
        self._flush_recent()
        if not self._nonempty:
            return 0
        return max(self._free_by_start[s] for s in self._bins[self._nonempty.bit_length() - 1])

    def allocate(self, nbytes: int) -> Extent | None:
        """An extent of at least ``nbytes``, or None if no free extent fits."""
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        need = self.rounded(nbytes)
        if need > self._capacity:
            return None
        recent = self._recent.get(need)
        if recent:
            at = recent.pop()
            self._recent_count -= 1
            need = self._lengths.get(need, need)
            self._live[at] = need
            self._used += need
            return Extent(at, need)
        start = self._find_fit(need)
        if start is None:
            if not self._recent_count:
                return None
            self._flush_recent()
            start = self._find_fit(need)
            if start is None:
                return None
        length = self._remove_free(start)
        if length > need:
            self._insert_free(start + need, length - need)
        shared = self._lengths.get(need)
        if shared is not None:
            need = shared
        elif len(self._lengths) < _MAX_SHARED_LENGTHS:
            self._lengths[need] = need
        self._live[start] = need
        self._used += need
        return Extent(start, need)

    def free(self, extent: Extent) -> None:
        """Returns ``extent`` to the free space: to its length's recent list, or (that
        list full) merged with its free neighbours at once."""
        length = self._live.get(extent.offset)
        if length is None or length != extent.length:
            raise AllocatorError(f"free of an extent that is not live: {extent}")
        del self._live[extent.offset]
        self._used -= length
        if self._recent_count < MAX_RECENT:
            recent = self._recent.get(length)
            if recent is None:
                recent = self._recent[length] = []
            recent.append(extent.offset)
            self._recent_count += 1
            return
        self._coalesce(extent.offset, length)

    def _coalesce(self, start: int, length: int) -> None:
        """Makes ``[start, start + length)`` free in the coalesced view, merged with neighbours."""
        end = start + length
        if end in self._free_by_start:
            end += self._remove_free(end)
        left = self._free_by_end.get(start)
        if left is not None:
            self._remove_free(left)
            start = left
        self._insert_free(start, end - start)

    def rebuild(self, live: Sequence[Extent]) -> None:
        """Makes exactly ``live`` allocated and everything else free (restart recovery).

        Only valid with nothing allocated. Raises ValueError if the extents overlap,
        are misaligned or fall outside the region. O(n log n).
        """
        if self._live:
            raise RuntimeError("rebuild() needs an allocator with no live extents")
        self._recent.clear()
        self._recent_count = 0
        a, cap = self._alignment, self._capacity
        ordered = sorted(live, key=_offset_of)
        prev_end = used = 0
        for e in ordered:  # every check before any change: a refused rebuild changes nothing
            offset, length = e.offset, e.length
            if length <= 0 or offset % a or length % a:
                raise ValueError(f"misaligned extent {e}")
            if offset < prev_end:
                raise ValueError(f"overlapping extents near offset {offset}")
            prev_end = offset + length
            if prev_end > cap:
                raise ValueError(f"extent {e} beyond the region ({cap} bytes)")
            used += length
        self._free_by_start.clear()
        self._free_by_end.clear()
        for b in self._bins:
            b.clear()
        self._nonempty = 0
        cursor = 0
        live_table = self._live
        for e in ordered:
            offset = e.offset
            if offset > cursor:
                self._insert_free(cursor, offset - cursor)
            live_table[offset] = e.length
            cursor = offset + e.length
        if cursor < cap:
            self._insert_free(cursor, cap - cursor)
        self._used = used

    def free_extents(self) -> list[Extent]:
        """Every free extent, by offset (for tests and diagnostics)."""
        self._flush_recent()
        return [Extent(s, n) for s, n in sorted(self._free_by_start.items())]

    def live_extents(self) -> list[Extent]:
        return [Extent(s, n) for s, n in sorted(self._live.items())]

    def _flush_recent(self) -> None:
        if not self._recent_count:
            return
        recent, self._recent, self._recent_count = self._recent, {}, 0
        for length, starts in recent.items():
            for start in starts:
                self._coalesce(start, length)

    def _find_fit(self, need: int) -> int | None:
        k0 = need.bit_length() - 1
        bins = self._bins
        above = self._nonempty >> (k0 + 1)
        if above:
            b = bins[k0 + (above & -above).bit_length()]  # the lowest non-empty bin above k0
            # Lowest offset keeps allocations packed towards the region start.
            return min(b) if len(b) <= 8 else next(iter(b))
        for start in bins[k0]:
            if self._free_by_start[start] >= need:
                return start
        return None

    def _insert_free(self, start: int, length: int) -> None:
        self._free_by_start[start] = length
        self._free_by_end[start + length] = start
        k = length.bit_length() - 1
        self._bins[k].add(start)
        self._nonempty |= 1 << k

    def _remove_free(self, start: int) -> int:
        length = self._free_by_start.pop(start)
        del self._free_by_end[start + length]
        k = length.bit_length() - 1
        b = self._bins[k]
        b.discard(start)
        if not b:
            self._nonempty &= ~(1 << k)
        return length
