"""Where a same-host client's puts land before they are committed: staging areas it maps,
never the node's region.

Why: a client filling a reservation in shared memory may stall (SIGSTOP, a hung engine)
past ``--read-lease-timeout``; the node then aborts the reservation and reuses its space.
If the client wrote straight into the region, its late bytes would land in whatever
block took that space, and no check at commit could undo that. So a client that asks
for it (``wire.CAP_STAGED_PUTS``) writes into a staging area, a memfd the node hands it,
at a slot the node carves for each reservation; the node copies the slot into the region
at commit, only for a reservation that is still live. On any expiry the slot's area is
*retired*: it takes no new reservation (later ones get a fresh area, whose descriptor
rides along with the next RESERVE reply), so the expired slot is never handed to anyone
again and the node never reads it. A late writer's bytes thus land in memory nobody
reads.

Invariants: a slot belongs to one reservation from grant to its end (slots share no
byte; neighbours may share a page), and an expired reservation's slot is never granted
again; an area's descriptor and mapping stay open while a live reservation holds a slot
in it or it is the current one; a slot's bytes are copied before its commit publishes
the block. Slots are carved low-first and their
pages kept for the next reservation (no page faults on a steady stream of puts), up to
``KEEP_RESIDENT`` bytes into the area; pages of slots past that are given back to the
kernel when the slot ends.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable

import cffi

from tiers.allocator import Extent, ExtentAllocator

_PAGE = mmap.PAGESIZE
SLOT_ALIGNMENT = 64  # the DRAM tier's: whatever the region holds at once fits an area
KEEP_RESIDENT = 32 << 20
"""Bytes at the start of an area whose pages stay resident between reservations."""
_COPY_CHUNK = 1 << 20  # the GIL is released between chunks of a landing copy
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02

# ABI mode: libc's fallocate (Python has posix_fallocate only), no compiler needed.
_ffi = cffi.FFI()
_ffi.cdef("int fallocate(int fd, int mode, long offset, long len);")
_libc = _ffi.dlopen(None)
# The cdef above declares it; cffi's stub types a Lib's attributes by nothing it can see.
_fallocate: Callable[[int, int, int, int], int] = _libc.fallocate  # type: ignore[attr-defined]  # cffi's stub cannot know a cdef'd function


class StagingArea:
    """One memfd of ``size`` bytes (sparse) a client writes its puts into, carved into
    slots; the node reads it through its own mapping."""

    __slots__ = ("_alloc", "_map", "fd", "generation", "retired", "size", "users")

    def __init__(self, size: int, generation: int) -> None:
        self.fd = os.memfd_create(f"kvstore-staging-{generation}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)  # sparse: pages exist only where a client wrote
            self._map: mmap.mmap | None = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED,
                                                    prot=mmap.PROT_READ)
        except BaseException:
            os.close(self.fd)
            raise
        self._alloc = ExtentAllocator(size, alignment=SLOT_ALIGNMENT)
        self.size = size
        self.generation = generation
        self.users = 0  # live reservations holding a slot here
        self.retired = False

    def carve(self, nbytes: int) -> Extent | None:
        """A slot for ``nbytes`` (None if none fits)."""
        return self._alloc.allocate(nbytes)

    def land(self, slot: Extent, dest: memoryview) -> None:
        """Copies the first ``len(dest)`` bytes of ``slot`` into ``dest`` (the region)."""
        assert self._map is not None
        with memoryview(self._map) as src:
            n = len(dest)
            for lo in range(0, n, _COPY_CHUNK):
                hi = min(n, lo + _COPY_CHUNK)
                dest[lo:hi] = src[slot.offset + lo:slot.offset + hi]

    def free(self, slot: Extent) -> None:
        """A live reservation's slot ended: carved again later (its pages kept, up to
        KEEP_RESIDENT into the area; past it, the pages wholly inside the slot are given
        back, the partial ones may hold a neighbour's bytes)."""
        start = -(-max(slot.offset, KEEP_RESIDENT) // _PAGE) * _PAGE
        end = slot.end // _PAGE * _PAGE
        if end > start:
            _fallocate(self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, start,
                            end - start)
        self._alloc.free(slot)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Staging:
    """A connection's staging areas: the current one, and retired ones still in use."""

    __slots__ = ("_current", "_generation", "_live", "_sent", "_size")

    def __init__(self, size: int) -> None:
        self._size = size
        self._generation = 1
        self._current = StagingArea(size, 1)
        self._live: list[StagingArea] = [self._current]
        self._sent = 0  # the generation whose descriptor the client was last given

    def to_send(self) -> tuple[int, int] | None:
        """(descriptor, generation) of the current area if the client has not been given
        it yet; the caller sends it, and it counts as sent."""
        if self._sent == self._current.generation:
            return None
        self._sent = self._current.generation
        return self._current.fd, self._current.generation

    def grant(self, nbytes: int) -> tuple[StagingArea, Extent] | None:
        """The area and slot a new reservation of ``nbytes`` is filled in (a fresh area
        after a retirement); None if no slot fits."""
        if self._current.retired:
            old = self._current
            self._generation += 1
            self._current = StagingArea(self._size, self._generation)
            self._live.append(self._current)
            if old.users == 0:
                self._drop(old)
        slot = self._current.carve(nbytes)
        if slot is None:
            return None
        self._current.users += 1
        return self._current, slot

    def done(self, area: StagingArea, slot: Extent, *, expired: bool) -> None:
        """A reservation holding ``slot`` of ``area`` ended. An expired one's writer may
        still write there: its slot is never carved again, and its area is retired."""
        if expired:
            area.retired = True
        else:
            area.free(slot)
        area.users -= 1
        if area.users == 0 and area is not self._current:
            self._drop(area)

    def _drop(self, area: StagingArea) -> None:
        area.close()
        self._live.remove(area)

    def close(self) -> None:
        for area in self._live:
            with contextlib.suppress(OSError):
                area.close()
        self._live = []
