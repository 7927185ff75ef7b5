"""The SSD tier's RocksDB index (tiers/ssd/index.py): what counts as damage rather than a
configuration mismatch, the high-water record the witness is checked against, and
retention updates that change only an entry still naming their location."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent
from tiers.retention import Retention
from tiers.ssd.index import SsdIndex
from tiers.ssd.types import HEADER_BYTES, SsdFormatError, SsdIndexDamagedError, SsdLocation

CAPACITY = 1 << 20


def key_of(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "big") * 2)


def loc(offset: int) -> SsdLocation:
    return SsdLocation(extent=Extent(offset, 2 * HEADER_BYTES), nbytes=100, checksum=7,
                       header=HEADER_BYTES)


def fresh(tmp_path: Path) -> SsdIndex:
    index = SsdIndex(str(tmp_path / "index"), str(tmp_path / "data"))
    assert index.validate(CAPACITY, True, in_use=False, acked=0) == (True, False)
    index.write_format(CAPACITY, False)
    return index


def test_the_high_water_record_never_goes_back_and_is_checked_against_the_witness(
        tmp_path: Path) -> None:
    index = fresh(tmp_path)
    index.put([(key_of(1), None, loc(0), 5, None)])
    index.put([(key_of(2), None, loc(8192), 3, None)])  # an earlier batch landing later
    assert index.high_water == 5
    index.close()
    index = SsdIndex(str(tmp_path / "index"), str(tmp_path / "data"))
    assert index.validate(CAPACITY, False, in_use=True, acked=5) == (False, True)
    index.close()
    index = SsdIndex(str(tmp_path / "index"), str(tmp_path / "data"))
    with pytest.raises(SsdIndexDamagedError, match="lost acknowledged writes"):
        index.validate(CAPACITY, False, in_use=True, acked=6)
    index.close()


def test_damage_and_mismatch_are_told_apart(tmp_path: Path) -> None:
    fresh(tmp_path).close()
    index = SsdIndex(str(tmp_path / "index"), str(tmp_path / "data"))
    with pytest.raises(SsdFormatError) as mismatch:
        index.validate(2 * CAPACITY, False, in_use=True, acked=0)
    assert not isinstance(mismatch.value, SsdIndexDamagedError)  # a configuration error
    index.close()
    empty = SsdIndex(str(tmp_path / "other"), str(tmp_path / "data"))
    with pytest.raises(SsdIndexDamagedError):  # no format record, yet the region was in use
        empty.validate(CAPACITY, False, in_use=True, acked=0)
    empty.close()


def test_an_entry_that_does_not_decode_is_damage(tmp_path: Path) -> None:
    import rocksdict

    fresh(tmp_path).close()
    db = rocksdict.Rdict(str(tmp_path / "index"), rocksdict.Options(raw_mode=True))
    db[b"b" + key_of(1)] = b"\x01" * 30
    db.close()
    index = SsdIndex(str(tmp_path / "index"), str(tmp_path / "data"))
    index.validate(CAPACITY, False, in_use=True, acked=0)
    with pytest.raises(SsdIndexDamagedError):
        index.records()
    index.close()


def test_retention_updates_change_only_entries_still_at_their_location(tmp_path: Path) -> None:
    index = fresh(tmp_path)
    kept = Retention(until=2e9, seconds=30.0)
    index.put([(key_of(1), key_of(9), loc(0), 1, None), (key_of(2), None, loc(8192), 2, kept)])
    later = Retention(until=2e9 + 30, seconds=30.0)
    assert index.update_retention([(key_of(1), loc(0), later),  # changes
                                   (key_of(2), loc(0), later),  # moved on: left alone
                                   (key_of(3), loc(0), later),  # absent
                                   (key_of(2), loc(8192), kept)]) == 1  # unchanged
    records = {r.key: r for r in index.records()}
    assert records[key_of(1)].retention == later and records[key_of(1)].parent == key_of(9)
    assert records[key_of(1)].seq == 1 and records[key_of(1)].location == loc(0)
    assert records[key_of(2)].retention == kept
    index.close()
