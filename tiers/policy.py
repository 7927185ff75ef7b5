"""Eviction: one mechanism, policies as priority functions over it.

The mechanism (``EvictionQueue``) is a min-heap of ``(priority, seq, key)``
with lazy invalidation: every push gets a fresh ``seq``, and a heap item is
live only while the block's ``queue_seq`` still equals it. Seqs come from a
clock (an ``itertools.count``) that the owner may share with its own access
clock: the TierManager stamps an access with ``tick = next(clock)``, sets
``last_access = tick`` and pushes with ``seq=tick``, so for LRU the item's
priority and seq are one int object (no second int per block). A policy is just

* ``priority(block)``: lower is evicted first; computed when the block is pushed
  (insert or access), so it may depend on policy state at that moment;
* ``leaves_only``: whether a block that still has children in its prefix chain
  is ineligible (it is pushed again when its last child goes);
* ``on_evict(priority)``: a hook for policies with state (LFU's ageing);
* ``by_recency``: whether ``priority`` is the block's ``last_access`` (the native index
  then requeues a read in the same C call that counts it).

Ties in priority go to the block pushed earliest, so eviction order is exact
and reproducible: tests assert it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from typing import Any, Protocol, TypeVar

from kvstore.core.keys import BlockKey


class QueuedBlock(Protocol):
    """What the mechanism and the policies read and write on a block's metadata."""

    hits: int
    last_access: int
    queue_seq: int
    queue_priority: float


B = TypeVar("B", bound=QueuedBlock)
"""The caller's block type: its ``eligibility`` is asked about its own blocks."""
B_co = TypeVar("B_co", bound=QueuedBlock, covariant=True)


class Blocks(Protocol[B_co]):
    """Where a queue looks its keys up (a dict, or ``tiers.block_table.BlockTable``)."""

    def get(self, key: BlockKey, /) -> B_co | None: ...


Deferred = list[tuple[float, int, Any]]
"""Items a victim search passed over, for ``restore``: (priority, seq, the queue's own
reference to the block: its key here, a slot in ``tiers.native_index``)."""


class EvictionPolicy(Protocol):
    name: str
    leaves_only: bool
    by_recency: bool

    def priority(self, block: QueuedBlock) -> float: ...

    def on_evict(self, priority: float) -> None: ...


class LRUPolicy:
    """Least recently used first."""

    name = "lru"
    leaves_only = False
    by_recency = True

    def priority(self, block: QueuedBlock) -> float:
        return block.last_access

    def on_evict(self, priority: float) -> None:
        pass


class LFUPolicy:
    """Least frequently used first, with dynamic ageing (LFU-DA).

    A block's priority is ``age + hits`` at its last access, where ``age`` is the
    priority of the last victim. Ageing lets blocks that were hot long ago leave
    once newer blocks have been read as often, without a clock; ties go to the
    least recently pushed block.
    """

    name = "lfu"
    leaves_only = False
    by_recency = False

    def __init__(self) -> None:
        self.age = 0.0

    def priority(self, block: QueuedBlock) -> float:
        return self.age + block.hits

    def on_evict(self, priority: float) -> None:
        # Age only moves forward: a block deferred in an earlier round (it was being
        # read) can leave later with a priority below the current age.
        self.age = max(self.age, priority)


class PrefixAwarePolicy:
    """Least recently used leaf first: a block never leaves before its descendants.

    A child without its parent can never be a prefix hit, so evicting the parent
    first would strand every block below it.
    """

    name = "prefix"
    leaves_only = True
    by_recency = True

    def priority(self, block: QueuedBlock) -> float:
        return block.last_access

    def on_evict(self, priority: float) -> None:
        pass


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "prefix": PrefixAwarePolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        known = sorted(POLICIES)
        raise ValueError(f"unknown eviction policy {name!r}; choose from {known}") from None


class Eligibility(Enum):
    EVICT = "evict"
    DEFER = "defer"  # ineligible for now (being read); stays queued
    DROP = "drop"  # ineligible until its owner pushes it again (pinned, or has children)


_EVICT = Eligibility.EVICT
_DEFER = Eligibility.DEFER
_heappush = heapq.heappush
_heappop = heapq.heappop


class EvictionQueue:
    """The shared mechanism: pops the lowest-priority eligible blocks."""

    __slots__ = ("_clock", "_heap", "_on_evict", "_priority", "policy")

    def __init__(self, policy: EvictionPolicy, *, clock: Iterator[int] | None = None) -> None:
        self.policy = policy
        self._heap: list[tuple[float, int, BlockKey]] = []
        # Seqs only need to grow: queues of one owner may share a clock.
        self._clock = clock if clock is not None else itertools.count(1)
        # Bound once: push and pop_victim run per block access and per eviction.
        self._priority = policy.priority
        self._on_evict = policy.on_evict

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, key: BlockKey, block: QueuedBlock, seq: int | None = None) -> None:
        """(Re)queues ``block`` at its current priority; earlier heap items for it go stale.

        ``seq``, if given, must be a value just drawn from this queue's clock (no other
        push in between): it saves a second draw when the caller stamped an access with it.
        """
        if seq is None:
            seq = next(self._clock)
        prio = self._priority(block)
        block.queue_seq = seq
        block.queue_priority = prio
        _heappush(self._heap, (prio, seq, key))

    @staticmethod
    def forget(block: QueuedBlock) -> None:
        """Makes every heap item of ``block`` stale."""
        block.queue_seq = 0

    def pop_victim(
        self,
        blocks: Blocks[B],
        eligibility: Callable[[B], Eligibility],
        deferred: Deferred,
    ) -> BlockKey | None:
        """The next victim, or None when no queued block is eligible.

        Deferred items are appended to ``deferred``; the caller must hand them to
        ``restore`` when its eviction round ends, whatever happened.
        """
        heap = self._heap
        get = blocks.get
        while heap:
            item = _heappop(heap)
            key = item[2]
            block = get(key)
            if block is None or block.queue_seq != item[1]:
                continue
            verdict = eligibility(block)
            if verdict is _EVICT:
                block.queue_seq = 0
                self._on_evict(item[0])
                return key
            if verdict is _DEFER:
                deferred.append(item)
            else:
                block.queue_seq = 0
        return None

    def restore(self, deferred: Deferred) -> None:
        for item in deferred:
            heapq.heappush(self._heap, item)
        deferred.clear()

    def needs_compaction(self, live: int) -> bool:
        """Whether stale heap items outnumber the ``live`` blocks the queue orders."""
        return len(self._heap) > 2 * live + 1024

    def compact(self, blocks: Mapping[BlockKey, QueuedBlock]) -> None:
        """Drops stale heap items once they outnumber live ones (keeps memory O(blocks))."""
        if not self.needs_compaction(len(blocks)):
            return
        self._heap = [
            (b.queue_priority, b.queue_seq, k) for k, b in blocks.items() if b.queue_seq
        ]
        heapq.heapify(self._heap)
