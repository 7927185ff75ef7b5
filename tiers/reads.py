"""Reading leased blocks out of their tiers: in place from memory, in one batch from disk.

The caller holds a read lease on each block (or is moving it), so its bytes stay put
while they are read without the owner's lock; the lock is taken only to report a
block whose copy failed its checksum. The node's reads and the TierMover's copies
both go through here.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from tiers.manager import BlockEntry, TierManager

_PAGE = mmap.PAGESIZE


def leased_block_view(manager: TierManager, lock: AbstractContextManager[Any],
                      entry: BlockEntry) -> memoryview | None:
    """The bytes of a block the caller holds a lease on (or is moving).

    In place for a mapped tier; otherwise read into a new buffer without ``lock``.
    None if the copy failed its checksum: the block is then reported corrupt under
    ``lock`` (counted, and dropped from the index) and must be treated as a miss.
    """
    if manager.is_mapped(entry):  # the common case, a node's every one-block get: in place
        return manager.read_view(entry)
    return leased_block_views(manager, lock, [entry])[0]


def leased_block_views(manager: TierManager, lock: AbstractContextManager[Any],
                       entries: Sequence[BlockEntry | None]) -> list[memoryview | None]:
    """``leased_block_view`` of each entry (None stays None), reading the blocks of a
    durable tier in one batch: one ``read_blocks_into`` call keeps the tier's queue
    as deep as the batch, where one call per block would read at queue depth 1.

    The batch lands in one page-aligned buffer (each block at a page boundary), so
    O_DIRECT reads go straight into it instead of through a bounce buffer.
    """
    out: list[memoryview | None] = [None] * len(entries)
    durable: dict[int, list[BlockEntry]] = {}  # level -> its entries
    positions: dict[int, list[int]] = {}  # level -> their places in ``entries``
    for i, e in enumerate(entries):
        if e is None:
            continue
        if manager.is_mapped(e):
            out[i] = manager.read_view(e)
            continue
        level = manager.level_of(e)
        if level.durable_tier is not None:
            durable.setdefault(e.level, []).append(e)
            positions.setdefault(e.level, []).append(i)
        else:
            extent = e.extent
            assert extent is not None  # a leased block of a memory tier holds its extent
            buf = memoryview(bytearray(e.nbytes))
            level.tier.read_into(extent, e.nbytes, buf)
            out[i] = buf
    for level_index, batch in durable.items():
        tier = manager.levels[level_index].store
        spans = [-(-e.nbytes // _PAGE) * _PAGE for e in batch]
        arena = memoryview(mmap.mmap(-1, max(sum(spans), _PAGE)))
        bufs, at = [], 0
        for e, span in zip(batch, spans, strict=True):
            bufs.append(arena[at:at + e.nbytes])
            at += span
        ok = tier.read_blocks_into([e.location for e in batch], bufs)
        corrupt = []
        for i, e, buf, good in zip(positions[level_index], batch, bufs, ok, strict=True):
            if good:
                out[i] = buf
            else:
                corrupt.append(e)
        if corrupt:
            with lock:
                for e in corrupt:
                    manager.report_corrupt(e)
    return out
