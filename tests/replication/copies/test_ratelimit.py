"""TokenBucket: exact waits, the debt rule, long-run rate, set_rate, fairness, threads."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replication.copies.ratelimit import TokenBucket


class FakeTime:
    """A clock plus a sleep that advances it and records each call. Thread-safe."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t
        self.sleeps: list[float] = []
        self._lock = threading.Lock()

    def clock(self) -> float:
        with self._lock:
            return self.t

    def sleep(self, d: float) -> None:
        assert d > 0
        with self._lock:
            self.sleeps.append(d)
            self.t += d

    def advance(self, d: float) -> None:
        with self._lock:
            self.t += d


def bucket(ft: FakeTime, *, rate: float, burst: float) -> TokenBucket:
    return TokenBucket(rate=rate, burst=burst, clock=ft.clock, sleep=ft.sleep)


# ---- exact waits -----------------------------------------------------------------------------


def test_starts_full_and_waits_exactly_for_the_shortfall() -> None:
    ft = FakeTime(100.0)
    b = bucket(ft, rate=8.0, burst=4.0)
    assert b.available() == 4.0
    assert b.acquire(4) == 0.0
    assert b.acquire(4) == 0.5
    assert b.acquire(2) == 0.25
    assert b.acquire(1) == 0.125
    assert ft.sleeps == [0.5, 0.25, 0.125]
    assert ft.t == 100.875
    assert b.available() == 0.0


def test_idle_time_refills_up_to_burst_only() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=8.0, burst=4.0)
    b.acquire(4)
    ft.advance(0.25)
    assert b.available() == 2.0
    assert b.acquire(3) == 0.125
    ft.advance(1000.0)
    assert b.available() == 4.0
    assert b.acquire(4) == 0.0
    assert b.acquire(4) == 0.5


def test_try_acquire_never_waits() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=2.0, burst=2.0)
    assert b.try_acquire(1.5)
    assert not b.try_acquire(1)  # 0.5 left
    assert b.try_acquire(0.5)
    assert not b.try_acquire(0.25)
    ft.advance(0.125)
    assert b.try_acquire(0.25)
    assert ft.sleeps == []
    assert b.available() == 0.0


def test_fractional_rate_waits_are_exact_to_rounding() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=3.0, burst=1.0)
    b.acquire(1)
    waits = [b.acquire(1) for _ in range(30)]
    assert waits == pytest.approx([1 / 3] * 30, rel=1e-9)
    assert len(ft.sleeps) == 30  # one sleep per acquire: no vanishing re-sleeps
    assert ft.t == pytest.approx(10.0, rel=1e-12)


# ---- debt rule -------------------------------------------------------------------------------


def test_request_larger_than_burst_waits_for_full_then_goes_into_debt() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=2.0, burst=4.0)
    assert b.acquire(10) == 0.0  # full bucket: passes at once
    assert b.available() == -6.0
    assert b.acquire(1) == 3.5  # repay 6 of debt, then 1 token
    assert b.available() == 0.0
    assert b.acquire(10) == 2.0  # waits only until the bucket is full
    assert b.available() == -6.0
    assert ft.sleeps == [3.5, 2.0]


def test_large_request_on_partial_bucket_waits_for_full() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=4.0, burst=4.0)
    assert b.try_acquire(3)
    assert not b.try_acquire(100)  # needs a full bucket
    assert b.acquire(100) == 0.75
    assert b.available() == -96.0


def test_try_acquire_larger_than_burst_on_full_bucket_goes_into_debt() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=1.0, burst=1.0)
    assert b.try_acquire(5)
    assert b.available() == -4.0
    assert not b.try_acquire(0.5)
    ft.advance(4.5)
    assert b.try_acquire(0.5)


def test_blocks_larger_than_burst_pass_at_the_configured_rate() -> None:
    # 10 MB blocks under a 1 MB burst at 1 MB/s: one block per 10 s in the long run.
    mb = 1 << 20
    ft = FakeTime()
    b = bucket(ft, rate=float(mb), burst=float(mb))
    waits = [b.acquire(10 * mb) for _ in range(20)]
    assert waits == [0.0] + [10.0] * 19
    assert ft.t == 190.0


# ---- long-run rate ---------------------------------------------------------------------------


def test_long_run_rate_of_random_sequence_is_the_configured_rate() -> None:
    rng = random.Random(1234)
    ft = FakeTime()
    rate, burst = 1000.0, 250.0
    b = bucket(ft, rate=rate, burst=burst)
    total = 0.0
    for _ in range(5000):
        n = rng.uniform(1.0, 3.0 * burst)  # a third of them exceed the burst
        b.acquire(n)
        total += n
    assert total / ft.t == pytest.approx(rate, rel=0.01)


def test_long_run_rate_with_idle_gaps_never_exceeds_burst_plus_rate() -> None:
    rng = random.Random(99)
    ft = FakeTime()
    rate, burst = 50.0, 20.0
    b = bucket(ft, rate=rate, burst=burst)
    total = 0.0
    for _ in range(2000):
        if rng.random() < 0.3:
            ft.advance(rng.uniform(0.0, 2.0))
        n = rng.uniform(0.5, 40.0)
        if rng.random() < 0.5:
            b.acquire(n)
            total += n
        elif b.try_acquire(n):
            total += n
        # n <= 40 may exceed the burst of 20: the debt rule lets the last one overshoot.
        assert total <= burst + rate * ft.t + max(0.0, n - burst) + 1e-6


# ---- set_rate --------------------------------------------------------------------------------


def test_set_rate_keeps_refill_earned_at_the_old_rate() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=1.0, burst=1.0)
    b.acquire(1)
    ft.advance(0.5)  # 0.5 tokens at the old rate
    b.set_rate(4.0)
    assert b.rate == 4.0
    assert b.available() == 0.5
    assert b.acquire(1) == 0.125
    b.set_rate(0.5)
    assert b.acquire(1) == 2.0


def test_set_rate_while_waiting_is_applied_at_the_next_wake_up() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=2.0, burst=2.0)
    b.acquire(2)
    calls = 0

    def sleep(d: float) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            b.set_rate(1.0)  # also proves the lock is not held while sleeping
        ft.sleep(d)

    b._sleep = sleep  # type: ignore[attr-defined]
    # Computed at rate 2: sleep 1 s. After it only 1 token came in at rate 1: sleep 1 s more.
    assert b.acquire(2) == 2.0
    assert ft.sleeps == [1.0, 1.0]


def test_set_rate_validates() -> None:
    b = bucket(FakeTime(), rate=1.0, burst=1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rate"):
            b.set_rate(bad)
    assert b.rate == 1.0


# ---- fairness --------------------------------------------------------------------------------


def test_waiters_reserve_so_try_acquire_cannot_jump_the_queue() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=1.0, burst=4.0)
    b.acquire(4)
    seen: list[bool] = []

    def sleep(d: float) -> None:
        # While a large request waits, small ones are refused even as tokens refill.
        ft.advance(d / 2)
        seen.append(b.try_acquire(0.5))
        ft.advance(d / 2)

    b._sleep = sleep  # type: ignore[attr-defined]
    assert b.acquire(10) == 4.0
    assert seen == [False]
    assert b.available() == -6.0


def test_concurrent_waiters_are_served_in_arrival_order() -> None:
    """Three threads queue up; each grant time matches serving them one by one."""
    ft = FakeTime()
    b = bucket(ft, rate=1.0, burst=1.0)
    b.acquire(1)
    release = threading.Event()
    arrived = threading.Semaphore(0)
    grants: dict[str, float] = {}

    def sleep(d: float) -> None:
        arrived.release()
        assert release.wait(10)
        # Each waiter's first sleep is its full computed wait; nobody needs a second.
        ft.sleep(d)

    b._sleep = sleep  # type: ignore[attr-defined]
    threads: list[threading.Thread] = []
    for name, n in (("a", 2.0), ("b", 1.0), ("c", 3.0)):
        th = threading.Thread(target=lambda name=name, n=n: grants.__setitem__(
            name, b.acquire(n)))
        th.start()
        assert arrived.acquire(timeout=10)  # this one has reserved before the next starts
        threads.append(th)
    # Balance is now 0 - 2 - 1 - 3 = -6; waits computed: a 1 s (needs 1), b 3 s, c 4 s.
    assert b.available() == -6.0
    assert ft.sleeps == []
    release.set()
    for th in threads:
        th.join(10)
        assert not th.is_alive()
    assert sorted(ft.sleeps) == [1.0, 3.0, 4.0]
    assert set(grants) == {"a", "b", "c"}


# ---- threads ---------------------------------------------------------------------------------


def test_threads_never_over_grant_with_a_frozen_clock() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=1.0, burst=1000.0)
    workers = 8
    start = threading.Barrier(workers)
    counts = [0] * workers

    def work(i: int) -> None:
        start.wait(10)
        while b.try_acquire(1):
            counts[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert sum(counts) == 1000
    assert b.available() == 0.0


def test_real_clock_threads_within_burst_never_sleep() -> None:
    """Real clock, real threads; the rate is negligible, so the burst is the whole budget."""

    def no_sleep(d: float) -> None:
        raise AssertionError(f"slept {d}")

    workers, each = 8, 250
    b = TokenBucket(rate=1e-9, burst=float(workers * each), sleep=no_sleep)
    start = threading.Barrier(workers)
    waited: list[float] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            start.wait(10)
            for _ in range(each):
                waited.append(b.acquire(1))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert errors == []
    assert waited == [0.0] * (workers * each)
    assert not b.try_acquire(1)


def test_lock_is_not_held_while_another_thread_sleeps() -> None:
    ft = FakeTime()
    b = bucket(ft, rate=1.0, burst=1.0)
    b.acquire(1)
    sleeping = threading.Event()
    go = threading.Event()
    result: list[float] = []

    def sleep(d: float) -> None:
        sleeping.set()
        assert go.wait(10)
        ft.sleep(d)

    b._sleep = sleep  # type: ignore[attr-defined]
    th = threading.Thread(target=lambda: result.append(b.acquire(1)))
    th.start()
    assert sleeping.wait(10)
    # These would block forever if the sleeper held the lock.
    done = threading.Event()

    def poke() -> None:
        assert not b.try_acquire(1)
        assert b.available() == -1.0
        b.set_rate(1.0)
        done.set()

    poker = threading.Thread(target=poke)
    poker.start()
    assert done.wait(10)
    go.set()
    th.join(10)
    poker.join(10)
    assert result == [1.0]


def test_concurrent_acquires_with_fake_time_respect_the_budget() -> None:
    ft = FakeTime()
    rate, burst = 100.0, 10.0
    b = bucket(ft, rate=rate, burst=burst)
    workers, each = 6, 200
    start = threading.Barrier(workers)
    totals = [0.0] * workers

    def work(i: int) -> None:
        rng = random.Random(i)
        start.wait(10)
        for _ in range(each):
            n = rng.uniform(0.5, 25.0)
            b.acquire(n)
            totals[i] += n

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
        assert not th.is_alive()
    # Concurrent fake sleeps each advance the shared clock, so time runs at least as fast
    # as real waiting would; the bucket must still never pass more than it refilled, but
    # for the debt of the one request (at most 25 - burst) granted last.
    assert sum(totals) <= burst + rate * ft.t + (25.0 - burst) + 1e-6
    assert b.available() >= -25.0


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0.0, "burst": 1.0}, "rate"),
        ({"rate": -1.0, "burst": 1.0}, "rate"),
        ({"rate": float("inf"), "burst": 1.0}, "rate"),
        ({"rate": 1.0, "burst": 0.0}, "burst"),
        ({"rate": 1.0, "burst": float("nan")}, "burst"),
        ({"rate": "1", "burst": 1.0}, "rate"),
    ],
)
def test_constructor_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenBucket(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, -1, -0.5, float("nan"), float("inf"), True, "3"])
def test_non_positive_or_bad_n_is_rejected(n: object) -> None:
    ft = FakeTime()
    b = bucket(ft, rate=1.0, burst=1.0)
    with pytest.raises(ValueError, match="n must be"):
        b.acquire(n)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        b.try_acquire(n)  # type: ignore[arg-type]
    assert b.available() == 1.0


def test_default_clock_and_sleep_are_monotonic_and_sleep() -> None:
    b = TokenBucket(rate=1000.0, burst=1.0)
    assert b.acquire(1) == 0.0
    t0 = time.monotonic()
    waited = b.acquire(1)
    assert 0.0 < waited <= time.monotonic() - t0 + 1e-6


# ---- properties ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(rate=st.floats(0.1, 1e6), burst=st.floats(0.1, 1e6),
       units=st.lists(st.floats(1e-3, 10.0), min_size=1, max_size=60))
def test_total_wait_bounds(rate: float, burst: float, units: list[float]) -> None:
    """Back-to-back acquires: the waits are those of serving the requests one by one.

    Request k is granted at ``t_k = max(t_{k-1}, (sum of earlier n + min(n_k, burst) -
    burst) / rate)``: the bucket never overflows without idle time, so by then exactly
    ``rate * t_k`` has been refilled. Hence ``waited >= (total - burst) / rate`` whenever
    the last request fits the burst; a last request larger than the burst is in debt by
    its excess ``n - burst``, which the *next* request repays.
    """
    ft = FakeTime()
    b = bucket(ft, rate=rate, burst=burst)
    ns = [u * burst for u in units]  # scaled to the burst: both debt and ordinary requests
    waited = sum(b.acquire(n) for n in ns)
    total = sum(ns)
    expected = 0.0
    prefix = 0.0
    for n in ns:
        expected = max(expected, (prefix + min(n, burst) - burst) / rate)
        prefix += n
    tol = 1e-9 * (total / rate + 1.0)
    assert waited == pytest.approx(expected, rel=1e-9, abs=tol)
    excess_last = max(0.0, ns[-1] - burst)
    assert waited >= (total - excess_last - burst) / rate - tol
    if excess_last == 0.0:
        assert waited >= (total - burst) / rate - tol
    assert waited <= total / rate + tol
    assert waited == pytest.approx(ft.t, rel=1e-9, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.01, 30.0), st.booleans()),
                    min_size=1, max_size=60))
def test_never_passes_more_than_burst_plus_refill(ops: list[tuple[float, float, bool]]) -> None:
    """Every grant had ``min(n, burst)`` tokens: earlier units + that <= burst + rate * t."""
    ft = FakeTime()
    rate, burst = 3.0, 10.0
    b = bucket(ft, rate=rate, burst=burst)
    total = idle = waited = excess_last = 0.0
    for gap, n, blocking in ops:
        ft.advance(gap)
        idle += gap
        before = total
        if blocking:
            waited += b.acquire(n)
            total += n
        elif b.try_acquire(n):
            total += n
        if total > before:
            assert before + min(n, burst) <= burst + rate * ft.t + 1e-9 * (total + 1.0)
            excess_last = max(0.0, n - burst)  # debt of the last granted request
        assert b.available() <= burst
    # The idle gaps may have refilled at most rate * idle; the rest came from waiting.
    assert waited >= (total - excess_last - burst - rate * idle) / rate - 1e-9 * (total + 1.0)
