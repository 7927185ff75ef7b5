"""The DRAM tier: one shared-memory region carved by an extent allocator.

The region is a memfd, so a client on the same host can map the very pages
blocks live in (the fd travels over a Unix socket) and read without a copy
through the network stack. When CUDA is present the region is also page-locked
(``cudaHostRegister``), so copies to and from the GPU are DMA at full speed;
without a GPU it stays plain shared memory and ``pinned`` says so. The CUDA
path has not run on the machines that test this project (they have no GPU).
"""

from __future__ import annotations

import contextlib
import mmap
import os

from tiers.allocator import Extent, ExtentAllocator
from tiers.base import AllocatorBacked


class DramTier(AllocatorBacked):
    """Pinned-DRAM / shared-memory tier (a ``MappedTier``)."""

    name = "dram"

    def __init__(self, capacity: int, *, alignment: int = 64, prefault: bool = True,
                 index: str | None = None) -> None:
        """``index``: the allocator's live-table kind (``tiers.index_kind``; None: the
        environment's)."""
        if capacity <= 0:
            raise ValueError(f"DRAM tier capacity must be positive, got {capacity}")
        self._allocator = ExtentAllocator(capacity, alignment=alignment, index=index)
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
        self.pinned = self._register_with_cuda()

    def _address(self) -> int:
        import numpy as np

        arr = np.frombuffer(self._map, dtype=np.uint8)
        try:
            return int(arr.ctypes.data)
        finally:
            del arr  # drop the buffer export, or the mapping could never close

    def _register_with_cuda(self) -> bool:
        """Page-locks the region for CUDA DMA when a GPU is present; False otherwise."""
        if not os.path.exists("/dev/nvidiactl"):
            return False  # no NVIDIA driver: not worth importing torch to find out
        try:
            import torch
        except ImportError:
            return False
        if not torch.cuda.is_available():
            return False
        err = torch.cuda.cudart().cudaHostRegister(self._address(), len(self._map), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the DRAM region failed: {err}")
        return True

    @property
    def region_bytes(self) -> int:
        return len(self._map)

    @property
    def fd(self) -> int:
        """The memfd of the region, for handing to same-host clients."""
        return self._fd

    def view(self, extent: Extent, nbytes: int) -> memoryview:
        if nbytes > extent.length:
            raise ValueError(f"view of {nbytes} bytes exceeds extent {extent}")
        return self._view[extent.offset : extent.offset + nbytes]

    def write(self, extent: Extent, data: memoryview) -> None:
        self.view(extent, len(data))[:] = data

    def read_into(self, extent: Extent, nbytes: int, out: memoryview) -> None:
        out[:nbytes] = self.view(extent, nbytes)

    def close(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._address())
            self.pinned = False
        self._view.release()
        # A view may still be exported (a server thread mid-send during shutdown);
        # the mapping then goes when the last view does.
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self._fd)
