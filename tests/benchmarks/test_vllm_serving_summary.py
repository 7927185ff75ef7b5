"""The serving benchmark's summary: TTFT split by whether a request was first of its group."""

from __future__ import annotations

import pytest

from benchmarks.serving_workloads import prefix_groups
from benchmarks.vllm_serving import first_of_group, split_ttft


def test_the_first_question_of_each_document_in_a_round_is_first_of_its_group() -> None:
    w = prefix_groups(documents=3, questions=2, doc_tokens=20, question_tokens=4, output=1,
                      interval_s=0.1)
    assert first_of_group(w) == [True, True, True, False, False, False]


def test_ttft_percentiles_are_split_by_first_of_group_per_round_leaving_out_failures() -> None:
    w = prefix_groups(documents=2, questions=2, doc_tokens=20, question_tokens=4, output=1,
                      interval_s=0.1)
    ok = [{"ok": True, "ttft_s": t} for t in (1.0, 2.0, 0.1, 0.2)]
    second = [{"ok": True, "ttft_s": 3.0}, {"ok": False}, {"ok": True, "ttft_s": 0.3},
              {"ok": True, "ttft_s": None}]
    out = split_ttft([w, w], [ok, second])
    # first: 1.0, 2.0, 3.0; rest: 0.1, 0.2, 0.3 (linear interpolation between ranks)
    assert out == pytest.approx({"ttft_first_50_s": 2.0, "ttft_first_90_s": 2.8,
                                 "ttft_rest_50_s": 0.2, "ttft_rest_90_s": 0.28})
