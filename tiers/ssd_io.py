"""The SSD tier's raw I/O: aligned scratch buffers and the two backends that move bytes.

A backend runs a batch of positional transfers (:class:`_Op`, one iovec each) against
one descriptor and reports, per op, the bytes moved or ``-errno``; it never raises for
a failed transfer. A short transfer is continued until the op completes or reaches
EOF, so a result below ``op.nbytes`` means the transfer could not finish.

``"uring"``: the native helper ``tiers._uring`` (built by ``python -m
cffi_build.uring_build``) submits a batch of readv/writev through io_uring with up to
``queue_depth`` in flight; a ring whose run failed is closed, never reused. When the
helper was built with xxHash (``kv_have_verify()``), a read op carrying a checksum is
verified in C, without the GIL, as it completes (``_Op.verified``); otherwise, and
for any read it could not check (short, failed), the caller verifies in Python.
``"python"``: ``os.preadv``/``os.pwritev`` on a thread pool of ``queue_depth``
threads (the syscalls release the GIL). :func:`open_backend` picks between them.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import cffi

from tiers.ssd_types import ALIGNMENT, UringUnavailableError

# Scratch arenas kept for reuse across calls (their pages are already faulted in).
_ARENA_CACHE_BYTES = 128 << 20

# ABI-mode FFI: only used to read buffer addresses (for the alignment test), which
# needs no compiler, so it works whether or not the native module was built.
_ffi = cffi.FFI()

IO_CHOICES = ("auto", "uring", "python")

# In-flight bytes a batch aims for: large blocks get fewer, bigger I/Os in flight
# (on the virtio disk measured, deep queues of MiB-sized requests are slower than
# a few), small ones up to the queue depth. See :func:`inflight_depth`.
INFLIGHT_BYTES = 8 << 20
MIN_INFLIGHT = 2

# on_complete(op index, bytes moved or -errno), called as each op of a batch finishes.
OnComplete = Callable[[int, int], None]

# The tiers._uring API this module calls (cffi_build/uring_build.py API_VERSION).
URING_API_VERSION = 2


def inflight_depth(op_bytes: int, queue_depth: int) -> int:
    """How many ops of ``op_bytes`` each a batch keeps in flight (at most queue_depth)."""
    want = INFLIGHT_BYTES // max(op_bytes, 1)
    return max(1, min(queue_depth, max(MIN_INFLIGHT, want)))


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
    # Reads only: the xxh3-64 the first verify_bytes bytes must hash to (None: no check).
    checksum: int | None = None
    verify_bytes: int = 0
    # Set by the backend before on_complete: 1 verified good, 0 failed the checksum,
    # -1 not checked (the caller must verify).
    verified: int = -1


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
        self._depth = depth
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="ssd-io")

    def run(self, ops: Sequence[_Op], depth: int = 0,
            on_complete: OnComplete | None = None) -> list[int]:
        """Runs ``ops`` with at most ``depth`` (0: the pool's) in flight; per-op result.

        ``on_complete(i, result)`` runs in the caller's thread as each op finishes,
        while later ones are still in flight. Every op has finished when this returns,
        even if ``on_complete`` raised.
        """
        n = len(ops)
        results = [0] * n
        if n == 1:
            # One op gains nothing from a thread hop.
            results[0] = _run_op_sync(self._fd, ops[0])
            if on_complete is not None:
                on_complete(0, results[0])
            return results
        workers = min(n, depth if 0 < depth < self._depth else self._depth)
        todo = iter(range(n))  # shared: each worker pulls the next op (atomic under the GIL)
        done: queue.SimpleQueue[int] = queue.SimpleQueue()
        stop = threading.Event()

        def work() -> None:
            try:
                for i in todo:
                    if stop.is_set():
                        return
                    results[i] = _run_op_sync(self._fd, ops[i])
                    done.put(i)
            finally:
                done.put(-1)  # this worker is finished

        futures = [self._pool.submit(work) for _ in range(workers)]
        try:
            if on_complete is not None:
                live = workers
                while live:
                    i = done.get()
                    if i < 0:
                        live -= 1
                    else:
                        on_complete(i, results[i])
        except BaseException:
            stop.set()
            raise
        finally:
            for f in futures:
                f.result()  # every op finished: no buffer in use after this
        return results

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
    version = getattr(module.lib, "kv_ring_api_version", None)
    if version is None or version() != URING_API_VERSION:
        # An older build: its functions take other arguments. Never call them.
        return None, ("native module tiers._uring is stale (API version "
                      f"{version() if version else 1}, need {URING_API_VERSION}); "
                      "rebuild it with: python -m cffi_build.uring_build")
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
        self.verifies = bool(self._lib.kv_have_verify())
        # Create one ring now: if the kernel refuses io_uring (seccomp, disabled,
        # too old) the constructor raises and the tier can fall back.
        self._idle.append(self._open_ring())

    def _open_ring(self) -> Any:
        out = self._ffi.new("struct kv_ring **")
        rc = self._lib.kv_ring_open(self._depth, out)
        if rc < 0:
            raise OSError(-rc, f"io_uring_queue_init failed: {os.strerror(-rc)}")
        return out[0]

    def run(self, ops: Sequence[_Op], depth: int = 0,
            on_complete: OnComplete | None = None) -> list[int]:
        """As :meth:`_PythonBackend.run`. Each step submits what fits in one
        io_uring_enter and reaps completions in bulk; ``on_complete`` handles each
        finished op while the rest are in flight."""
        ffi, lib, n = self._ffi, self._lib, len(ops)
        if n == 0:
            return []
        niov = sum(len(op.bufs) for op in ops)
        is_write = ffi.new("unsigned char[]", n)
        offsets = ffi.new("int64_t[]", n)
        counts = ffi.new("int[]", n)
        iovs = ffi.new("struct iovec[]", niov)
        results = ffi.new("int64_t[]", n)
        done_idx = ffi.new("int[]", n)
        want = vlen = verdict = ffi.NULL
        verifying = self.verifies and any(op.checksum is not None for op in ops)
        if verifying:
            want = ffi.new("uint64_t[]", [op.checksum or 0 for op in ops])
            vlen = ffi.new("int64_t[]", [op.verify_bytes if op.checksum is not None else -1
                                         for op in ops])
            verdict = ffi.new("signed char[]", n)
        # The from_buffer handles pin the Python buffers until the batch is complete.
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
        out = [0] * n
        reported = [False] * n
        rc = 0
        lib.kv_ring_start(ring, self._fd, n, is_write, offsets, iovs, counts, results, depth,
                          want, vlen, verdict)
        try:
            while True:
                got = lib.kv_ring_step(ring, done_idx, n)
                if got <= 0:
                    rc = got
                    break
                for i in ffi.unpack(done_idx, got):
                    reported[i] = True
                    op = ops[i]
                    out[i] = self._finish(op, results[i])
                    op.verified = verdict[i] if verifying else -1
                    if on_complete is not None:
                        on_complete(i, out[i])
        except BaseException:
            # on_complete raised: the kernel may still be filling buffers; drain first.
            while rc == 0:
                got = lib.kv_ring_step(ring, done_idx, n)
                if got <= 0:
                    rc = got
                    break
            raise
        finally:
            self._release(ring, rc)
            del pins
        if rc < 0:
            # The ring failed: every op has completed or was never submitted.
            for i in range(n):
                if not reported[i]:
                    out[i] = self._finish(ops[i], results[i])
                    if on_complete is not None:
                        on_complete(i, out[i])
        return out

    def _finish(self, op: _Op, r: int) -> int:
        # (A read the helper verified moved all op.nbytes: the paths below, which
        # re-read it, never follow a verdict.)
        if 0 < r < op.nbytes:
            # A short transfer (EOF, or a split request): finish it synchronously.
            return _run_op_sync(self._fd, op, r)
        if r in (-errno.EAGAIN, -errno.EINTR):
            return _run_op_sync(self._fd, op)
        return r

    def _release(self, ring: Any, rc: int) -> None:
        if rc < 0:
            # The ring holds stale submissions: never reuse it.
            self._lib.kv_ring_close(ring)
            return
        with self._lock:
            if not self._closed:
                self._idle.append(ring)
                return
        self._lib.kv_ring_close(ring)

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


# --------------------------------------------------------------------------- selection

Backend = _PythonBackend | _UringBackend


def open_backend(fd: int, io: str, depth: int) -> tuple[Backend, str, str | None]:
    """The backend ``io`` asks for on ``fd``, its name, and why it is not uring (None if it is).

    ``"auto"`` picks uring when the module imports and a ring can be created, else the
    thread pool; ``"uring"`` raises UringUnavailableError instead of falling back.
    """
    reason: str | None = None
    if io in ("auto", "uring"):
        module, reason = _load_uring()
        if module is not None:
            try:
                return _UringBackend(fd, depth, module), "uring", None
            except OSError as exc:
                reason = str(exc)
        if io == "uring":
            raise UringUnavailableError(f"io='uring' requested but unavailable: {reason}")
    else:
        reason = "io='python' requested"
    return _PythonBackend(fd, depth), "python", reason
