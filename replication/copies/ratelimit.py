"""Token bucket that paces background repair traffic (units are up to the caller: bytes).

The bucket holds up to ``burst`` tokens, starts full, and refills at ``rate`` tokens
per second. Taking ``n`` tokens is allowed when the bucket holds at least
``need(n) = min(n, burst)`` tokens, and then removes all ``n`` of them.

Debt rule. For ``n <= burst`` this is the usual bucket. A request larger than the
bucket (a 10 MB block under a 1 MB burst) could never be covered, so it waits only
until the bucket is *full* and then takes all ``n``, leaving the bucket at
``burst - n < 0``: in debt. Later requests wait until the debt is repaid by the
refill. So every grant at time ``T`` satisfies ``units granted before it +
min(n, burst) <= burst + rate * T`` (starting full at 0): the units passed exceed
``burst + rate * T`` at most by the debt ``n - burst`` of the latest large request,
which the next request repays, and large requests go through at the configured
long-run rate instead of deadlocking.

Fairness. :meth:`TokenBucket.acquire` *reserves* on entry: it takes its ``n``
tokens at once (possibly driving the balance negative) and then sleeps until the
refill since that moment covers what it was short of. Waiters are therefore served
in arrival order, a large request cannot be starved by a stream of small ones, and
this gives exactly the same grant times as serving the requests one by one. While
any waiter is still short the balance is negative, so :meth:`try_acquire` fails and
never jumps the queue. A reservation is not refunded if the waiting thread dies
(e.g. ``KeyboardInterrupt`` inside ``sleep``); it only delays later requests.

Rate changes. :meth:`set_rate` credits the refill earned so far at the old rate,
then switches. A thread already sleeping wakes when its sleep, computed at the old
rate, ends and re-computes what remains at the new rate: a lower rate makes it
sleep again, a higher one helps only from that wake-up on.

Thread-safe: one lock guards the balance and is never held while sleeping, so
several repair threads can share one bucket. The clock and sleep are injected.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from kvstore.core.tunables import positive_finite

# Float slack when comparing balances that went through different roundings: a
# relative 1e-12 of the magnitudes involved (real rounding error is ~1e-16), so a
# waiter whose refill is one ulp short does not sleep for a vanishing interval.
_REL_TOL = 1e-12


class TokenBucket:
    """A thread-safe token bucket with reservations and a debt rule (see module doc).

    Invariants (under the lock): ``tokens <= burst``; ``tokens < 0`` only after a
    request of more than the balance or while reservations are outstanding;
    ``credited`` is the refill added since it was last reset, and is reset only
    when no thread is waiting.
    """

    __slots__ = ("_burst", "_clock", "_credited", "_lock", "_rate", "_sleep", "_t_last",
                 "_tokens", "_waiting")

    def __init__(self, *, rate: float, burst: float,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep) -> None:
        self._rate = positive_finite("rate", rate)
        self._burst = positive_finite("burst", burst)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = self._burst
        self._t_last = clock()
        self._credited = 0.0
        self._waiting = 0

    @property
    def rate(self) -> float:
        """Refill rate, tokens per second."""
        return self._rate

    @property
    def burst(self) -> float:
        """Capacity of the bucket."""
        return self._burst

    def available(self) -> float:
        """The balance now (negative while in debt or while waiters are queued)."""
        with self._lock:
            self._refill(self._clock())
            return self._tokens

    def set_rate(self, rate: float) -> None:
        """Changes the refill rate from now on; refill earned so far keeps the old rate."""
        rate = positive_finite("rate", rate)
        with self._lock:
            self._refill(self._clock())
            self._rate = rate

    def try_acquire(self, n: float) -> bool:
        """Takes ``n`` tokens if allowed now (balance >= ``min(n, burst)``); never waits."""
        need = self._need(n)
        with self._lock:
            self._refill(self._clock())
            if self._tokens >= need - _REL_TOL * self._burst:
                self._tokens -= n
                return True
            return False

    def acquire(self, n: float) -> float:
        """Takes ``n`` tokens, sleeping until allowed; returns the seconds waited.

        The wait is measured on the injected clock from entry to grant.
        """
        need = self._need(n)
        with self._lock:
            start = self._clock()
            self._refill(start)
            short = need - self._tokens
            if short <= _REL_TOL * self._burst:
                self._tokens -= n
                return 0.0
            if self._waiting == 0:
                self._credited = 0.0  # rebase: keeps `credited` small when possible
            target = self._credited + short
            self._tokens -= n
            self._waiting += 1
            delay = short / self._rate
        try:
            while True:
                self._sleep(delay)
                with self._lock:
                    now = self._clock()
                    self._refill(now)
                    remaining = target - self._credited
                    if remaining <= _REL_TOL * (self._burst + abs(target)):
                        return max(0.0, now - start)
                    delay = remaining / self._rate
        finally:
            with self._lock:
                self._waiting -= 1

    def _need(self, n: float) -> float:
        if isinstance(n, bool) or not isinstance(n, int | float):
            raise ValueError(f"n must be a number, got {n!r}")
        if not math.isfinite(n) or n <= 0:
            raise ValueError(f"n must be finite and > 0, got {n!r}")
        return min(float(n), self._burst)

    def _refill(self, now: float) -> None:
        """Adds the refill since the last call (lock held). A clock step back adds nothing."""
        dt = now - self._t_last
        if dt <= 0.0:
            return
        self._t_last = now
        room = self._burst - self._tokens
        add = dt * self._rate
        if add >= room:
            self._tokens = self._burst
            self._credited += room
        else:
            self._tokens += add
            self._credited += add
