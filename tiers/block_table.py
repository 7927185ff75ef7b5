"""The TierManager's block table: key to entry, entry records, and the eviction queues
over them, behind one Protocol with two implementations.

* ``python``: a dict of ``BlockEntry`` objects and ``EvictionQueue`` heaps of tuples
  (several Python objects per block);
* ``native``: ``tiers.native_index`` (issue #24): the keys, records and heaps in native
  memory (``cffi_build/block_index.c``), no Python object per block; an entry handed out
  is a handle onto its record (one per block while anyone holds it).

Both keep the manager's semantics exactly (leases, pins, orders: the same tests run on
each). ``KVSTORE_NATIVE_INDEX=1`` selects the native index where a caller does not name
one, ``0`` the Python one; unset, ``DEFAULT_INDEX``. Without the built extension
(``python -m cffi_build.block_index_build``) a request for the native index falls back to
the Python one where no kind was named, and raises ``IndexUnavailable`` where one was.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from kvstore.core.keys import BlockKey, leading_run
from tiers.errors import TierError
from tiers.index_budget import IndexKind
from tiers.policy import EvictionPolicy, EvictionQueue
from tiers.records import BlockEntry

ENV = "KVSTORE_NATIVE_INDEX"
DEFAULT_INDEX: IndexKind = "python"
"""The index a TierManager runs when neither its caller nor ``KVSTORE_NATIVE_INDEX`` says."""


class IndexUnavailable(TierError):
    """The native index was asked for by name and its extension is not built."""


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

    def retire(self, entry: BlockEntry) -> None:
        pass

    def prefix_length(self, keys: Sequence[BlockKey]) -> int:
        return leading_run(map(self.__contains__, keys))  # map: no frame per key

    def make_queue(self, policy: EvictionPolicy, *, clock: Iterator[int], level: int
                   ) -> EvictionQueue:
        return EvictionQueue(policy, clock=clock)


def requested_kind() -> IndexKind | None:
    """What ``KVSTORE_NATIVE_INDEX`` asks for (None: unset or empty)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if value in ("1", "native"):
        return "native"
    if value in ("0", "python"):
        return "python"
    raise ValueError(f"{ENV} must be 1 (native) or 0 (python), got {value!r}")


def native_available() -> bool:
    try:
        importlib.import_module("tiers._block_index")
    except ImportError:
        return False
    return True


def make_table(kind: str | None = None) -> BlockTable:
    """The block table of ``kind`` (None: ``KVSTORE_NATIVE_INDEX``, else ``DEFAULT_INDEX``,
    the Python one where the native one is not built)."""
    named = kind is not None
    chosen = kind if kind is not None else requested_kind() or DEFAULT_INDEX
    if chosen == "python":
        return PyBlockTable()
    if chosen != "native":
        raise ValueError(f"index must be 'python' or 'native', got {chosen!r}")
    if not native_available():
        if named:
            raise IndexUnavailable("the native tier index is not built "
                                   "(python -m cffi_build.block_index_build)")
        return PyBlockTable()
    from tiers.native_index import NativeBlockTable

    return NativeBlockTable()
