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
* The index lives in RocksDB (``rocksdict``). :meth:`SsdTier.write_blocks` writes
  every block's data, makes it durable (``fdatasync``), and only then writes the
  index entries in one synced ``WriteBatch``. So after a crash a block is either
  fully recoverable (its entry exists, and the data it names was durable before
  the entry was) or absent (no entry; its extent is free again after recovery).
  :meth:`SsdTier.delete` removes the entries durably *before* freeing the extents,
  so an entry never names space that may be reused.
* Each entry holds offset, extent length, value length, an xxh3-64 checksum and
  the parent key, so :meth:`SsdTier.recover` rebuilds the allocator from the
  index alone, with no scan of the data. Every read verifies the checksum: a torn
  or corrupted block reads as missing (``False``), never as wrong bytes.

I/O backends
------------
``"uring"``: the native helper ``tiers._uring`` (built by ``python -m
cffi_build.uring_build``) submits a batch of readv/writev through io_uring with up
to ``queue_depth`` in flight. ``"python"``: ``os.preadv``/``os.pwritev`` on a
thread pool of ``queue_depth`` threads (the syscalls release the GIL). ``"auto"``
picks uring when the module imports and a ring can be created.

Concurrency: the allocator, counters and index mutations are guarded by one lock,
so a node may call the batch methods from several threads; two callers must still
never write one extent at once (the Tier contract).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import mmap
import os
import stat
import struct
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import cffi
import rocksdict
import xxhash

from kvstore.keys import BlockKey
from tiers.allocator import Extent, ExtentAllocator
from tiers.errors import TierError

ALIGNMENT = 4096
"""Offset, length and buffer alignment of every O_DIRECT transfer."""

FORMAT_NAME = "kvstore-ssd-index"
FORMAT_VERSION = 1

_KEY_BYTES = 16
# The meta key sorts before every block key (b"b" + key), so a prefix scan from
# _BLOCK_PREFIX never sees it.
_META_KEY = b"\x00meta"
_BLOCK_PREFIX = b"b"
# offset, extent length, value length, checksum, has_parent, parent key.
_ENTRY = struct.Struct("<QQQQB16s")
_NO_PARENT = bytes(_KEY_BYTES)

# A batch is split into chunks whose bounce buffers stay under this, so a batch
# of large unaligned values cannot make the tier map gigabytes of scratch memory.
_MAX_BOUNCE_PER_CHUNK = 64 << 20
# Scratch arenas kept for reuse across calls (their pages are already faulted in).
_ARENA_CACHE_BYTES = 128 << 20
_ZEROS = bytes(ALIGNMENT)

# ABI-mode FFI: only used to read buffer addresses (for the alignment test), which
# needs no compiler, so it works whether or not the native module was built.
_ffi = cffi.FFI()

IO_CHOICES = ("auto", "uring", "python")


class SsdError(TierError):
    """Base of SSD-tier errors."""


class SsdFormatError(SsdError, ValueError):
    """The index or data file does not match what this tier was opened with."""


class UringUnavailableError(SsdError, RuntimeError):
    """``io="uring"`` was requested but the native io_uring backend cannot run here."""


class NotRecoveredError(SsdError, RuntimeError):
    """The index holds blocks but :meth:`SsdTier.recover` has not run: allocating could
    overwrite them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SsdLocation:
    """Where one block lives: ``nbytes`` of value at the start of ``extent``."""

    extent: Extent
    nbytes: int
    checksum: int  # xxh3_64 of the value bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class SsdRecord:
    """One index entry, as :meth:`SsdTier.recover` returns it."""

    key: BlockKey
    parent: BlockKey | None
    location: SsdLocation


# --------------------------------------------------------------------------- allocator


class _SsdAllocator(ExtentAllocator):
    """An ExtentAllocator that can be reset to a given set of live extents.

    Recovery knows exactly which extents the index names; the base class can only
    hand out extents of its own choosing. Rebuilding the free list as the gaps
    between the recovered extents is O(n log n) and needs no data scan.
    """

    __slots__ = ()

    def rebuild(self, live: Sequence[Extent]) -> None:
        """Makes exactly ``live`` allocated and everything else free.

        Only valid on an allocator with nothing allocated. Raises SsdFormatError
        if the extents overlap, are misaligned or fall outside the region: that
        index cannot have been written by this tier for this file.
        """
        if self.live_count:
            raise RuntimeError("rebuild() needs an allocator with no live extents")
        a, cap = self.alignment, self.capacity
        ordered = sorted(live, key=lambda e: e.offset)
        prev_end = 0
        for e in ordered:
            if e.length <= 0 or e.offset % a or e.length % a:
                raise SsdFormatError(f"index names a misaligned extent {e}")
            if e.offset < prev_end:
                raise SsdFormatError(f"index names overlapping extents near offset {e.offset}")
            if e.end > cap:
                raise SsdFormatError(f"index names extent {e} beyond the region ({cap} bytes)")
            prev_end = e.end
        # Reset the base class's state (see its invariants): no free extents, no live ones.
        self._free_by_start.clear()
        self._free_by_end.clear()
        for b in self._bins:
            b.clear()
        self._live.clear()
        cursor = 0
        used = 0
        for e in ordered:
            if e.offset > cursor:
                self._insert_free(cursor, e.offset - cursor)
            self._live[e.offset] = e.length
            used += e.length
            cursor = e.end
        if cursor < cap:
            self._insert_free(cursor, cap - cursor)
        self._used = used


# --------------------------------------------------------------------------- buffers


def _byte_view(obj: Any, *, writable: bool = False) -> memoryview:
    """``obj`` as a 1-D unsigned-byte memoryview, without copying."""
    mv = obj if isinstance(obj, memoryview) else memoryview(obj)
    if not mv.c_contiguous:
        raise ValueError("SSD tier buffers must be C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    if writable and mv.readonly:
        raise ValueError("read destination is read-only")
    return mv


def _address(mv: memoryview) -> int:
    return int(_ffi.cast("uintptr_t", _ffi.from_buffer(mv)))


def _round_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class _ArenaPool:
    """Reusable page-aligned scratch memory for O_DIRECT bounce buffers.

    Anonymous mmaps are page-aligned (4096 here) by construction. Arenas are
    handed to one caller at a time; the cache keeps their pages faulted in.
    """

    def __init__(self, keep_bytes: int) -> None:
        self._keep = keep_bytes
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []

    def acquire(self, nbytes: int) -> mmap.mmap:
        size = max(64 << 10, 1 << (nbytes - 1).bit_length())
        with self._lock:
            best = None
            for m in self._free:
                if len(m) >= size and (best is None or len(m) < len(best)):
                    best = m
            if best is not None:
                self._free.remove(best)
                return best
        return mmap.mmap(-1, size)

    def release(self, m: mmap.mmap) -> None:
        with self._lock:
            if sum(len(x) for x in self._free) + len(m) <= self._keep:
                self._free.append(m)
                return
        _close_mmap(m)

    def close(self) -> None:
        with self._lock:
            arenas, self._free = self._free, []
        for m in arenas:
            _close_mmap(m)


def _close_mmap(m: mmap.mmap) -> None:
    # A view may have escaped (only after an exception mid-call); the GC frees it then.
    with contextlib.suppress(BufferError):
        m.close()


# --------------------------------------------------------------------------- I/O backends


@dataclass(slots=True, kw_only=True)
class _Op:
    """One positional transfer over a list of buffers (an iovec)."""

    is_write: bool
    offset: int
    bufs: list[memoryview]
    nbytes: int  # sum of the buffers' lengths: what a complete transfer moves


def _iov_from(bufs: list[memoryview], skip: int) -> list[memoryview]:
    """The buffers with their first ``skip`` bytes dropped."""
    out: list[memoryview] = []
    for b in bufs:
        if skip >= len(b):
            skip -= len(b)
            continue
        out.append(b[skip:] if skip else b)
        skip = 0
    return out


def _run_op_sync(fd: int, op: _Op, done: int = 0) -> int:
    """Runs ``op`` to completion from byte ``done``; bytes moved, or -errno.

    Short transfers are continued; a transfer of zero bytes (EOF) stops.
    """
    while done < op.nbytes:
        iov = _iov_from(op.bufs, done)
        try:
            if op.is_write:
                n = os.pwritev(fd, iov, op.offset + done)
            else:
                n = os.preadv(fd, iov, op.offset + done)
        except OSError as exc:
            return -(exc.errno or errno.EIO)
        if n <= 0:
            break
        done += n
    return done


class _PythonBackend:
    """``os.preadv``/``os.pwritev`` on a pool of ``depth`` threads: depth ops in flight."""

    name = "python"

    def __init__(self, fd: int, depth: int) -> None:
        self._fd = fd
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="ssd-io")

    def run(self, ops: Sequence[_Op]) -> list[int]:
        if len(ops) == 1:
            # One op gains nothing from a thread hop.
            return [_run_op_sync(self._fd, ops[0])]
        futures = [self._pool.submit(_run_op_sync, self._fd, op) for op in ops]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _load_uring() -> tuple[ModuleType | None, str | None]:
    """The native module, or None and why not."""
    try:
        # import_module honours sys.modules (a None entry there disables the backend).
        module = importlib.import_module("tiers._uring")
    except ImportError as exc:
        return None, (f"native module tiers._uring not importable ({exc}); "
                      "build it with: python -m cffi_build.uring_build")
    return module, None


class _UringBackend:
    """Batches through io_uring (``tiers._uring``), one ring per concurrent caller."""

    name = "uring"

    def __init__(self, fd: int, depth: int, module: ModuleType) -> None:
        self._fd = fd
        self._depth = depth
        self._ffi = module.ffi
        self._lib = module.lib
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._closed = False
        # Create one ring now: if the kernel refuses io_uring (seccomp, disabled,
        # too old) the constructor raises and the tier can fall back.
        self._idle.append(self._open_ring())

    def _open_ring(self) -> Any:
        out = self._ffi.new("struct kv_ring **")
        rc = self._lib.kv_ring_open(self._depth, out)
        if rc < 0:
            raise OSError(-rc, f"io_uring_queue_init failed: {os.strerror(-rc)}")
        return out[0]

    def run(self, ops: Sequence[_Op]) -> list[int]:
        ffi, n = self._ffi, len(ops)
        if n == 0:
            return []
        niov = sum(len(op.bufs) for op in ops)
        is_write = ffi.new("unsigned char[]", n)
        offsets = ffi.new("int64_t[]", n)
        counts = ffi.new("int[]", n)
        iovs = ffi.new("struct iovec[]", niov)
        results = ffi.new("int64_t[]", n)
        # The from_buffer handles pin the Python buffers until the call returns.
        pins = []
        j = 0
        for i, op in enumerate(ops):
            is_write[i] = op.is_write
            offsets[i] = op.offset
            counts[i] = len(op.bufs)
            for b in op.bufs:
                c = ffi.from_buffer(b)
                pins.append(c)
                iovs[j].iov_base = c
                iovs[j].iov_len = len(b)
                j += 1
        with self._lock:
            if self._closed:
                raise ValueError("I/O on a closed SSD tier")
            ring = self._idle.pop() if self._idle else None
        if ring is None:
            ring = self._open_ring()
        rc = self._lib.kv_ring_run(ring, self._fd, n, is_write, offsets, iovs, counts, results)
        if rc < 0:
            # The ring holds stale submissions: never reuse it.
            self._lib.kv_ring_close(ring)
        else:
            with self._lock:
                if self._closed:
                    self._lib.kv_ring_close(ring)
                else:
                    self._idle.append(ring)
        del pins
        out = list(results)
        for i, r in enumerate(out):
            op = ops[i]
            if 0 < r < op.nbytes:
                # A short transfer (EOF, or a split request): finish it synchronously.
                out[i] = _run_op_sync(self._fd, op, r)
            elif r in (-errno.EAGAIN, -errno.EINTR):
                out[i] = _run_op_sync(self._fd, op)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            rings, self._idle = self._idle, []
        for ring in rings:
            self._lib.kv_ring_close(ring)


def uring_available() -> tuple[bool, str | None]:
    """Whether the io_uring backend can run here, and if not why (for tests and stats)."""
    module, reason = _load_uring()
    if module is None:
        return False, reason
    out = module.ffi.new("struct kv_ring **")
    rc = module.lib.kv_ring_open(4, out)
    if rc < 0:
        return False, f"io_uring_queue_init failed: {os.strerror(-rc)}"
    module.lib.kv_ring_close(out[0])
    return True, None


# --------------------------------------------------------------------------- staging


@dataclass(slots=True, kw_only=True)
class _ReadFixup:
    """How to finish one read after the I/O: verify, then copy bounce bytes to the caller."""

    out: memoryview  # the caller's buffer, first nbytes
    head: int  # bytes read straight into out[:head]
    bounce: memoryview | None  # holds out[head:nbytes] when not None
    checksum: int


@dataclass(slots=True, kw_only=True)
class _Chunk:
    """Items of a batch that share one bounce arena."""

    items: list[int] = field(default_factory=list)
    bounce_bytes: int = 0


def _write_bounce_need(mv: memoryview, direct: bool) -> int:
    n = len(mv)
    if not direct or n == 0:
        return 0
    if _address(mv) % ALIGNMENT == 0:
        return ALIGNMENT if n % ALIGNMENT else 0
    return _round_up(n)


def _read_bounce_need(out: memoryview, nbytes: int, direct: bool) -> int:
    if not direct or nbytes == 0:
        return 0
    if _address(out) % ALIGNMENT == 0:
        return ALIGNMENT if nbytes % ALIGNMENT else 0
    return _round_up(nbytes)


def _chunks(needs: Sequence[int]) -> list[_Chunk]:
    chunks = [_Chunk()]
    for i, need in enumerate(needs):
        c = chunks[-1]
        if c.items and c.bounce_bytes + need > _MAX_BOUNCE_PER_CHUNK:
            c = _Chunk()
            chunks.append(c)
        c.items.append(i)
        c.bounce_bytes += need
    return chunks


# --------------------------------------------------------------------------- the tier


class SsdTier:
    """Immutable KV blocks on a file or block device (see the module docstring).

    ``direct=False`` forces buffered I/O + fdatasync, the path a filesystem without
    O_DIRECT support (e.g. an old tmpfs) gets automatically. ``preallocate``
    reserves the file's blocks with posix_fallocate when the file is created, so a
    full disk shows up at start rather than as a failed write.
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
    ) -> None:
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
        self._db: rocksdict.Rdict | None = None
        self._backend: _PythonBackend | _UringBackend | None = None
        self._arenas = _ArenaPool(_ARENA_CACHE_BYTES)
        try:
            self._open(capacity, io, index_path, queue_depth, direct, preallocate)
        except BaseException:
            self.close()
            raise

    def _open(self, capacity: int, io: str, index_path: str | None, queue_depth: int,
              direct: bool, preallocate: bool) -> None:
        try:
            st: os.stat_result | None = os.stat(self._path)
        except FileNotFoundError:
            st = None
        self.is_block_device = st is not None and stat.S_ISBLK(st.st_mode)
        if self.is_block_device and index_path is None:
            raise ValueError("a block device needs an explicit index_path")
        created = st is None
        if st is not None and not self.is_block_device and st.st_size > capacity:
            # Never shrink: a larger file is another configuration's data; truncating
            # it would destroy blocks.
            raise SsdFormatError(
                f"{self._path} is {st.st_size} bytes, larger than capacity {capacity}; "
                "refusing to truncate it")
        # Validate the index before touching the data file, so a mismatched
        # configuration changes nothing on disk.
        self._index_path = index_path if index_path is not None else self._path + ".index"
        write_meta = self._open_index(capacity, created)

        # Size the region with a plain descriptor.
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if self.is_block_device:
                device_size = os.lseek(fd, 0, os.SEEK_END)
                if capacity > device_size:
                    raise ValueError(
                        f"capacity {capacity} exceeds the size of {self._path} ({device_size})")
            else:
                size = os.fstat(fd).st_size
                if size < capacity:
                    os.ftruncate(fd, capacity)
                    if preallocate:
                        try:
                            os.posix_fallocate(fd, 0, capacity)
                        except OSError as exc:
                            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                                raise
                    os.fsync(fd)
                if created:
                    # The new directory entry must survive a crash too.
                    _fsync_dir(os.path.dirname(os.path.abspath(self._path)))
        finally:
            os.close(fd)
        if write_meta:
            # Only once the region exists: an index's format record promises a data
            # file of this size.
            meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "alignment": ALIGNMENT,
                    "capacity": capacity, "block_device": self.is_block_device}
            assert self._db is not None
            self._db.put(_META_KEY, json.dumps(meta, sort_keys=True).encode(), self._sync_write)

        self.o_direct = False
        self.o_direct_fallback: str | None = "disabled by the direct=False flag"
        if direct:
            self._fd, self.o_direct, self.o_direct_fallback = self._open_direct()
        else:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC)
        # Close the descriptor even if the tier is dropped without close() (a
        # simulated crash): only acknowledged, already durable state matters then.
        self._fd_finalizer = weakref.finalize(self, os.close, self._fd)

        self._allocator = _SsdAllocator(capacity, alignment=ALIGNMENT)

        self.io_backend, self.io_backend_reason = self._pick_backend(io, queue_depth)

        self._blocks = 0
        self._reads = 0
        self._writes = 0
        self._bytes_read = 0
        self._bytes_written = 0
        self._checksum_failures = 0
        self._io_errors = 0
        self._fdatasyncs = 0
        self._mutated = False

    def _open_direct(self) -> tuple[int, bool, str | None]:
        """An O_DIRECT descriptor if the filesystem honours it, else a buffered one and why."""
        plain = os.O_RDWR | os.O_CLOEXEC
        try:
            fd = os.open(self._path, plain | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return os.open(self._path, plain), False, "open(O_DIRECT) failed with EINVAL"
        # Some filesystems accept the flag at open and refuse the I/O: probe one
        # aligned read (the region is at least one page).
        arena = self._arenas.acquire(ALIGNMENT)
        try:
            with memoryview(arena) as view:
                os.preadv(fd, [view[:ALIGNMENT]], 0)
        except OSError as exc:
            os.close(fd)
            if exc.errno != errno.EINVAL:
                raise
            return os.open(self._path, plain), False, "O_DIRECT read failed with EINVAL"
        finally:
            self._arenas.release(arena)
        return fd, True, None

    def _open_index(self, capacity: int, data_missing: bool) -> bool:
        """Opens and validates the index; True if its format record is still to be written."""
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db = rocksdict.Rdict(self._index_path, opts)
        self._sync_write = rocksdict.WriteOptions()
        self._sync_write.sync = True
        raw = self._db.get(_META_KEY)
        has_blocks = self._first_block_key() is not None
        if raw is None:
            if has_blocks:
                raise SsdFormatError(f"index {self._index_path} has blocks but no format record")
        else:
            try:
                meta = json.loads(bytes(raw))
            except ValueError as exc:
                raise SsdFormatError(f"index {self._index_path}: unreadable format record") from exc
            if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
                raise SsdFormatError(
                    f"index {self._index_path} has format {meta.get('format')!r} version "
                    f"{meta.get('version')!r}; this code reads {FORMAT_NAME!r} "
                    f"version {FORMAT_VERSION}")
            if meta.get("alignment") != ALIGNMENT:
                raise SsdFormatError(
                    f"index {self._index_path} uses alignment {meta.get('alignment')}, "
                    f"expected {ALIGNMENT}")
            if meta.get("capacity") != capacity:
                raise SsdFormatError(
                    f"index {self._index_path} was written for a data file of "
                    f"{meta.get('capacity')} bytes, but {self._path} is opened with capacity "
                    f"{capacity}; refusing to mix them")
        if has_blocks and data_missing:
            raise SsdFormatError(
                f"index {self._index_path} names blocks but the data file {self._path} "
                "did not exist; refusing to serve from an empty file")
        # Blocks in the index own their extents; until recover() marks them, any
        # allocation could land on one of them.
        self._needs_recover = has_blocks
        self._recovered = False
        return raw is None

    def _first_block_key(self) -> bytes | None:
        assert self._db is not None
        for k in self._db.keys(from_key=_BLOCK_PREFIX):
            return k if k.startswith(_BLOCK_PREFIX) else None
        return None

    def _pick_backend(self, io: str, depth: int) -> tuple[str, str | None]:
        reason: str | None = None
        if io in ("auto", "uring"):
            module, reason = _load_uring()
            if module is not None:
                try:
                    self._backend = _UringBackend(self._fd, depth, module)
                    return "uring", None
                except OSError as exc:
                    reason = str(exc)
            if io == "uring":
                raise UringUnavailableError(f"io='uring' requested but unavailable: {reason}")
        else:
            reason = "io='python' requested"
        self._backend = _PythonBackend(self._fd, depth)
        return "python", reason

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
        mv = _byte_view(data)
        if len(mv) > extent.length:
            raise ValueError(f"{len(mv)} bytes do not fit in {extent}")
        results = self._write_views([mv], [extent.offset])
        self._raise_on_failure(results, [_round_up(len(mv)) if self.o_direct else len(mv)])
        self._sync_data()
        with self._lock:
            self._writes += 1
            self._bytes_written += len(mv)

    def read_into(self, extent: Extent, nbytes: int, out: memoryview) -> None:
        """Raw read of the first ``nbytes`` of ``extent`` into ``out`` (no checksum)."""
        self._check_open()
        if nbytes > extent.length:
            raise ValueError(f"cannot read {nbytes} bytes from {extent}")
        mv = _byte_view(out, writable=True)
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
        if self._db is not None:
            self._db.close()
            self._db = None
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
        self, items: Sequence[tuple[BlockKey, BlockKey | None, memoryview]]
    ) -> list[SsdLocation | None]:
        """Stores each (key, parent, value); None for an item that does not fit.

        Returns only after the data is durable and, after it, the index entries
        (one synced batch): every returned location survives a crash. On an I/O
        error nothing of the batch is acknowledged, its extents are freed, and the
        error propagates.
        """
        self._check_mutable()
        views = [_byte_view(v) for _, _, v in items]
        for key, parent, _ in items:
            _check_key(key)
            if parent is not None:
                _check_key(parent)
        extents: list[Extent | None] = []
        with self._lock:
            self._mutated = True
            for mv in views:
                # A zero-length value still takes one page so its extent is unique.
                extents.append(self._allocator.allocate(max(len(mv), 1)))
        placed = [i for i, e in enumerate(extents) if e is not None]
        try:
            checksums = {i: xxhash.xxh3_64_intdigest(views[i]) for i in placed}
            results = self._write_views([views[i] for i in placed],
                                        [extents[i].offset for i in placed])  # type: ignore[union-attr]
            self._raise_on_failure(
                results, [_round_up(len(views[i])) if self.o_direct else len(views[i])
                          for i in placed])
            if placed:
                self._sync_data()
                batch = rocksdict.WriteBatch(raw_mode=True)
                for i in placed:
                    key, parent, _ = items[i]
                    ext = extents[i]
                    assert ext is not None
                    batch.put(_BLOCK_PREFIX + bytes(key),
                              _encode_entry(ext, len(views[i]), checksums[i], parent))
                assert self._db is not None
                self._db.write(batch, self._sync_write)
        except BaseException:
            with self._lock:
                for i in placed:
                    self._allocator.free(extents[i])  # type: ignore[arg-type]
            raise
        out: list[SsdLocation | None] = [None] * len(items)
        nbytes = 0
        for i in placed:
            ext = extents[i]
            assert ext is not None
            out[i] = SsdLocation(extent=ext, nbytes=len(views[i]), checksum=checksums[i])
            nbytes += len(views[i])
        with self._lock:
            self._blocks += len(placed)
            self._writes += len(placed)
            self._bytes_written += nbytes
        return out

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
        views: list[memoryview] = []
        for loc, out in zip(locations, outs, strict=True):
            mv = _byte_view(out, writable=True)
            if len(mv) < loc.nbytes:
                raise ValueError(f"buffer of {len(mv)} bytes for a block of {loc.nbytes}")
            if loc.nbytes > loc.extent.length:
                raise ValueError(f"corrupt location {loc}")
            views.append(mv[: loc.nbytes])
        ok = self._read_views(views, [loc.extent.offset for loc in locations],
                              [loc.checksum for loc in locations])
        with self._lock:
            self._reads += len(locations)
            self._bytes_read += sum(loc.nbytes for loc, good in zip(locations, ok, strict=True)
                                    if good)
        return ok

    def delete(self, keys_and_locations: Sequence[tuple[BlockKey, SsdLocation]]) -> None:
        """Removes the index entries durably, then frees the extents.

        An entry is removed only if it still names that location (a key written
        twice keeps its newer entry when the older copy is deleted).
        """
        self._check_mutable()
        if not keys_and_locations:
            return
        assert self._db is not None
        db_keys = [_BLOCK_PREFIX + bytes(k) for k, _ in keys_and_locations]
        stored = self._db.get(db_keys)
        batch = rocksdict.WriteBatch(raw_mode=True)
        for dbk, raw, (_, loc) in zip(db_keys, stored, keys_and_locations, strict=True):
            if raw is not None and _decode_entry(bytes(raw))[1] == loc:
                batch.delete(dbk)
        self._db.write(batch, self._sync_write)
        with self._lock:
            self._mutated = True
            for _, loc in keys_and_locations:
                self._allocator.free(loc.extent)
                self._blocks -= 1

    def recover(self) -> list[SsdRecord]:
        """Every indexed block; marks their extents allocated. Call once, right after
        opening and before any allocation. Reads only the index."""
        self._check_open()
        with self._lock:
            if self._recovered:
                raise RuntimeError("recover() already ran on this tier")
            if self._mutated:
                raise RuntimeError("recover() must run before any allocation or write")
            assert self._db is not None
            records: list[SsdRecord] = []
            for k, v in self._db.items(from_key=_BLOCK_PREFIX):
                if not k.startswith(_BLOCK_PREFIX):
                    break
                key = bytes(k[len(_BLOCK_PREFIX):])
                if len(key) != _KEY_BYTES:
                    raise SsdFormatError(f"index key of wrong length: {k!r}")
                parent, loc = _decode_entry(bytes(v))
                records.append(SsdRecord(key=BlockKey(key), parent=parent, location=loc))
            self._allocator.rebuild([r.location.extent for r in records])
            self._blocks = len(records)
            self._recovered = True
            self._needs_recover = False
            return records

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

    def _write_views(self, views: Sequence[memoryview], offsets: Sequence[int]) -> list[int]:
        """Writes each view at its offset; per-view bytes transferred or -errno.

        Under O_DIRECT each transfer is padded to the alignment; an aligned caller
        buffer is written in place and only its partial last page is bounced.
        """
        assert self._backend is not None
        direct = self.o_direct
        results = [0] * len(views)
        for chunk in _chunks([_write_bounce_need(mv, direct) for mv in views]):
            arena = self._arenas.acquire(chunk.bounce_bytes) if chunk.bounce_bytes else None
            try:
                ops: list[_Op] = []
                op_items: list[int] = []
                with (memoryview(arena) if arena is not None else memoryview(b"")) as scratch:
                    pos = 0
                    for i in chunk.items:
                        mv, n = views[i], len(views[i])
                        if n == 0:
                            continue
                        if not direct:
                            bufs = [mv]
                        elif _address(mv) % ALIGNMENT == 0:
                            head = n - n % ALIGNMENT
                            bufs = [mv[:head]] if head else []
                            if n % ALIGNMENT:
                                tail = scratch[pos:pos + ALIGNMENT]
                                pos += ALIGNMENT
                                tail[: n - head] = mv[head:]
                                # Pad with zeros, not stale scratch bytes of another block.
                                tail[n - head:] = _ZEROS[: ALIGNMENT - (n - head)]
                                bufs.append(tail)
                        else:
                            padded = _round_up(n)
                            slot = scratch[pos:pos + padded]
                            pos += padded
                            slot[:n] = mv
                            slot[n:] = _ZEROS[: padded - n]
                            bufs = [slot]
                        ops.append(_Op(is_write=True, offset=offsets[i], bufs=bufs,
                                       nbytes=sum(len(b) for b in bufs)))
                        op_items.append(i)
                    for i, r in zip(op_items, self._backend.run(ops), strict=True):
                        results[i] = r
                    del ops
            finally:
                if arena is not None:
                    self._arenas.release(arena)
        return results

    def _read_views(self, views: Sequence[memoryview], offsets: Sequence[int],
                    checksums: Sequence[int] | None) -> list[bool]:
        """Reads ``len(view)`` bytes at each offset into each view; per-view success.

        With checksums, a block is good only if its bytes hash to its checksum;
        bounced bytes reach the caller only after they verified.
        """
        assert self._backend is not None
        direct = self.o_direct
        ok = [False] * len(views)
        for chunk in _chunks([_read_bounce_need(mv, len(mv), direct) for mv in views]):
            arena = self._arenas.acquire(chunk.bounce_bytes) if chunk.bounce_bytes else None
            try:
                with (memoryview(arena) if arena is not None else memoryview(b"")) as scratch:
                    ops: list[_Op] = []
                    fixups: list[tuple[int, _ReadFixup, int]] = []
                    pos = 0
                    for i in chunk.items:
                        mv, n = views[i], len(views[i])
                        want = checksums[i] if checksums is not None else 0
                        if n == 0:
                            ok[i] = checksums is None or want == xxhash.xxh3_64_intdigest(b"")
                            continue
                        bounce: memoryview | None = None
                        if not direct:
                            head, bufs = n, [mv]
                        elif _address(mv) % ALIGNMENT == 0:
                            head = n - n % ALIGNMENT
                            bufs = [mv[:head]] if head else []
                            if n % ALIGNMENT:
                                bounce = scratch[pos:pos + ALIGNMENT]
                                pos += ALIGNMENT
                                bufs.append(bounce)
                        else:
                            head = 0
                            bounce = scratch[pos:pos + _round_up(n)]
                            pos += _round_up(n)
                            bufs = [bounce]
                        total = sum(len(b) for b in bufs)
                        ops.append(_Op(is_write=False, offset=offsets[i], bufs=bufs,
                                       nbytes=total))
                        fixups.append((i, _ReadFixup(out=mv, head=head, bounce=bounce,
                                                     checksum=want), total))
                    results = self._backend.run(ops)
                    del ops
                    for (i, fx, total), r in zip(fixups, results, strict=True):
                        ok[i] = self._finish_read(fx, r, total, checksums is not None)
                    del fixups
            finally:
                if arena is not None:
                    self._arenas.release(arena)
        return ok

    def _finish_read(self, fx: _ReadFixup, result: int, total: int, verify: bool) -> bool:
        if result != total:
            with self._lock:
                self._io_errors += 1
            return False
        n = len(fx.out)
        tail = n - fx.head
        if verify:
            h = xxhash.xxh3_64()
            if fx.head:
                h.update(fx.out[: fx.head])
            if tail:
                assert fx.bounce is not None
                h.update(fx.bounce[:tail])
            if h.intdigest() != fx.checksum:
                with self._lock:
                    self._checksum_failures += 1
                return False
        if tail and fx.bounce is not None:
            fx.out[fx.head:] = fx.bounce[:tail]
        return True


# --------------------------------------------------------------------------- helpers


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != _KEY_BYTES:
        raise ValueError(f"a block key is {_KEY_BYTES} bytes, got {key!r}")


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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
