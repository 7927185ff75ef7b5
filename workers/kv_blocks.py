"""The mapping between a worker's KV cache and kvstore objects.

Byte layout (layout version 1)
------------------------------
A prompt of ``n`` tokens has ``n_full = n // B`` full blocks (``B = block_tokens``)
with the store's prefix-hash keys ``kvstore.block_keys(tokens, B, namespace)``.
There is **one object per (block, layer)**, keyed (``kvstore.core.keys.layer_key``, where
every stored-key derivation is specified and pinned by vectors)::

    layer_key(block_key, l) = xxh3_128(b"kvstore-workers-layer-v1\\x00" || block_key || u32le(l))

Its value is exactly ``B * 2 * n_kv_heads * head_dim * itemsize`` bytes: the cache rows
``KVCache.kv[l, i*B:(i+1)*B]`` as they lie in memory, i.e. for each of the ``B``
tokens in order, its key ``[n_kv_heads][head_dim]`` then its value
``[n_kv_heads][head_dim]``, elements in the model dtype (IEEE float32, bfloat16 or
float16), little-endian. Keys are stored *after* RoPE (a block's positions are
fixed by its prefix, which its key already names). Each layer object's parent is
the same layer's object of the previous block (none for block 0), so a
prefix-aware eviction policy drops chain tails first.

Why per (block, layer): prefill puts layer ``l`` of all new blocks as soon as layer
``l`` is computed, overlapping the transfer with layers ``l+1..``; and the rows of
one layer are contiguous in the cache, so the client reads each value straight
from the cache tensor (no staging copy) and ``get_batch_into`` writes straight
into it.

Namespace: ``default_namespace`` = model name (which carries the seed or a hash
of the weights) / dtype / shape / layout version / block size, so different
models, dtypes or layouts never share objects.

Completeness rule: layers are written in order 0, 1, ..., L-1 and a writer stops
at the first failed layer, so the last layer of a block is stored only after all
its other layers were acknowledged. ``cached_blocks`` therefore prefix-matches the
*last* layer's keys. Eviction can still drop an earlier layer later, so
``fetch`` checks every returned size and reports only the leading blocks whose
every layer arrived whole; callers recompute from there.

Partial tail (the last ``n - n_full*B`` tokens, not content-addressable): put per
layer under ``layer_key(tail_key(namespace, request_id, tokens), l)`` with the same
row layout (``tail_tokens`` rows instead of ``B``); request-scoped, so the decode
worker of that request reads it and removes it. A missing tail is recomputed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvstore import BlockKey, InvalidArgument, block_keys

# The layer and tail derivations are kvstore.core.keys' (with every other stored-key derivation,
# so the Conductor names last layers without importing torch); re-exported here.
from kvstore.core.keys import layer_key, tail_key
from workers.model import KVCache, LlamaModel

LAYOUT_VERSION = 1
log = logging.getLogger("workers.kv_blocks")


class StoredBlocks(Protocol):
    """The store calls the worker makes: ``kvstore.Client`` has them, on one node and on a
    cluster (the worker never needs to know which)."""

    def prefix_match(self, keys: Sequence[bytes]) -> int: ...

    def get_batch_into(self, keys: Sequence[bytes], bufs: Sequence[object]
                       ) -> list[int | None]: ...

    def get_into(self, key: bytes, buf: object) -> int | None: ...

    def put_batch(self, keys: Sequence[bytes], values: Sequence[object], *,
                  parents: Sequence[bytes | None] | None = None,
                  retain_s: float | None = None) -> list[bool]: ...

    def remove(self, key: bytes) -> bool: ...


def kv_shape(model: LlamaModel) -> dict[str, int]:
    """What a scheduler needs to price a KV transfer and to name a block's last layer."""
    c = model.config
    return {"n_layers": c.n_layers,
            "kv_bytes_per_token": 2 * c.n_layers * c.n_kv_heads * c.head_dim
            * c.torch_dtype.itemsize}


def default_namespace(model: LlamaModel, block_tokens: int) -> str:
    c = model.config
    return (f"{model.name}/{c.dtype}/L{c.n_layers}-kvh{c.n_kv_heads}-hd{c.head_dim}"
            f"/kvlayout-v{LAYOUT_VERSION}/B{block_tokens}")


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor (shares its memory)."""
    return t.view(torch.uint8).numpy()


@dataclass(slots=True, kw_only=True)
class FetchResult:
    """``blocks``: leading blocks whose every layer arrived whole; ``tail``: the tail's
    every layer arrived (only looked at when all blocks did)."""

    blocks: int
    tail: bool
    nbytes: int
    seconds: float


class KVBlockStore:
    """Moves cache rows to and from the store in the layout above. Thread-safe (the
    client is); holds no cache state of its own.

    ``staged``: go through a host staging tensor (needed when the cache is not in
    CPU memory, e.g. CUDA; default: only then). On CPU it is off: values are views
    of the cache itself.
    """

    def __init__(self, store: StoredBlocks, model: LlamaModel, *, block_tokens: int,
                 namespace: str | None = None, staged: bool | None = None) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.store = store
        self.model = model
        self.block_tokens = block_tokens
        self.namespace = namespace or default_namespace(model, block_tokens)
        self.staged = model.device.type != "cpu" if staged is None else staged
        c = model.config
        self.n_layers = c.n_layers
        self.token_bytes = 2 * c.n_kv_heads * c.head_dim * c.torch_dtype.itemsize
        self.block_bytes = block_tokens * self.token_bytes

    def block_keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        return block_keys(token_ids, self.block_tokens, self.namespace)

    def tail_key(self, request_id: str, token_ids: Sequence[int]) -> BlockKey:
        return tail_key(self.namespace, request_id, token_ids)

    def cached_blocks(self, keys: Sequence[BlockKey]) -> int:
        """Leading blocks whose last layer is stored (see the completeness rule)."""
        if not keys:
            return 0
        last = self.n_layers - 1
        return self.store.prefix_match([layer_key(k, last) for k in keys])

    # ---- reads -----------------------------------------------------------------------------

    def fetch(self, cache: KVCache, keys: Sequence[BlockKey], *, tail: BlockKey | None = None,
              tail_tokens: int = 0) -> FetchResult:
        """Reads every layer of blocks ``0..len(keys)-1`` (and of the tail, rows
        ``[len(keys)*B, len(keys)*B + tail_tokens)``) into ``cache`` rows. Does not change
        ``cache.length``; rows of blocks past ``FetchResult.blocks`` hold garbage."""
        t0 = time.perf_counter()
        B = self.block_tokens
        n = len(keys)
        rows = n * B + (tail_tokens if tail is not None else 0)
        if rows == 0:
            return FetchResult(blocks=0, tail=False, nbytes=0, seconds=0.0)
        cache.reserve(rows)
        host = (torch.empty((self.n_layers, rows, *cache.kv.shape[2:]), dtype=cache.kv.dtype,
                            pin_memory=cache.kv.is_cuda)
                if self.staged else cache.kv)
        skeys: list[bytes] = []
        bufs: list[np.ndarray] = []
        sizes: list[int] = []
        for layer in range(self.n_layers):
            for i, k in enumerate(keys):
                skeys.append(layer_key(k, layer))
                bufs.append(_bytes_of(host[layer, i * B : (i + 1) * B]))
                sizes.append(self.block_bytes)
            if tail is not None and tail_tokens:
                skeys.append(layer_key(tail, layer))
                bufs.append(_bytes_of(host[layer, n * B : rows]))
                sizes.append(tail_tokens * self.token_bytes)
        got = self._get_into(skeys, bufs)
        per_layer = n + (1 if tail is not None and tail_tokens else 0)
        good = n
        tail_ok = tail is not None and tail_tokens > 0
        nbytes = 0
        for layer in range(self.n_layers):
            base = layer * per_layer
            for i in range(good):
                if got[base + i] != sizes[base + i]:
                    good = i
                    break
            if tail_ok and got[base + n] != sizes[base + n]:
                tail_ok = False
        tail_ok = tail_ok and good == n
        for g in got:
            nbytes += g or 0
        if self.staged:
            cache.kv[:, :rows].copy_(host)
        return FetchResult(blocks=good, tail=tail_ok, nbytes=nbytes,
                           seconds=time.perf_counter() - t0)

    def _get_into(self, keys: list[bytes], bufs: list[np.ndarray]) -> list[int | None]:
        try:
            return self.store.get_batch_into(keys, bufs)
        except InvalidArgument:
            # Some stored value is larger than its slot (a foreign or corrupt object under
            # our key). Find which, key by key: those count as misses.
            out: list[int | None] = []
            for k, b in zip(keys, bufs, strict=True):
                try:
                    out.append(self.store.get_into(k, b))
                except InvalidArgument:
                    log.warning("object %s has the wrong size; treated as missing", k.hex())
                    out.append(None)
            return out

    # ---- writes ----------------------------------------------------------------------------

    def host_rows(self, cache: KVCache, layer: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``layer`` in CPU memory: a view of the cache, or a copy
        when staged (taken now, so the caller may overwrite the cache afterwards)."""
        rows = cache.rows(layer, start, stop)
        return rows.to("cpu", copy=True) if self.staged else rows

    def put_layer(self, layer: int, rows: torch.Tensor, keys: Sequence[BlockKey],
                  first_block: int, *, tail: BlockKey | None = None,
                  retain_s: float | None = None) -> int:
        """Puts layer ``layer`` of blocks ``first_block..len(keys)-1`` and, if ``tail`` is
        given, of the tail: ``rows`` (from ``host_rows``) starts at token
        ``first_block * B`` and its rows past the last full block are the tail's.
        ``retain_s``: the full blocks are put with that retention (the tail, read once by
        the decode worker, never is). Returns the bytes sent. Raises the store's errors."""
        B = self.block_tokens
        skeys: list[bytes] = []
        values: list[np.ndarray] = []
        parents: list[bytes | None] = []
        prev = layer_key(keys[first_block - 1], layer) if first_block > 0 else None
        for j, i in enumerate(range(first_block, len(keys))):
            k = layer_key(keys[i], layer)
            skeys.append(k)
            values.append(_bytes_of(rows[j * B : (j + 1) * B]))
            parents.append(prev)
            prev = k
        full_rows = (len(keys) - first_block) * B
        n_full = len(skeys)
        if tail is not None and rows.shape[0] > full_rows:
            skeys.append(layer_key(tail, layer))
            values.append(_bytes_of(rows[full_rows:]))
            parents.append(prev)
        if not skeys:
            return 0
        if retain_s and n_full:
            self.store.put_batch(skeys[:n_full], values[:n_full], parents=parents[:n_full],
                                 retain_s=retain_s)
            if len(skeys) > n_full:
                self.store.put_batch(skeys[n_full:], values[n_full:],
                                     parents=parents[n_full:])
        else:
            self.store.put_batch(skeys, values, parents=parents)
        return sum(v.nbytes for v in values)

    def remove_tail(self, tail: BlockKey) -> None:
        """Drops every layer of a request's tail (best effort: it is only a cache)."""
        for layer in range(self.n_layers):
            try:
                self.store.remove(layer_key(tail, layer))
            except Exception as exc:  # (a leftover tail only costs space)
                log.warning("removing tail %s layer %d: %s", tail.hex(), layer, exc)
                return
