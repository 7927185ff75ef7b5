"""Mooncake 0.3.13's whole-tensor methods (``put_tensor``, ``batch_put_tensor``,
``get_tensor``, ``batch_get_tensor``, ``get_tensor_into``, ``batch_get_tensor_into``) as a
mixin of ``MooncakeDistributedStore``, in the wheel's own object format, so a tensor put by
either is read by the other from the same bytes.

The stored value is Mooncake's ``TensorMetadata`` (``integration_utils.h``: a 40-byte
``TensorObjectHeader`` — magic ``0x4d4f4f4e``, version 1, header size, dtype code, ndim,
layout kind FULL, data offset, data bytes — then a 264-byte ``TensorLayoutMetadata`` with the
global and local shapes, eight int64 dims each, -1 past ``ndim``, and no parallel axes),
304 bytes little-endian, followed by the tensor's bytes in row-major order. Tensors must be
on the CPU here (the CUDA reads are ``mooncake_cuda``); the tensor-/expert-parallel and
``pub``/``upsert`` tensor variants are not provided (``mooncake_unsupported``).

Returns as the wheel: puts give 0 or a negative code (-600 for what is not a CPU tensor of
a supported dtype with at most 8 dimensions); gets give a tensor, or None on a miss, an
error, or a value that is not a Mooncake tensor object. ``get_tensor_into`` reads the whole
object into registered memory and returns a tensor over its payload there (no copy).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from typing import Any

from kvstore.integrations.mooncake.host import StoreHost
from kvstore.integrations.mooncake.types import INVALID_PARAMS

log = logging.getLogger(__name__)

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
_HEADER = struct.Struct("<IHHiiIIQQ")  # TensorObjectHeader, 40 bytes
_SHAPE = struct.Struct("<8q")
_AXES_BYTES = 4 * 32  # four LayoutAxis of int32 x 6 + int64, unused (FULL layout)
META_BYTES = _HEADER.size + 2 * _SHAPE.size + 8 + _AXES_BYTES  # 304, sizeof(TensorMetadata)
# Mooncake's TensorDtype codes, by torch dtype name.
DTYPES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
          "int64", "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")

Key = str | bytes


def pack_header(dtype_name: str, shape: Sequence[int], data_bytes: int) -> bytes:
    """The 304-byte metadata of a FULL-layout tensor. ValueError for an unsupported dtype
    or more than 8 dimensions."""
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype {dtype_name} has no Mooncake tensor code")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"{len(shape)} dimensions; Mooncake tensors have at most {MAX_DIMS}")
    dims = _SHAPE.pack(*[*shape, *[-1] * (MAX_DIMS - len(shape))])
    head = _HEADER.pack(MAGIC, VERSION, META_BYTES, DTYPES.index(dtype_name), len(shape),
                        0, 0, META_BYTES, data_bytes)
    return head + dims + dims + bytes(8 + _AXES_BYTES)


def parse_header(value: bytes | memoryview) -> tuple[str, tuple[int, ...], int, int] | None:
    """(dtype name, shape, data offset, data bytes) of a Mooncake tensor object, or None."""
    if len(value) < META_BYTES:
        return None
    magic, version, _, code, ndim, _, _, offset, nbytes = _HEADER.unpack_from(value, 0)
    if magic != MAGIC or version != VERSION or not 0 <= code < len(DTYPES) \
            or not 0 <= ndim <= MAX_DIMS or offset + nbytes > len(value):
        return None
    local = _SHAPE.unpack_from(value, _HEADER.size + _SHAPE.size)[:ndim]
    return DTYPES[code], tuple(local), offset, nbytes


def _to_tensor(torch: Any, raw: Any, dtype_name: str, shape: tuple[int, ...]) -> Any:
    """A tensor over ``raw``. A 0-dim tensor (stored with ndim 0) comes back with shape
    (1,), as the 0.3.13 wheel returns it."""
    shape = shape or (1,)
    flat = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(
        0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype_name)).reshape(shape)


class TensorObjects(StoreHost):
    """The whole-tensor methods; the store class provides the attributes below."""

    def _get_into(self, keys: Sequence[Key], outs: Sequence[memoryview | None]
                  ) -> list[int]:
        raise NotImplementedError  # pragma: no cover

    @staticmethod
    def _encode(tensor: Any) -> bytes | None:
        try:
            import torch
        except ImportError:
            log.error("put_tensor: torch is not installed")
            return None
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            log.error("put_tensor: needs a CPU torch.Tensor, got %r", type(tensor).__name__)
            return None
        t = tensor.contiguous()
        try:
            head = pack_header(str(t.dtype).removeprefix("torch."), list(t.shape), t.nbytes)
        except ValueError as exc:
            log.error("put_tensor: %s", exc)
            return None
        return head + t.reshape(-1).view(torch.uint8).numpy().tobytes()

    def put_tensor(self, key: Key, tensor: Any) -> int:
        """Stores ``tensor`` (metadata + bytes): 0 or a negative code."""
        return self.batch_put_tensor([key], [tensor])[0]

    def batch_put_tensor(self, keys: Sequence[Key], tensors_list: Sequence[Any]) -> list[int]:
        """Per key: 0 or a negative code."""
        if len(keys) != len(tensors_list):
            return [INVALID_PARAMS] * len(keys)
        return self._put(keys, [self._encode(t) for t in tensors_list], None)

    def get_tensor(self, key: Key) -> Any:
        """The tensor stored under ``key``, or None."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: Sequence[Key]) -> list[Any]:
        """Per key the tensor, or None (a miss, an error, not a Mooncake tensor object)."""
        try:
            import torch
        except ImportError:
            log.error("get_tensor: torch is not installed")
            return [None] * len(keys)
        values = self._values(keys)
        if values is None:
            return [None] * len(keys)
        out: list[Any] = []
        for value in values:
            if value is None or (meta := parse_header(value)) is None:
                out.append(None)
                continue
            dtype, shape, offset, nbytes = meta
            out.append(_to_tensor(torch, bytearray(value[offset : offset + nbytes]), dtype,
                                  shape))
        return out

    def get_tensor_into(self, key: Key, buffer_ptr: int, size: int) -> Any:
        """Reads ``key``'s tensor object into registered memory; a tensor over its payload
        there, or None."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, base_keys: Sequence[Key], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[Any]:
        """Per key as ``get_tensor_into``."""
        try:
            import torch
        except ImportError:
            return [None] * len(base_keys)
        if not len(base_keys) == len(buffer_ptrs) == len(sizes):
            return [None] * len(base_keys)
        outs = [self._view(p, s) for p, s in zip(buffer_ptrs, sizes, strict=True)]
        got = self._get_into(base_keys, outs)
        result: list[Any] = []
        for out, n in zip(outs, got, strict=True):
            if out is None or n < 0 or (meta := parse_header(out[:n])) is None:
                result.append(None)
                continue
            dtype, shape, offset, nbytes = meta
            result.append(_to_tensor(torch, out[offset : offset + nbytes], dtype, shape))
        return result
