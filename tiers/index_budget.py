"""What the tier index costs in memory per block, for a node's start-up budget.

A node's tiers hold bytes; its index (``tiers.manager.TierManager``: the key to entry
table, the per-block fields, the eviction queues, the allocator's live table) holds
metadata in host memory, one record per block. At full occupancy a tier of ``C`` bytes
holding blocks of ``B`` bytes has ``C // B`` of them, so a node started with 64 GiB of
DRAM and 1 TiB of SSD in 64 KiB blocks indexes 17.8 million blocks. ``index_bytes``
is what those records need, and ``kvstore.node.fit`` refuses to start a node whose
tiers and index together do not fit the memory it may use.

The figures per block are measured, not derived:

* ``python``: the pure-Python index (``BlockEntry`` objects, dicts, heap tuples), by
  ``python -m benchmarks.index_scale`` on a ``MetadataTier`` (only metadata, small
  values): the RSS delta per block after the index was filled, at 1 and 10 million
  blocks (``benchmarks/RESULTS.md``, "The tier index at 1, 10 and 50 million blocks").
  What does not depend on the count (the objects per block) is that figure less the
  two dicts' tables; the tables are computed for the capacity (``dict_table_bytes``),
  because a dict doubles its table when it fills and costs 34-67 bytes per entry
  depending on where between two growths the count falls.
* ``native``: the native index (``tiers.native_index``, ``KVSTORE_NATIVE_INDEX=1``), by
  the same benchmark with ``--index native``: 186 bytes per block in RSS at 1 million
  blocks, 165 at 10 million. Its 120-byte record per block is fixed; its key table (8
  bytes a bucket), heap (4 bytes a place) and the allocator's live table (16 bytes a
  bucket; 8 where the tier's region holds fewer than 2**32 - 2 alignment units, which
  took 17 bytes a block off at 1 million) double as they fill, so the figure steps
  between about 145 and 190 with the count and the tier; the budget takes the top of
  that range, the wide live table's.

Neither counts a durable tier's location records (``tiers.ssd``: one Python object per
SSD block in both indexes), which the benchmark's metadata-only tier has none of.
"""

from __future__ import annotations

from typing import Literal

IndexKind = Literal["python", "native"]
INDEX_KINDS: tuple[IndexKind, ...] = ("python", "native")

DEFAULT_BLOCK_BYTES = 64 << 10
"""The block size a node's budget assumes unless told (``--block-bytes``)."""

PYTHON_FIXED_BYTES_PER_BLOCK = 350
"""Measured, less the two dicts' tables: the objects each block keeps (above)."""

PYTHON_DICTS_PER_BLOCK = 2
"""The index's ``key -> entry`` dict and the allocator's ``offset -> length`` dict."""

NATIVE_BYTES_PER_BLOCK = 190
"""Measured (186 at 1 million blocks, 165 at 10 million), the top of its range: see the
module."""


def index_bytes_per_block(capacity_blocks: int, *, kind: str) -> int:
    """Bytes of host memory the ``kind`` index needs per block when it holds
    ``capacity_blocks`` blocks (rounded up to a whole byte)."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    if kind == "python":
        tables = PYTHON_DICTS_PER_BLOCK * dict_table_bytes(max(1, capacity_blocks))
        return PYTHON_FIXED_BYTES_PER_BLOCK - (-tables // max(1, capacity_blocks))
    if kind == "native":
        return NATIVE_BYTES_PER_BLOCK
    raise ValueError(f"index kind must be one of {', '.join(INDEX_KINDS)}, got {kind!r}")


def dict_table_bytes(entries: int) -> int:
    """The hash table of a CPython 3.11 dict grown by inserting ``entries`` keys that are
    not ``str``: a power-of-two index of 1-8 byte slots, two thirds of it usable, and a
    24-byte entry per usable slot. Its size per entry steps between about 34 and 67
    bytes as the table doubles, which is why the figure depends on the capacity."""
    size = 8
    while size * 2 // 3 < entries:
        size *= 2
    width = 1 if size <= 0xFF else 2 if size <= 0xFFFF else 4 if size <= 0xFFFFFFFF else 8
    return size * width + size * 2 // 3 * 24


def index_bytes(capacity_blocks: int, *, kind: str) -> int:
    """Bytes of host memory the ``kind`` index needs to hold ``capacity_blocks`` blocks."""
    return capacity_blocks * index_bytes_per_block(capacity_blocks, kind=kind)


def blocks_at_full_occupancy(tier_bytes: int, block_bytes: int) -> int:
    """How many blocks of ``block_bytes`` a tier of ``tier_bytes`` holds when full."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    return max(0, tier_bytes) // block_bytes
