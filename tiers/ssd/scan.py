"""Finding the SSD tier's blocks without its index: one sequential scan of the data region.

Used only to rebuild a damaged index (:meth:`tiers.ssd.tier.SsdTier` with
``allow_index_rebuild``). The region is read once, in large aligned chunks (O_DIRECT
safe). Every page that starts with a block header whose MAC verifies (see
:mod:`tiers.ssd.header`) is a candidate; its value is hashed as the scan streams past it,
and only a candidate whose bytes match its checksum is kept. So a torn or corrupted
block, a header overwritten by a later block, or bytes that merely look like a header
are never indexed.

Two intact candidates can still conflict: copies of one key written at different times,
or (rarely) a stale block whose space a later one reused without changing its bytes.
The highest sequence number wins each conflict and the losers are dropped, so the
rebuilt index names non-overlapping extents and one copy per key.

Blocks written before format 2 carry no header: a scan cannot find them.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

import xxhash

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent
from tiers.ssd.header import MAGIC, BlockHeader, decode_header
from tiers.ssd.types import ALIGNMENT, HEADER_BYTES, SsdLocation, SsdRecord

CHUNK_BYTES = 8 << 20


@dataclass(slots=True, kw_only=True)
class ScanResult:
    """What a scan found: the blocks to index, and what it left out."""

    blocks: list[SsdRecord] = field(default_factory=list)
    dropped: int = 0  # verified headers whose block failed its checksum, or lost a conflict
    unverified: int = 0  # pages that start like a header but fail its MAC
    top_seq: int = 0  # the highest sequence number of any verified header
    scanned_bytes: int = 0


@dataclass(slots=True, kw_only=True)
class _Candidate:
    header: BlockHeader
    start: int  # offset of the header page
    fed: int  # value bytes hashed so far
    hasher: xxhash.xxh3_64 = field(default_factory=xxhash.xxh3_64)

    @property
    def value_start(self) -> int:
        return self.start + HEADER_BYTES


def scan_region(fd: int, capacity: int, mac_key: bytes, *, chunk_bytes: int = CHUNK_BYTES
                ) -> ScanResult:
    """Scans ``[0, capacity)`` of ``fd`` (``capacity`` a multiple of the alignment)."""
    if chunk_bytes % ALIGNMENT or chunk_bytes < HEADER_BYTES:
        raise ValueError(f"chunk_bytes must be a multiple of {ALIGNMENT}, got {chunk_bytes}")
    out = ScanResult()
    intact: list[_Candidate] = []
    open_: list[_Candidate] = []
    buf = mmap.mmap(-1, chunk_bytes)  # page-aligned: O_DIRECT reads go straight in
    try:
        with memoryview(buf) as view:
            for base in range(0, capacity, chunk_bytes):
                want = min(chunk_bytes, capacity - base)
                got = os.preadv(fd, [view[:want]], base)
                out.scanned_bytes += got
                for c in _headers(buf, view, base, got, capacity, mac_key, out):
                    open_.append(c)
                open_ = _feed(open_, view, base, got, intact, out)
                if got < want:
                    break  # the region ends early (it never should): nothing lies past it
    finally:
        buf.close()
    out.dropped += len(open_)  # values cut off by the end of the region
    _resolve(intact, out)
    return out


def _headers(buf: mmap.mmap, view: memoryview, base: int, got: int, capacity: int,
             mac_key: bytes, out: ScanResult) -> list[_Candidate]:
    """The verified headers on the pages of one chunk."""
    found: list[_Candidate] = []
    pos = 0
    while True:
        i = buf.find(MAGIC, pos, got)
        if i < 0:
            return found
        if i % ALIGNMENT:
            pos = (i // ALIGNMENT + 1) * ALIGNMENT  # a header starts a page: skip the rest
            continue
        pos = i + ALIGNMENT
        h = decode_header(mac_key, view[i:i + HEADER_BYTES])
        if h is None:
            out.unverified += 1
            continue
        start = base + i
        # New writes must number after every block on disk, kept or not.
        out.top_seq = max(out.top_seq, h.seq)
        if (h.extent_length % ALIGNMENT or HEADER_BYTES + h.nbytes > h.extent_length
                or start + h.extent_length > capacity):
            out.dropped += 1  # verified yet impossible: never written by this tier
            continue
        found.append(_Candidate(header=h, start=start, fed=0))


def _feed(open_: list[_Candidate], view: memoryview, base: int, got: int,
          intact: list[_Candidate], out: ScanResult) -> list[_Candidate]:
    """Hashes each open candidate's value bytes within this chunk; those complete are
    judged (kept if they match their checksum). Returns the ones still open."""
    still: list[_Candidate] = []
    end = base + got
    for c in open_:
        lo = c.value_start + c.fed
        hi = min(c.value_start + c.header.nbytes, end)
        if hi > lo:
            c.hasher.update(view[lo - base:hi - base])
            c.fed += hi - lo
        if c.fed < c.header.nbytes:
            still.append(c)
        elif c.hasher.intdigest() == c.header.checksum:
            intact.append(c)
        else:
            out.dropped += 1  # torn or corrupted
    return still


def _resolve(intact: list[_Candidate], out: ScanResult) -> None:
    """Keeps non-overlapping blocks, one per key, the highest sequence number first."""
    intact.sort(key=lambda c: c.start)
    kept: list[_Candidate] = []
    group: list[_Candidate] = []  # candidates whose extents overlap, one after another
    group_end = -1
    for c in intact:
        if c.start >= group_end and group:
            kept.extend(_winners(group, out))
            group = []
        group.append(c)
        group_end = max(group_end, c.start + c.header.extent_length)
    if group:
        kept.extend(_winners(group, out))
    best: dict[BlockKey, _Candidate] = {}
    for c in kept:
        other = best.get(c.header.key)
        if other is None or c.header.seq > other.header.seq:
            best[c.header.key] = c
        if other is not None:
            out.dropped += 1
    for c in sorted(best.values(), key=lambda c: c.start):
        h = c.header
        out.blocks.append(SsdRecord(
            key=h.key, parent=h.parent, retention=h.retention, seq=h.seq,
            location=SsdLocation(extent=Extent(c.start, h.extent_length), nbytes=h.nbytes,
                                 checksum=h.checksum, header=HEADER_BYTES)))


def _winners(group: list[_Candidate], out: ScanResult) -> list[_Candidate]:
    """The candidates of one overlapping group that keep their space, newest first."""
    if len(group) == 1:
        return group
    won: list[_Candidate] = []
    for c in sorted(group, key=lambda c: -c.header.seq):
        end = c.start + c.header.extent_length
        if any(c.start < w.start + w.header.extent_length and w.start < end for w in won):
            out.dropped += 1
        else:
            won.append(c)
    return won
