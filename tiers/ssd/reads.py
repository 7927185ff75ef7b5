"""The handle :meth:`tiers.ssd.tier.SsdTier.submit_reads` returns: block reads in flight.

It drives a :class:`tiers.ssd.staging.ReadJob` from the caller's thread: each
completion is checked (checksum, copy-out of bounced bytes) as the caller collects
it, so results arrive in completion order, not submission order. A failed read
(I/O error, checksum mismatch, cancelled, tier closed) is a False result, never an
exception; only a wait that times out raises (:class:`TimeoutError`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from tiers.ssd.staging import ReadJob


class SsdReads:
    """Reads in flight. Thread-safe; usually one thread collects the results.

    Invariant: every index is reported once by :meth:`completions` (or counted by
    :meth:`wait`); after :meth:`close` (or once all are reported) no I/O touches
    the caller's buffers.
    """

    def __init__(self, count_reads: Callable[[int, int], None], job: ReadJob,
                 nbytes: list[int]) -> None:
        """``count_reads(reads, nbytes)``: the tier's counters, told of each batch collected
        (a callable, not the tier, so this module does not import the tier's)."""
        self._count_reads = count_reads
        self._job = job
        self._nbytes = nbytes
        self._lock = threading.Lock()
        self._reported = 0
        self._closed = False

    def __len__(self) -> int:
        return len(self._nbytes)

    @property
    def done(self) -> bool:
        """Whether every result was collected."""
        return self._reported == len(self._nbytes)

    def completions(self, timeout: float | None = None) -> Iterator[tuple[int, bool]]:
        """Yields (index, ok) for each read as it finishes, until all were yielded.

        ``timeout`` bounds each wait for the next completion (TimeoutError)."""
        return self._collect(timeout, False)

    def _collect(self, timeout: float | None, all_left: bool) -> Iterator[tuple[int, bool]]:
        while True:
            with self._lock:
                if self._closed:
                    return
                got = self._job.reap(timeout, all_left=all_left)
                if got is None:
                    raise TimeoutError("no SSD read completed in time")
                if not got:
                    self._finish()
                    return
                ok = self._job.ok
                self._reported += len(got)
                self._count_reads(len(got), sum(self._nbytes[i] for i in got if ok[i]))
            for i in got:
                yield i, ok[i]

    def wait(self, timeout: float | None = None) -> list[bool]:
        """Every read's result, in submission order (``timeout``: per wait). Waits for
        whole chunks at once: one wake-up, not one per read."""
        for _ in self._collect(timeout, True):
            pass
        return list(self._job.ok)

    def cancel(self) -> None:
        """Reads not yet started end as False without I/O; started ones finish."""
        with self._lock:
            self._job.cancel()

    def _finish(self) -> None:
        self._job.release()

    def close(self) -> None:
        """Cancels what has not started, waits for what is in flight, frees buffers.
        Results not yet collected stay False (reads that finished stay as they are)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._job.release()

    def __enter__(self) -> SsdReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
