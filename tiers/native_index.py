"""The native block table (issue #24): ``tiers.block_table.BlockTable`` over the records,
key table and heaps of ``cffi_build/block_index.c``, with no Python object per block.

An entry handed out (``get``, ``new_entry``, a victim) is a ``NativeEntry``: a handle
onto its record whose attributes read and write the record's fields in place (cffi
struct access: no C call, the GIL held). Records never move, so a handle stays valid
while its block is leased, read outside the owner's lock as a ``BlockEntry`` is. One
handle per record exists at a time while anyone holds it (``is`` holds as for the Python
table's entries); handles nobody holds are dropped in amortised sweeps.

Every C call (key table, heaps) is made under the owner's lock, as every other
TierManager call. A durable tier's location records (Python objects) are kept in a dict
by slot; offsets in memory tiers are record fields.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent
from tiers.errors import LeaseNotHeld
from tiers.index_budget import IndexKind
from tiers.policy import (
    B,
    Blocks,
    Deferred,
    Eligibility,
    EvictionPolicy,
    EvictionQueue,
    QueuedBlock,
)
from tiers.records import MOVING, PINNED, UNLINKED, BlockEntry

_module: Any = importlib.import_module("tiers._block_index")  # cffi: untyped
ffi: Any = _module.ffi
lib: Any = _module.lib
API_VERSION = 5  # cffi_build/block_index_build.py API_VERSION
KEY_BYTES = 16
_NONE = lib.KVB_NONE
_EBAD = lib.KVB_EBAD
_CHUNK_BITS = lib.KVB_CHUNK_BITS
_CHUNK_MASK = (1 << _CHUNK_BITS) - 1
_EVICT = Eligibility.EVICT
_DEFER = Eligibility.DEFER
_SWEEP_FLOOR = 1024
_ITER_BATCH = 4096
_getrefcount = sys.getrefcount
_UNREAD = object()  # a handle's parent not read from its record yet


class NativeIndexError(RuntimeError):
    """The native table refused a call (a bad slot, or out of memory)."""


def _indexable(key: object) -> bool:
    """Whether ``key`` is one the native table can hold: 16 bytes, of type bytes."""
    return type(key) is bytes and len(key) == KEY_BYTES


def _check(rc: int, what: str) -> int:
    if rc < 0:
        reason = "out of memory" if rc == lib.KVB_ENOMEM else "bad argument"
        raise NativeIndexError(f"native index: {what} failed ({reason})")
    return rc


class _Record(Protocol):
    """A ``struct kvb_entry *`` as cffi shows it (``cffi_build/block_index_build.py``)."""

    key: Any
    parent: Any
    nbytes: int
    place: int
    length: int
    last_access: int
    queue_seq: int
    queue_priority: float
    readers: int
    children: int
    hits: int
    tier_hits: int
    heap_pos: int
    gen: int
    level: int
    flags: int
    has_parent: int
    pkind: int


class NativeEntry(BlockEntry):
    """A ``BlockEntry`` whose fields are a native record's (see the module). Its key and
    parent are fixed when the record is made."""

    __slots__ = ("_gen", "_key", "_p", "_parent", "_slot", "_table")

    def __init__(self, table: NativeBlockTable, slot: int, p: _Record, key: BlockKey) -> None:
        # No BlockEntry.__init__: every field is a property over the record.
        self._table = table
        self._slot = slot
        self._p = p
        self._key = key
        self._gen = p.gen  # the record's generation: retiring it bumps the record's
        self._parent: object = _UNREAD

    @property
    def key(self) -> BlockKey:  # type: ignore[override]  # read-only here: fixed at creation
        return self._key

    @property
    def parent(self) -> BlockKey | None:  # type: ignore[override]  # read-only here: fixed at creation
        parent = self._parent
        if parent is _UNREAD:
            p = self._p
            parent = BlockKey(ffi.buffer(p.parent, KEY_BYTES)[:]) if p.has_parent else None
            self._parent = parent
        return cast("BlockKey | None", parent)  # a string: no Union built per call

    @property
    def nbytes(self) -> int:  # type: ignore[override]  # read-only here: fixed at creation
        return self._p.nbytes

    @property
    def queue_priority(self) -> float:
        return self._p.queue_priority

    @property
    def level(self) -> int:
        return self._p.level

    @level.setter
    def level(self, value: int) -> None:
        self._p.level = value

    @property
    def flags(self) -> int:
        return self._p.flags

    @flags.setter
    def flags(self, value: int) -> None:
        self._p.flags = value

    @property
    def readers(self) -> int:
        # A retired record has no readers (a release of it again must fail, as it does on
        # a Python entry), whatever its slot holds now.
        p = self._p
        return p.readers if p.gen == self._gen else 0

    @readers.setter
    def readers(self, value: int) -> None:
        self._p.readers = value

    @property
    def children(self) -> int:
        return self._p.children

    @children.setter
    def children(self, value: int) -> None:
        self._p.children = value

    @property
    def hits(self) -> int:
        return self._p.hits

    @hits.setter
    def hits(self, value: int) -> None:
        self._p.hits = value

    @property
    def tier_hits(self) -> int:
        return self._p.tier_hits

    @tier_hits.setter
    def tier_hits(self, value: int) -> None:
        self._p.tier_hits = value

    @property
    def last_access(self) -> int:
        return self._p.last_access

    @last_access.setter
    def last_access(self, value: int) -> None:
        self._p.last_access = value

    @property
    def queue_seq(self) -> int:
        return self._p.queue_seq

    @queue_seq.setter
    def queue_seq(self, value: int) -> None:
        p = self._p
        p.queue_seq = value
        if not value and p.heap_pos != _NONE:
            lib.kvb_heap_remove(self._table.c, self._slot)  # forgotten: out of its heap

    @property
    def length(self) -> int:
        return self._p.length

    @length.setter
    def length(self, value: int) -> None:
        self._p.length = value

    @property
    def place(self) -> Any:
        p = self._p
        kind = p.pkind
        if kind == 1:
            return p.place
        if kind == 2:
            return self._table.places.get(self._slot)
        return None

    @place.setter
    def place(self, value: Any) -> None:
        p = self._p
        if p.pkind == 2:
            self._table.places.pop(self._slot, None)
        p.place, p.pkind = _place_fields(value)
        if p.pkind == 2:
            self._table.places[self._slot] = value


def _record_place(key: BlockKey, parent: BlockKey | None, extent: Extent | None,
                  location: Any) -> tuple[int, int, int]:
    """A new record's (place, length, pkind), once its keys are checked (ValueError)."""
    if not _indexable(key):
        raise ValueError(f"the native index keeps {KEY_BYTES}-byte keys, got {key!r}")
    if parent is not None and len(parent) != KEY_BYTES:
        raise ValueError(f"the native index keeps {KEY_BYTES}-byte keys, "
                         f"got parent {parent!r}")
    if extent is not None:
        return extent.offset, extent.length, 1
    (place, pkind) = _place_fields(location)
    return place, 0, pkind


def _place_fields(value: Any) -> tuple[int, int]:
    """A place's record fields (place, pkind): none (0), an int kept in the record (1), or
    an object the table keeps by slot (2: a durable tier's location record)."""
    if value is None:
        return 0, 0
    if type(value) is int:
        return value, 1
    return 0, 2


class NativeBlockTable:
    """``BlockTable`` over a ``kvb_table`` (see the module)."""

    kind: IndexKind = "native"

    def __init__(self) -> None:
        if lib.kvb_api_version() != API_VERSION:
            raise NativeIndexError(f"tiers._block_index is API {lib.kvb_api_version()}, "
                                   f"this code needs {API_VERSION}: rebuild it")
        c = lib.kvb_open()
        if c == ffi.NULL:
            raise MemoryError("native index: no memory for an empty table")
        self.c = ffi.gc(c, lib.kvb_close)
        self.places: dict[int, Any] = {}  # slot -> a durable tier's location record
        self._chunks: list[Any] = []
        self._handles: dict[int, NativeEntry] = {}
        self._sweep_at = _SWEEP_FLOOR

    # ---- handles -------------------------------------------------------------------------

    def _record(self, slot: int) -> Any:
        chunks = self._chunks
        i = slot >> _CHUNK_BITS
        while i >= len(chunks):
            chunks.append(lib.kvb_chunk(self.c, len(chunks)))
        return chunks[i] + (slot & _CHUNK_MASK)

    def handle(self, slot: int, key: BlockKey | None = None) -> NativeEntry:
        """The one handle of ``slot`` (made if nobody holds one)."""
        h = self._handles.get(slot)
        if h is not None:
            return h
        p = self._record(slot)
        if key is None:
            key = BlockKey(ffi.buffer(p.key, KEY_BYTES)[:])
        h = NativeEntry(self, slot, p, key)
        self._handles[slot] = h
        if len(self._handles) > self._sweep_at:
            self._sweep()
        return h

    def _sweep(self) -> None:
        """Drops the handles nobody else holds (counted: the dict's and the call's: 2)."""
        handles = self._handles
        dead = [s for s in handles if _getrefcount(handles[s]) <= 2]
        for s in dead:
            del handles[s]
        self._sweep_at = 2 * len(handles) + _SWEEP_FLOOR

    # ---- the Protocol --------------------------------------------------------------------

    def __len__(self) -> int:
        return int(lib.kvb_count(self.c))

    def __contains__(self, key: object) -> bool:
        return (_indexable(key)
                and lib.kvb_find(self.c, key) >= 0)

    def _slot_of(self, key: BlockKey) -> int:
        if not _indexable(key):
            return -1
        return int(lib.kvb_find(self.c, key))

    def get(self, key: BlockKey) -> BlockEntry | None:
        slot = self._slot_of(key)
        return None if slot < 0 else self.handle(slot, key)

    def __getitem__(self, key: BlockKey) -> BlockEntry:
        slot = self._slot_of(key)
        if slot < 0:
            raise KeyError(key)
        return self.handle(slot, key)

    def __setitem__(self, key: BlockKey, entry: BlockEntry) -> None:
        h = self._own(entry)
        if h.key != key:
            raise ValueError("an entry is indexed under its own key")
        _check(lib.kvb_link(self.c, h._slot), "link")

    def __delitem__(self, key: BlockKey) -> None:
        slot = self._slot_of(key)
        if slot < 0:
            raise KeyError(key)
        _check(lib.kvb_unlink(self.c, slot), "unlink")

    def _slots(self) -> Iterator[int]:
        cursor = ffi.new("uint32_t *", _NONE)
        buf = ffi.new("uint32_t[]", _ITER_BATCH)
        while True:
            n = lib.kvb_slots(self.c, cursor, buf, _ITER_BATCH)
            yield from buf[0:n]
            if cursor[0] == _NONE:
                return

    def __iter__(self) -> Iterator[BlockKey]:
        record = self._record
        for slot in list(self._slots()):
            yield BlockKey(ffi.buffer(record(slot).key, KEY_BYTES)[:])

    def items(self) -> Iterator[tuple[BlockKey, BlockEntry]]:
        for slot in list(self._slots()):
            h = self.handle(slot)
            yield h.key, h

    def new_entry(self, *, key: BlockKey, parent: BlockKey | None, nbytes: int, level: int,
                  extent: Extent | None = None, location: Any = None, pinned: bool = False,
                  children: int = 0, last_access: int = 0) -> BlockEntry:
        place, length, pkind = _record_place(key, parent, extent, location)
        slot = _check(int(lib.kvb_new(self.c, key, ffi.NULL if parent is None else bytes(parent),
                                      nbytes, level, place, length, pkind,
                                      PINNED if pinned else 0, children, last_access)),
                      "new record")
        if pkind == 2:
            self.places[slot] = location
        h = self.handle(slot, key)
        h._parent = parent
        return h

    def insert(self, *, key: BlockKey, parent: BlockKey | None, nbytes: int, level: int,
               tick: int, extent: Extent | None = None, location: Any = None,
               pinned: bool = False, children: int = 0) -> bool:
        """``TierManager``'s indexing of a new block (its commit, its adopt) in one C call,
        for a policy ordered by recency (``EvictionPolicy.by_recency``; ``kvb_insert``): the
        ``new_entry`` of these fields at last access ``tick``, linked, counted as a child
        of ``parent`` where that is indexed, queued at ``tick`` unless pinned. No handle
        is made. Returns whether a block is indexed under ``parent`` (False: the caller
        counts an orphan); NativeIndexError (nothing changed) if ``key`` is indexed."""
        place, length, pkind = _record_place(key, parent, extent, location)
        rc = _check(int(lib.kvb_insert(self.c, key,
                                       ffi.NULL if parent is None else bytes(parent), nbytes,
                                       level, place, length, pkind, PINNED if pinned else 0,
                                       children, tick)), "insert")
        if pkind == 2:
            self.places[rc & 0xFFFFFFFF] = location
        return bool(rc >> 32)

    def read_hit(self, key: BlockKey, tick: int, *, leaves_only: bool, promote_after: int
                 ) -> tuple[NativeEntry, int, bool] | None:
        """``TierManager.acquire_read``'s hit path in one C call, for a policy ordered by
        recency (``EvictionPolicy.by_recency``): the entry of ``key`` leased, its hit
        counted and requeued at ``tick`` (``kvb_read_hit``), with its level and whether
        it is now due for promotion; None if ``key`` is not indexed."""
        if not _indexable(key):
            return None
        hit = int(lib.kvb_read_hit(self.c, key, tick, leaves_only, promote_after, MOVING))
        if hit < 0:
            if hit == -1:
                return None
            _check(hit, "read")
        return self.handle(hit & 0xFFFFFFFF, key), (hit >> 32) & 0xFF, bool(hit >> 40)

    def unlink(self, entry: BlockEntry) -> None:
        h = self._own(entry)
        _check(lib.kvb_unlink_entry(self.c, h._slot, UNLINKED), "unlink")

    def add_child(self, parent: BlockKey) -> bool:
        return self._child(parent, 1) >= 0

    def drop_child(self, parent: BlockKey) -> int:
        return self._child(parent, -1)

    def _child(self, parent: BlockKey, delta: int) -> int:
        if not _indexable(parent):
            return -1  # never indexed here
        left = int(lib.kvb_child(self.c, parent, delta))
        if left == _EBAD:  # a broken count: a drop below 0, or an add past 2**32 - 1
            raise ValueError(f"{parent.hex()} has no child to drop" if delta < 0
                             else f"{parent.hex()} has 2**32 - 1 children already")
        return left

    def end_read(self, entry: BlockEntry) -> bool:
        h = self._own(entry)
        rc = int(lib.kvb_release_read(self.c, h._slot, h._gen, UNLINKED))
        if rc < 0:
            raise LeaseNotHeld(f"release of a read lease not held: {h._key.hex()}")
        return rc == 1

    def retire(self, entry: BlockEntry) -> None:
        h = self._own(entry)
        slot = h._slot
        if h._p.pkind == 2:
            self.places.pop(slot, None)
        self._handles.pop(slot, None)
        _check(lib.kvb_retire(self.c, slot), "retire")

    def prefix_length(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:  # only 16-byte keys can be indexed here
            if not _indexable(key):
                break
            n += 1
        if not n:
            return 0
        return int(lib.kvb_prefix_length(self.c, b"".join(keys[:n]), n))

    def make_queue(self, policy: EvictionPolicy, *, clock: Iterator[int], level: int
                   ) -> EvictionQueue:
        if not 0 <= level < lib.KVB_LEVELS:
            raise ValueError(f"the native index keeps at most {lib.KVB_LEVELS} tiers")
        return NativeEvictionQueue(policy, clock=clock, table=self, level=level)

    def native_bytes(self) -> int:
        """Native memory the table holds."""
        return int(lib.kvb_native_bytes(self.c))

    def moving_buckets(self) -> int:
        """Buckets of the key table's old half still to move while it grows (0: not
        growing; ``cffi_build/probe_table.c``)."""
        return int(lib.kvb_moving(self.c))

    def _own(self, entry: BlockEntry) -> NativeEntry:
        if not isinstance(entry, NativeEntry) or entry._table is not self:
            raise TypeError("not an entry of this native table")
        return entry


class NativeEvictionQueue(EvictionQueue):
    """``EvictionQueue`` over one level's native heap: indexed (a block is in at most one
    heap, at one place), so there are no stale items and nothing to compact; it pops the
    blocks in the exact order of the lazy heap of tuples."""

    __slots__ = ("_level", "_table")

    def __init__(self, policy: EvictionPolicy, *, clock: Iterator[int],
                 table: NativeBlockTable, level: int) -> None:
        super().__init__(policy, clock=clock)
        self._table = table
        self._level = level

    def __len__(self) -> int:
        return int(lib.kvb_heap_len(self._table.c, self._level))

    def push(self, key: BlockKey, block: QueuedBlock, seq: int | None = None) -> None:
        if seq is None:
            seq = next(self._clock)
        h = cast(NativeEntry, block)
        _check(lib.kvb_heap_push(self._table.c, self._level, h._slot, self._priority(block),
                                 seq), "queue push")

    def pop_victim(
        self,
        blocks: Blocks[B],
        eligibility: Callable[[B], Eligibility],
        deferred: Deferred,
    ) -> BlockKey | None:
        table = self._table
        c, level = table.c, self._level
        while True:
            slot = int(lib.kvb_heap_pop(c, level))
            if slot < 0:
                return None
            h = table.handle(slot)
            p = h._p
            prio, seq = float(p.queue_priority), int(p.queue_seq)
            verdict = eligibility(cast(B, h))
            if verdict is _EVICT:
                p.queue_seq = 0
                self._on_evict(prio)
                return h._key
            if verdict is _DEFER:
                deferred.append((prio, seq, slot))
            else:
                p.queue_seq = 0

    def restore(self, deferred: Deferred) -> None:
        c, level = self._table.c, self._level
        for _prio, seq, slot in deferred:
            _check(lib.kvb_heap_restore(c, level, slot, seq), "queue restore")
        deferred.clear()

    def needs_compaction(self, live: int) -> bool:
        return False  # an indexed heap holds no stale items

    def compact(self, blocks: Mapping[BlockKey, QueuedBlock]) -> None:
        pass
