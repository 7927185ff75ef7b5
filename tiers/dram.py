"""The DRAM tier: one shared-memory region carved by an extent allocator.

The region is a memfd, so a client on the same host can map the very pages
blocks live in (the fd travels over a Unix socket) and read without a copy
through the network stack. When CUDA is present the pages could be page-locked
for DMA; without a GPU (as here) they are plain shared memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from tiers.allocator import Extent, ExtentAllocator


class DramTier:
    """Pinned-DRAM / shared-memory tier (a ``MappedTier``)."""

    name = "dram"

    def __init__(self, capacity: int, *, alignment: int = 64, prefault: bool = True) -> None:
        if capacity <= 0:
            raise ValueError(f"DRAM tier capacity must be positive, got {capacity}")
        self._allocator = ExtentAllocator(capacity, alignment=alignment)
        self._fd = os.memfd_create("kvstore-dram", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, capacity)
            flags = mmap.MAP_SHARED
            if prefault:
                # Fault every page in now: a first write into fresh pages runs at a
                # fraction of memcpy speed, and that cost belongs to start-up.
                flags |= mmap.MAP_POPULATE
            self._map = mmap.mmap(self._fd, capacity, flags=flags)
        except BaseException:
            os.close(self._fd)
            raise
        self._view = memoryview(self._map)

    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def used(self) -> int:
        return self._allocator.used

    @property
    def region_bytes(self) -> int:
        return len(self._map)

    @property
    def fd(self) -> int:
        """The memfd of the region, for handing to same-host clients."""
        return self._fd

    @property
    def allocator(self) -> ExtentAllocator:
        return self._allocator

    def allocate(self, nbytes: int) -> Extent | None:
        return self._allocator.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self._allocator.free(extent)

    def view(self, extent: Extent, nbytes: int) -> memoryview:
        if nbytes > extent.length:
            raise ValueError(f"view of {nbytes} bytes exceeds extent {extent}")
        return self._view[extent.offset : extent.offset + nbytes]

    def write(self, extent: Extent, data: memoryview) -> None:
        self.view(extent, len(data))[:] = data

    def read_into(self, extent: Extent, nbytes: int, out: memoryview) -> None:
        out[:nbytes] = self.view(extent, nbytes)

    def close(self) -> None:
        self._view.release()
        # A view may still be exported (a server thread mid-send during shutdown);
        # the mapping then goes when the last view does.
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self._fd)
