"""The scan that rebuilds a damaged SSD index (tiers/ssd/scan.py) and the block headers it
trusts (tiers/ssd/header.py), on crafted region files: only a block whose header verifies
under the node's key and whose bytes match its checksum is found, conflicts keep the
newest copy, and chunk boundaries change nothing."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
import xxhash

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent
from tiers.retention import Retention
from tiers.ssd.header import MAGIC, Witness, decode_header, encode_header
from tiers.ssd.scan import scan_region
from tiers.ssd.types import ALIGNMENT, HEADER_BYTES

KEY = secrets.token_bytes(32)
CAPACITY = 64 * ALIGNMENT


def key_of(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "big") * 2)


def block(region: bytearray, offset: int, key: BlockKey, value: bytes, seq: int, *,
          mac_key: bytes = KEY, extent_length: int | None = None,
          parent: BlockKey | None = None, retention: Retention | None = None) -> Extent:
    """Lays one block (header page, then value) into ``region`` at ``offset``."""
    length = extent_length or HEADER_BYTES + -(-len(value) // ALIGNMENT) * ALIGNMENT
    page = memoryview(region)[offset:offset + HEADER_BYTES]
    encode_header(mac_key, page, key=key, parent=parent, nbytes=len(value),
                  extent_length=length, checksum=xxhash.xxh3_64_intdigest(value), seq=seq,
                  retention=retention)
    region[offset + HEADER_BYTES:offset + HEADER_BYTES + len(value)] = value
    return Extent(offset, length)


def scan(tmp_path: Path, region: bytearray, chunk: int = 4 * ALIGNMENT):
    path = tmp_path / "region.img"
    path.write_bytes(bytes(region))
    fd = os.open(path, os.O_RDONLY)
    try:
        return scan_region(fd, len(region), KEY, chunk_bytes=chunk)
    finally:
        os.close(fd)


def test_a_header_round_trips_and_fails_under_another_key() -> None:
    page = bytearray(HEADER_BYTES)
    kept = Retention(until=1.7e9, seconds=600.0)
    encode_header(KEY, memoryview(page), key=key_of(1), parent=key_of(2), nbytes=77,
                  extent_length=2 * ALIGNMENT, checksum=123, seq=9, retention=kept)
    h = decode_header(KEY, page)
    assert h is not None
    assert (h.key, h.parent, h.nbytes, h.extent_length, h.checksum, h.seq, h.retention) == (
        key_of(1), key_of(2), 77, 2 * ALIGNMENT, 123, 9, kept)
    assert decode_header(secrets.token_bytes(32), page) is None
    page[40] ^= 1  # any field changed: the MAC fails
    assert decode_header(KEY, page) is None


@pytest.mark.parametrize("chunk", [HEADER_BYTES, 3 * ALIGNMENT, 64 * ALIGNMENT])
def test_only_blocks_whose_header_and_bytes_verify_are_found(tmp_path: Path,
                                                             chunk: int) -> None:
    region = bytearray(CAPACITY)
    kept = Retention(until=2e9, seconds=60.0)
    a = os.urandom(5 * ALIGNMENT + 17)  # spans chunks
    ea = block(region, 0, key_of(1), a, 1, parent=key_of(7), retention=kept)
    torn = block(region, ea.end, key_of(2), os.urandom(3000), 2)
    region[torn.offset + HEADER_BYTES + 100] ^= 0xFF  # its value changed after the header
    forged_at = torn.end
    block(region, forged_at, key_of(3), b"x" * 100, 3, mac_key=secrets.token_bytes(32))
    # A value holding a look-alike header page (made with another key) and a stray magic.
    inner = bytearray(3 * ALIGNMENT)
    block(inner, ALIGNMENT, key_of(4), b"y" * 10, 4, mac_key=secrets.token_bytes(32))
    inner[7:7 + len(MAGIC)] = MAGIC
    c = block(region, forged_at + 2 * ALIGNMENT, key_of(5), bytes(inner), 5)
    # A block claiming more than the region holds.
    block(region, CAPACITY - 2 * ALIGNMENT, key_of(6), b"z" * 10, 6,
          extent_length=4 * ALIGNMENT)
    found = scan(tmp_path, region, chunk)
    assert {r.key: r.location.extent for r in found.blocks} == {key_of(1): ea, key_of(5): c}
    first = next(r for r in found.blocks if r.key == key_of(1))
    assert (first.parent, first.retention, first.seq) == (key_of(7), kept, 1)
    assert first.location.header == HEADER_BYTES and first.location.nbytes == len(a)
    assert found.dropped == 2  # the torn block and the one past the end
    assert found.unverified == 2  # the two headers made with another key
    assert found.top_seq == 6
    assert found.scanned_bytes == CAPACITY


def test_conflicts_keep_the_newest_copy(tmp_path: Path) -> None:
    region = bytearray(CAPACITY)
    block(region, 0, key_of(1), b"old" * 100, 3)
    newer = block(region, 8 * ALIGNMENT, key_of(1), b"new" * 100, 9)
    # A stale block whose space a newer one reused without changing its bytes: both verify.
    inner = bytearray(5 * ALIGNMENT)
    later = block(inner, ALIGNMENT, key_of(3), b"later" * 10, 12)
    outer = block(region, 16 * ALIGNMENT, key_of(2), bytes(inner), 4)
    found = scan(tmp_path, region)
    assert {r.key: r.location.extent for r in found.blocks} == {
        key_of(1): newer, key_of(3): Extent(outer.offset + HEADER_BYTES + later.offset,
                                            later.length)}
    assert found.dropped == 2


def test_a_witness_keeps_its_key_and_the_highest_acknowledged_write(tmp_path: Path) -> None:
    path = str(tmp_path / "index.witness")
    assert Witness.load(path) is None
    w = Witness.create(path, acked=5)
    w.record(3)  # never backwards
    w.record(11)
    w.close()
    again = Witness.load(path)
    assert again is not None and (again.mac_key, again.acked) == (w.mac_key, 11)
    again.close()
    with open(path, "r+b") as f:
        f.write(b"garbage!")
    assert Witness.load(path) is None
