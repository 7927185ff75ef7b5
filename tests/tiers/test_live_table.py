"""The native live table (``tiers.live_table.NativeLiveTable``) against the dict it stands
in for, operation by operation (Hypothesis), while it grows too; its refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.index_kind import native_available
from tiers.live_table import NativeLiveTable, PyLiveTable

pytestmark = pytest.mark.skipif(not native_available(), reason="native index not built")


def _drive_against_a_dict(native: NativeLiveTable, ops: list[tuple[str, int, int]], *,
                          unit: int, fill_from: int) -> None:
    """Runs ``ops`` (offsets and lengths in ``unit``s) on ``native`` and a dict alike and
    compares every answer; ``fill`` sets hundreds of offsets at once (from ``fill_from``
    units on) to reach a growth, so later operations run while the old table drains."""
    ref = PyLiveTable()
    next_fill = fill_from
    for op, unit_offset, unit_length in ops:
        offset, length = unit_offset * unit, unit_length * unit
        if op == "fill":
            for i in range(unit_offset % 700):
                native[(next_fill + i) * unit] = length
                ref[(next_fill + i) * unit] = length
            next_fill += 700
        elif op == "set":
            native[offset] = length
            ref[offset] = length
        elif op == "del":
            if offset in ref:
                del native[offset]
                del ref[offset]
            else:
                with pytest.raises(KeyError):
                    del native[offset]
        assert native.get(offset) == ref.get(offset)
        if unit > 1:
            assert native.get(offset + 1) is None  # no extent of this allocator starts there
        assert len(native) == len(ref)
    assert sorted(native.items()) == sorted(ref.items())


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["set", "del", "get", "fill"]),
                              st.integers(0, 3000) | st.integers(0, 1 << 62),
                              st.integers(0, 1 << 40)), max_size=300))
def test_native_live_table_answers_as_a_dict(ops: list[tuple[str, int, int]]) -> None:
    """Also while it grows (see ``_drive_against_a_dict``), and once cleared."""
    native = NativeLiveTable()
    assert not native.compact
    _drive_against_a_dict(native, ops, unit=1, fill_from=1 << 50)
    native.clear()
    assert len(native) == 0 and list(native.items()) == []


def test_native_live_table_grows_and_refuses_negative_values() -> None:
    t = NativeLiveTable()
    for i in range(50_000):
        t[i * 64] = 64
    for i in range(0, 50_000, 2):
        del t[i * 64]
    assert len(t) == 25_000 and t.get(64) == 64 and t.get(0) is None and t.get(-1) is None
    with pytest.raises(ValueError, match=">= 0"):
        t[-64] = 1


UNIT = 64
UNITS = (1 << 32) - 3  # the largest region, in units, a compact table serves


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["set", "del", "get", "fill"]),
                              st.integers(0, 3000) | st.integers(0, UNITS - 1),
                              st.integers(0, (1 << 32) - 1)), max_size=300))
def test_a_compact_live_table_answers_as_a_dict(ops: list[tuple[str, int, int]]) -> None:
    """Offsets and lengths in units of the allocator's alignment, one word a bucket: the
    same answers as the dict for every offset and length an allocator of that alignment
    can hand out, also while the table grows."""
    native = NativeLiveTable(alignment=UNIT, capacity=UNITS * UNIT)
    assert native.compact
    _drive_against_a_dict(native, ops, unit=UNIT, fill_from=1 << 31)


def test_a_compact_live_table_refuses_what_it_cannot_hold_exactly() -> None:
    units = (1 << 32) - 2
    t = NativeLiveTable(alignment=UNIT, capacity=units * UNIT - 1)
    assert t.compact
    last = (units - 1) * UNIT  # the highest offset a compact table holds
    t[last] = ((1 << 32) - 1) * UNIT  # the longest length it holds
    assert t.get(last) == ((1 << 32) - 1) * UNIT
    for offset, length in [(UNIT + 1, UNIT), (UNIT, UNIT + 1), (units * UNIT, UNIT),
                           (UNIT, (1 << 32) * UNIT), (-UNIT, UNIT), (UNIT, -UNIT)]:
        with pytest.raises(ValueError, match=f"multiples of {UNIT}"):
            t[offset] = length
        assert t.get(offset) is None
    assert list(t.items()) == [(last, ((1 << 32) - 1) * UNIT)] and len(t) == 1


@pytest.mark.parametrize(("alignment", "capacity", "compact"), [
    (64, 1 << 30, True), (4096, 1 << 40, True), (1, 1 << 20, True),
    (64, ((1 << 32) - 2) * 64 - 1, True), (64, ((1 << 32) - 2) * 64, False),
    (48, 1 << 20, False), (64, None, False)])
def test_a_live_table_is_compact_only_where_every_extent_fits_one_word(
        alignment: int, capacity: int | None, compact: bool) -> None:
    assert NativeLiveTable(alignment=alignment, capacity=capacity).compact is compact


def test_a_native_allocator_builds_a_compact_live_table_and_keeps_its_answers() -> None:
    from tiers.allocator import AllocatorError, ExtentAllocator
    from tiers.live_table import make_live_table

    table = make_live_table("native", alignment=64, capacity=1 << 30)
    assert isinstance(table, NativeLiveTable) and table.compact
    alloc = ExtentAllocator(1 << 30, alignment=64, index="native")
    extents = [alloc.allocate(n) for n in (1, 64, 65, 4096, 1 << 20)]
    assert [(e.offset, e.length) for e in extents if e] == [
        (0, 64), (64, 64), (128, 128), (256, 4096), (4352, 1 << 20)]
    assert alloc.live_extents() == [e for e in extents if e]
    first = extents[0]
    assert first is not None
    alloc.free(first)
    with pytest.raises(AllocatorError, match="not live"):
        alloc.free(first)
    assert alloc.live_count == 4
