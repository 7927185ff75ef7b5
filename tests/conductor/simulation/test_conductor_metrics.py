"""conductor.simulation.metrics: the tail-mean TBT (FAST'25 section 5.1) and the SLO check, exactly.

Intervals are dyadic fractions (exact in binary floating point), so the expected means
are exact too.
"""

from __future__ import annotations

import pytest

from conductor.scheduling.types import RequestId, Slo
from conductor.simulation.metrics import (
    MEAN,
    TAIL_MEAN,
    RequestRecord,
    summarize,
    tail_k,
    tail_mean_s,
    token_interval_stats,
)


@pytest.mark.parametrize(("n", "k"), [(0, 0), (1, 1), (2, 1), (9, 1), (10, 1), (11, 2),
                                      (20, 2), (21, 3), (30, 3), (31, 4), (100, 10),
                                      (101, 11), (1999, 200)])
def test_tail_k_is_max_1_ceil_a_tenth(n: int, k: int) -> None:
    assert tail_k(n) == k


def test_tail_k_rejects_a_negative_count() -> None:
    with pytest.raises(ValueError, match="n_intervals"):
        tail_k(-1)


def test_tail_mean_of_short_outputs_is_the_longest_interval() -> None:
    assert tail_mean_s([]) == 0.0
    assert tail_mean_s([0.25]) == 0.25
    assert tail_mean_s([0.125, 0.5, 0.25]) == 0.5
    assert tail_mean_s([0.0625] * 9 + [1.5]) == 1.5  # 10 intervals: still one


def test_tail_mean_averages_the_longest_tenth() -> None:
    # 11 intervals: k = 2, the two longest are 1.0 and 0.5.
    gaps = [0.0625] * 9 + [0.5, 1.0]
    assert tail_mean_s(gaps) == 0.75
    # 30 intervals (0.1 * 30 is 3.0000000000000004 in floats): k = 3, not 4.
    gaps = [0.03125] * 26 + [0.25, 0.5, 0.75, 1.0]
    assert tail_mean_s(gaps) == 0.75
    # Ties: 21 intervals, k = 3, the three longest are all 0.5.
    assert tail_mean_s([0.5] * 4 + [0.125] * 17) == 0.5
    # The order of the intervals does not matter.
    assert tail_mean_s([1.0, 0.0625, 0.5] + [0.0625] * 8) == 0.75


def test_token_interval_stats_from_token_times() -> None:
    # First token at 1.0, decoded tokens at 1.5, 1.625, 1.75 -> intervals 0.5, 0.125, 0.125.
    assert token_interval_stats(1.0, [1.5, 1.625, 1.75]) == (0.5, 0.5)
    assert token_interval_stats(1.0, []) == (0.0, 0.0)
    # 11 tokens after the first: one stall of 1.0 and one of 0.5 among 0.0625 gaps.
    times, t = [], 2.0
    for gap in [0.0625] * 4 + [1.0] + [0.0625] * 4 + [0.5, 0.0625]:
        t += gap
        times.append(t)
    assert token_interval_stats(2.0, times) == (0.75, 1.0)


def rec(i: int, *, ttft: float, output: int, finish: float, tail: float | None
        ) -> RequestRecord:
    return RequestRecord(id=RequestId(i), arrival_s=0.0, prompt_tokens=100,
                         output_tokens=output, first_token_s=ttft, finish_s=finish,
                         tail_tbt_s=tail)


def test_slo_check_uses_the_tail_mean_and_keeps_the_mean_for_comparison() -> None:
    # a: 11 tokens in 1.0 s after the first -> mean 0.1; its tail mean 0.375 (one stall).
    # b: 3 tokens, mean 0.0625, tail 0.125. c: one token (no interval), tail 0.
    a = rec(0, ttft=1.0, output=11, finish=2.0, tail=0.375)
    b = rec(1, ttft=1.0, output=3, finish=1.125, tail=0.125)
    c = rec(2, ttft=1.0, output=1, finish=1.0, tail=0.0)
    slo = Slo(ttft_s=2.0, tbt_s=0.25)
    assert [x.meets(slo) for x in (a, b, c)] == [False, True, True]
    assert [x.meets(slo, MEAN) for x in (a, b, c)] == [True, True, True]
    tail = summarize([a, b, c], slo)
    assert (tail["effective_requests"], tail["tbt_slo_statistic"]) == (2, TAIL_MEAN)
    assert tail["tail_tbt_s"] == 0.25  # mean of 0.375 and 0.125 (multi-token requests)
    assert tail["avg_tbt_s"] == pytest.approx(0.08125)  # mean TBT keeps its meaning
    mean = summarize([a, b, c], slo, tbt_statistic=MEAN)
    assert (mean["effective_requests"], mean["tbt_slo_statistic"]) == (3, MEAN)


def test_tail_check_without_token_times_is_an_error() -> None:
    a = rec(0, ttft=1.0, output=11, finish=2.0, tail=None)
    with pytest.raises(ValueError, match="no token times"):
        a.meets(Slo())
    assert a.meets(Slo(), MEAN)
    with pytest.raises(ValueError, match="unknown TBT statistic"):
        a.meets(Slo(), "p90")
