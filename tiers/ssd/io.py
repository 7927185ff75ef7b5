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

import errno
import importlib
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from tiers.ssd.buffers import InlineIO
from tiers.ssd.types import UringUnavailableError

IO_CHOICES = ("auto", "uring", "python")

# In-flight bytes a batch aims for: large blocks get fewer, bigger I/Os in flight
# (on the virtio disk measured, deep queues of MiB-sized requests are slower than
# a few), small ones up to the queue depth. See :func:`inflight_depth`.
INFLIGHT_BYTES = 8 << 20
MIN_INFLIGHT = 2

# on_complete(op index, bytes moved or -errno), called as each op of a batch finishes.
OnComplete = Callable[[int, int], None]

# The tiers._uring API this module calls (cffi_build/uring_build.py API_VERSION).
URING_API_VERSION = 4


def inflight_depth(op_bytes: int, queue_depth: int) -> int:
    """How many ops of ``op_bytes`` each a batch keeps in flight (at most queue_depth)."""
    want = INFLIGHT_BYTES // max(op_bytes, 1)
    return max(1, min(queue_depth, max(MIN_INFLIGHT, want)))


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


class _Batch(Protocol):
    """A submitted batch of ops (:meth:`Backend.submit`); its caller drives it.

    Invariants: each op index is returned by :meth:`reap` exactly once, after
    ``results[i]`` (and, for reads, ``ops[i].verified``) are set and the backend no
    longer touches that op's buffers; :meth:`release` returns only once no op is in
    flight, so the caller may then free every buffer.
    """

    results: list[int]

    def reap(self, timeout: float | None = None, *, all_left: bool = False,
             min_new: int = 1) -> list[int] | None:
        """Indices of ops finished since the last call (waiting for at least
        ``min_new`` of those left, or with ``all_left`` for every op left); ``[]`` once
        every op was reported; None if too few finished within ``timeout``."""

    def cancel(self) -> None:
        """Fails the ops not yet started with ``-ECANCELED``; started ones finish."""

    def release(self) -> None:
        """Waits until no op is in flight and frees the batch (idempotent)."""


def run_batch(backend: Backend, ops: Sequence[_Op], depth: int = 0,
              on_complete: OnComplete | None = None) -> list[int]:
    """Runs ``ops`` with at most ``depth`` (0: the backend's) in flight; per-op result.

    ``on_complete(i, result)`` runs in the caller's thread as each op finishes,
    while later ones are still in flight. Every op has finished when this returns,
    even if ``on_complete`` raised (the ops not yet started are then cancelled).
    """
    if not ops:
        return []
    batch = backend.submit(ops, depth)
    # Collect completions half an in-flight window at a time: enough overlap for
    # on_complete, and one wake-up of this thread per several ops, not per op.
    step = max(1, (depth if depth > 0 else len(ops)) // 2)
    try:
        while True:
            got = batch.reap(min_new=step)
            if not got:
                break
            if on_complete is not None:
                for i in got:
                    on_complete(i, batch.results[i])
    except BaseException:
        batch.cancel()
        raise
    finally:
        batch.release()
    return batch.results


class _ThreadBatch:
    """A batch on the thread pool: ``workers`` tasks pull ops in order."""

    def __init__(self, backend: _PythonBackend, ops: Sequence[_Op], workers: int) -> None:
        self.results = [0] * len(ops)
        self._ops = ops
        self._backend = backend
        self._todo = iter(range(len(ops)))  # shared by the workers (atomic under the GIL)
        self._done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._cancelled = False
        self._left = len(ops)  # ops not yet reaped
        self._futures = [backend._pool.submit(self._work) for _ in range(workers)]

    def _work(self) -> None:
        for i in self._todo:
            if self._cancelled or self._backend._closed:
                self.results[i] = -errno.ECANCELED
            else:
                self.results[i] = _run_op_sync(self._backend._fd, self._ops[i])
            self._done.put(i)

    def reap(self, timeout: float | None = None, *, all_left: bool = False,
             min_new: int = 1) -> list[int] | None:
        if self._left == 0:
            return []
        if all_left and timeout is None:
            self.release()  # every op has finished: collect them all at once
        try:
            got = [self._done.get(timeout=timeout)]
        except queue.Empty:
            return None
        while True:
            try:
                got.append(self._done.get_nowait())
            except queue.Empty:
                break
        self._left -= len(got)
        return got

    def cancel(self) -> None:
        self._cancelled = True

    def release(self) -> None:
        for f in self._futures:
            f.result()  # every op finished: no buffer in use after this


class _PythonBackend:
    """``os.preadv``/``os.pwritev`` on a pool of ``depth`` threads: depth ops in flight."""

    name = "python"
    verifies = False

    def __init__(self, fd: int, depth: int) -> None:
        self._fd = fd
        self._depth = depth
        self._closed = False
        self._inline = InlineIO()
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="ssd-io")

    def submit(self, ops: Sequence[_Op], depth: int = 0) -> _ThreadBatch:
        """Starts ``ops`` with at most ``depth`` (0: the pool's) in flight."""
        if self._closed:
            raise ValueError("I/O on a closed SSD tier")
        return _ThreadBatch(self, ops, min(len(ops), depth if 0 < depth < self._depth
                                           else self._depth))

    def run(self, ops: Sequence[_Op], depth: int = 0,
            on_complete: OnComplete | None = None) -> list[int]:
        """See :func:`run_batch`; one op runs in the caller's thread (no hop)."""
        if len(ops) == 1 and not self._closed:
            with self._inline.running():
                r = _run_op_sync(self._fd, ops[0])
            if on_complete is not None:
                on_complete(0, r)
            return [r]
        return run_batch(self, ops, depth, on_complete)

    def close(self) -> None:
        # Batches in flight see _closed and fail their remaining ops (-ECANCELED).
        self._closed = True
        self._inline.close()
        self._pool.shutdown(wait=True)


def load_uring() -> tuple[ModuleType | None, str | None]:
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


class _UringBatch:
    """A batch on the shared queue: a ``kv_group`` of ``kv_op``s (see uring_io.c)."""

    def __init__(self, backend: _UringBackend, ops: Sequence[_Op], cops: Any,
                 pins: list[Any], group: Any) -> None:
        self.results = [0] * len(ops)
        self._backend = backend
        self._ops = ops
        self._cops = cops  # the C ops and iovecs: the kernel reads them until release
        self._pins = pins  # from_buffer handles: keep the buffers alive until release
        self._group = group
        self._idx = backend._ffi.new("int[]", max(len(ops), 1))
        self._left = len(ops)

    def reap(self, timeout: float | None = None, *, all_left: bool = False,
             min_new: int = 1) -> list[int] | None:
        if self._left == 0:
            return []
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        got = self._backend._lib.kv_group_wait(self._group, self._idx, self._left,
                                               self._left if all_left else min_new, ms)
        if got < 0:
            return None  # -ETIMEDOUT
        out: list[int] = self._backend._ffi.unpack(self._idx, got)
        self._left -= got
        cops, ops, results, finish = self._cops, self._ops, self.results, self._backend._finish
        for i in out:
            c = cops[i]
            op = ops[i]
            results[i] = finish(op, c.result)
            op.verified = c.verdict
        return out

    def cancel(self) -> None:
        if self._group is not None:
            self._backend._lib.kv_group_cancel(self._group)

    def release(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            self._backend._lib.kv_group_free(group)  # waits for in-flight ops
            self._pins = []


class _UringBackend:
    """io_uring through one shared ``kv_queue`` per tier, driven by a C completion
    thread: concurrent callers' ops share one ring kept up to ``depth`` deep."""

    name = "uring"

    def __init__(self, fd: int, depth: int, module: ModuleType) -> None:
        self._fd = fd
        self._depth = depth
        self._ffi = module.ffi
        self._lib = module.lib
        self._lock = threading.Lock()
        self._closed = False
        self._inline = InlineIO()
        self.verifies = bool(self._lib.kv_have_verify())
        # Open the queue now: if the kernel refuses io_uring (seccomp, disabled, too
        # old) the constructor raises and the tier can fall back.
        self._queue = self._open_queue()

    def _open_queue(self) -> Any:
        out = self._ffi.new("struct kv_queue **")
        rc = self._lib.kv_queue_open(self._depth, self._fd, out)
        if rc < 0:
            raise OSError(-rc, f"io_uring_queue_init failed: {os.strerror(-rc)}")
        return out[0]

    def _build(self, ops: Sequence[_Op]) -> tuple[Any, list[Any]]:
        """The C ops for ``ops``, and what must stay alive while they run (the op and
        iovec arrays, and the from_buffer handles that pin the Python buffers)."""
        ffi = self._ffi
        cops = ffi.new("struct kv_op[]", len(ops))
        iovs = ffi.new("struct iovec[]", sum(len(op.bufs) for op in ops))
        pins: list[Any] = [cops, iovs]
        verify = self.verifies
        j = 0
        for i, op in enumerate(ops):
            c = cops[i]
            c.iov = iovs + j
            c.iov_count = len(op.bufs)
            c.offset = op.offset
            c.is_write = op.is_write
            if verify and op.checksum is not None:
                c.want = op.checksum
                c.verify_len = op.verify_bytes
            else:
                c.verify_len = -1
            for buf in op.bufs:
                ptr = ffi.from_buffer(buf)
                pins.append(ptr)
                iov = iovs[j]
                iov.iov_base = ptr
                iov.iov_len = len(buf)
                j += 1
        return cops, pins

    def _call(self, fn: Callable[[Any], int]) -> None:
        """``fn(queue)``; on a broken ring opens a fresh queue and retries once."""
        rc = 0
        for _attempt in range(2):
            with self._lock:
                if self._closed:
                    raise ValueError("I/O on a closed SSD tier")
                q = self._queue
            rc = fn(q)
            if rc == 0:
                return
            if rc == -errno.ECANCELED:  # closed meanwhile
                raise ValueError("I/O on a closed SSD tier")
            self._replace(q)
        raise OSError(-rc, f"io_uring submission failed: {os.strerror(-rc)}")

    def submit(self, ops: Sequence[_Op], depth: int = 0) -> _UringBatch:
        """Queues ``ops`` with at most ``depth`` (0: the queue's) of them in flight."""
        cops, pins = self._build(ops)
        out = self._ffi.new("struct kv_group **")
        self._call(lambda q: self._lib.kv_queue_submit(q, cops, len(ops), depth, out))
        return _UringBatch(self, ops, cops, pins, out[0])

    def run(self, ops: Sequence[_Op], depth: int = 0,
            on_complete: OnComplete | None = None) -> list[int]:
        """See :func:`run_batch`. One op runs in the caller's thread, as one
        ``preadv``/``pwritev`` and its checksum in one C call with the GIL released:
        through the shared queue it would cost two thread hand-offs (caller to
        completion thread and back, ~30 us each on the VM measured) for the same single
        syscall's worth of I/O. A batch whose caller needs no progress goes through
        ``kv_queue_run``: submit and wait in one C call, one GIL release."""
        n = len(ops)
        if n == 0:
            return []
        if n == 1:
            op = ops[0]
            cops, pins = self._build(ops)
            c = cops[0]
            with self._inline.running():
                self._lib.kv_op_sync(self._fd, cops)  # GIL released: syscall and checksum
                r = self._finish(op, c.result)
            op.verified = c.verdict
            del pins
            if on_complete is not None:
                on_complete(0, r)
            return [r]
        if n > 1 and on_complete is not None and not (
                self.verifies and all(not op.is_write and op.checksum is not None
                                      for op in ops)):
            # Per-op progress pays only when on_complete has real work to overlap
            # (Python checksums): reads verified in C need just a copy-out each.
            return run_batch(self, ops, depth, on_complete)
        cops, pins = self._build(ops)
        self._call(lambda q: self._lib.kv_queue_run(q, cops, n, depth))
        del pins  # every op has completed: nothing in use
        results = [0] * n
        for i, op in enumerate(ops):
            c = cops[i]
            results[i] = r = self._finish(op, c.result)
            op.verified = c.verdict
            if on_complete is not None:
                on_complete(i, r)
        return results

    def _replace(self, broken: Any) -> None:
        with self._lock:
            if self._closed or self._queue != broken:
                return
            self._queue = self._open_queue()
        # Its in-flight ops (other callers') finish first; their groups stay valid.
        self._lib.kv_queue_close(broken)

    def _finish(self, op: _Op, r: int) -> int:
        # (A read the helper verified moved all op.nbytes: the paths below, which
        # re-read it, never follow a verdict.)
        if 0 < r < op.nbytes:
            # A short transfer (EOF, or a split request): finish it synchronously.
            with self._inline.running():
                return _run_op_sync(self._fd, op, r)
        if r in (-errno.EAGAIN, -errno.EINTR):
            with self._inline.running():
                return _run_op_sync(self._fd, op)
        return r

    def close(self) -> None:
        """Ops not yet started fail with -ECANCELED; in-flight ones finish first."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            q = self._queue
        self._inline.close()
        self._lib.kv_queue_close(q)


def uring_available() -> tuple[bool, str | None]:
    """Whether the io_uring backend can run here, and if not why (for tests and stats)."""
    module, reason = load_uring()
    if module is None:
        return False, reason
    out = module.ffi.new("struct kv_queue **")
    rc = module.lib.kv_queue_open(4, -1, out)
    if rc < 0:
        return False, f"io_uring_queue_init failed: {os.strerror(-rc)}"
    module.lib.kv_queue_close(out[0])
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
        module, reason = load_uring()
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
