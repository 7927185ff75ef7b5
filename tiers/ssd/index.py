"""The SSD tier's durable index: a RocksDB (``rocksdict``) entry per block, and a format record.

Each entry holds offset, extent length, value length, an xxh3-64 checksum and the
parent key, so the tier can rebuild its allocator from the index alone, with no scan
of the data; format 2 adds the block's header length, its write's sequence number and
its retention (a wall-clock deadline and its seconds). Invariants the tier relies on:

* Every mutation of entries is one synced write (``WriteOptions.sync``): a
  ``WriteBatch`` of entries lands whole or not at all. Retention updates are the one
  exception: unsynced (a crash may lose the last refreshes, never an entry).
* Mutations that read an entry first (:meth:`SsdIndex.delete`,
  :meth:`SsdIndex.update_retention`) run under one lock with the writes, so an entry
  is changed or removed only if it still names the given location.
* The format record (under ``_META_KEY``, which sorts before every block key) names the
  format, version, alignment and data-region capacity; an index with blocks always has
  one, and an index is never served against a region of another size.
* The high-water record (``_HW_KEY``) is the highest sequence number ever written, in
  the same batch as the entries that carry it, and never decreases: compared with the
  witness file (:mod:`tiers.ssd.header`) it tells an intact index from one that lost
  acknowledged writes.

Format versions: 1 (entries of 49 bytes, blocks without a header) is still read, and
an index of format 1 is marked format 2 when it is opened (its old entries keep their
meaning: their blocks carry no header, so only the index knows them). Code before
format 2 refuses a format-2 index.

What counts as damage (:class:`SsdIndexDamagedError`) rather than a configuration
mismatch (:class:`SsdFormatError`): RocksDB cannot open or read it, an entry or the
format record does not decode, blocks without a format record, a missing or empty index
where the data region was in use, or a high-water mark below the witness's.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import rocksdict

from kvstore.core.keys import KEY_BYTES, BlockKey
from tiers.allocator import Extent
from tiers.ssd.types import (
    ALIGNMENT,
    Retention,
    SsdFormatError,
    SsdIndexDamagedError,
    SsdLocation,
    SsdRecord,
)

FORMAT_NAME = "kvstore-ssd-index"
FORMAT_VERSION = 2
READS_VERSIONS = (1, 2)

# The meta keys sort before every block key (b"b" + key), so a prefix scan from
# _BLOCK_PREFIX never sees them.
_META_KEY = b"\x00meta"
_HW_KEY = b"\x00hw"
_BLOCK_PREFIX = b"b"
# Format 1: offset, extent length, value length, checksum, has_parent, parent key.
_ENTRY_V1 = struct.Struct("<QQQQB16s")
# Format 2 adds: header bytes, sequence number, retention deadline (wall clock, 0: none),
# retention seconds.
_ENTRY = struct.Struct("<QQQQB16sIQdd")
_NO_PARENT = bytes(KEY_BYTES)
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexEntry:
    """What one block's entry says (the key is the entry's own)."""

    parent: BlockKey | None
    location: SsdLocation
    seq: int
    retention: Retention | None


def _encode_entry(parent: bytes | None, loc: SsdLocation, seq: int,
                  retention: Retention | None) -> bytes:
    until, seconds = (retention.until, retention.seconds) if retention is not None else (0, 0)
    return _ENTRY.pack(loc.extent.offset, loc.extent.length, loc.nbytes, loc.checksum,
                       parent is not None, bytes(parent) if parent is not None else _NO_PARENT,
                       loc.header, seq, until, seconds)


def _decode_entry(raw: bytes) -> IndexEntry:
    parent, loc, seq, retention = _decode(raw)
    return IndexEntry(parent=parent, location=loc, seq=seq, retention=retention)


def _decode(raw: bytes) -> tuple[BlockKey | None, SsdLocation, int, Retention | None]:
    """(parent, location, sequence number, retention) of one entry; SsdIndexDamagedError
    if it does not decode or its value does not fit its extent. Restart decodes every
    entry through here: no object beyond the ones a record keeps."""
    header, seq, until, seconds = 0, 0, 0.0, 0.0
    if len(raw) == _ENTRY.size:
        (offset, length, nbytes, checksum, has_parent, parent, header, seq, until,
         seconds) = _ENTRY.unpack(raw)
    elif len(raw) == _ENTRY_V1.size:
        offset, length, nbytes, checksum, has_parent, parent = _ENTRY_V1.unpack(raw)
    else:
        raise SsdIndexDamagedError(f"index entry of {len(raw)} bytes, expected "
                                   f"{_ENTRY.size} (or {_ENTRY_V1.size})")
    if header + nbytes > length:
        raise SsdIndexDamagedError(f"index entry claims {header} + {nbytes} bytes in an "
                                   f"extent of {length}")
    return (parent if has_parent else None,
            SsdLocation(Extent(offset, length), nbytes, checksum, header),  # by position: fast
            seq, Retention(until=until, seconds=seconds) if until else None)


class SsdIndex:
    """The open index of the data region at ``data_path`` (named in error messages).

    Raises SsdIndexDamagedError if RocksDB cannot open it.
    """

    def __init__(self, path: str, data_path: str) -> None:
        self.path = path
        self._data_path = data_path
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        self._sync_write = rocksdict.WriteOptions()
        self._sync_write.sync = True
        self._lazy_write = rocksdict.WriteOptions()
        self._lock = threading.Lock()
        self._hw = 0  # guarded by _lock: the high-water record as last written
        try:
            self._db = rocksdict.Rdict(path, opts)
        except Exception as exc:  # rocksdict raises plain Exception for RocksDB errors
            raise SsdIndexDamagedError(f"RocksDB cannot open index {path}: {exc}") from exc

    def validate(self, capacity: int, data_missing: bool, *, in_use: bool, acked: int
                 ) -> tuple[bool, bool]:
        """Checks the format record against this configuration, and the index for damage.

        ``in_use``: the data region held blocks before (so an index without a format
        record lost it); ``acked``: the highest sequence number the witness saw
        acknowledged. Returns (the format record is still to be written, the index holds
        blocks).
        """
        try:
            raw = self._db.get(_META_KEY)
            has_blocks = self._first_block_key() is not None
            hw_raw = self._db.get(_HW_KEY)
        except Exception as exc:
            raise SsdIndexDamagedError(f"RocksDB cannot read index {self.path}: {exc}") from exc
        if raw is None:
            if has_blocks:
                raise SsdIndexDamagedError(f"index {self.path} has blocks but no format record")
            if in_use:
                raise SsdIndexDamagedError(
                    f"index {self.path} is missing or empty, but the data region "
                    f"{self._data_path} was in use")
        else:
            try:
                meta = json.loads(bytes(raw))
            except ValueError as exc:
                raise SsdIndexDamagedError(
                    f"index {self.path}: unreadable format record") from exc
            if not isinstance(meta, dict):
                raise SsdIndexDamagedError(f"index {self.path}: unreadable format record")
            if meta.get("format") != FORMAT_NAME or meta.get("version") not in READS_VERSIONS:
                raise SsdFormatError(
                    f"index {self.path} has format {meta.get('format')!r} version "
                    f"{meta.get('version')!r}; this code reads {FORMAT_NAME!r} "
                    f"versions {', '.join(map(str, READS_VERSIONS))}")
            if meta.get("alignment") != ALIGNMENT:
                raise SsdFormatError(
                    f"index {self.path} uses alignment {meta.get('alignment')}, "
                    f"expected {ALIGNMENT}")
            if meta.get("capacity") != capacity:
                raise SsdFormatError(
                    f"index {self.path} was written for a data file of "
                    f"{meta.get('capacity')} bytes, but {self._data_path} is opened with "
                    f"capacity {capacity}; refusing to mix them")
        if has_blocks and data_missing:
            raise SsdFormatError(
                f"index {self.path} names blocks but the data file {self._data_path} "
                "did not exist; refusing to serve from an empty file")
        if hw_raw is not None and len(hw_raw) != _U64.size:
            raise SsdIndexDamagedError(f"index {self.path}: unreadable high-water record")
        version = None if raw is None else meta.get("version")
        self._hw = _U64.unpack(bytes(hw_raw))[0] if hw_raw is not None else 0
        if self._hw < acked:
            raise SsdIndexDamagedError(
                f"index {self.path} lost acknowledged writes: it records writes up to "
                f"#{self._hw}, but the witness saw #{acked} acknowledged")
        return version != FORMAT_VERSION, has_blocks

    @property
    def high_water(self) -> int:
        """The highest sequence number this index has recorded."""
        with self._lock:
            return self._hw

    def _raw_keys(self, from_key: bytes) -> Iterator[bytes]:
        # raw_mode: every key the database holds is bytes; rocksdict's stub types a key as
        # any kind of key it accepts (str, int, float, bytes, bool).
        return cast("Iterator[bytes]", self._db.keys(from_key=from_key))

    def _raw_items(self, from_key: bytes) -> Iterator[tuple[bytes, Any]]:
        # raw_mode, as in _raw_keys.
        return cast("Iterator[tuple[bytes, Any]]", self._db.items(from_key=from_key))

    def _first_block_key(self) -> bytes | None:
        for k in self._raw_keys(_BLOCK_PREFIX):
            return k if k.startswith(_BLOCK_PREFIX) else None
        return None

    def write_format(self, capacity: int, block_device: bool) -> None:
        """Writes the format record (durably), marking the index as this format."""
        meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "alignment": ALIGNMENT,
                "capacity": capacity, "block_device": block_device}
        with self._lock:
            self._db.put(_META_KEY, json.dumps(meta, sort_keys=True).encode(),
                         self._sync_write)

    def put(self, entries: Sequence[tuple[BlockKey, BlockKey | None, SsdLocation, int,
                                          Retention | None]]) -> None:
        """Writes the (key, parent, location, sequence number, retention) entries, and the
        high-water record, in one synced batch."""
        batch = rocksdict.WriteBatch(raw_mode=True)
        top = 0
        for key, parent, loc, seq, retention in entries:
            batch.put(_BLOCK_PREFIX + bytes(key), _encode_entry(parent, loc, seq, retention))
            top = max(top, seq)
        with self._lock:
            if top > self._hw:
                batch.put(_HW_KEY, _U64.pack(top))
            self._db.write(batch, self._sync_write)
            self._hw = max(self._hw, top)

    def raise_high_water(self, seq: int) -> None:
        """Records (durably) that sequence numbers up to ``seq`` were used."""
        with self._lock:
            if seq > self._hw:
                self._db.put(_HW_KEY, _U64.pack(seq), self._sync_write)
                self._hw = seq

    def delete(self, keys_and_locations: Sequence[tuple[BlockKey, SsdLocation]]) -> None:
        """Removes, in one synced batch, each entry that still names its location (a key
        written twice keeps its newer entry when the older copy is deleted)."""
        # Typed as the stub's key union: a list of bytes is no list of that union (a list
        # is invariant).
        db_keys: list[str | int | float | bytes | bool] = [
            _BLOCK_PREFIX + bytes(k) for k, _ in keys_and_locations]
        with self._lock:
            # A list of keys gets a list of values (None where a key is missing); the stub
            # returns Any | None whatever the key.
            stored = cast("list[Any]", self._db.get(db_keys))
            batch = rocksdict.WriteBatch(raw_mode=True)
            for dbk, raw, (_, loc) in zip(db_keys, stored, keys_and_locations, strict=True):
                if raw is not None and _decode_entry(bytes(raw)).location == loc:
                    batch.delete(dbk)
            self._db.write(batch, self._sync_write)

    def update_retention(self, updates: Sequence[tuple[BlockKey, SsdLocation, Retention | None]]
                         ) -> int:
        """Sets the retention of each entry that still names its location (one unsynced
        batch: a crash may lose it, and the block then keeps its older deadline). How many
        entries changed."""
        db_keys: list[str | int | float | bytes | bool] = [
            _BLOCK_PREFIX + bytes(k) for k, _, _ in updates]
        changed = 0
        with self._lock:
            stored = cast("list[Any]", self._db.get(db_keys))  # as in remove_if_at
            batch = rocksdict.WriteBatch(raw_mode=True)
            for dbk, raw, (_, loc, retention) in zip(db_keys, stored, updates, strict=True):
                if raw is None:
                    continue
                entry = _decode_entry(bytes(raw))
                if entry.location == loc and entry.retention != retention:
                    batch.put(dbk, _encode_entry(entry.parent, loc, entry.seq, retention))
                    changed += 1
            if changed:
                self._db.write(batch, self._lazy_write)
        return changed

    def records(self) -> list[SsdRecord]:
        """Every entry, in key order (SsdIndexDamagedError if one cannot be read)."""
        records: list[SsdRecord] = []
        add, decode, Record = records.append, _decode, SsdRecord  # locals: once per entry
        skip = len(_BLOCK_PREFIX)
        key_end = skip + KEY_BYTES
        try:
            for k, v in self._raw_items(_BLOCK_PREFIX):
                if not k.startswith(_BLOCK_PREFIX):
                    break
                if len(k) != key_end:
                    raise SsdIndexDamagedError(f"index key of wrong length: {k!r}")
                parent, loc, seq, retention = decode(v)
                add(Record(BlockKey(k[skip:]), parent, loc, retention, seq))
        except SsdIndexDamagedError:
            raise
        except Exception as exc:  # RocksDB's own errors (a corrupt table read lazily)
            raise SsdIndexDamagedError(f"RocksDB cannot read index {self.path}: {exc}") from exc
        return records

    def close(self) -> None:
        self._db.close()
