"""The SSD tier's buffers and descriptor guard: what its I/O paths share besides the I/O.

Page-aligned scratch arenas for O_DIRECT bounce buffers, byte views of caller buffers,
their addresses (for the alignment test), and the count of transfers running in
callers' threads that closing waits for.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator
from typing import Any

import cffi

from tiers.ssd.types import ALIGNMENT

# Scratch arenas kept for reuse across calls (their pages are already faulted in).
ARENA_CACHE_BYTES = 128 << 20

# ABI-mode FFI: only used to read buffer addresses (for the alignment test), which
# needs no compiler, so it works whether or not the native module was built.
_ffi = cffi.FFI()


def byte_view(obj: Any, *, writable: bool = False) -> memoryview:
    """``obj`` as a 1-D unsigned-byte memoryview, without copying."""
    mv = obj if isinstance(obj, memoryview) else memoryview(obj)
    if not mv.c_contiguous:
        raise ValueError("SSD tier buffers must be C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    if writable and mv.readonly:
        raise ValueError("read destination is read-only")
    return mv


def address_of(mv: memoryview) -> int:
    return int(_ffi.cast("uintptr_t", _ffi.from_buffer(mv)))


def round_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class ArenaPool:
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


class InlineIO:
    """Counts transfers that run in callers' threads on the tier's descriptor, so that
    closing waits for them: the tier closes the descriptor right after its backend,
    and a syscall on a closed (or already reused) descriptor could read or write
    another file. ``running()`` raises ValueError once ``close()`` began."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._closed = False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._cond:
            if self._closed:
                raise ValueError("I/O on a closed SSD tier")
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                if not self._running:
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._running == 0)
