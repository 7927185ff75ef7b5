"""How one vLLM KV-cache block is stored in kvstore (layout version 1).

One kvstore object per block, under the block's prefix-hash key
(``kvstore.block_keys(token_ids, block_size, namespace, extra=...)``); the object holds
every attention layer of that block, so a block is stored or missing as a whole and one
``prefix_match`` answers how much of a prompt the store can serve.

Value::

    offset  size  field
    0       8     magic b"KVSVLLM\\x01"
    8       4     layout version (u32le, 1)
    12      4     number of layers L (u32le)
    16      8     bytes of one layer's block, S (u64le)
    24      8     layout fingerprint (u64le): xxh3_64 of the dtype and per-layer shapes
    32      8     payload checksum (u64le): xxh3_64 (seed 0) of bytes [64, 64 + L*S)
    40      16    the block's own key
    56      8     engine identity (u64le): xxh3_64 of what decides the KV bytes beyond the
                  layout (the weights' fingerprint, dtypes, quantization, shard: the
                  ``engine_identity.engine_identity``); zero in values written before it
    64      L*S   payload: layer 0's block, layer 1's block, ... in the engine's layer order

A layer's block is ``kv_cache[block_id]`` of that layer's cache tensor, in C order: vLLM
0.32 gives every attention layer a logical ``[num_blocks, H, N, C]`` view (for the CPU
backend ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, keys then values per
head), in the cache dtype, little-endian. The bytes are the engine's own, not converted:
an engine with another layout or dtype has another fingerprint (and should use another
namespace, which the connector's default namespace ensures for dtype and shape).

A value is accepted only if its length is exactly ``64 + L*S``, its header matches this
engine's layout, its identity and the key it was fetched under, and its checksum matches:
a torn, truncated, misplaced or corrupted block, or one an engine on other weights or
settings wrote (under a namespace both were given), is refused, never loaded.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

MAGIC = b"KVSVLLM\x01"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQQ16sQ")
assert _HEADER.size == HEADER_BYTES


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The shape of one block across the engine's attention layers."""

    layer_shapes: tuple[tuple[int, ...], ...]
    """Per layer, the shape of one block (the cache tensor's shape without dim 0)."""
    dtype: torch.dtype
    identity: int = 0
    """The writing engine's identity (header offset 56); a reader refuses another."""
    itemsize: int = field(init=False, repr=False, compare=False)
    layer_bytes_each: tuple[int, ...] = field(init=False, repr=False, compare=False)
    fingerprint: int = field(init=False, repr=False, compare=False)
    """xxh3_64 of the dtype and per-layer shapes (header offset 24)."""

    def __post_init__(self) -> None:
        # Derived once: seal and check read them for every block of every step.
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        each = tuple(itemsize * math.prod(shape) for shape in self.layer_shapes)
        fingerprint = xxhash.xxh3_64_intdigest(
            repr((str(self.dtype), self.layer_shapes)).encode())
        object.__setattr__(self, "itemsize", itemsize)
        object.__setattr__(self, "layer_bytes_each", each)
        object.__setattr__(self, "fingerprint", fingerprint)

    @classmethod
    def from_caches(cls, caches: Sequence[torch.Tensor], *, identity: int = 0
                    ) -> BlockLayout:
        if not caches:
            raise ValueError("no attention layers to store")
        dtype = caches[0].dtype
        shapes = []
        for kv in caches:
            if kv.dtype != dtype:
                raise ValueError(f"layers differ in dtype: {kv.dtype} vs {dtype}")
            if kv.device.type != "cpu":
                raise ValueError(f"KV cache on {kv.device}: only CPU caches are supported")
            shapes.append(tuple(kv.shape[1:]))
        layout = cls(tuple(shapes), dtype, identity)
        if len(set(layout.layer_bytes_each)) != 1:
            raise ValueError(f"layers differ in block size: {layout.layer_shapes}")
        return layout

    @property
    def num_layers(self) -> int:
        return len(self.layer_shapes)

    @property
    def layer_bytes(self) -> int:
        return self.layer_bytes_each[0]

    @property
    def value_bytes(self) -> int:
        return HEADER_BYTES + self.num_layers * self.layer_bytes

    # --- staging buffers: one row of value_bytes per block --------------------------------

    def new_staging(self, num_blocks: int) -> torch.Tensor:
        return torch.empty((num_blocks, self.value_bytes), dtype=torch.uint8)

    def layer_view(self, staging: torch.Tensor, layer: int) -> torch.Tensor:
        """Rows of ``staging`` seen as ``[n, *layer_shape]`` of the cache dtype (a view)."""
        lo = HEADER_BYTES + layer * self.layer_bytes
        part = staging[:, lo : lo + self.layer_bytes]
        return part.view(self.dtype).view(staging.shape[0], *self.layer_shapes[layer])

    def gather_layer(self, staging: torch.Tensor, layer: int, kv: torch.Tensor,
                     block_ids: torch.Tensor) -> None:
        """Copies blocks ``block_ids`` of one layer's cache into the staging rows."""
        self.layer_view(staging, layer).copy_(kv.index_select(0, block_ids))

    def scatter_layer(self, staging: torch.Tensor, layer: int, kv: torch.Tensor,
                      block_ids: torch.Tensor) -> None:
        """Copies the staging rows into blocks ``block_ids`` of one layer's cache."""
        kv.index_copy_(0, block_ids, self.layer_view(staging, layer))

    def seal(self, staging: torch.Tensor, keys: Sequence[bytes]) -> None:
        """Writes every row's header (checksum over its payload, its key)."""
        rows = staging.numpy()
        for i, key in enumerate(keys):
            # .data: the payload's buffer as a memoryview (numpy's stub declares the buffer
            # protocol of an array for Python 3.12+ only).
            payload = rows[i, HEADER_BYTES:].data
            header = _HEADER.pack(MAGIC, VERSION, self.num_layers, self.layer_bytes,
                                  self.fingerprint, xxhash.xxh3_64_intdigest(payload), key,
                                  self.identity)
            rows[i, :HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)

    def check(self, row: torch.Tensor | memoryview | bytes, key: bytes,
              length: int | None) -> str | None:
        """Why a fetched value must be refused, or None if it is sound.

        ``length`` is the stored value's size (None: a miss)."""
        if length is None:
            return "missing"
        if length != self.value_bytes:
            return f"size {length}, expected {self.value_bytes}"
        buf = row.numpy().data if isinstance(row, torch.Tensor) else row  # .data: see seal()
        magic, version, layers, layer_bytes, fp, checksum, stored_key, identity = (
            _HEADER.unpack_from(buf, 0))
        if magic != MAGIC or version != VERSION:
            return "not a vLLM block of layout version 1"
        if (layers, layer_bytes, fp) != (self.num_layers, self.layer_bytes, self.fingerprint):
            return "another engine layout (layers, shapes or dtype)"
        if identity != self.identity:
            return "another engine identity (weights, dtypes, quantization or shard)"
        if stored_key != key:
            return "stored under another key"
        if xxhash.xxh3_64_intdigest(memoryview(buf)[HEADER_BYTES:length]) != checksum:
            return "checksum mismatch"
        return None


def parse_header(value: bytes) -> dict:
    """The header fields of a stored value (for tools and tests)."""
    magic, version, layers, layer_bytes, fp, checksum, key, ident = _HEADER.unpack_from(value, 0)
    return {"magic": magic, "version": version, "num_layers": layers,
            "layer_bytes": layer_bytes, "fingerprint": fp, "checksum": checksum, "key": key,
            "identity": ident}


def reseal(value: bytes | bytearray) -> bytes:
    """``value`` with its checksum recomputed over its payload (tests use it to forge a
    well-formed block with other contents)."""
    buf = bytearray(value)
    struct.pack_into("<Q", buf, 32, xxhash.xxh3_64_intdigest(bytes(buf[HEADER_BYTES:])))
    return bytes(buf)
