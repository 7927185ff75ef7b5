"""The tier index's memory per block: measured constants, dict tables, full occupancy."""

from __future__ import annotations

import sys

import pytest

from tiers import index_budget as ib


def test_a_dict_table_matches_what_cpython_allocates() -> None:
    # The index's dict of 16-byte keys, grown by inserts: its size less the keys and
    # values it holds (shared objects here) is the table the budget counts.
    for n in (1, 5, 6, 100, 1000, 50_000):
        d = {}
        for i in range(n):
            d[i.to_bytes(16, "big")] = None
        assert sys.getsizeof(d) - sys.getsizeof({}) <= ib.dict_table_bytes(n) + 64
        assert ib.dict_table_bytes(n) <= sys.getsizeof(d)


def test_the_table_per_entry_steps_between_growths() -> None:
    assert ib.dict_table_bytes(1_000_000) // 1_000_000 == 41  # measured: 42 (RESULTS.md)
    assert ib.dict_table_bytes(10_000_000) // 10_000_000 == 33
    assert ib.dict_table_bytes(12_000_000) // 12_000_000 == 55  # just past a growth


def test_python_bytes_per_block_is_the_fixed_part_plus_two_tables() -> None:
    n = 10_000_000
    tables = 2 * ib.dict_table_bytes(n)
    assert ib.index_bytes_per_block(n, kind="python") == \
        ib.PYTHON_FIXED_BYTES_PER_BLOCK + -(-tables // n)
    assert ib.index_bytes(n, kind="python") == n * ib.index_bytes_per_block(n, kind="python")
    assert ib.index_bytes_per_block(0, kind="python") > ib.PYTHON_FIXED_BYTES_PER_BLOCK


def test_native_is_the_measured_top_of_its_range_at_every_count() -> None:
    assert ib.index_bytes_per_block(50_000_000, kind="native") == ib.NATIVE_BYTES_PER_BLOCK
    assert ib.index_bytes(0, kind="native") == 0


def test_bad_arguments_are_refused_by_type() -> None:
    with pytest.raises(ValueError, match="index kind must be one of python, native"):
        ib.index_bytes_per_block(10, kind="rust")
    with pytest.raises(ValueError, match="capacity_blocks must be >= 0"):
        ib.index_bytes_per_block(-1, kind="python")
    with pytest.raises(ValueError, match="block_bytes must be positive"):
        ib.blocks_at_full_occupancy(1 << 30, 0)


def test_blocks_at_full_occupancy_rounds_down() -> None:
    assert ib.blocks_at_full_occupancy(64 << 30, 64 << 10) == 1 << 20
    assert ib.blocks_at_full_occupancy((64 << 10) * 3 - 1, 64 << 10) == 2
    assert ib.blocks_at_full_occupancy(0, 4096) == 0
