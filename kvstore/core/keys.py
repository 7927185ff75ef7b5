"""Prefix-hash block keys.

Specification (version 1). Any client, in any language, reproduces these bytes.

* A *block* is ``block_tokens`` consecutive token ids of one sequence. Only full
  blocks get a key; a partial last block gets none.
* ``xxh3_128(b)`` is XXH3-128 with seed 0; its 16-byte digest is the canonical
  big-endian form (what ``xxhash.xxh3_128(b).digest()`` returns).
* The root of a chain is derived from the namespace (model name, dtype, layout,
  tensor-parallel rank, in whatever spelling the deployment agrees on)::

      root = xxh3_128(b"kvstore-prefix-v1\\x00" || utf8(namespace))

* Block ``i`` (0-based) of a sequence has the key::

      key_i = xxh3_128(key_{i-1} || u32le(t_{i*B}) || ... || u32le(t_{i*B+B-1}) || extra)

  with ``key_{-1} = root``, ``B = block_tokens``, every token id encoded as an
  unsigned 32-bit little-endian integer, and ``extra`` the same bytes for every
  block of the chain (default empty; e.g. a LoRA id or multimodal hash).

Because each key covers its whole prefix, two sequences that share their first
``n`` full blocks share their first ``n`` keys, and a key never names two
different contents: a block's bytes are immutable once stored.

Derived keys (version 1). Every other stored key is derived here too, each with its
own domain-separation string, so no derivation can name another's object
(``tests/vectors/derived_keys.json`` pins their bytes)::

    salt_key(tenant, key)   = xxh3_128(b"kvstore-tenant-v1\\x00" || utf8(tenant) || b"\\x00" || key)
    layer_key(key, l)       = xxh3_128(b"kvstore-workers-layer-v1\\x00" || key || u32le(l))
    tail_key(ns, rid, toks) = xxh3_128(b"kvstore-workers-tail-v1\\x00" || utf8(ns) || b"\\x00"
                                       || utf8(rid) || b"\\x00" || u32le(t_0) || ... )
    mooncake_key(k)         = xxh3_128(b"kvstore-mooncake-v1\\x00" || utf8(k))
    shard_key(key, shard)   = xxh3_128(b"kvstore-shard-v1\\x00" || utf8(shard) || b"\\x00" || key)

* ``salt_key``: a tenant's key as the node stores it (``kvstore.auth.tenancy``): two tenants
  naming the same key name two different blocks.
* ``layer_key``: one layer of a block (or of a tail) in the workers' layout
  (``workers.kv_blocks``); the Conductor prefix-matches last layers with it.
* ``tail_key``: a prompt's request-scoped partial last block; it covers the whole prompt,
  so a request id reused for another prompt never reads a stale tail.
* ``mooncake_key``: the 16-byte key of a Mooncake (and SGLang / LMCache) string key
  (``bytes`` are hashed as they are).
* ``shard_key``: one rank's shard of a block when an engine splits its KV cache over
  several ranks (tensor / pipeline parallelism, ``kvstore.integrations.vllm.ranks``);
  ``shard`` names the rank and the world size (``"tp1of2.pp0of1"``), so engines of other
  parallel shapes never read each other's shards as their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NewType

import numpy as np
import xxhash

BlockKey = NewType("BlockKey", bytes)
"""A 16-byte prefix-hash key of one block."""

KEY_BYTES = 16
_ROOT_DOMAIN = b"kvstore-prefix-v1\x00"
TENANT_DOMAIN = b"kvstore-tenant-v1\x00"
LAYER_DOMAIN = b"kvstore-workers-layer-v1\x00"
TAIL_DOMAIN = b"kvstore-workers-tail-v1\x00"
MOONCAKE_DOMAIN = b"kvstore-mooncake-v1\x00"
SHARD_DOMAIN = b"kvstore-shard-v1\x00"
_U32_MAX = 0xFFFFFFFF


def namespace_root_key(namespace: str) -> BlockKey:
    """The chain root for ``namespace``: the parent of every first block."""
    return BlockKey(xxhash.xxh3_128_digest(_ROOT_DOMAIN + namespace.encode("utf-8")))


def chained_block_key(parent: bytes, block_token_ids: bytes, extra: bytes = b"") -> BlockKey:
    """The key of one block from its parent key and its token ids already encoded as u32le."""
    return BlockKey(xxhash.xxh3_128_digest(parent + block_token_ids + extra))


def encode_token_ids(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as consecutive unsigned 32-bit little-endian integers.

    Raises ValueError for ids outside ``[0, 2**32)``: truncating them would make
    distinct prompts share keys.
    """
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _U32_MAX:
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def block_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_tokens: int,
    namespace: str,
    *,
    extra: bytes = b"",
) -> list[BlockKey]:
    """Keys of every full block of ``token_ids``, in order (see the module spec)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    encoded = encode_token_ids(token_ids)
    stride = 4 * block_tokens
    parent: bytes = namespace_root_key(namespace)
    keys: list[BlockKey] = []
    for start in range(0, len(encoded) - stride + 1, stride):
        parent = chained_block_key(parent, encoded[start : start + stride], extra)
        keys.append(BlockKey(parent))
    return keys


def salt_key(tenant: str, key: bytes) -> BlockKey:
    """The stored key of ``key`` in ``tenant``'s namespace (see the module spec)."""
    return BlockKey(xxhash.xxh3_128(TENANT_DOMAIN + tenant.encode() + b"\x00" + key).digest())


def layer_key(key: bytes, layer: int) -> BlockKey:
    """The key of layer ``layer`` of the block (or tail) named ``key``."""
    return BlockKey(xxhash.xxh3_128_digest(LAYER_DOMAIN + bytes(key) + layer.to_bytes(4, "little")))


def tail_key(namespace: str, request_id: str, token_ids: Sequence[int]) -> BlockKey:
    """The request-scoped name of a prompt's partial last block. It covers the whole
    prompt, so a request id reused for another prompt never reads a stale tail."""
    return BlockKey(xxhash.xxh3_128_digest(
        TAIL_DOMAIN + namespace.encode() + b"\x00" + request_id.encode() + b"\x00"
        + encode_token_ids(list(token_ids))))


def mooncake_key(key: str | bytes) -> BlockKey:
    """The 16-byte kvstore key of a Mooncake key (see the module spec)."""
    if isinstance(key, str):
        raw = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
    else:
        raise TypeError(f"a Mooncake key is a str (or bytes), got {type(key).__name__}")
    return BlockKey(xxhash.xxh3_128_digest(MOONCAKE_DOMAIN + raw))


def shard_key(key: bytes, shard: str) -> BlockKey:
    """The key of rank ``shard``'s part of the block named ``key`` (see the module spec)."""
    return BlockKey(xxhash.xxh3_128_digest(SHARD_DOMAIN + shard.encode("utf-8") + b"\x00"
                                           + bytes(key)))


def parse_key(text: str) -> BlockKey:
    """A key from its 32-character hex spelling (the CLI's form)."""
    try:
        raw = bytes.fromhex(text)
    except ValueError as exc:
        raise ValueError(f"key must be {2 * KEY_BYTES} hex characters: {text!r}") from exc
    return ensure_key(raw)


def ensure_key(raw: object, what: str = "a block key",
               error: type[ValueError] = ValueError) -> BlockKey:
    """``raw`` as a BlockKey, or ``error`` if it is not exactly 16 bytes (bytes-like).

    The one rule of what a key is: ``kvstore.core.checks.check_key`` applies it on every
    transport and in the clients, with InvalidArgument as ``error``.
    """
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise error(f"{what} must be {KEY_BYTES} bytes, got {type(raw).__name__}")
    b = bytes(raw)
    if len(b) != KEY_BYTES:
        raise error(f"{what} must be {KEY_BYTES} bytes, got {len(b)}")
    return BlockKey(b)


def leading_run(present: Iterable[object]) -> int:
    """How many leading items of ``present`` are true: the length of the stored prefix of
    a key chain, given whether each key is held (a lazy iterable stops at the first miss).

    Every prefix match (the node's index, the cluster, the Conductor's caches, the
    engine adapters) counts with this, so a chain with a hole matches only up to it.
    """
    n = 0
    for p in present:
        if not p:
            break
        n += 1
    return n
