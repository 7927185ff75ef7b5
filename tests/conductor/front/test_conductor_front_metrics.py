"""``conductor.front.front_metrics``: rejection labels and the exposition."""

from __future__ import annotations

from conductor.front.front_metrics import FrontMetrics, reason_label


def test_reason_labels_stay_low_cardinality() -> None:
    assert reason_label("TTFT 2.31 s > SLO 2.00 s") == "ttft_slo"
    assert reason_label("decode TBT 120 ms > SLO 100 ms") == "tbt_slo"
    assert reason_label("decode KV cache full") == "decode_kv_full"
    assert reason_label("something new") == "other"


def test_two_fronts_keep_separate_counts() -> None:
    a, b = FrontMetrics(), FrontMetrics()
    a.requests.labels("completions", "ok").inc()
    a.rejections.labels("ttft_slo").inc(2)
    text = a.render().decode()
    assert 'conductor_requests_total{outcome="ok",route="completions"} 1.0' in text
    assert 'conductor_rejections_total{reason="ttft_slo"} 2.0' in text
    assert "conductor_requests_total{" not in b.render().decode()
