"""Where a colocated request runs: the instance with the lowest estimated time to first
token, counting what the store will hold by the time the request would start.

Every instance can load from the store what any instance has saved, and loading costs
far less than computing (40-60x here, more on a GPU). So a prefix that another instance
is computing right now is nearly as good as a stored one: a request for it need not
compute it a second time, nor queue behind everything else on the instance computing it.
It can wait until the prefix is saved and load it on whichever instance is free by then.

An instance's estimate is the better of:

* **now**: the later of its queue and the time until its KV cache has room for the
  request (``conductor.front.kv_room``: the front's requests in flight there hold their
  blocks until they end), plus the prefill of what neither its own prefix cache (what the
  front sent there) nor the store holds now;
* **after a save** (only when another instance is computing a longer prefix of the
  request, ``ComputingPrefixes``): the latest of its queue, its room and that
  computation's expected first token, plus the prefill of what is left after the prefix.
  The front then holds the request until the prefix is durable in the store before sending
  it (``await_blocks``).

Both are estimates from the same calibrated cost model, so they compare fairly; the load
itself is left out of both, as it was of the store's blocks before (it is small and the
same wherever the request goes).

Estimates within ``TIE_S`` of the best are a tie, and a tie goes to the instance with the
fewest of the front's requests in flight (then the first): with nothing queued anywhere,
as on a lightly loaded or store-backed cluster, every instance estimates the same, and
sending each request to the first one would stack every decode (and the next arrival's
queue) there while the others idle.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NewType, Protocol

from conductor.scheduling.costs import CostModel
from conductor.scheduling.state import LocalPrefixCache
from conductor.scheduling.types import InstanceId

ComputingId = NewType("ComputingId", int)
TIE_S = 0.001
"""Estimates closer than this are equal: the cost model is not finer than a millisecond."""


@dataclass(slots=True, kw_only=True, frozen=True)
class Computing:
    """The longest prefix of a request that some instance is computing now."""

    instance: InstanceId
    blocks: int
    """Leading blocks of the request's keys the computation covers."""
    ready_at: float
    """When its first token is expected (``time.monotonic``); the saves follow it."""


@dataclass(slots=True, kw_only=True)
class _Entry:
    instance: InstanceId
    keys: tuple[bytes, ...]
    ready_at: float


class ComputingPrefixes:
    """The block chains the front's requests are computing, from sending until the request
    is over (its blocks are saved by then, or it failed: either way the store's answer is
    the truth again). Few entries (requests in flight), so lookups scan them."""

    __slots__ = ("_entries", "_ids")

    def __init__(self) -> None:
        self._entries: dict[ComputingId, _Entry] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, instance: InstanceId, keys: Sequence[bytes], ready_at: float) -> ComputingId:
        cid = ComputingId(next(self._ids))
        self._entries[cid] = _Entry(instance=instance, keys=tuple(keys), ready_at=ready_at)
        return cid

    def started(self, cid: ComputingId, now: float) -> None:
        """Its first token came: the prefix is computed, its saves are under way."""
        entry = self._entries.get(cid)
        if entry is not None:
            entry.ready_at = min(entry.ready_at, now)

    def discard(self, cid: ComputingId) -> None:
        self._entries.pop(cid, None)

    def longest(self, keys: Sequence[bytes]) -> Computing | None:
        """The computation covering the most leading blocks of ``keys`` (the earliest ready
        among equals), None when none covers any."""
        best: Computing | None = None
        for entry in self._entries.values():
            n = _common_prefix(entry.keys, keys)
            if n and (best is None or n > best.blocks
                      or (n == best.blocks and entry.ready_at < best.ready_at)):
                best = Computing(instance=entry.instance, blocks=n, ready_at=entry.ready_at)
        return best


def _common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """Leading blocks ``a`` and ``b`` share. Keys are chained (each hashes its whole
    prefix), so equal keys at ``i`` mean equal keys before it: a binary search."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RoutedInstance(Protocol):
    @property
    def in_flight(self) -> int:
        """The front's requests sent there and not over yet (prefilling or decoding)."""
        ...

    def queue_s(self, *, mean_prompt_tokens: float, now: float) -> float: ...

    def kv_wait_s(self, keys: Sequence[bytes], *, prompt_tokens: int, out_tokens: int,
                  now: float) -> float:
        """Seconds until its KV cache has room for the request (``KvRoom.wait_s``)."""
        ...

    def cost(self) -> CostModel:
        """Its calibrated speed."""
        ...


@dataclass(slots=True, kw_only=True, frozen=True)
class ColocatedChoice:
    est_s: float
    """Estimated seconds to the first token."""
    instance: InstanceId
    cached_tokens: int
    """Prompt tokens it will not compute."""
    await_blocks: int = 0
    """Leading blocks to wait for in the store before sending (0: send now)."""


@dataclass(slots=True, kw_only=True, frozen=True)
class ColocatedRouter:
    """The rule of the module docstring over the front's colocated instances."""

    instances: Mapping[InstanceId, RoutedInstance]
    local: Mapping[InstanceId, LocalPrefixCache]
    computing: ComputingPrefixes
    block_tokens: int

    def __post_init__(self) -> None:
        if self.block_tokens < 1:  # 0 would count every stored block as no token at all
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")

    def choose(self, keys: Sequence[bytes], stored: int, prompt_tokens: int, *,
               mean_prompt_tokens: float, now: float, out_tokens: int = 0,
               prefer: InstanceId | None = None, prefer_within_s: float = 0.0
               ) -> ColocatedChoice:
        """The instance with the lowest estimate; ties (``TIE_S``) go to the fewest requests in
        flight, then the first. ``prefer`` (a session's instance) wins when its estimate is at
        most ``prefer_within_s``. ``out_tokens``: what the request may generate (its blocks
        count in the room it needs)."""
        elsewhere = self.computing.longest(keys)
        options: list[tuple[ColocatedChoice, int]] = []
        for iid, inst in self.instances.items():
            queue = max(inst.queue_s(mean_prompt_tokens=mean_prompt_tokens, now=now),
                        inst.kv_wait_s(keys, prompt_tokens=prompt_tokens,
                                       out_tokens=out_tokens, now=now))
            cost = inst.cost()
            cached = self.cached_tokens(iid, keys, stored, prompt_tokens)
            option = ColocatedChoice(
                est_s=queue + cost.prefill_s(prompt_tokens - cached, cached), instance=iid,
                cached_tokens=cached)
            if (elsewhere is not None and elsewhere.instance != iid
                    and elsewhere.blocks * self.block_tokens > cached):
                later = self._capped(elsewhere.blocks, prompt_tokens)
                waited = ColocatedChoice(
                    est_s=(max(queue, elsewhere.ready_at - now)
                           + cost.prefill_s(prompt_tokens - later, later)),
                    instance=iid, cached_tokens=later, await_blocks=elsewhere.blocks)
                if waited.est_s < option.est_s:
                    option = waited
            if iid == prefer and option.est_s <= prefer_within_s:
                return option
            options.append((option, inst.in_flight))
        if not options:
            raise ValueError("no colocated instance")
        best_s = min(o.est_s for o, _ in options)
        return min(((o, n) for o, n in options if o.est_s <= best_s + TIE_S),
                   key=lambda on: on[1])[0]

    def cached_tokens(self, iid: InstanceId, keys: Sequence[bytes], stored: int,
                      prompt_tokens: int) -> int:
        """Prompt tokens instance ``iid`` need not compute now: the longer of its own prefix
        cache and the store's ``stored`` leading blocks."""
        return self._capped(max(self.local[iid].prefix_len(keys), stored), prompt_tokens)

    def _capped(self, blocks: int, prompt_tokens: int) -> int:
        """``blocks`` in tokens, leaving at least the last prompt token to compute."""
        return min(blocks * self.block_tokens, prompt_tokens - 1)
