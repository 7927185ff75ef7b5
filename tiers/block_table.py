"""The TierManager's block table: key to entry, entry records, and the eviction queues
over them, behind one Protocol with two implementations.

* ``python``: a dict of ``BlockEntry`` objects and ``EvictionQueue`` heaps of tuples
  (several Python objects per block);
* ``native``: ``tiers.native_index`` (issue #24): the keys, records and heaps in native
  memory (``cffi_build/block_index.c``), no Python object per block; an entry handed out
  is a handle onto its record (one per block while anyone holds it).

Both keep the manager's semantics exactly (leases, pins, orders: the same tests run on
each); which one runs: ``tiers.index_kind``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from kvstore.core.keys import BlockKey, leading_run
from tiers.errors import LeaseNotHeld
from tiers.index_budget import IndexKind
from tiers.index_kind import resolve
from tiers.policy import EvictionPolicy, EvictionQueue
from tiers.records import UNLINKED, BlockEntry


class BlockTable(Protocol):
    """What the TierManager keeps per block (``tiers.manager``: the key table, entries
    and queues); iteration is in insertion order, as a dict's."""

    kind: IndexKind

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def __iter__(self) -> Iterator[BlockKey]: ...

    def __getitem__(self, key: BlockKey) -> BlockEntry: ...

    def __setitem__(self, key: BlockKey, entry: BlockEntry) -> None:
        """Indexes ``entry`` (from ``new_entry``) under its key, last in order."""

    def __delitem__(self, key: BlockKey) -> None:
        """Unindexes ``key``; its entry lives on (leases) until ``retire``."""

    def get(self, key: BlockKey) -> BlockEntry | None: ...

    def items(self) -> Iterator[tuple[BlockKey, BlockEntry]]: ...

    def new_entry(self, *, key: BlockKey, parent: BlockKey | None, nbytes: int, level: int,
                  extent: Any = None, location: Any = None, pinned: bool = False,
                  children: int = 0, last_access: int = 0) -> BlockEntry:
        """A record for a block about to be indexed (``BlockEntry``'s arguments)."""

    def unlink(self, entry: BlockEntry) -> None:
        """Unindexes ``entry`` for good: out of the key table and its queue (``queue_seq``
        0), flagged ``UNLINKED``; it lives on (leases) until ``retire``."""

    def add_child(self, parent: BlockKey) -> bool:
        """One more indexed block names ``parent``: its count grows; False (nothing
        counted) if ``parent`` is not indexed."""

    def drop_child(self, parent: BlockKey) -> int:
        """One indexed block naming ``parent`` left: its children left, -1 if ``parent`` is
        not indexed. ValueError (nothing changed) if it has none: a broken count."""

    def end_read(self, entry: BlockEntry) -> bool:
        """Ends one read lease of ``entry``: True if it was the last lease of an unlinked
        entry (its space is now the caller's to free). ``LeaseNotHeld`` if none is held."""

    def retire(self, entry: BlockEntry) -> None:
        """``entry`` is unindexed, unleased and its space freed: nothing reads it again."""

    def prefix_length(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys`` are indexed before the first that is not."""

    def make_queue(self, policy: EvictionPolicy, *, clock: Iterator[int], level: int
                   ) -> EvictionQueue:
        """The eviction queue of tier ``level`` over this table's entries."""


class PyBlockTable(dict[BlockKey, BlockEntry]):
    """The pure-Python block table: a dict of ``BlockEntry`` objects."""

    kind: IndexKind = "python"

    def items(self) -> Iterator[tuple[BlockKey, BlockEntry]]:  # type: ignore[override]  # an iterator, as the Protocol's
        return iter(dict.items(self))

    def new_entry(self, *, key: BlockKey, parent: BlockKey | None, nbytes: int, level: int,
                  extent: Any = None, location: Any = None, pinned: bool = False,
                  children: int = 0, last_access: int = 0) -> BlockEntry:
        return BlockEntry(key=key, parent=parent, nbytes=nbytes, level=level, extent=extent,
                          location=location, pinned=pinned, children=children,
                          last_access=last_access)

    def unlink(self, entry: BlockEntry) -> None:
        del self[entry.key]
        entry.queue_seq = 0  # EvictionQueue.forget(entry)
        entry.flags |= UNLINKED

    def add_child(self, parent: BlockKey) -> bool:
        p = self.get(parent)
        if p is None:
            return False
        p.children += 1
        return True

    def drop_child(self, parent: BlockKey) -> int:
        p = self.get(parent)
        if p is None:
            return -1
        if p.children <= 0:
            raise ValueError(f"{parent.hex()} has no child to drop")
        p.children -= 1
        return p.children

    def end_read(self, entry: BlockEntry) -> bool:
        if entry.readers <= 0:
            raise LeaseNotHeld(f"release of a read lease not held: {entry.key.hex()}")
        entry.readers -= 1
        return entry.readers == 0 and entry.flags & UNLINKED != 0

    def retire(self, entry: BlockEntry) -> None:
        pass

    def prefix_length(self, keys: Sequence[BlockKey]) -> int:
        return leading_run(map(self.__contains__, keys))  # map: no frame per key

    def make_queue(self, policy: EvictionPolicy, *, clock: Iterator[int], level: int
                   ) -> EvictionQueue:
        return EvictionQueue(policy, clock=clock)


def make_table(kind: str | None = None) -> BlockTable:
    """The block table of ``kind`` (``tiers.index_kind.resolve``)."""
    if resolve(kind) == "python":
        return PyBlockTable()
    from tiers.native_index import NativeBlockTable

    return NativeBlockTable()
