"""Loading stored blocks into vLLM's paged KV cache, on the worker: fetch, check, scatter,
with the fetch of the next chunk overlapping the check and copy of this one.

One load is one KV-cache group's leading blocks of one request. Its blocks are fetched in
chunks of about ``CHUNK_BYTES`` (``get_batch_into`` into a staging buffer of the chunk's
rows): while the fetch thread receives chunk k+1 (socket I/O, the GIL released), the
calling thread checks chunk k's values (size, header, key, checksum: ``BlockLayout.check``)
and copies its sound rows into the paged cache. A load then costs about its bytes'
transfer plus one chunk's check and copy, not the sum of all three (issue #28, "a hit
costs the bytes").

Invariants: the blocks written are the leading sound ones, in order, and nothing after
the first refused or missing block (vLLM recomputes from there); every value in the load
is still checked, and each refused one reported, so the caller removes all of them from
the store. The store client is used by one thread at a time: only the fetch thread calls
it during a load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvstore import Client
from kvstore.core.errors import BufferTooSmall
from kvstore.integrations.vllm.blocks import BlockLayout

CHUNK_BYTES = 4 << 20
"""About this many bytes per fetch: small enough that a chunk's check and copy hide
behind the next chunk's transfer, large enough that a call's fixed cost does not show."""

Scatter = Callable[[torch.Tensor, Sequence[int]], None]
"""Writes staging rows into these block ids of every layer of the load's group."""


@dataclass(slots=True, kw_only=True)
class LoadOutcome:
    loaded: int = 0
    """Leading blocks written into the cache."""
    missing: int = 0
    refused: list[tuple[bytes, str]] = field(default_factory=list)
    """``(key, why)`` of each value that failed its check (the caller removes them)."""
    error: Exception | None = None
    """A fetch failed: nothing from that chunk on was written."""


def chunk_bounds(n: int, value_bytes: int, chunk_bytes: int = CHUNK_BYTES
                 ) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk of ``n`` blocks of ``value_bytes`` (at least one
    block per chunk)."""
    per = max(1, chunk_bytes // max(1, value_bytes))
    return [(i, min(n, i + per)) for i in range(0, n, per)]


def _fetch(client: Client, layout: BlockLayout, keys: Sequence[bytes]
           ) -> tuple[torch.Tensor, list[int | None]]:
    staging = layout.new_staging(len(keys))
    try:
        sizes = client.get_batch_into(list(keys), [staging[i].numpy()
                                                   for i in range(len(keys))])
    except BufferTooSmall:
        # A value larger than a block (not ours): fetch as bytes to see which.
        sizes = []
        for i, v in enumerate(client.get_batch(list(keys))):
            if v is not None and len(v) == layout.value_bytes:
                staging[i].numpy()[:] = memoryview(v)
            sizes.append(None if v is None else len(v))
    return staging, sizes


def load_blocks(client: Client, fetcher: ThreadPoolExecutor, layout: BlockLayout,
                keys: Sequence[bytes], block_ids: Sequence[int], scatter: Scatter, *,
                chunk_bytes: int = CHUNK_BYTES) -> LoadOutcome:
    """Loads ``keys`` into ``block_ids`` (see the module docstring); ``fetcher`` runs the
    fetches (one thread)."""
    if len(keys) != len(block_ids):
        raise ValueError(f"{len(keys)} keys for {len(block_ids)} block ids")
    out = LoadOutcome()
    chunks = chunk_bounds(len(keys), layout.value_bytes, chunk_bytes)
    sound = True  # every block so far was written
    nxt: Future[tuple[torch.Tensor, list[int | None]]] | None = (
        fetcher.submit(_fetch, client, layout, keys[chunks[0][0]:chunks[0][1]])
        if chunks else None)
    try:
        for c, (lo, hi) in enumerate(chunks):
            assert nxt is not None
            try:
                staging, sizes = nxt.result()
            except Exception as exc:  # the store failed: recompute from here
                nxt = None
                out.error = exc
                return out
            nxt = (fetcher.submit(_fetch, client, layout,
                                  keys[chunks[c + 1][0]:chunks[c + 1][1]])
                   if c + 1 < len(chunks) else None)
            good = hi - lo
            for i in range(hi - lo):
                why = layout.check(staging[i], keys[lo + i], sizes[i])
                if why is None:
                    continue
                good = min(good, i)
                if why == "missing":
                    out.missing += 1
                else:
                    out.refused.append((keys[lo + i], why))
            if sound and good:
                scatter(staging[:good], block_ids[lo:lo + good])
                out.loaded += good
            sound = sound and good == hi - lo
    finally:
        if nxt is not None and not nxt.cancel():
            nxt.exception()  # a check or copy raised: wait, the client is the caller's again
    return out
