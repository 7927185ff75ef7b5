"""The SSD tier: immutable KV blocks on a file or block device.

Layout and durability
---------------------
* The data region is a regular file (created and sized to ``capacity``) or a block
  device (a local NVMe namespace, or an NVMe-oF one the kernel shows as a block
  device). It carries no header: every byte of it belongs to blocks, carved by an
  :class:`~tiers.allocator.ExtentAllocator` with 4096-byte alignment.
* Data is written with ``O_DIRECT`` (aligned buffers, aligned offsets, lengths
  padded to 4096) so the page cache is neither polluted nor trusted. A filesystem
  that refuses ``O_DIRECT`` (``EINVAL``) gets buffered I/O instead; ``stats()``
  says which is in use and why.
* Each block (format 2) is a header page, then its value: the header names the key,
  parent, length, checksum, write sequence number and retention, under a keyed MAC
  (:mod:`tiers.ssd.header`), so the region can be read without the index.
* The index lives in RocksDB (``rocksdict``). :meth:`SsdTier.write_blocks` writes
  every block's value and header, makes them durable (``fdatasync``), and only then
  writes the index entries in one synced ``WriteBatch``. So after a crash a block is either
  fully recoverable (its entry exists, and the data it names was durable before
  the entry was) or absent (no entry; its extent is free again after recovery).
  :meth:`SsdTier.delete` removes the entries durably *before* freeing the extents,
  so an entry never names space that may be reused, and zeroes the blocks' headers
  first, so a scan never brings a deleted block back.
* Each entry holds offset, extent length, value length, an xxh3-64 checksum and
  the parent key, so :meth:`SsdTier.recover` rebuilds the allocator from the
  index alone, with no scan of the data. Every read verifies the checksum: a torn
  or corrupted block reads as missing (``False``), never as wrong bytes.
* A damaged index (RocksDB cannot read it, it lost writes the witness file saw
  acknowledged, or it is gone while the region was in use: see :mod:`tiers.ssd.index`)
  raises :class:`SsdIndexDamagedError` at open, before the data file is touched,
  unless ``allow_index_rebuild``: then the damaged index is moved aside, the region is
  scanned (:mod:`tiers.ssd.scan`) and every block whose header and bytes verify is
  indexed again (``rebuild_report`` says how many, and how many were dropped).

I/O backends
------------
``"uring"``: the native helper ``tiers._uring`` (built by ``python -m
cffi_build.uring_build``) submits a batch of readv/writev through io_uring with up
to ``queue_depth`` in flight. ``"python"``: ``os.preadv``/``os.pwritev`` on a
thread pool of ``queue_depth`` threads (the syscalls release the GIL). ``"auto"``
picks uring when the module imports and a ring can be created. A helper built with
xxHash verifies each read's checksum in C, without the GIL, as it lands; otherwise
(and for the thread pool) the check runs in Python, with the same result.

Concurrency: the allocator, counters and index mutations are guarded by one lock,
so a node may call the batch methods from several threads; two callers must still
never write one extent at once (the Tier contract).

Modules: :class:`SsdTier` here; the recovering allocator in :mod:`tiers.ssd.alloc`; the
data file or device in :mod:`tiers.ssd.region`; scratch buffers and I/O backends in
:mod:`tiers.ssd.io`; O_DIRECT bounce staging in :mod:`tiers.ssd.staging`; the RocksDB
index in :mod:`tiers.ssd.index`; block headers and the witness file in
:mod:`tiers.ssd.header`; the rebuild's scan in :mod:`tiers.ssd.scan`; the alignment, errors
and location types (re-exported here) in :mod:`tiers.ssd.types`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import xxhash

from kvstore.core.keys import BlockKey, ensure_key
from tiers.allocator import Extent
from tiers.ssd.alloc import _SsdAllocator
from tiers.ssd.buffers import ARENA_CACHE_BYTES, ArenaPool, byte_view
from tiers.ssd.header import Witness, encode_header
from tiers.ssd.index import FORMAT_NAME, FORMAT_VERSION, SsdIndex
from tiers.ssd.io import IO_CHOICES, Backend, OnComplete, _Op, open_backend, uring_available
from tiers.ssd.reads import SsdReads
from tiers.ssd.region import fsync_dir, open_data, probe_region, size_region
from tiers.ssd.scan import scan_region
from tiers.ssd.staging import ReadJob, bounces, read_views, transfer_bytes, write_views
from tiers.ssd.types import (
    ALIGNMENT,
    HEADER_BYTES,
    NotRecoveredError,
    RebuildReport,
    Retention,
    SsdError,
    SsdFormatError,
    SsdIndexDamagedError,
    SsdLocation,
    SsdRecord,
    UringUnavailableError,
)

# Re-exported: callers import these from tiers.ssd.tier.
__all__ = [
    "ALIGNMENT", "FORMAT_NAME", "FORMAT_VERSION", "HEADER_BYTES", "IO_CHOICES",
    "NotRecoveredError", "RebuildReport", "Retention", "SsdError", "SsdFormatError",
    "SsdIndexDamagedError", "SsdLocation", "SsdReads", "SsdRecord", "SsdTier",
    "UringUnavailableError", "uring_available",
]

log = logging.getLogger("kvstore.tiers.ssd")

# Entries per index batch when a rebuild writes the blocks it found.
_REBUILD_BATCH = 4096


# --------------------------------------------------------------------------- the tier


class SsdTier:
    """Immutable KV blocks on a file or block device (see the module docstring).

    ``direct=False`` forces buffered I/O + fdatasync, the path a filesystem without
    O_DIRECT support (e.g. an old tmpfs) gets automatically. ``preallocate``
    reserves the file's blocks with posix_fallocate when the file is created, so a
    full disk shows up at start rather than as a failed write. ``allow_index_rebuild``:
    rebuild a damaged index from the data region instead of raising
    SsdIndexDamagedError (``rebuild_report`` then says what the scan found).
    """

    name = "ssd"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity: int,
        *,
        io: str = "auto",
        index_path: str | None = None,
        queue_depth: int = 32,
        direct: bool = True,
        preallocate: bool = True,
        allow_index_rebuild: bool = False,
        index_kind: str | None = None,
    ) -> None:
        """``index_kind``: the kind of the allocator's live table (``tiers.index_kind``;
        None: the environment's), not to be confused with the tier's own durable index
        (``index_path``)."""
        if io not in IO_CHOICES:
            raise ValueError(f"io must be one of {IO_CHOICES}, got {io!r}")
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        if capacity < ALIGNMENT:
            raise ValueError(f"capacity must be at least {ALIGNMENT} bytes, got {capacity}")
        self._path = os.fspath(path)
        self._lock = threading.Lock()
        self._closed = False
        self._fd = -1
        self._index: SsdIndex | None = None
        self._witness: Witness | None = None
        self._backend: Backend | None = None
        self._arenas = ArenaPool(ARENA_CACHE_BYTES)
        self.rebuild_report: RebuildReport | None = None
        try:
            self._open(capacity, io, index_path, queue_depth, direct, preallocate,
                       allow_index_rebuild, index_kind)
        except BaseException:
            self.close()
            raise

    def _open(self, capacity: int, io: str, index_path: str | None, queue_depth: int,
              direct: bool, preallocate: bool, allow_rebuild: bool,
              index_kind: str | None) -> None:
        self.is_block_device, created = probe_region(self._path, capacity)
        if self.is_block_device and index_path is None:
            raise ValueError("a block device needs an explicit index_path")
        self._index_path = index_path if index_path is not None else self._path + ".index"
        witness_path = self._index_path + ".witness"
        self._witness = Witness.load(witness_path)
        # The region held blocks before if the witness exists, or (a regular file) if the
        # data file did: an index without a format record then lost it.
        in_use = os.path.exists(witness_path) or (not created and not self.is_block_device)
        self._allocator = _SsdAllocator(capacity, alignment=ALIGNMENT, index=index_kind)
        # Validate the index before touching the data file, so a mismatched
        # configuration, or a damaged index nobody allowed to rebuild, changes nothing.
        damage: SsdIndexDamagedError | None = None
        records: list[SsdRecord] = []
        write_meta = False
        try:
            if in_use and not os.path.exists(self._index_path):
                # (Opening it would create an empty one: a refusal must leave no trace.)
                raise SsdIndexDamagedError(
                    f"index {self._index_path} is missing, but the data region "
                    f"{self._path} was in use")
            self._index = SsdIndex(self._index_path, self._path)
            write_meta, _ = self._index.validate(
                capacity, created, in_use=in_use,
                acked=self._witness.acked if self._witness is not None else 0)
            records = self._index.records()
            self._rebuild_allocator(records)
        except SsdIndexDamagedError as exc:
            if not allow_rebuild:
                raise
            damage = exc

        size_region(self._path, capacity, block_device=self.is_block_device, created=created,
                    preallocate=preallocate)

        self._fd, self.o_direct, self.o_direct_fallback = open_data(
            self._path, direct, self._arenas)
        # Close the descriptor even if the tier is dropped without close() (a
        # simulated crash): only acknowledged, already durable state matters then.
        self._fd_finalizer = weakref.finalize(self, os.close, self._fd)

        if damage is not None:
            records = self._rebuild(damage, capacity, witness_path)
        elif write_meta:
            # Only once the region exists: an index's format record promises a data
            # file of this size.
            assert self._index is not None
            self._index.write_format(capacity, self.is_block_device)
        if self._witness is None:
            if in_use and damage is None:
                log.warning("SSD tier %s: the witness file %s is missing or unreadable; a "
                            "new one is made, and blocks written before cannot be found by "
                            "a rebuild", self._path, witness_path)
            assert self._index is not None
            self._witness = Witness.create(witness_path, acked=self._index.high_water)
        assert self._index is not None
        # Sequence numbers go on from the highest either record has seen.
        self._seq = max(self._index.high_water, self._witness.acked)
        # Blocks in the index own their extents; until recover() hands them to the
        # caller, writing is refused.
        self._records = records
        self._needs_recover = bool(records)
        self._recovered = False

        self._backend, self.io_backend, self.io_backend_reason = open_backend(
            self._fd, io, queue_depth)

        self._blocks = len(records)
        self._reads = 0
        self._writes = 0
        self._bytes_read = 0
        self._bytes_written = 0
        self._checksum_failures = 0
        self._io_errors = 0
        self._fdatasyncs = 0
        self._mutated = False

    def _rebuild_allocator(self, records: Sequence[SsdRecord]) -> None:
        """Marks exactly the records' extents allocated (SsdIndexDamagedError if they
        overlap, are misaligned or fall outside the region)."""
        try:
            self._allocator.rebuild([r.location.extent for r in records])
        except SsdFormatError as exc:
            raise SsdIndexDamagedError(str(exc)) from exc

    def _rebuild(self, damage: SsdIndexDamagedError, capacity: int, witness_path: str
                 ) -> list[SsdRecord]:
        """Moves the damaged index aside, scans the region, and indexes every block whose
        header and bytes verify; the records of the new index."""
        if self._index is not None:
            self._index.close()
            self._index = None
        kept_at = None
        if os.path.exists(self._index_path):
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            kept_at = f"{self._index_path}.damaged-{stamp}"
            n = 1
            while os.path.exists(kept_at):
                n += 1
                kept_at = f"{self._index_path}.damaged-{stamp}-{n}"
            os.rename(self._index_path, kept_at)
            fsync_dir(os.path.dirname(os.path.abspath(self._index_path)))
        if self._witness is None:
            # No key: no header can be verified, so the scan finds nothing to trust.
            self._witness = Witness.create(witness_path, acked=0)
        found = scan_region(self._fd, self._allocator.capacity, self._witness.mac_key)
        index = self._index = SsdIndex(self._index_path, self._path)
        index.validate(capacity, False, in_use=False, acked=0)
        entries = [(r.key, r.parent, r.location, r.seq, r.retention) for r in found.blocks]
        for lo in range(0, len(entries), _REBUILD_BATCH):
            index.put(entries[lo:lo + _REBUILD_BATCH])
        index.raise_high_water(max(found.top_seq, self._witness.acked))
        index.write_format(capacity, self.is_block_device)
        records = index.records()
        self._rebuild_allocator(records)
        self.rebuild_report = RebuildReport(
            reason=str(damage), rebuilt=len(records), dropped=found.dropped,
            unverified=found.unverified, scanned_bytes=found.scanned_bytes, kept_at=kept_at)
        return records

    # ------------------------------------------------------------------ properties

    @property
    def capacity(self) -> int:
        """Usable bytes (the region rounded down to the alignment)."""
        return self._allocator.capacity

    @property
    def used(self) -> int:
        return self._allocator.used

    def largest_free(self) -> int:
        """The largest value (rounded to the alignment) a write could place now."""
        with self._lock:
            return self._allocator.largest_free()

    @property
    def path(self) -> str:
        return self._path

    @property
    def index_path(self) -> str:
        return self._index_path

    # ------------------------------------------------------------------ Tier protocol

    def footprint(self, nbytes: int) -> int:
        """A block's header page and value, rounded up to the alignment (``write_blocks``):
        8 KiB for a 64-byte value."""
        return self._allocator.rounded(HEADER_BYTES + nbytes)

    def allocate(self, nbytes: int) -> Extent | None:
        self._check_mutable()
        with self._lock:
            self._mutated = True
            return self._allocator.allocate(max(nbytes, 1))

    def free(self, extent: Extent) -> None:
        self._check_open()
        with self._lock:
            self._allocator.free(extent)

    def write(self, extent: Extent, data: memoryview) -> None:
        """Raw, durable write of ``data`` at the start of ``extent`` (no index, no checksum)."""
        self._check_open()
        mv = byte_view(data)
        if len(mv) > extent.length:
            raise ValueError(f"{len(mv)} bytes do not fit in {extent}")
        results = self._write_views([mv], [extent.offset])
        self._raise_on_failure(results, [transfer_bytes(mv, self.o_direct)])
        self._sync_data()
        with self._lock:
            self._writes += 1
            self._bytes_written += len(mv)

    def read_into(self, extent: Extent, nbytes: int, out: memoryview) -> None:
        """Raw read of the first ``nbytes`` of ``extent`` into ``out`` (no checksum)."""
        self._check_open()
        if nbytes > extent.length:
            raise ValueError(f"cannot read {nbytes} bytes from {extent}")
        mv = byte_view(out, writable=True)
        if len(mv) < nbytes:
            raise ValueError(f"out holds {len(mv)} bytes, {nbytes} needed")
        ok = self._read_views([mv[:nbytes]], [extent.offset], None)
        if not ok[0]:
            raise OSError(errno.EIO, f"SSD read of {extent} failed")
        with self._lock:
            self._reads += 1
            self._bytes_read += nbytes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._backend is not None:
            self._backend.close()
        if self._index is not None:
            self._index.close()
            self._index = None
        if self._witness is not None:
            self._witness.close()
        finalizer = getattr(self, "_fd_finalizer", None)
        if finalizer is not None:
            finalizer()
        elif self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
        self._arenas.close()

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ block API

    def write_blocks(
        self, items: Sequence[tuple[BlockKey, BlockKey | None, memoryview]],
        retention: Sequence[Retention | None] | None = None,
    ) -> list[SsdLocation | None]:
        """Stores each (key, parent, value); None for an item that does not fit.
        ``retention``: each item's, kept in its header and index entry (None: none).

        Returns only after the data and headers are durable and, after them, the index
        entries (one synced batch): every returned location survives a crash. On an I/O
        error nothing of the batch is acknowledged, its extents are freed, and the
        error propagates.
        """
        self._check_mutable()
        views = [byte_view(v) for _, _, v in items]
        for key, parent, _ in items:
            ensure_key(key)
            if parent is not None:
                ensure_key(parent)
        if retention is not None and len(retention) != len(items):
            raise ValueError(f"{len(retention)} retentions for {len(items)} items")
        extents: list[Extent | None] = []
        seqs: dict[int, int] = {}
        with self._lock:
            self._mutated = True
            for i, mv in enumerate(views):
                # The header page makes every extent unique, even for an empty value.
                ext = self._allocator.allocate(HEADER_BYTES + len(mv))
                extents.append(ext)
                if ext is not None:
                    self._seq += 1
                    seqs[i] = self._seq
        held = {i: e for i, e in enumerate(extents) if e is not None}  # the items that fit
        placed = list(held)
        keep = retention if retention is not None else [None] * len(items)
        try:
            checksums: dict[int, int] = {}

            def checksum(k: int, _result: int) -> None:
                # Runs as write k completes, while the rest of the batch is in flight.
                checksums[placed[k]] = xxhash.xxh3_64_intdigest(views[placed[k]])

            results = self._write_views([views[i] for i in placed],
                                        [held[i].offset + HEADER_BYTES for i in placed],
                                        checksum)
            for i in placed:
                if i not in checksums:  # empty values (no I/O)
                    checksums[i] = xxhash.xxh3_64_intdigest(views[i])
            self._raise_on_failure(results,
                                   [transfer_bytes(views[i], self.o_direct) for i in placed])
            if placed:
                # Headers after values: each names its value's checksum, known only now.
                self._write_headers([(items[i][0], items[i][1], held[i], len(views[i]),
                                      checksums[i], seqs[i], keep[i]) for i in placed])
                self._sync_data()
                assert self._index is not None
                self._index.put([(items[i][0], items[i][1],
                                  self._location(held[i], len(views[i]), checksums[i]),
                                  seqs[i], keep[i]) for i in placed])
        except BaseException:
            with self._lock:
                for i in placed:
                    self._allocator.free(held[i])
            raise
        out: list[SsdLocation | None] = [None] * len(items)
        nbytes = 0
        for i in placed:
            out[i] = self._location(held[i], len(views[i]), checksums[i])
            nbytes += len(views[i])
        with self._lock:
            if placed:
                assert self._witness is not None
                self._witness.record(max(seqs.values()))
            self._blocks += len(placed)
            self._writes += len(placed)
            self._bytes_written += nbytes
        return out

    @staticmethod
    def _location(extent: Extent, nbytes: int, checksum: int) -> SsdLocation:
        return SsdLocation(extent=extent, nbytes=nbytes, checksum=checksum,
                           header=HEADER_BYTES)

    def _write_headers(self, blocks: Sequence[tuple[BlockKey, BlockKey | None, Extent, int,
                                                    int, int, Retention | None]]) -> None:
        """Writes each block's header page (raises on an I/O error, as the values do)."""
        assert self._witness is not None
        mac_key = self._witness.mac_key
        arena = self._arenas.acquire(len(blocks) * HEADER_BYTES)
        try:
            with memoryview(arena) as pages:
                views = [pages[j * HEADER_BYTES:(j + 1) * HEADER_BYTES]
                         for j in range(len(blocks))]
                for view, (key, parent, ext, nbytes, checksum, seq, kept) in zip(
                        views, blocks, strict=True):
                    encode_header(mac_key, view, key=key, parent=parent, nbytes=nbytes,
                                  extent_length=ext.length, checksum=checksum, seq=seq,
                                  retention=kept)
                results = self._write_views(views, [b[2].offset for b in blocks])
                del views  # (no view of the arena may outlive the with)
            self._raise_on_failure(results, [HEADER_BYTES] * len(blocks))
        finally:
            self._arenas.release(arena)

    def _clear_headers(self, locations: Sequence[SsdLocation]) -> None:
        """Zeroes the header pages of blocks being deleted, so no scan finds them again.
        Not synced and best effort: a failure is counted in ``io_errors``."""
        arena = self._arenas.acquire(len(locations) * HEADER_BYTES)
        try:
            with memoryview(arena) as pages:
                n = len(locations) * HEADER_BYTES
                pages[:n] = bytes(n)
                results = self._write_views(
                    [pages[j * HEADER_BYTES:(j + 1) * HEADER_BYTES]
                     for j in range(len(locations))],
                    [loc.extent.offset for loc in locations])
            for r in results:
                if r != HEADER_BYTES:
                    self._count_failure("io_errors")
        finally:
            self._arenas.release(arena)

    def read_blocks_into(
        self, locations: Sequence[SsdLocation], outs: Sequence[memoryview]
    ) -> list[bool]:
        """Reads each block into the start of its ``out``; False if it failed its checksum
        (torn or corrupted: counted in ``checksum_failures``) or could not be read
        (``io_errors``). A False block's ``out`` holds unspecified bytes; a True one
        holds exactly the stored value."""
        self._check_open()
        if len(locations) != len(outs):
            raise ValueError(f"{len(locations)} locations but {len(outs)} buffers")
        views = self._read_targets(locations, outs)
        if len(views) == 1:
            one = self._read_one(locations[0], views[0])
            if one is not None:
                return [one]
        ok = self._read_views(views, [loc.value_offset for loc in locations],
                              [loc.checksum for loc in locations])
        self._count_reads(len(locations), sum(loc.nbytes for loc, good
                                              in zip(locations, ok, strict=True) if good))
        return ok

    def submit_reads(self, locations: Sequence[SsdLocation],
                     outs: Sequence[memoryview]) -> SsdReads:
        """Starts reading each block into the start of its ``out`` and returns at once.

        The returned :class:`SsdReads` yields each block's result as it finishes, in
        completion order; the same checks as :meth:`read_blocks_into` apply, and a
        failure is a False result, never an exception. Several reads outstanding
        (from one caller or many) share the tier's queue, so a caller with more
        blocks to read keeps it full instead of waiting for each batch's slowest read.
        The buffers must stay untouched until the handle reported them or is closed.
        """
        self._check_open()
        if len(locations) != len(outs):
            raise ValueError(f"{len(locations)} locations but {len(outs)} buffers")
        views = self._read_targets(locations, outs)
        assert self._backend is not None
        job = ReadJob(self._backend, self._arenas, self.o_direct, views,
                      [loc.value_offset for loc in locations],
                      [loc.checksum for loc in locations], self._count_failure)
        return SsdReads(self._count_reads, job, [loc.nbytes for loc in locations])

    def _read_targets(self, locations: Sequence[SsdLocation],
                      outs: Sequence[memoryview]) -> list[memoryview]:
        views: list[memoryview] = []
        for loc, out in zip(locations, outs, strict=True):
            mv = byte_view(out, writable=True)
            if len(mv) < loc.nbytes:
                raise ValueError(f"buffer of {len(mv)} bytes for a block of {loc.nbytes}")
            if loc.header + loc.nbytes > loc.extent.length:
                raise ValueError(f"corrupt location {loc}")
            views.append(mv[: loc.nbytes])
        return views

    def _read_one(self, loc: SsdLocation, view: memoryview) -> bool | None:
        """A lone block read straight into ``view`` (the common case of a node serving
        one key: one op run in this thread, without the staging of a batch); None where
        it needs the batch path: an empty or bounced (unaligned under O_DIRECT) block,
        or a read that did not move every byte (the batch path finishes or reports it).
        """
        n = len(view)
        if n == 0 or bounces(view, self.o_direct):
            return None
        assert self._backend is not None
        op = _Op(is_write=False, offset=loc.value_offset, bufs=[view], nbytes=n,
                 checksum=loc.checksum, verify_bytes=n)
        (result,) = self._backend.run([op])
        verdict = op.verified
        if result != n:
            return None
        if verdict < 0:
            verdict = xxhash.xxh3_64_intdigest(view) == loc.checksum
        if not verdict:
            self._count_failure("checksum_failures")
        self._count_reads(1, n if verdict else 0)
        return bool(verdict)

    def _count_reads(self, count: int, nbytes: int) -> None:
        with self._lock:
            self._reads += count
            self._bytes_read += nbytes

    def delete(self, keys_and_locations: Sequence[tuple[BlockKey, SsdLocation]]) -> None:
        """Removes the index entries durably, then frees the extents.

        An entry is removed only if it still names that location (a key written
        twice keeps its newer entry when the older copy is deleted).
        """
        self._check_mutable()
        if not keys_and_locations:
            return
        assert self._index is not None
        self._index.delete(keys_and_locations)
        headed = [loc for _, loc in keys_and_locations if loc.header]
        if headed:
            self._clear_headers(headed)
        with self._lock:
            self._mutated = True
            for _, loc in keys_and_locations:
                self._allocator.free(loc.extent)
                self._blocks -= 1

    def recover(self) -> list[SsdRecord]:
        """Every indexed block (their extents are allocated since the tier opened). Call
        once, right after opening and before any allocation. Reads only the index (a
        rebuild at open read the region)."""
        self._check_open()
        with self._lock:
            if self._recovered:
                raise RuntimeError("recover() already ran on this tier")
            if self._mutated:
                raise RuntimeError("recover() must run before any allocation or write")
            records, self._records = self._records, []
            self._recovered = True
            self._needs_recover = False
            return records

    @property
    def verifies_in_c(self) -> bool:
        """True if the io backend checks each read's checksum in C, without the GIL, as it
        lands (io_uring built with xxHash); else reads are checked in Python."""
        return self._backend is not None and self._backend.verifies

    def update_retention(self, updates: Sequence[tuple[BlockKey, SsdLocation,
                                                       Retention | None]]) -> int:
        """Sets the retention each (key, location) keeps across a restart, where the index
        still names that location (unsynced: a crash may lose the latest). How many
        entries changed."""
        self._check_open()
        if not updates:
            return 0
        assert self._index is not None
        return self._index.update_retention(updates)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "name": self.name,
                "capacity": self.capacity,
                "used": self.used,
                "blocks": self._blocks,
                "reads": self._reads,
                "writes": self._writes,
                "bytes_read": self._bytes_read,
                "bytes_written": self._bytes_written,
                "checksum_failures": self._checksum_failures,
                "io_errors": self._io_errors,
                "fdatasyncs": self._fdatasyncs,
                "io_backend": self.io_backend,
                "io_backend_reason": self.io_backend_reason,
                "o_direct": self.o_direct,
                "o_direct_fallback": self.o_direct_fallback,
                "block_device": self.is_block_device,
                "path": self._path,
                "index_path": self._index_path,
            }

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("SSD tier is closed")

    def _check_mutable(self) -> None:
        self._check_open()
        if self._needs_recover:
            raise NotRecoveredError(
                f"index {self._index_path} holds blocks: call recover() before writing")

    def _sync_data(self) -> None:
        os.fdatasync(self._fd)
        with self._lock:
            self._fdatasyncs += 1

    def _raise_on_failure(self, results: Sequence[int], expected: Sequence[int]) -> None:
        for r, want in zip(results, expected, strict=True):
            if r < 0:
                raise OSError(-r, f"SSD write failed: {os.strerror(-r)}")
            if r != want:
                raise OSError(errno.EIO, f"SSD short write: {r} of {want} bytes")

    def _write_views(self, views: Sequence[memoryview], offsets: Sequence[int],
                     on_complete: OnComplete | None = None) -> list[int]:
        """Writes each view at its offset; per-view bytes transferred or -errno."""
        assert self._backend is not None
        return write_views(self._backend, self._arenas, self.o_direct, views, offsets,
                           on_complete)

    def _read_views(self, views: Sequence[memoryview], offsets: Sequence[int],
                    checksums: Sequence[int] | None) -> list[bool]:
        """Reads ``len(view)`` bytes at each offset into each view; per-view success
        (with checksums, only blocks whose bytes hash to their checksum)."""
        assert self._backend is not None
        return read_views(self._backend, self._arenas, self.o_direct, views, offsets,
                          checksums, self._count_failure)

    def _count_failure(self, counter: str) -> None:
        """Counts one failed read in ``counter`` ("io_errors" or "checksum_failures")."""
        with self._lock:
            if counter == "io_errors":
                self._io_errors += 1
            else:
                self._checksum_failures += 1
