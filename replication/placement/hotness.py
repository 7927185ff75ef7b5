"""Decayed per-key read counters: which blocks are hot enough for extra copies.

The cluster client records every read of a block key here. A key whose read rate
reaches ``hot_reads_per_s`` becomes *hot*: the caller places extra copies of it on
more nodes and spreads its readers over them. When the key's rate falls below the
lower ``cool_reads_per_s`` it becomes cold again and the extra copies are dropped.
The gap between the two thresholds (hysteresis) keeps a key whose rate hovers
around one threshold from flapping between the two states.

Counter and rate estimate
-------------------------
Each tracked key has an exponentially decayed counter ``c`` and the time ``t_last``
of its last update. A read of ``n`` blocks at time ``t`` does::

    c = c * 2 ** (-(t - t_last) / half_life) + n
    t_last = t

so every read counts for half as much ``half_life`` seconds later. The rate
estimate is ``rate = c * ln 2 / half_life``. For reads at a steady rate ``r`` the
counter converges to ``r * half_life / ln 2`` (the integral of ``r * 2**(-s/h)``
over ``s >= 0``), so the estimate converges to ``r``; after a step change it
covers half the distance to the new rate every ``half_life``. Between reads the
estimate is a sawtooth around ``r``: one read is ``ln 2 / (r * half_life)`` of the
steady counter, so the estimate stays within about ``+-ln 2 / (2 * r * half_life)``
of ``r`` (under 1% once ``r * half_life >= 35``), and its average over a period is
exactly ``r``. Pick ``half_life`` so that ``hot_reads_per_s * half_life`` is well
above 35 or the sawtooth itself can cross the thresholds. A clock that steps
backwards is treated as not having moved (no decay, never growth).

States and transitions
----------------------
* A key becomes hot only inside :meth:`HotnessTracker.record`, when its rate right
  after the read is ``>= hot_reads_per_s`` (the rate only rises at reads, so no
  crossing is missed). That call, and only that call, returns ``True``.
* A hot key becomes cold only inside :meth:`HotnessTracker.cooled`, which returns
  the hot keys whose rate, decayed to now, is ``< cool_reads_per_s``.

So every cold -> hot transition is reported exactly once and matched by at most
one later report from ``cooled()``; between the two the key is in the hot set
(``is_hot``, ``hot_keys``) whatever its rate. A hot key that is read again stays
hot; one whose rate is between the thresholds stays hot.

Memory bound
------------
At most ``max_keys`` keys have a counter. When a key not yet tracked is recorded
while ``max_keys`` are tracked, the tracker first drops the ``slack`` keys
(``slack = max(1, max_keys // 16)``) with the smallest counters decayed to now:
cold keys first, and hot keys (smallest first) only when there are not enough cold
ones, i.e. when nearly all tracked keys are hot. Dropping a batch instead of one
key makes the O(tracked keys) selection happen once per ``slack`` new keys, which
is amortised O(1) per record. A dropped key simply starts again from zero if it
is read again. A dropped *hot* key stays in the hot set with rate 0 until the next
``cooled()`` reports it, so the caller still learns to drop its extra copies.
(Such keys are the only hot-set entries without a counter; they exist only when
``max_keys`` is too small for the number of hot keys, and ``cooled()`` drains them.)

Not thread-safe: one tracker per thread, or the caller holds a lock. Pure: no I/O,
no threads; the clock is injected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from itertools import chain

import numpy as np

from kvstore.core.tunables import positive_finite

LN2 = math.log(2.0)

# Fraction of max_keys dropped per prune: pruning costs O(max_keys), so it runs once
# per max_keys // _SLACK_DIVISOR new keys.
_SLACK_DIVISOR = 16


class HotnessTracker:
    """Decayed read counters per block key, with a hot set under hysteresis.

    Invariants: ``len(self) <= max_keys``; every counter is ``>= 0``; the hot set
    is ordered by the time each key (last) became hot; ``cool_reads_per_s <=
    hot_reads_per_s``.
    """

    __slots__ = ("_clock", "_cool_count", "_entries", "_half_life", "_hot", "_hot_count",
                 "_max_keys", "_rate_per_count", "_slack", "cool_reads_per_s",
                 "half_life_s", "hot_reads_per_s", "max_keys")

    def __init__(self, *, half_life_s: float = 10.0, hot_reads_per_s: float,
                 cool_reads_per_s: float | None = None, max_keys: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        half_life = positive_finite("half_life_s", half_life_s)
        hot = positive_finite("hot_reads_per_s", hot_reads_per_s)
        cool = hot / 2 if cool_reads_per_s is None else positive_finite(
            "cool_reads_per_s", cool_reads_per_s)
        if cool > hot:
            raise ValueError(f"cool_reads_per_s ({cool!r}) must be <= hot_reads_per_s "
                             f"({hot!r}) for hysteresis")
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"max_keys must be an integer >= 1, got {max_keys!r}")
        self.half_life_s = half_life
        self.hot_reads_per_s = hot
        self.cool_reads_per_s = cool
        self.max_keys = max_keys
        self._clock = clock
        self._half_life = half_life
        self._rate_per_count = LN2 / half_life
        # Thresholds in counter units, so record() compares the counter directly.
        self._hot_count = hot * half_life / LN2
        self._cool_count = cool * half_life / LN2
        self._max_keys = max_keys
        self._slack = max(1, max_keys // _SLACK_DIVISOR)
        # key -> [counter, t_last]; a mutable pair so record() does one dict lookup.
        self._entries: dict[bytes, list[float]] = {}
        # The hot set, in the order keys became hot (values unused).
        self._hot: dict[bytes, None] = {}

    def __len__(self) -> int:
        """Number of keys with a counter (``<= max_keys``)."""
        return len(self._entries)

    def record(self, key: bytes, n: int = 1) -> bool:
        """Counts ``n`` reads of ``key`` now; True iff this call made the key hot."""
        if n <= 0:
            raise ValueError(f"n must be > 0, got {n!r}")
        now = self._clock()
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self._max_keys:
                self._prune(now)
            c = float(n)
            self._entries[key] = [c, now]
        else:
            dt = now - entry[1]
            if dt > 0.0:
                c = entry[0] * 2.0 ** (-dt / self._half_life) + n
                entry[1] = now
            else:
                c = entry[0] + n
            entry[0] = c
        if c >= self._hot_count and key not in self._hot:
            self._hot[key] = None
            return True
        return False

    def _counter_now(self, key: bytes, now: float) -> float:
        entry = self._entries.get(key)
        if entry is None:
            return 0.0
        dt = now - entry[1]
        return entry[0] * 2.0 ** (-dt / self._half_life) if dt > 0.0 else entry[0]

    def rate(self, key: bytes) -> float:
        """Estimated reads per second of ``key``, decayed to now; 0.0 if untracked."""
        return self._counter_now(key, self._clock()) * self._rate_per_count

    def is_hot(self, key: bytes) -> bool:
        """Whether ``key`` is in the hot set (became hot, not yet reported cooled)."""
        return key in self._hot

    def hot_keys(self) -> list[bytes]:
        """The hot set, in the order the keys became hot."""
        return list(self._hot)

    def cooled(self) -> list[bytes]:
        """Removes and returns the hot keys whose rate is now below the cool threshold.

        In the order they became hot. Each hot key is returned by exactly one call
        (unless it becomes hot again, which ``record`` reports anew).
        """
        now = self._clock()
        cool = self._cool_count
        out = [k for k in self._hot if self._counter_now(k, now) < cool]
        for k in out:
            del self._hot[k]
        return out

    def _prune(self, now: float) -> None:
        """Drops the ``slack`` tracked keys with the smallest decayed counters.

        Cold keys go first; hot keys only if fewer than ``slack`` keys are cold.
        Ties are broken arbitrarily but deterministically.
        """
        entries = self._entries
        size = len(entries)
        drop = min(size, self._slack)
        keys = list(entries)
        pairs = np.fromiter(chain.from_iterable(entries.values()), dtype=np.float64,
                            count=2 * size).reshape(size, 2)
        age = now - pairs[:, 1]
        np.maximum(age, 0.0, out=age)
        decayed = pairs[:, 0] * np.exp2(-age / self._half_life)
        hot = self._hot
        if hot:
            is_hot = np.fromiter((k in hot for k in keys), dtype=bool, count=size)
            cold_idx = np.flatnonzero(~is_hot)
            hot_idx = np.flatnonzero(is_hot)
        else:
            cold_idx = np.arange(size)
            hot_idx = cold_idx[:0]
        victims = _smallest(cold_idx, decayed, drop)
        if len(victims) < drop:
            victims = np.concatenate(
                (victims, _smallest(hot_idx, decayed, drop - len(victims))))
        for i in victims.tolist():
            del entries[keys[i]]


def _smallest(idx: np.ndarray, values: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` entries of ``idx`` with the smallest ``values[idx]`` (all if fewer)."""
    if k >= len(idx):
        return idx
    part = np.argpartition(values[idx], k - 1)[:k]
    return idx[part]
