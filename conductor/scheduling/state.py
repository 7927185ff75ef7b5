"""The Conductor's view of the cluster: prefix caches, prefill queues, decode batches.

The Conductor reads these objects when it schedules and updates them when it
commits a decision; the environment (the simulator, or the live service from
worker reports) updates them as work completes. Nothing here reads a clock.

Cache model (Mooncake's KV-cache pool): every prefill instance keeps the blocks
it has computed or fetched in its own DRAM (``LocalPrefixCache``, LRU with a
capacity in blocks), and the pool is the union of those caches
(``PoolIndex``): a block held by any instance can be fetched by any other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from conductor.scheduling.types import CacheKey, InstanceId, RequestId
from kvstore.core.keys import leading_run


class GlobalCache(Protocol):
    """The global view of the distributed KV-cache pool."""

    def prefix_len(self, keys: Sequence[CacheKey]) -> int:
        """Length of the leading run of ``keys`` held somewhere in the pool."""
        ...


class PoolIndex:
    """Which blocks the pool holds: a reference count per key over all local caches.

    Invariant: ``count[k]`` is the number of ``LocalPrefixCache`` objects attached to
    this index that hold ``k``; keys with no holder are absent.
    """

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count: dict[CacheKey, int] = {}

    def prefix_len(self, keys: Sequence[CacheKey]) -> int:
        count = self.count
        return leading_run(map(count.__contains__, keys))

    def holds(self, key: CacheKey) -> bool:
        return key in self.count

    def __len__(self) -> int:
        return len(self.count)


class LocalPrefixCache:
    """One instance's prefix cache: an LRU of block keys with a capacity in blocks.

    ``use(keys)`` records that a request's chain is now held here (computed or
    fetched). It refreshes the chain tail first and the head last, so the head is
    the most recently used: eviction then trims chains from their tails, and a
    cached chain stays a usable prefix as long as possible (evicting a head would
    strand every block after it, since lookups stop at the first miss).
    """

    __slots__ = ("_lru", "capacity_blocks", "evictions", "pool")

    def __init__(self, capacity_blocks: int, pool: PoolIndex | None = None) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self.pool = pool
        self._lru: OrderedDict[CacheKey, None] = OrderedDict()
        self.evictions = 0

    def prefix_len(self, keys: Sequence[CacheKey]) -> int:
        lru = self._lru
        return leading_run(map(lru.__contains__, keys))

    def use(self, keys: Sequence[CacheKey]) -> None:
        lru = self._lru
        count = self.pool.count if self.pool is not None else None
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
                if count is not None:
                    count[k] = count.get(k, 0) + 1
        while len(lru) > self.capacity_blocks:
            k, _ = lru.popitem(last=False)
            self.evictions += 1
            if count is not None:
                c = count[k] - 1
                if c:
                    count[k] = c
                else:
                    del count[k]

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> list[CacheKey]:
        """Keys from least to most recently used."""
        return list(self._lru)


@dataclass(slots=True, kw_only=True)
class PrefillInstance:
    """A prefill instance: its FIFO work queue (as estimated seconds) and its cache.

    ``busy_until_s`` is when the instance is estimated to finish everything queued
    on it; the queue time a new request would see at ``now`` is
    ``max(0, busy_until_s - now)``. Estimates drift live; ``complete`` shifts the
    remaining queue by the observed error and ``report_queue`` overwrites it.
    """

    id: InstanceId
    cache: LocalPrefixCache
    busy_until_s: float = 0.0
    _ends: dict[RequestId, float] = field(default_factory=dict)
    _shift: float = 0.0

    def queue_s(self, now: float) -> float:
        return max(0.0, self.busy_until_s - now)

    def enqueue(self, rid: RequestId, now: float, work_s: float) -> float:
        """Appends ``work_s`` seconds of work; returns its estimated end time."""
        end = max(now, self.busy_until_s) + work_s
        self.busy_until_s = end
        self._ends[rid] = end - self._shift
        return end

    def complete(self, rid: RequestId, now: float) -> None:
        """The request's prefill finished at ``now``: later work moves by the error."""
        est = self._ends.pop(rid, None)
        if est is None:
            return
        error = now - (est + self._shift)
        if self._ends:
            self._shift += error
            self.busy_until_s = max(now, self.busy_until_s + error)
        else:
            self._shift = 0.0
            self.busy_until_s = now

    def report_queue(self, now: float, pending_s: float) -> None:
        """Overwrite the estimate with the instance's own (live)."""
        self.busy_until_s = now + max(0.0, pending_s)

    @property
    def queued(self) -> int:
        return len(self._ends)


@dataclass(slots=True, kw_only=True)
class DecodeSlot:
    """A request in a decode batch. It ends when the instance's step counter reaches
    ``finish_step``; its context is ``prompt_tokens`` plus the steps it has been in."""

    prompt_tokens: int
    start_step: int
    finish_step: int
    reserved_tokens: int


@dataclass(slots=True, kw_only=True)
class Incoming:
    """A request accepted for a decode instance whose KV cache has not joined its batch:
    still in prefill, in transfer, or waiting for KV space. ``ready_s`` is when its KV
    cache is estimated to reach the instance."""

    ready_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(slots=True, kw_only=True)
class DecodeInstance:
    """A decode instance: its continuous batch and the requests heading for it.

    Invariants: ``context_tokens`` is the sum over ``active`` of prompt plus generated
    tokens; ``reserved_tokens`` the sum of their reservations (prompt + expected
    output, reserved whole at admission so a batch never outgrows its KV memory);
    ``reserved_tokens <= kv_capacity_tokens`` when the environment admits only what
    fits. ``steps`` counts the batch steps run so far.
    """

    id: InstanceId
    kv_capacity_tokens: int
    steps: int = 0
    context_tokens: int = 0
    reserved_tokens: int = 0
    active: dict[RequestId, DecodeSlot] = field(default_factory=dict)
    incoming: dict[RequestId, Incoming] = field(default_factory=dict)

    def expect(self, rid: RequestId, ready_s: float, prompt_tokens: int,
               output_tokens: int) -> None:
        self.incoming[rid] = Incoming(ready_s=ready_s, prompt_tokens=prompt_tokens,
                                      output_tokens=output_tokens)

    def drop(self, rid: RequestId) -> None:
        """Forget a request that will not join the batch (rejected, or needs no decode)."""
        self.incoming.pop(rid, None)

    def fits(self, prompt_tokens: int, output_tokens: int) -> bool:
        return self.reserved_tokens + prompt_tokens + output_tokens <= self.kv_capacity_tokens

    def start(self, rid: RequestId, prompt_tokens: int, decode_tokens: int,
              output_tokens: int) -> None:
        """The request joined the batch; it will run ``decode_tokens`` steps."""
        self.incoming.pop(rid, None)
        reserved = prompt_tokens + output_tokens
        self.active[rid] = DecodeSlot(prompt_tokens=prompt_tokens, start_step=self.steps,
                                      finish_step=self.steps + decode_tokens,
                                      reserved_tokens=reserved)
        self.context_tokens += prompt_tokens
        self.reserved_tokens += reserved

    def step(self) -> None:
        """One batch step ran: every active request grew by one token."""
        self.steps += 1
        self.context_tokens += len(self.active)

    def finish(self, rid: RequestId) -> None:
        slot = self.active.pop(rid)
        self.context_tokens -= slot.prompt_tokens + (self.steps - slot.start_step)
        self.reserved_tokens -= slot.reserved_tokens

    def remaining(self, rid: RequestId) -> int:
        return max(0, self.active[rid].finish_step - self.steps)

    def set_remaining(self, rid: RequestId, remaining: int) -> None:
        """Live: correct a request's expected remaining tokens."""
        self.active[rid].finish_step = self.steps + max(0, remaining)
