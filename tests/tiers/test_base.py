"""Tier.footprint: the used bytes a block takes in each tier, exactly what storing it adds.

The mover counts victims by it (tests/tiers/test_tier_moves.py, test_mover.py): a 64-byte
value takes 64 bytes of DRAM but 8 KiB of SSD (a header page, then the value, aligned).
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from kvstore.core.keys import BlockKey
from tiers.base import DurableTier, MappedTier, Tier
from tiers.dram import DramTier
from tiers.metadata import MetadataTier
from tiers.ssd.tier import SsdTier
from tiers.ssd.types import ALIGNMENT, HEADER_BYTES


def test_dram_footprint_is_the_allocator_rounding() -> None:
    dram = DramTier(1 << 16, prefault=False)
    try:
        assert isinstance(dram, MappedTier)
        assert [dram.footprint(n) for n in (1, 16, 64, 65, 4096)] == [64, 64, 64, 128, 4096]
        before = dram.used
        assert dram.allocate(65) is not None
        assert dram.used - before == dram.footprint(65) == 128
    finally:
        dram.close()


def test_metadata_footprint_follows_its_alignment() -> None:
    exact, paged = MetadataTier(1 << 16), MetadataTier(1 << 16, alignment=4096)
    assert [exact.footprint(n) for n in (1, 64, 65)] == [1, 64, 65]
    assert [paged.footprint(n) for n in (1, 64, 4097)] == [4096, 4096, 8192]
    assert paged.allocate(64) is not None and paged.used == paged.footprint(64)


def test_ssd_footprint_is_a_header_page_and_the_aligned_value(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path / "kv.img", 64 * ALIGNMENT, io="python")
    try:
        assert isinstance(ssd, DurableTier) and isinstance(ssd, Tier)
        assert HEADER_BYTES == ALIGNMENT == 4096
        assert [ssd.footprint(n) for n in (0, 1, 64, 4096, 4097)] == [
            4096, 8192, 8192, 8192, 12288]
        sizes = [64, 4096, 4097, 0]
        values = [memoryview(bytes(n)) for n in sizes]
        keys = [BlockKey(f"k{i}".encode().ljust(16, b".")) for i in range(len(sizes))]
        used = [ssd.used]
        for key, value in zip(keys, values, strict=True):
            assert ssd.write_blocks([(key, None, value)])[0] is not None
            used.append(ssd.used)
        assert [b - a for a, b in pairwise(used)] == [
            ssd.footprint(n) for n in sizes]
    finally:
        ssd.close()
