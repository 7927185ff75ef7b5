"""HotnessTracker: exact decay, rate convergence, transitions, hysteresis, pruning, validation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replication.placement import hotness
from replication.placement.hotness import HotnessTracker

LN2 = math.log(2.0)


class FakeClock:
    """A clock that moves only when the test says so."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def tracker(clock: FakeClock, **kw: float) -> HotnessTracker:
    args: dict[str, float] = {"half_life_s": 10.0, "hot_reads_per_s": 1.0}
    args.update(kw)
    return HotnessTracker(clock=clock, **args)  # type: ignore[arg-type]


# ---- decay and the rate estimate -------------------------------------------------------------


def test_rate_is_counter_times_ln2_over_half_life() -> None:
    clock = FakeClock()
    t = tracker(clock, hot_reads_per_s=1000.0)
    t.record(key(1), 8)
    assert t.rate(key(1)) == 8 * (LN2 / 10.0)
    assert t.rate(key(2)) == 0.0


def test_counter_halves_every_half_life_exactly() -> None:
    clock = FakeClock()
    t = tracker(clock, hot_reads_per_s=1000.0)
    t.record(key(1), 8)
    r0 = t.rate(key(1))
    clock.advance(10.0)
    assert t.rate(key(1)) == r0 / 2
    clock.advance(10.0)
    assert t.rate(key(1)) == r0 / 4
    clock.advance(5.0)
    assert t.rate(key(1)) == pytest.approx(r0 / 4 / math.sqrt(2), rel=1e-15)
    # A record decays the stored counter to now, then adds: 8 * 2**-2.5 + 1.
    t.record(key(1))
    assert t.rate(key(1)) == pytest.approx((8 * 2**-2.5 + 1) * LN2 / 10.0, rel=1e-15)


def test_record_at_same_instant_adds_without_decay() -> None:
    clock = FakeClock(100.0)
    t = tracker(clock, hot_reads_per_s=1000.0)
    for _ in range(4):
        t.record(key(1))
    t.record(key(1), 4)
    assert t.rate(key(1)) == 8 * (LN2 / 10.0)


def test_clock_stepping_back_neither_decays_nor_grows() -> None:
    clock = FakeClock(50.0)
    t = tracker(clock, hot_reads_per_s=1000.0)
    t.record(key(1), 8)
    clock.t = 40.0
    assert t.rate(key(1)) == 8 * (LN2 / 10.0)
    t.record(key(1), 8)
    assert t.rate(key(1)) == 16 * (LN2 / 10.0)


@pytest.mark.parametrize(("reads_per_s", "half_life_s"), [(3.0, 20.0), (100.0, 2.0),
                                                           (2500.0, 0.5)])
def test_steady_rate_estimate_converges_within_one_percent(
        reads_per_s: float, half_life_s: float) -> None:
    clock = FakeClock()
    t = tracker(clock, half_life_s=half_life_s, hot_reads_per_s=1e9)
    step = 1.0 / reads_per_s
    for _ in range(int(reads_per_s * half_life_s * 20)):  # 20 half-lives
        clock.advance(step)
        t.record(key(7))
    # Just after a read (the top of the sawtooth) and just before the next (the bottom).
    assert t.rate(key(7)) == pytest.approx(reads_per_s, rel=0.01)
    clock.advance(step * (1 - 1e-9))
    assert t.rate(key(7)) == pytest.approx(reads_per_s, rel=0.01)


def test_steady_rate_sawtooth_bound_and_exact_time_average() -> None:
    # 3 reads/s with a 2 s half-life: each read is 1/8.7 of the counter, so the estimate
    # swings by about +-ln 2 / (2 r h) = 5.8% around r, and averages exactly r over a period.
    r, h = 3.0, 2.0
    clock = FakeClock()
    t = tracker(clock, half_life_s=h, hot_reads_per_s=1e9)
    step = 1.0 / r
    for _ in range(int(r * h * 40)):
        clock.advance(step)
        t.record(key(7))
    top = t.rate(key(7))
    # Steady state: the counter just after a read is 1 / (1 - 2**(-step / h)).
    assert top == pytest.approx(LN2 / h / (1 - 2 ** (-step / h)), rel=1e-9)
    samples = 2000
    total = 0.0
    for j in range(samples):
        clock.t += 0 if j == 0 else step / samples
        total += t.rate(key(7))
    average = total / samples
    assert top == pytest.approx(r * (1 + LN2 / (2 * r * h)), rel=0.01)
    assert average == pytest.approx(r, rel=2e-3)


def test_batched_reads_estimate_the_same_rate() -> None:
    clock = FakeClock()
    t = tracker(clock, half_life_s=5.0, hot_reads_per_s=1e9)
    for _ in range(500):  # 50 reads every 0.5 s for 250 s = 100 reads/s
        clock.advance(0.5)
        t.record(key(1), 50)
    clock.advance(0.25)
    assert t.rate(key(1)) == pytest.approx(100.0, rel=0.01)


# ---- cold -> hot -----------------------------------------------------------------------------


def test_exact_call_that_makes_a_key_hot() -> None:
    # hot = 1 read/s with a 10 s half-life is a counter of 10 / ln 2 = 14.43 reads.
    clock = FakeClock()
    t = tracker(clock)
    results = [t.record(key(1)) for _ in range(20)]
    assert results == [False] * 14 + [True] + [False] * 5
    assert t.is_hot(key(1))
    assert t.hot_keys() == [key(1)]


def test_transition_accounts_for_decay() -> None:
    clock = FakeClock()
    t = tracker(clock)
    assert not t.record(key(1), 14)  # 14 < 14.43
    clock.advance(10.0)  # counter 7
    assert not t.record(key(1), 7)  # 14 again
    assert t.record(key(1), 1)  # 15
    assert not t.record(key(1), 100)


def test_threshold_is_inclusive() -> None:
    # White-box: the hot threshold in counter units is hot * half_life / ln 2, and a
    # counter exactly on it is hot.
    clock = FakeClock()
    t = tracker(clock, hot_reads_per_s=3.0)
    assert t._hot_count == 3.0 * 10.0 / LN2
    assert t.record(key(1), t._hot_count)  # type: ignore[arg-type]
    assert t.is_hot(key(1))


def test_unknown_key_is_cold() -> None:
    t = tracker(FakeClock())
    assert not t.is_hot(key(1))
    assert t.hot_keys() == []
    assert t.cooled() == []


def test_record_rejects_non_positive_n() -> None:
    t = tracker(FakeClock())
    for n in (0, -1):
        with pytest.raises(ValueError, match="n must be > 0"):
            t.record(key(1), n)


# ---- hot -> cold (hysteresis) ----------------------------------------------------------------


def test_hysteresis_between_cool_and_hot_stays_hot() -> None:
    clock = FakeClock()
    t = tracker(clock, hot_reads_per_s=10.0, cool_reads_per_s=5.0)
    hot_count = 10.0 * 10.0 / LN2  # 144.27
    assert t.record(key(1), 150)
    # Rate 10.4 -> after 9 s: 150 * 2**-0.9 = 80.4 reads = 5.57/s, between cool and hot.
    clock.advance(9.0)
    assert 5.0 < t.rate(key(1)) < 10.0
    assert t.cooled() == []
    assert t.is_hot(key(1))
    # Reading again while hot is no new transition, even above the hot threshold.
    assert not t.record(key(1), int(hot_count))
    assert t.is_hot(key(1))
    # Let it fall below cool: reported once, then cold.
    clock.advance(20.0)
    assert t.rate(key(1)) < 5.0
    assert t.is_hot(key(1))  # still hot until cooled() reports it
    assert t.cooled() == [key(1)]
    assert not t.is_hot(key(1))
    assert t.cooled() == []
    assert t.hot_keys() == []
    # Heating again is a new transition.
    assert t.record(key(1), 150)


def test_cool_threshold_is_strict_and_defaults_to_half_of_hot() -> None:
    clock = FakeClock()
    t = tracker(clock, hot_reads_per_s=2.0)
    assert t.cool_reads_per_s == 1.0
    assert t.record(key(1), 64)  # 64 reads >= 2 * 10 / ln 2 = 28.85
    # cool counter = 14.43: after 2 half-lives the counter is 16 (rate 1.109): stays;
    # after 3 it is 8: cooled.
    clock.advance(20.0)
    assert t.cooled() == []
    clock.advance(10.0)
    assert t.cooled() == [key(1)]


def test_cool_equal_to_hot_is_allowed() -> None:
    clock = FakeClock()
    t = tracker(clock, hot_reads_per_s=1.0, cool_reads_per_s=1.0)
    assert t.record(key(1), 15)
    assert t.cooled() == []  # 15 >= 14.43
    clock.advance(1.0)  # 15 * 2**-0.1 = 13.99 < 14.43
    assert t.cooled() == [key(1)]


def test_cooled_returns_keys_in_order_they_became_hot_and_only_once() -> None:
    clock = FakeClock()
    t = tracker(clock)
    # 20 reads is hot (>= 14.43); cool counter is 7.21.
    assert t.record(key(2), 20)
    clock.advance(1.0)
    assert t.record(key(1), 40)
    clock.advance(1.0)
    assert t.record(key(3), 20)
    assert t.hot_keys() == [key(2), key(1), key(3)]
    # 12 s later: key 2 at 20 * 2**-1.4 = 7.58 and key 3 at 20 * 2**-1.2 = 8.7 stay hot.
    clock.advance(12.0)
    assert t.cooled() == []
    clock.advance(2.0)  # key 2: 20 * 2**-1.6 = 6.6, key 3: 20 * 2**-1.4 = 7.58, key 1: 40 * ...
    assert t.cooled() == [key(2)]
    assert t.cooled() == []
    clock.advance(100.0)
    assert t.cooled() == [key(1), key(3)]
    assert t.cooled() == []
    assert t.hot_keys() == []


def test_order_of_reheated_key_is_its_new_transition() -> None:
    clock = FakeClock()
    t = tracker(clock)
    assert t.record(key(1), 20)
    assert t.record(key(2), 20)
    clock.advance(100.0)
    assert t.cooled() == [key(1), key(2)]
    assert t.record(key(2), 20)
    assert t.record(key(1), 20)
    clock.advance(100.0)
    assert t.cooled() == [key(2), key(1)]


# ---- memory bound ----------------------------------------------------------------------------


def test_pruning_drops_smallest_decayed_counter() -> None:
    clock = FakeClock()
    t = tracker(clock, hot_reads_per_s=1000.0, max_keys=4)
    t.record(key(0), 8)  # decays to 2 by t = 20
    clock.advance(20.0)
    t.record(key(1), 3)
    t.record(key(2), 5)
    t.record(key(3), 4)
    assert len(t) == 4
    t.record(key(4), 1)  # full: drops the smallest decayed counter, key 0 (2 < 3)
    assert len(t) == 4
    assert t.rate(key(0)) == 0.0
    assert all(t.rate(key(i)) > 0 for i in (1, 2, 3, 4))
    t.record(key(5), 1)  # drops key 4 (1), the newest but smallest
    assert t.rate(key(4)) == 0.0
    assert {i for i in range(6) if t.rate(key(i)) > 0} == {1, 2, 3, 5}


def test_pruning_keeps_the_hottest_keys() -> None:
    clock = FakeClock()
    t = tracker(clock, hot_reads_per_s=1e9, max_keys=100)
    slack = max(1, 100 // 16)
    for i in range(1000):
        t.record(key(i), i + 1)
        assert len(t) <= 100
    tracked = {i for i in range(1000) if t.rate(key(i)) > 0}
    # Each prune keeps the largest counters, so the survivors are the last arrivals
    # that were never the smallest: all of the top 100 - slack counters survive.
    assert set(range(1000 - (100 - slack), 1000)) <= tracked
    assert len(tracked) <= 100


def test_pruning_never_drops_hot_keys_while_cold_ones_remain() -> None:
    clock = FakeClock()
    t = tracker(clock, max_keys=3)  # hot counter 14.43
    assert t.record(key(9), 15)
    clock.advance(5.0)  # key 9 decays to 10.6 but stays hot
    t.record(key(1), 14)
    t.record(key(2), 13)
    t.record(key(3), 1)  # full: drops cold key 2 (13), not hot key 9 (10.6)
    assert t.rate(key(2)) == 0.0
    assert t.rate(key(9)) > 0.0
    assert t.rate(key(1)) > 0.0
    assert t.is_hot(key(9))


def test_pruning_drops_smallest_hot_key_when_all_are_hot_and_cooled_reports_it() -> None:
    clock = FakeClock()
    t = tracker(clock, max_keys=2)
    assert t.record(key(1), 30)
    assert t.record(key(2), 20)
    assert not t.record(key(3), 1)  # full of hot keys: drops the smaller hot key 2
    assert len(t) == 2
    assert t.rate(key(2)) == 0.0
    assert t.is_hot(key(2))  # still hot until reported
    assert t.hot_keys() == [key(1), key(2)]
    assert t.cooled() == [key(2)]
    assert t.hot_keys() == [key(1)]
    # Read again, it starts from zero and must earn its transition anew.
    assert not t.record(key(2), 1)


def test_evicted_hot_key_read_again_stays_hot_without_a_new_transition() -> None:
    clock = FakeClock()
    t = tracker(clock, max_keys=1)
    assert t.record(key(1), 20)
    assert t.record(key(2), 20)  # evicts hot key 1
    assert t.is_hot(key(1))
    assert not t.record(key(1), 20)  # re-tracked, still in the hot set: no new transition
    assert t.cooled() == [key(2)]  # key 2 was evicted by key 1
    assert t.hot_keys() == [key(1)]


def test_pruning_is_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    original = HotnessTracker._prune

    def counting(self: HotnessTracker, now: float) -> None:
        nonlocal calls
        calls += 1
        original(self, now)

    monkeypatch.setattr(HotnessTracker, "_prune", counting)
    clock = FakeClock()
    t = tracker(clock, hot_reads_per_s=1e9, max_keys=1600)
    for i in range(1600 + 100 * 10):
        t.record(key(i))
    # slack = 1600 // 16 = 100: one prune per 100 new keys once full.
    assert hotness._SLACK_DIVISOR == 16
    assert calls == 10
    assert len(t) == 1600


def test_existing_keys_never_prune() -> None:
    clock = FakeClock()
    t = tracker(clock, hot_reads_per_s=1e9, max_keys=3)
    for i in range(3):
        t.record(key(i))
    for _ in range(10):
        for i in range(3):
            t.record(key(i))
    assert len(t) == 3
    assert all(t.rate(key(i)) > 0 for i in range(3))


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"half_life_s": 0.0}, "half_life_s"),
        ({"half_life_s": -1.0}, "half_life_s"),
        ({"half_life_s": math.inf}, "half_life_s"),
        ({"hot_reads_per_s": 0.0}, "hot_reads_per_s"),
        ({"hot_reads_per_s": math.nan}, "hot_reads_per_s"),
        ({"cool_reads_per_s": 0.0}, "cool_reads_per_s"),
        ({"cool_reads_per_s": -1.0}, "cool_reads_per_s"),
        ({"cool_reads_per_s": 2.0}, "must be <= hot_reads_per_s"),
        ({"max_keys": 0}, "max_keys"),
        ({"max_keys": 1.5}, "max_keys"),
        ({"max_keys": True}, "max_keys"),
    ],
)
def test_argument_validation(kwargs: dict[str, float], message: str) -> None:
    args: dict[str, float] = {"hot_reads_per_s": 1.0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        HotnessTracker(**args)  # type: ignore[arg-type]


def test_hot_threshold_is_required() -> None:
    with pytest.raises(TypeError):
        HotnessTracker()  # type: ignore[call-arg]


def test_defaults() -> None:
    t = HotnessTracker(hot_reads_per_s=4.0)
    assert t.half_life_s == 10.0
    assert t.cool_reads_per_s == 2.0
    assert t.max_keys == 100_000


# ---- properties ------------------------------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.floats(min_value=0.0, max_value=30.0)),
        st.tuples(st.just("record"), st.integers(0, 5), st.integers(1, 20)),
        st.tuples(st.just("cooled")),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, max_keys=st.integers(1, 8), cool_frac=st.floats(0.05, 1.0))
def test_hot_iff_more_transitions_to_hot_than_cooled(
        ops: list[tuple], max_keys: int, cool_frac: float) -> None:
    clock = FakeClock()
    t = tracker(clock, half_life_s=5.0, hot_reads_per_s=2.0,
                cool_reads_per_s=2.0 * cool_frac, max_keys=max_keys)
    to_hot = [0] * 6
    to_cold = [0] * 6
    order: list[int] = []  # model of the hot set, in order of transition
    for op in ops:
        if op[0] == "advance":
            clock.advance(op[1])
        elif op[0] == "record":
            _, i, n = op
            if t.record(key(i), n):
                to_hot[i] += 1
                order.append(i)
                assert t.rate(key(i)) * (1 + 1e-12) >= t.hot_reads_per_s
        else:
            out = t.cooled()
            assert out == [key(i) for i in order if key(i) in out]
            for k in out:
                i = int.from_bytes(k, "big")
                to_cold[i] += 1
                order.remove(i)
                assert t.rate(k) < t.cool_reads_per_s * (1 + 1e-12)
        assert len(t) <= max_keys
        assert t.hot_keys() == [key(i) for i in order]
        for i in range(6):
            assert t.rate(key(i)) >= 0.0
            assert to_hot[i] - to_cold[i] in (0, 1)
            assert t.is_hot(key(i)) == (to_hot[i] > to_cold[i])


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(0.0, 25.0), st.integers(1, 50)), max_size=40))
def test_rate_matches_reference_model(steps: list[tuple[float, int]]) -> None:
    clock = FakeClock()
    t = tracker(clock, half_life_s=4.0, hot_reads_per_s=1e9)
    c = 0.0
    for dt, n in steps:
        clock.advance(dt)
        c = c * math.exp(-dt * LN2 / 4.0) + n
        t.record(key(0), n)
        assert t.rate(key(0)) == pytest.approx(c * LN2 / 4.0, rel=1e-9)
    clock.advance(3.0)
    assert t.rate(key(0)) == pytest.approx(c * 2**-0.75 * LN2 / 4.0, rel=1e-9)
