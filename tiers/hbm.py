"""The HBM tier: one region on a torch device, carved by an extent allocator.

In production the device is a CUDA GPU and the tier holds the hottest blocks next
to the model. Without a GPU (as on the machines that test this project) the same
code runs on the CPU device so every path is exercised, and the tier reports
the device it really uses: it never claims to be on a GPU when it is not.

torch is imported only when an HBM tier is created; the rest of kvstore does not
need it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from tiers.allocator import Extent, ExtentAllocator
from tiers.base import AllocatorBacked

if TYPE_CHECKING:
    import torch


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError("the HBM tier needs torch (pip install 'kvstore[torch]')") from exc
    return torch


def pick_device(requested: str | None = None) -> str:
    """``requested``, or ``"cuda"`` when a GPU is present, else ``"cpu"``."""
    torch = _torch()
    if requested:
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"HBM device {requested!r} requested but CUDA is not available")
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


class HbmTier(AllocatorBacked):
    """A ``Tier`` on a torch device. Not a ``MappedTier``: bytes move by copies."""

    name = "hbm"

    def __init__(self, capacity: int, *, device: str | None = None, alignment: int = 256,
                 index: str | None = None) -> None:
        """``index``: the allocator's live-table kind (``tiers.index_kind``; None: the
        environment's)."""
        # The module is kept as an attribute, not a local named ``torch``: that name is
        # the module-level (type-checking only) import the annotations refer to.
        self._torch = _torch()
        self.device = pick_device(device)
        self._allocator = ExtentAllocator(capacity, alignment=alignment, index=index)
        self._region: torch.Tensor = self._torch.empty(
            self._allocator.capacity, dtype=self._torch.uint8, device=self.device)

    @property
    def on_gpu(self) -> bool:
        return self._region.is_cuda

    def tensor(self, extent: Extent, nbytes: int) -> torch.Tensor:
        """The block as a uint8 tensor on the device (no copy), for consumers on that device."""
        if nbytes > extent.length:
            raise ValueError(f"{nbytes} bytes exceed extent {extent}")
        return self._region[extent.offset : extent.offset + nbytes]

    def _host(self, buf: memoryview) -> torch.Tensor:
        with warnings.catch_warnings():
            # A read-only source is only ever read from; torch warns regardless.
            warnings.simplefilter("ignore", UserWarning)
            host: torch.Tensor = self._torch.frombuffer(buf, dtype=self._torch.uint8)
            return host

    def write(self, extent: Extent, data: memoryview) -> None:
        n = len(data)
        if n == 0:
            return
        self.tensor(extent, n).copy_(self._host(data))

    def read_into(self, extent: Extent, nbytes: int, out: memoryview) -> None:
        if nbytes == 0:
            return
        if len(out) < nbytes:
            raise ValueError(f"buffer of {len(out)} bytes for {nbytes} bytes")
        self._host(out)[:nbytes].copy_(self.tensor(extent, nbytes))

    def describe(self) -> dict[str, str | bool]:
        return {"device": str(self._region.device), "on_gpu": self.on_gpu}

    def close(self) -> None:
        self._region = self._torch.empty(0, dtype=self._torch.uint8)
