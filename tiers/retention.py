"""Retention a caller asks for: keep a block for S seconds after its last put or read.

A put with ``retain_s=S`` (every transport, the CLI's ``--retain S``) asks the node
to keep the block in the cache until ``S`` seconds after its last put or read; after
that it is an ordinary block again. Retention is *eligibility*, not placement:

* a retained block is never dropped from the node (eviction from a memory-only last
  tier, or the mover's drop from the last tier, defer it: it keeps its place in the
  policy's queue, so once its retention ends it leaves in plain policy order);
* it may still be **demoted** to a lower tier: the operator's promise is "kept in the
  cache", not "kept in HBM"; a read promotes it back by the usual rule;
* hard pins are unchanged (a pinned block is never evicted nor demoted).

Caps, so retention cannot fill a node: the node's retained bytes are at most
``max_bytes`` (``--max-retained-fraction`` of the node's capacity over all tiers),
and a tenant's at most its ``owner_cap`` (the same fraction of its quota). A put
whose retention would pass a cap is **stored without retention** (counted in
``retention_denied``): the cache still works, only the promise is refused, as
hosted APIs' cache control is best effort. A later put or read of a block already
retained refreshes its deadline and never counts against the caps again.

A later put with ``retain_s`` sets the block's ``S`` (reads then refresh by it) but
never shortens the deadline already granted. ``retain_s`` of 0 asks for nothing.

Blocks already stored: a ``retain`` call (``TierManager.retain``) grants as a put of the
stored block would (the same caps, charged to the caller); a release
(``TierManager.release``, ``retain`` with 0 s) ends the retention now, and the block
rejoins eviction at its policy priority as if its deadline had passed.

Across a restart: a durable tier (SSD) keeps each retained block's deadline as
wall-clock time (``kept``, a :class:`Retention`), written with the block and updated as
reads refresh it; a restarted node ``restore``s it, so the block stays retained until
that deadline, and a deadline that passed while the node was down leaves the block
ordinary. Restored retention counts against the node's cap (tenants' charges are not
kept across restarts).

``RetentionBook`` is pure and single-owner, like the TierManager that holds it: its
owner calls it under the same lock. Time comes from an injected ``clock`` (seconds,
monotonic) and ``wall_clock`` (seconds since the epoch, for deadlines kept across
restarts), so tests move both exactly. Deadlines sit in a min-heap with one item per
retained key; a read refreshes only the key's record, and ``expire`` re-queues an
item whose record moved on, so reads never grow the heap.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.core.keys import BlockKey
from kvstore.core.retention import MAX_RETAIN_S as MAX_RETAIN_S  # re-exported
from kvstore.core.retention import check_retain_s as check_retain_s
from kvstore.core.retention import retain_seconds

DEFAULT_MAX_RETAINED_FRACTION = 0.5


def check_fraction(fraction: float) -> float:
    if not math.isfinite(fraction) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"max retained fraction must be in [0, 1], got {fraction!r}")
    return float(fraction)


@dataclass(frozen=True, slots=True, kw_only=True)
class Retention:
    """A block's retention as a durable tier keeps it across restarts: until ``until``
    (wall-clock seconds, as ``time.time()``), refreshed by ``seconds`` on each read."""

    until: float
    seconds: float


@dataclass(slots=True, kw_only=True)
class RetainAsk:
    """What one put asks for: ``seconds``, charged to ``owner`` (None: nobody) up to
    ``owner_cap`` bytes (None: no per-owner cap)."""

    seconds: float
    owner: str | None = None
    owner_cap: int | None = None


def retain_ask(retain_s: float | None, *, owner: str | None, quota: int | None,
               fraction: float) -> RetainAsk | None:
    """What a put asks the tiers for (None: no retention); INVALID_ARGUMENT for a bad
    ``retain_s``. A tenant's retained bytes are capped at ``fraction`` of its quota."""
    seconds = retain_seconds(retain_s)
    if not seconds:
        return None
    cap = None if quota is None else int(fraction * quota)
    return RetainAsk(seconds=seconds, owner=owner, owner_cap=cap)


@dataclass(slots=True, kw_only=True)
class _Held:
    seconds: float
    until: float
    nbytes: int
    owner: str | None


class RetentionBook:
    """Retained keys, their deadlines, and the bytes they hold per node and per owner."""

    __slots__ = ("_bytes", "_clock", "_ended", "_heap", "_owners", "_wall", "denied", "held",
                 "max_bytes")

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 max_bytes: int | None = None) -> None:
        self._clock = clock
        self._wall = wall_clock
        self.max_bytes = max_bytes  # None: no node cap
        self.held: dict[BlockKey, _Held] = {}
        self._heap: list[tuple[float, BlockKey]] = []
        self._bytes = 0
        self._owners: dict[str, int] = {}
        self._ended: list[BlockKey] = []  # expired since the last ``drain_ended``
        self.denied = 0

    def grant(self, key: BlockKey, nbytes: int, ask: RetainAsk) -> bool:
        """Retains ``key`` (``nbytes``) for ``ask.seconds`` from now; False if a cap refused
        it (the block stays stored, without retention)."""
        if ask.seconds <= 0:
            return False
        now = self._clock()
        self.expire(now)
        h = self.held.get(key)
        if h is not None:
            h.seconds = ask.seconds
            h.until = max(h.until, now + ask.seconds)
            return True
        return self._hold(key, nbytes, ask.seconds, now + ask.seconds, ask.owner,
                          ask.owner_cap)

    def _hold(self, key: BlockKey, nbytes: int, seconds: float, until: float,
              owner: str | None, owner_cap: int | None) -> bool:
        """Retains a key not yet held until ``until``; False if a cap refused it."""
        if (self.max_bytes is not None and self._bytes + nbytes > self.max_bytes) or (
                owner is not None and owner_cap is not None
                and self._owners.get(owner, 0) + nbytes > owner_cap):
            self.denied += 1
            return False
        self.held[key] = _Held(seconds=seconds, until=until, nbytes=nbytes, owner=owner)
        heapq.heappush(self._heap, (until, key))
        self._bytes += nbytes
        if owner is not None:
            self._owners[owner] = self._owners.get(owner, 0) + nbytes
        return True

    def kept(self, key: BlockKey) -> Retention | None:
        """``key``'s retention as a wall-clock deadline, for a durable tier to keep (None:
        not retained now)."""
        h = self.held.get(key)
        if h is None:
            return None
        left = h.until - self._clock()
        if left <= 0:
            return None
        return Retention(until=self._wall() + left, seconds=h.seconds)

    def restore(self, key: BlockKey, nbytes: int, kept: Retention) -> bool:
        """Retains ``key`` again after a restart, until the wall-clock deadline it kept;
        False if that deadline passed (the block is ordinary now) or the node's cap
        refuses it (counted in ``denied``). A key already held is left as it is."""
        left = kept.until - self._wall()
        if left <= 0 or kept.seconds <= 0 or key in self.held:
            return False
        now = self._clock()
        self.expire(now)
        return self._hold(key, nbytes, kept.seconds, now + left, None, None)

    def touch(self, key: BlockKey) -> bool:
        """A read of ``key``: a retained block is kept ``seconds`` from now again. True if
        that moved its deadline."""
        h = self.held.get(key)
        if h is not None:
            now = self._clock()
            if h.until > now and now + h.seconds > h.until:
                h.until = now + h.seconds
                return True
        return False

    def retains(self, key: BlockKey) -> bool:
        """Whether ``key`` may not leave the node now."""
        h = self.held.get(key)
        return h is not None and h.until > self._clock()

    def forget(self, key: BlockKey) -> None:
        """``key`` left the node (removed or corrupt); its heap item goes stale."""
        h = self.held.pop(key, None)
        if h is not None:
            self._drop(h)

    def release(self, key: BlockKey) -> bool:
        """Ends ``key``'s retention now (a caller's release): its bytes leave the caps and the
        manager queues it for eviction again (``drain_ended``). True if it was retained."""
        h = self.held.pop(key, None)
        if h is None:
            return False
        self._drop(h)  # its heap item goes stale, as a forgotten key's does
        self._ended.append(key)
        return True

    def _drop(self, h: _Held) -> None:
        self._bytes -= h.nbytes
        if h.owner is not None:
            left = self._owners[h.owner] - h.nbytes
            if left:
                self._owners[h.owner] = left
            else:
                del self._owners[h.owner]

    def drain_ended(self) -> list[BlockKey]:
        """Keys whose retention ended (by expiry, not ``forget``) since the last call: the
        manager queues them for eviction again."""
        if self._heap:
            self.expire()
        if not self._ended:
            return []
        out, self._ended = self._ended, []
        return out

    def expire(self, now: float | None = None) -> int:
        """Ends every retention whose deadline passed; how many ended."""
        if now is None:
            now = self._clock()
        heap, held = self._heap, self.held
        n = 0
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            h = held.get(key)
            if h is None:
                continue  # forgotten: a stale item
            if h.until > now:
                heapq.heappush(heap, (h.until, key))  # refreshed since it was queued
                continue
            del held[key]
            self._drop(h)
            self._ended.append(key)
            n += 1
        if len(heap) > 2 * len(held) + 1024:
            self._heap = [(h.until, k) for k, h in held.items()]
            heapq.heapify(self._heap)
        return n

    def seconds_of(self, key: BlockKey) -> float:
        """The retention ``key`` currently has (0.0: none): what a copy of it carries."""
        h = self.held.get(key)
        return h.seconds if h is not None and h.until > self._clock() else 0.0

    def stats(self) -> dict[str, int | dict[str, int]]:
        """``retained_blocks``/``retained_bytes`` now (after expiry), the cap, refusals,
        and each owner's retained bytes (``namespace_retained_bytes``, if any)."""
        self.expire()
        out: dict[str, int | dict[str, int]] = {
            "retained_blocks": len(self.held),
            "retained_bytes": self._bytes,
            "retention_denied": self.denied,
        }
        if self.max_bytes is not None:
            out["retained_cap_bytes"] = self.max_bytes
        if self._owners:
            out["namespace_retained_bytes"] = dict(self._owners)
        return out
