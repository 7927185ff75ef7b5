"""The SSD tier's durable index: a RocksDB (``rocksdict``) entry per block, and a format record.

Each entry holds offset, extent length, value length, an xxh3-64 checksum and the
parent key, so the tier can rebuild its allocator from the index alone, with no scan
of the data. Invariants the tier relies on:

* Every mutation is one synced write (``WriteOptions.sync``): a ``WriteBatch`` of
  entries lands whole or not at all.
* :meth:`SsdIndex.delete` removes an entry only if it still names the given location.
* The format record (under ``_META_KEY``, which sorts before every block key) names the
  format, version, alignment and data-region capacity; an index with blocks always has
  one, and an index is never served against a region of another size.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from typing import Any, cast

import rocksdict

from kvstore.core.keys import KEY_BYTES, BlockKey
from tiers.allocator import Extent
from tiers.ssd.types import ALIGNMENT, SsdFormatError, SsdLocation, SsdRecord

FORMAT_NAME = "kvstore-ssd-index"
FORMAT_VERSION = 1

# The meta key sorts before every block key (b"b" + key), so a prefix scan from
# _BLOCK_PREFIX never sees it.
_META_KEY = b"\x00meta"
_BLOCK_PREFIX = b"b"
# offset, extent length, value length, checksum, has_parent, parent key.
_ENTRY = struct.Struct("<QQQQB16s")
_NO_PARENT = bytes(KEY_BYTES)


def _encode_entry(extent: Extent, nbytes: int, checksum: int, parent: bytes | None) -> bytes:
    return _ENTRY.pack(extent.offset, extent.length, nbytes, checksum,
                       parent is not None, bytes(parent) if parent is not None else _NO_PARENT)


def _decode_entry(raw: bytes) -> tuple[BlockKey | None, SsdLocation]:
    if len(raw) != _ENTRY.size:
        raise SsdFormatError(f"index entry of {len(raw)} bytes, expected {_ENTRY.size}")
    offset, length, nbytes, checksum, has_parent, parent = _ENTRY.unpack(raw)
    if nbytes > length:
        raise SsdFormatError(f"index entry claims {nbytes} bytes in an extent of {length}")
    loc = SsdLocation(extent=Extent(offset, length), nbytes=nbytes, checksum=checksum)
    return (BlockKey(parent) if has_parent else None), loc


class SsdIndex:
    """The open index of the data region at ``data_path`` (named in error messages)."""

    def __init__(self, path: str, data_path: str) -> None:
        self.path = path
        self._data_path = data_path
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        self._sync_write = rocksdict.WriteOptions()
        self._sync_write.sync = True
        self._db = rocksdict.Rdict(path, opts)

    def validate(self, capacity: int, data_missing: bool) -> tuple[bool, bool]:
        """Checks the format record against this configuration.

        Returns (the format record is still to be written, the index holds blocks).
        """
        raw = self._db.get(_META_KEY)
        has_blocks = self._first_block_key() is not None
        if raw is None:
            if has_blocks:
                raise SsdFormatError(f"index {self.path} has blocks but no format record")
        else:
            try:
                meta = json.loads(bytes(raw))
            except ValueError as exc:
                raise SsdFormatError(f"index {self.path}: unreadable format record") from exc
            if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
                raise SsdFormatError(
                    f"index {self.path} has format {meta.get('format')!r} version "
                    f"{meta.get('version')!r}; this code reads {FORMAT_NAME!r} "
                    f"version {FORMAT_VERSION}")
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
        return raw is None, has_blocks

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
        """Writes the format record (durably)."""
        meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "alignment": ALIGNMENT,
                "capacity": capacity, "block_device": block_device}
        self._db.put(_META_KEY, json.dumps(meta, sort_keys=True).encode(), self._sync_write)

    def put(self, entries: Sequence[tuple[BlockKey, BlockKey | None, Extent, int, int]]) -> None:
        """Writes the (key, parent, extent, value length, checksum) entries in one synced
        batch."""
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key, parent, ext, nbytes, checksum in entries:
            batch.put(_BLOCK_PREFIX + bytes(key), _encode_entry(ext, nbytes, checksum, parent))
        self._db.write(batch, self._sync_write)

    def delete(self, keys_and_locations: Sequence[tuple[BlockKey, SsdLocation]]) -> None:
        """Removes, in one synced batch, each entry that still names its location (a key
        written twice keeps its newer entry when the older copy is deleted)."""
        # Typed as the stub's key union: a list of bytes is no list of that union (a list
        # is invariant).
        db_keys: list[str | int | float | bytes | bool] = [
            _BLOCK_PREFIX + bytes(k) for k, _ in keys_and_locations]
        # A list of keys gets a list of values (None where a key is missing); the stub
        # returns Any | None whatever the key.
        stored = cast("list[Any]", self._db.get(db_keys))
        batch = rocksdict.WriteBatch(raw_mode=True)
        for dbk, raw, (_, loc) in zip(db_keys, stored, keys_and_locations, strict=True):
            if raw is not None and _decode_entry(bytes(raw))[1] == loc:
                batch.delete(dbk)
        self._db.write(batch, self._sync_write)

    def records(self) -> list[SsdRecord]:
        """Every entry, in key order."""
        records: list[SsdRecord] = []
        for k, v in self._raw_items(_BLOCK_PREFIX):
            if not k.startswith(_BLOCK_PREFIX):
                break
            key = bytes(k[len(_BLOCK_PREFIX):])
            if len(key) != KEY_BYTES:
                raise SsdFormatError(f"index key of wrong length: {k!r}")
            parent, loc = _decode_entry(bytes(v))
            records.append(SsdRecord(key=BlockKey(key), parent=parent, location=loc))
        return records

    def close(self) -> None:
        self._db.close()
