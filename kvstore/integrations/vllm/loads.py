"""Loading stored blocks into vLLM's paged KV cache, on the worker: one fetch, then every
value checked, then the sound leading rows copied into the cache.

One load is one KV-cache group's leading blocks of one request, fetched by one
``get_batch_into`` into a staging buffer (one C call, the GIL released for all of it),
each value checked (size, header, key, checksum: ``BlockLayout.check``), and the leading
sound rows written into every layer of the group (``scatter``).

Why not in chunks with the next fetch overlapping this chunk's checks and copies: measured
(``benchmarks.connector_loads``, RESULTS.md), it was no faster with the engine idle and
slower beside a thread running Python (as vLLM's engine loop does while a request waits for
its load): each hand-over of the GIL between the loader, a fetch thread and the engine
costs up to the interpreter's switch interval, and more calls mean more hand-overs. What a
load costs there is the switch interval (``threads.shorten_gil_switch``), not the bytes.

The staging rows are reused from load to load (``Staging``): a fresh 15 MiB buffer per load
cost ~10 ms of page faults, four times the fetch itself (``benchmarks.connector_loads``).

Invariants: the blocks written are the leading sound ones, in order, and nothing after
the first refused or missing block (vLLM recomputes from there); every value is still
checked and each refused one reported, so the caller removes all of them from the store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvstore import Client
from kvstore.core.errors import BufferTooSmall
from kvstore.integrations.vllm.blocks import BlockLayout

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
    """The fetch failed: nothing was written."""


class Staging:
    """Staging rows reused from load to load, grown to the largest load seen. Not thread
    safe: one per loader thread, and a load's rows are copied out before the next load."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def rows(self, layout: BlockLayout, n: int) -> torch.Tensor:
        """``n`` rows of ``layout.value_bytes`` (their old contents undefined)."""
        need = n * layout.value_bytes
        if self._buf is None or self._buf.numel() < need:
            self._buf = torch.empty(need, dtype=torch.uint8)
        return self._buf[:need].view(n, layout.value_bytes)


def fetch(client: Client, layout: BlockLayout, keys: Sequence[bytes], staging: Staging
          ) -> tuple[torch.Tensor, list[int | None]]:
    """Staging rows holding the values of ``keys`` and each value's size (None: missing)."""
    rows = staging.rows(layout, len(keys))
    try:
        sizes = client.get_batch_into(list(keys), [rows[i].numpy() for i in range(len(keys))])
    except BufferTooSmall:
        # A value larger than a block (not ours): fetch as bytes to see which.
        sizes = []
        for i, v in enumerate(client.get_batch(list(keys))):
            if v is not None and len(v) == layout.value_bytes:
                rows[i].numpy()[:] = memoryview(v)
            sizes.append(None if v is None else len(v))
    return rows, sizes


def load_blocks(client: Client, layout: BlockLayout, keys: Sequence[bytes],
                block_ids: Sequence[int], scatter: Scatter, staging: Staging) -> LoadOutcome:
    """Loads ``keys`` into ``block_ids`` through ``staging`` (see the module docstring)."""
    if len(keys) != len(block_ids):
        raise ValueError(f"{len(keys)} keys for {len(block_ids)} block ids")
    out = LoadOutcome()
    if not keys:
        return out
    try:
        rows, sizes = fetch(client, layout, keys, staging)
    except Exception as exc:  # the store failed: recompute them all
        out.error = exc
        return out
    good = len(keys)
    for i, key in enumerate(keys):
        why = layout.check(rows[i], key, sizes[i])
        if why is None:
            continue
        good = min(good, i)
        if why == "missing":
            out.missing += 1
        else:
            out.refused.append((key, why))
    if good:
        scatter(rows[:good], block_ids[:good])
        out.loaded = good
    return out
