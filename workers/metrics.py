"""Small load meters the workers report to a scheduler. Not thread-safe: callers lock."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RateMeter:
    """Events per second over the last ``window`` seconds (0.0 when idle that long).

    Divides by the full window once the meter is older than it, else by its age, so
    a worker that just started does not report a rate near zero.
    """

    def __init__(self, window: float = 10.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.window = window
        self._clock = clock
        self._born = clock()
        self._events: deque[tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, amount: float) -> None:
        now = self._clock()
        self._events.append((now, amount))
        self._sum += amount
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._sum -= self._events.popleft()[1]

    def rate(self) -> float:
        now = self._clock()
        self._trim(now)
        span = min(self.window, max(now - self._born, 1e-3))
        return max(self._sum, 0.0) / span


class Ema:
    """Exponential moving average; ``value`` is None before the first sample."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
