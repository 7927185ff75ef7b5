"""tiers.records: each Level is typed by its tier's protocols (tiers.base), decided once."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.core.keys import BlockKey
from tiers.base import DurableCopy, DurableTier, MappedTier
from tiers.dram import DramTier
from tiers.hbm import HbmTier
from tiers.manager import TierManager
from tiers.metadata import MetadataTier
from tiers.policy import EvictionQueue, make_policy
from tiers.records import Level
from tiers.ssd.tier import SsdTier


def _queue() -> EvictionQueue:
    return EvictionQueue(make_policy("lru"))


def test_dram_is_mapped_memory_and_not_durable() -> None:
    dram = DramTier(1 << 20, prefault=False)
    try:
        assert isinstance(dram, MappedTier) and not isinstance(dram, DurableTier)
        lv = Level.of(dram, _queue())
        assert (lv.mapped, lv.durable, lv.durable_tier) == (True, False, None)
        assert lv.memory is dram
        with pytest.raises(TypeError, match=r"^the dram tier is not a durable tier$"):
            _ = lv.store
    finally:
        dram.close()


def test_ssd_is_durable_and_not_mapped(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path / "kv.img", 4 << 20, io="python")
    try:
        assert isinstance(ssd, DurableTier) and not isinstance(ssd, MappedTier)
        lv = Level.of(ssd, _queue())
        assert (lv.mapped, lv.durable, lv.mapped_tier) == (False, True, None)
        assert lv.store is ssd
        with pytest.raises(TypeError, match=r"^the ssd tier is not addressable memory$"):
            _ = lv.memory
    finally:
        ssd.close()


def test_hbm_is_neither_mapped_nor_durable() -> None:
    hbm = HbmTier(1 << 16, device="cpu")
    try:
        lv = Level.of(hbm, _queue())
        assert (lv.mapped, lv.durable, lv.mapped_tier, lv.durable_tier) == (False, False, None,
                                                                             None)
    finally:
        hbm.close()


def test_durable_override_marks_a_stand_in_without_giving_it_durable_calls() -> None:
    lv = Level.of(MetadataTier(1 << 10), _queue(), durable=True)
    assert (lv.durable, lv.durable_tier, lv.mapped) == (True, None, True)
    with pytest.raises(TypeError, match="metadata tier is not a durable tier"):
        _ = lv.store


def test_manager_decides_durability_by_protocol_and_returns_typed_garbage(tmp_path: Path
                                                                         ) -> None:
    dram = DramTier(1 << 20, prefault=False)
    ssd = SsdTier(tmp_path / "kv.img", 4 << 20, io="python")
    try:
        m = TierManager([dram, ssd], make_policy("lru"))  # no durable= flags
        assert [(lv.mapped, lv.durable) for lv in m.levels] == [(True, False), (False, True)]
        key = BlockKey(b"k" * 16)
        (loc,) = ssd.write_blocks([(key, None, memoryview(b"value"))])
        assert m.adopt(key, None, 5, level=1, location=loc)
        entry = m.acquire_read(key)
        assert entry is not None
        assert m.remove(key) is True  # unlinked; its copy goes when the lease ends
        gone = m.release_read(entry)
        assert isinstance(gone, DurableCopy) and gone == (key, loc)
        assert m.remove(key) is False
        assert m.remove(BlockKey(b"x" * 16)) is False
        assert m.adopt(key, None, 5, level=1, location=loc)
        gone = m.remove(key)
        assert isinstance(gone, DurableCopy) and (gone.key, gone.location) == (key, loc)
    finally:
        ssd.close()
        dram.close()
