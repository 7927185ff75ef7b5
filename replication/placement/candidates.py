"""Each key's candidates under one membership view, memoised and bounded.

``Placement.candidates`` ranks every node for a key: cheap, but not free, and the same
keys come back (a prefix read again, re-puts, hot blocks). The cluster client (read and
write candidates) and a master's forwarder (replica targets) each keep a
``CandidateCache`` per membership view: a new view gets a new cache, so no entry
outlives the placement it came from, and calls in flight finish on the cache of the
view they started with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, cast

from replication.placement.rendezvous import NodeId, Placement

T = TypeVar("T")

MAX_KEYS = 1 << 16
"""Entries a cache holds before it starts afresh."""


class CandidateCache(Generic[T]):
    """``shape(owners, rest)`` of ``placement.candidates(key, replicas)``, per
    ``(key, replicas)``; what a user keeps per key is its ``shape`` of the two lists.

    Bounded: at ``max_keys`` entries it is cleared (recomputing is cheap, only not free).
    No lock: each dict operation is atomic under the GIL, so racing callers at worst
    compute an entry twice (the same value) or lose entries to a clear. Callers must not
    mutate what ``get`` returns: it is shared.
    """

    __slots__ = ("_max_keys", "_memo", "_shape", "placement")

    def __init__(self, placement: Placement,
                 shape: Callable[[list[NodeId], list[NodeId]], T], *,
                 max_keys: int = MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.placement = placement
        self._shape = shape
        self._max_keys = max_keys
        self._memo: dict[tuple[bytes, int], T] = {}

    def get(self, key: bytes, replicas: int) -> T:
        memo = self._memo
        hit = memo.get((key, replicas))
        if hit is None:
            if len(memo) >= self._max_keys:
                memo.clear()
            hit = memo[(key, replicas)] = self._shape(*self.placement.candidates(key, replicas))
        return hit

    def get_many(self, keys: Sequence[bytes], replicas: int) -> list[T]:
        """``[get(k, replicas) for k in keys]``; the keys not memoised are ranked in one
        ``Placement.candidates_many`` call."""
        memo = self._memo
        out: list[T | None] = [memo.get((k, replicas)) for k in keys]
        missing = [i for i, hit in enumerate(out) if hit is None]
        if missing:
            if len(memo) + len(missing) > self._max_keys:
                memo.clear()
            ranked = self.placement.candidates_many([keys[i] for i in missing], replicas)
            for i, (owners, rest) in zip(missing, ranked, strict=True):
                out[i] = memo[(keys[i], replicas)] = self._shape(owners, rest)
        return cast("list[T]", out)

    def __len__(self) -> int:
        return len(self._memo)
