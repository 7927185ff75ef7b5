"""benchmarks.connector_cost's arithmetic: stored block sizes, the engine's metric sums,
the miss verdict (the servers themselves run only in the benchmark)."""

from __future__ import annotations

import pytest

from benchmarks.connector_cost import (
    ITL_COUNT,
    ITL_SUM,
    TTFT_SUM,
    metric_sums,
    miss_ratios,
    value_bytes_of,
)
from benchmarks.sessions import vllm_bytes_per_token
from kvstore.integrations.vllm.blocks import HEADER_BYTES


@pytest.mark.parametrize("shape", [(512, 4), (128, 2), (1024, 3)])
def test_a_stored_block_is_its_header_and_32_tokens_of_kv(shape: tuple[int, int]) -> None:
    assert value_bytes_of(*shape) == HEADER_BYTES + 32 * vllm_bytes_per_token(shape)


def test_metric_sums_add_label_sets_and_skip_others() -> None:
    text = "\n".join([
        "# HELP vllm:time_to_first_token_seconds ...",
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5',
        'vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.25',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 9.0',
        'vllm:inter_token_latency_seconds_sum{engine="0"} 0.5',
        'vllm:inter_token_latency_seconds_count{engine="0"} 50.0',
        'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01"} 7.0'])
    assert metric_sums(text) == {TTFT_SUM: 1.75, ITL_SUM: 0.5, ITL_COUNT: 50.0}
    assert metric_sums("") == {TTFT_SUM: 0.0, ITL_SUM: 0.0, ITL_COUNT: 0.0}


def cell(ttft: float, rate: float) -> dict[str, float]:
    return {"ttft_p50_s": ttft, "req_per_s": rate}


def test_the_miss_verdict_is_on_the_median_of_per_round_ratios() -> None:
    rounds = [{"plain": cell(1.0, 2.0), "connector": cell(1.05, 1.9),
               "connector+hint": cell(1.3, 1.0)},
              {"plain": cell(2.0, 1.0), "connector": cell(2.4, 1.0),
               "connector+hint": cell(2.0, 1.0)},
              {"plain": cell(1.0, 1.0), "connector": cell(1.0, 0.95),
               "connector+hint": cell(1.2, 1.0)}]
    r = miss_ratios(rounds)
    assert r["connector"]["ttft_p50_rounds"] == [1.05, 1.2, 1.0]
    assert r["connector"]["ttft_p50"] == 1.05 and r["connector"]["req_per_s"] == 0.95
    assert r["connector"]["within_10pct"]
    assert r["connector+hint"]["ttft_p50"] == 1.2 and not r["connector+hint"]["within_10pct"]
