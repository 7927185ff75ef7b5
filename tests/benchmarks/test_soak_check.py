"""The soak run's books and verdicts (benchmarks/soak_check.py), exactly: a lost block, a
wrong byte and a leaking process are each caught; removed and unacknowledged blocks are
judged by their bytes only."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from benchmarks.soak_check import (
    MIN_SAMPLES,
    Ledger,
    State,
    check,
    judged,
    key_of,
    memory_verdict,
    pooled_slope,
    stale_regions,
    value_of,
)


def ledger_of(n: int) -> tuple[Ledger, dict[bytes, bytes]]:
    """``n`` blocks: ids 0..n-1 acknowledged, and the store as the cluster would hold them."""
    led = Ledger(cls="tenant-a", tag=1, seed=7)
    store = {}
    for j in range(n):
        i = led.new(100 + 37 * (j % 5))
        led.acked(i)
        store[led.key(i)] = led.value(i)
    return led, store


def reader(store: dict[bytes, bytes]) -> Callable[[list[bytes]], list[bytes | None]]:
    return lambda keys: [store.get(k) for k in keys]


def test_values_differ_per_block_and_are_reproducible() -> None:
    assert value_of(1, "a", 5, 64) == value_of(1, "a", 5, 64)
    others = {value_of(1, "a", 6, 64), value_of(1, "b", 5, 64), value_of(2, "a", 5, 64)}
    assert value_of(1, "a", 5, 64) not in others and len(others) == 3
    assert key_of(1, 5) != key_of(2, 5) and len(key_of(255, (1 << 112) - 1)) == 16


def test_an_intact_store_passes() -> None:
    led, store = ledger_of(50)
    r = check(led, reader(store), batch_bytes=1000)  # many small batches
    assert (r.live, r.lost, r.wrong, r.maybe_found, r.gone_found) == (50, [], [], 0, 0)


def test_one_wrong_byte_is_caught() -> None:
    led, store = ledger_of(50)
    k = led.key(17)
    v = bytearray(store[k])
    v[len(v) // 2] ^= 1
    store[k] = bytes(v)
    r = check(led, reader(store))
    assert r.wrong == [17] and r.lost == []
    assert r.summary(led)["wrong_keys"] == [k.hex()]


def test_another_blocks_bytes_are_a_wrong_byte() -> None:
    led, store = ledger_of(10)
    store[led.key(3)] = store[led.key(4)][: led.sizes[3]].ljust(led.sizes[3], b"\0")
    assert check(led, reader(store)).wrong == [3]


def test_a_missing_acknowledged_block_is_lost() -> None:
    led, store = ledger_of(10)
    del store[led.key(9)]
    r = check(led, reader(store))
    assert r.lost == [9] and r.wrong == [] and r.summary(led)["lost"] == 1


def test_removed_and_unacknowledged_blocks_may_be_absent_but_never_wrong() -> None:
    led, store = ledger_of(6)
    led.removed(0)  # gone, and absent
    del store[led.key(0)]
    led.removed(1)  # gone, but a copy came back: fine, with its own bytes
    led.refused(2)  # a put that raised, stored anyway
    j = led.new(50)
    led.refused(j)  # a put that raised, stored nowhere
    led.removed(3)  # came back with wrong bytes: caught whatever the state
    store[led.key(3)] = b"x" * led.sizes[3]
    r = check(led, reader(store))
    assert (r.live, r.lost, r.wrong, r.maybe_found, r.gone_found) == (2, [], [3], 1, 1)
    assert led.counts() == {"live": 2, "maybe": 2, "gone": 3}


def test_held_bytes_follow_the_states() -> None:
    led = Ledger(cls="c", tag=3, seed=0)
    a, b = led.new(100), led.new(50)
    assert led.held_bytes == 150  # counted from the moment a put is tried
    led.acked(a)
    led.refused(b)
    assert led.held_bytes == 150
    led.removed(a)
    assert led.held_bytes == 50 and led.state[a] is State.GONE
    rng = random.Random(0)
    assert led.pick_live(rng) is None and led.pick_held(rng) == b
    led.removed(b)
    assert led.held_bytes == 0 and led.pick_held(rng) is None


def test_pooled_slope_is_the_growth_within_each_process() -> None:
    # Two processes, each growing 2 MiB per minute; the second restarted low.
    a = [(60.0 * m, 1, 100.0 + 2 * m) for m in range(5)]
    b = [(60.0 * m, 2, 10.0 + 2 * m) for m in range(5, 10)]
    assert pooled_slope(a + b) == pytest.approx(2.0)
    # A plain fit over both would see the drop at the restart as shrinking memory.
    flat = [(60.0 * m, 1, 100.0) for m in range(5)] + [(60.0 * m, 2, 10.0)
                                                        for m in range(5, 10)]
    assert pooled_slope(flat) == pytest.approx(0.0)
    assert pooled_slope([(0.0, 1, 5.0), (10.0, 2, 50.0)]) is None  # one sample per pid


def test_memory_verdict_judges_the_second_half_after_warm_up() -> None:
    leak = [(float(t), 11, 100.0 + t / 30) for t in range(0, 600, 10)]  # 2 MiB/min
    flat = [(float(t), 22, 100.0 + (5.0 if t < 300 else 0.0)) for t in range(0, 600, 10)]
    # Restarted at 400 s: with 60 s of warm-up only its samples from 460 s on count.
    restarted = [(float(t), 33, 200.0) for t in range(0, 400, 10)] + [
        (float(t), 34, 50.0 + (t - 400) / 3) for t in range(400, 600, 10)]
    started = {34: 400.0}
    window = judged(restarted, run_s=600, started=started, warmup_s=60)
    assert [t for t, pid, _ in window if pid == 33] == [float(t) for t in range(300, 400, 10)]
    assert [t for t, pid, _ in window if pid == 34] == [float(t) for t in range(460, 600, 10)]
    v = memory_verdict({"leak": leak, "flat": flat, "restarted": restarted}, run_s=600,
                       started=started, warmup_s=60, max_slope=1.0)
    assert v["leak"]["flat"] is False and v["leak"]["slope_mib_per_min"] == pytest.approx(2.0)
    assert v["flat"]["flat"] is True and v["flat"]["slope_mib_per_min"] == pytest.approx(0.0)
    assert v["restarted"]["flat"] is False  # 20 MiB/min within pid 34's judged life
    few = [(float(t), 5, 1.0) for t in range(300, 300 + 10 * (MIN_SAMPLES - 1), 10)]
    assert memory_verdict({"n": few}, run_s=600, started={}, warmup_s=0,
                          max_slope=1.0)["n"] == {"judged_samples": MIN_SAMPLES - 1,
                                                  "slope_mib_per_min": None, "flat": None}


def test_stale_regions_are_mapped_regions_beyond_one_per_live_node() -> None:
    # Three live nodes own regions 1, 2, 3; region 9 belonged to a node that died.
    assert stale_regions({100: {1, 2, 3}, 200: {2, 1}, 300: {3}}) == 0
    assert stale_regions({100: {1, 2, 3, 9}, 200: {2, 1}, 300: {3, 1, 2}}) == 1
    assert stale_regions({100: {1, 9}, 200: {2, 9, 8}, 300: {3}}) == 2
    assert stale_regions({}) == 0


def test_a_process_too_short_lived_is_not_judged() -> None:
    # pid 1 lives the whole run (flat); pid 2 is killed 30 s after its warm-up (growing).
    whole = [(float(t), 1, 50.0) for t in range(0, 600, 10)]
    short = [(float(t), 2, 10.0 + t) for t in range(300, 400, 10)]
    window = judged(whole + short, run_s=600, started={2: 310.0}, warmup_s=60,
                    min_span_s=120)
    assert {pid for _, pid, _ in window} == {1}
    v = memory_verdict({"a": whole, "b": short}, run_s=600, started={2: 310.0}, warmup_s=60,
                       max_slope=1.0, min_span_s=120)
    assert v["a"]["flat"] is True and v["b"] == {"judged_samples": 0, "slope_mib_per_min": None,
                                                 "flat": None}
