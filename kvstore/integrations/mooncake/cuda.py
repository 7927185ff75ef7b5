"""Mooncake 0.3.13's ``get_tensor_into_cuda`` / ``batch_get_tensor_into_cuda`` on kvstore,
as a mixin of ``MooncakeDistributedStore``.

Without CUDA (``torch.cuda.is_available()`` False, or no torch) every key answers
``INVALID_PARAMS`` (-600) and the reason is logged at ERROR: the return code is the one the
0.3.13 wheel gives when it cannot do a CUDA read (its non-dummy client), so callers that
check codes keep working, and the log says why.

With CUDA: each value is read through the host path kvstore already has (the node's DRAM
region, page-locked with ``cudaHostRegister`` when a GPU is present, then the transfer
channel or shared memory) into a page-locked staging tensor, and its payload is copied to
the device tensor with one host-to-device copy per key; the call returns after the copies
finish. As on the wheel, the value is a Mooncake tensor object (``put_tensor``'s format,
``mooncake_tensors``) and the destination must match its dtype and shape (else -600); it
must be a contiguous CUDA tensor. This path could not be run on the machine these modules
were written on (no GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvstore.core.errors import KVStoreError
from kvstore.integrations.mooncake.host import StoreHost
from kvstore.integrations.mooncake.tensors import META_BYTES, parse_header
from kvstore.integrations.mooncake.types import (
    INVALID_PARAMS,
    OBJECT_NOT_FOUND,
    code_of,
    mooncake_key,
)

log = logging.getLogger(__name__)


def cuda_unavailable_reason() -> str | None:
    """Why a CUDA read cannot run here, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


class CudaTensorReads(StoreHost):
    """The two CUDA read methods; the store class provides ``_reader``."""

    def get_tensor_into_cuda(self, key: str | bytes, tensor: Any) -> int:
        """Reads ``key``'s value into CUDA ``tensor``: bytes read, or a negative code."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: Sequence[str | bytes],
                                   tensors_list: Sequence[Any]) -> list[int]:
        """Per key: payload bytes read into its CUDA tensor, or a negative code (-600
        without CUDA, for a non-CUDA or non-contiguous tensor, or a stored tensor of
        another dtype or shape; -704 miss)."""
        codes = [INVALID_PARAMS] * len(keys)
        client = self._reader()
        if client is None or len(keys) != len(tensors_list):
            log.error("batch_get_tensor_into_cuda: store not set up, or %d keys for %d "
                      "tensors", len(keys), len(tensors_list))
            return codes
        reason = cuda_unavailable_reason()
        if reason is not None:
            log.error("batch_get_tensor_into_cuda is not available here: %s", reason)
            return codes
        import torch

        idx = [i for i, (k, t) in enumerate(zip(keys, tensors_list, strict=True))
               if isinstance(k, (str, bytes)) and isinstance(t, torch.Tensor) and t.is_cuda
               and t.is_contiguous()]
        staging = [torch.empty(META_BYTES + tensors_list[i].nbytes, dtype=torch.uint8,
                               pin_memory=True) for i in idx]
        got: list[int | None] = []
        try:
            got = client.get_batch_into([mooncake_key(keys[i]) for i in idx],
                                        [s.numpy() for s in staging])
        except KVStoreError as exc:
            for i in idx:
                codes[i] = code_of(exc)
            return codes
        for i, host, n in zip(idx, staging, got, strict=True):
            if n is None:
                codes[i] = OBJECT_NOT_FOUND
                continue
            # .data, the array's buffer: numpy's stub declares the buffer protocol for
            # Python 3.12+ only.
            meta = parse_header(host.numpy().data[:n])
            dst = tensors_list[i]
            if meta is None or meta[0] != str(dst.dtype).removeprefix("torch.") \
                    or (meta[1] or (1,)) != tuple(dst.shape):
                log.error("get_tensor_into_cuda: %r is not a tensor of %s %s", keys[i],
                          dst.dtype, tuple(dst.shape))
                continue
            _, _, offset, nbytes = meta
            dst.view(-1).view(torch.uint8).copy_(host[offset : offset + nbytes],
                                                 non_blocking=True)
            codes[i] = nbytes
        torch.cuda.synchronize()
        return codes
