"""An allocator's live table (extent offset to length, ``tiers.allocator``): a dict, or
with the native index (``tiers.index_kind``) a hash table in native memory
(``cffi_build/block_index.c``), with no Python int or dict entry per live extent.

Single owner, as the allocator: every call under the owner's lock.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Protocol

from tiers.index_kind import MODULE, resolve

_BATCH = 4096
_MAX_SHIFT = 32  # cffi_build/block_map.c: kvb_map_open_units
_MAX_UNITS = (1 << 32) - 2  # a compact table's offsets, in units, stay below it


class LiveTable(Protocol):
    """What ``ExtentAllocator`` needs of its ``offset -> length`` table (a dict has it)."""

    def __len__(self) -> int: ...

    def __setitem__(self, offset: int, length: int) -> None: ...

    def __delitem__(self, offset: int) -> None: ...

    def get(self, offset: int, /) -> int | None: ...

    def items(self) -> Iterator[tuple[int, int]]: ...

    def clear(self) -> None: ...


class PyLiveTable(dict[int, int]):
    """The pure-Python live table."""

    def items(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]  # an iterator, as LiveTable's
        return iter(dict.items(self))


class NativeLiveTable:
    """``LiveTable`` over a ``kvb_map`` (offsets and lengths >= 0).

    Given its allocator's ``alignment`` and ``capacity``, the table is *compact* when the
    region holds fewer than ``2**32 - 2`` alignment units: a live extent then costs one
    8-byte bucket (both numbers in units) instead of two words (issue #24), and the table
    refuses an offset or length that is not a multiple of the alignment, which no
    allocation of that allocator has. Without them (or past that size) it is wide and
    takes any offsets and lengths >= 0."""

    def __init__(self, *, alignment: int = 1, capacity: int | None = None) -> None:
        mod: Any = importlib.import_module(MODULE)
        self._ffi, self._lib = mod.ffi, mod.lib
        shift = alignment.bit_length() - 1
        self._unit = alignment if (
            capacity is not None and alignment > 0 and alignment == 1 << shift
            and shift <= _MAX_SHIFT and capacity >> shift < _MAX_UNITS) else None
        self._new()

    @property
    def compact(self) -> bool:
        return bool(self._lib.kvb_map_compact(self._m))

    def _new(self) -> None:
        lib = self._lib
        unit = self._unit
        m = lib.kvb_map_open() if unit is None else lib.kvb_map_open_units(unit.bit_length() - 1)
        if m == self._ffi.NULL:
            raise MemoryError("native index: no memory for an empty live table")
        self._m = self._ffi.gc(m, lib.kvb_map_close)

    def __len__(self) -> int:
        return int(self._lib.kvb_map_count(self._m))

    def __setitem__(self, offset: int, length: int) -> None:
        rc = self._lib.kvb_map_set(self._m, offset, length)
        if rc == self._lib.KVB_ENOMEM:
            raise MemoryError("native index: no memory for the live table")
        if rc < 0:
            unit = self._unit
            raise ValueError(f"live extent ({offset}, {length}): both must be >= 0"
                             + ("" if unit is None else
                                f", multiples of {unit} and within the region"))

    def __delitem__(self, offset: int) -> None:
        if self._lib.kvb_map_del(self._m, offset) < 0:
            raise KeyError(offset)

    def get(self, offset: int, /) -> int | None:
        length = int(self._lib.kvb_map_get(self._m, offset)) if offset >= 0 else -1
        return None if length < 0 else length

    def items(self) -> Iterator[tuple[int, int]]:
        ffi, lib = self._ffi, self._lib
        cursor = ffi.new("uint64_t *", 0)
        offsets, lengths = ffi.new("int64_t[]", _BATCH), ffi.new("int64_t[]", _BATCH)
        out: list[tuple[int, int]] = []
        while True:
            n = lib.kvb_map_items(self._m, cursor, offsets, lengths, _BATCH)
            if not n:
                return iter(out)
            out += zip(offsets[0:n], lengths[0:n], strict=True)

    def clear(self) -> None:
        self._new()

    def native_bytes(self) -> int:
        return int(self._lib.kvb_map_bytes(self._m))

    def moving_buckets(self) -> int:
        """Buckets of the old table still to move while the table grows (0: not growing;
        ``cffi_build/probe_table.c``)."""
        return int(self._lib.kvb_map_moving(self._m))

    def released_bytes(self) -> int:
        """Bytes of the old table already given back to the kernel while it drains."""
        return int(self._lib.kvb_map_released(self._m))


def make_live_table(kind: str | None = None, *, alignment: int = 1,
                    capacity: int | None = None) -> LiveTable:
    """The live table of ``kind`` (``tiers.index_kind.resolve``) for an allocator of
    ``alignment`` over ``capacity`` bytes (the native one is compact where they allow)."""
    if resolve(kind) == "native":
        return NativeLiveTable(alignment=alignment, capacity=capacity)
    return PyLiveTable()
