from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.sessions_report import (
    Sample,
    TurnRecord,
    compare,
    node_summary,
    overall,
    per_turn,
    plot,
    run_result,
    summary_table,
    turn_table,
)


def rec(session: str, turn: int, prev: int, cached: int | None, ttft: float | None,
        ok: bool = True) -> TurnRecord:
    return TurnRecord(session=session, turn=turn, prompt_tokens=prev + 10, prev_context=prev,
                      cached_tokens=cached, ttft_s=ttft, ok=ok, sent_s=0.0,
                      status=200 if ok else 502)


RECORDS = [
    rec("a", 0, 0, 0, 1.0), rec("b", 0, 0, 0, 2.0),
    # a's cached count past its previous context counts as the whole context
    rec("a", 1, 100, 120, 0.5), rec("b", 1, 100, 50, 1.5),
    rec("a", 2, 200, 200, 0.25), rec("b", 2, 200, None, 0.75),
    rec("c", 2, 300, 0, None, ok=False),
]


def test_per_turn_rows_in_turn_order() -> None:
    rows = per_turn(RECORDS)
    assert [r["turn"] for r in rows] == [0, 1, 2]
    assert [(r["requests"], r["ok"]) for r in rows] == [(2, 2), (2, 2), (3, 2)]
    assert rows[0]["hit_rate"] is None and rows[0]["min_hit"] is None
    assert rows[1]["hit_rate"] == pytest.approx(150 / 200)
    assert rows[1]["min_hit"] == pytest.approx(0.5)
    # an unknown cached count and a failed request are left out of the hit rate
    assert rows[2]["hit_rate"] == pytest.approx(1.0)
    assert rows[1]["ttft_p50_s"] == pytest.approx(1.0)
    assert rows[1]["ttft_p90_s"] == pytest.approx(0.5 + 0.9 * 1.0)
    assert rows[2]["ttft_p50_s"] == pytest.approx(0.5)
    assert rows[0]["prompt_tokens_mean"] == 10


def test_overall_counts_turns_after_the_first() -> None:
    o = overall(RECORDS)
    assert (o["requests"], o["ok"]) == (7, 6)
    assert o["hit_rate"] == pytest.approx((100 + 50 + 200) / 400)
    assert o["min_hit"] == pytest.approx(0.5)
    assert o["share_at_hit_target"] == pytest.approx(2 / 3)
    assert o["ttft_p50_s"] == pytest.approx((0.5 + 0.75) / 2)
    assert o["ttft_p50_all_s"] == pytest.approx((0.75 + 1.0) / 2)


def test_overall_of_nothing_known() -> None:
    o = overall([rec("a", 0, 0, None, None, ok=False)])
    assert o["hit_rate"] is None and o["ttft_p90_s"] is None
    assert o["share_at_hit_target"] is None


def test_compare_is_off_over_on_against_the_targets() -> None:
    on = {"ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "hit_rate": 0.99, "min_hit": 0.96}
    off = {"ttft_p50_s": 1.5, "ttft_p90_s": 3.0, "hit_rate": 0.49, "min_hit": 0.0}
    c = compare(on, off)
    assert c["ttft_p90_off_over_on"] == pytest.approx(1.5)
    assert c["ttft_p50_off_over_on"] == pytest.approx(1.5)
    assert c["hit_rate_on_minus_off"] == pytest.approx(0.5)
    assert c["p90_target_met"] is True and c["hit_target_met"] is True
    miss = compare({**on, "ttft_p90_s": 2.5, "min_hit": 0.9}, off)
    assert miss["p90_target_met"] is False and miss["hit_target_met"] is False
    unknown = compare({**on, "ttft_p90_s": None, "min_hit": None, "hit_rate": None}, off)
    assert unknown["p90_target_met"] is None and unknown["hit_target_met"] is None
    assert unknown["hit_rate_on_minus_off"] is None


SAMPLES = [Sample(t_s=0.0, retained_bytes=0, tier_bytes={"dram": 0, "ssd": 0}),
           Sample(t_s=1.0, retained_bytes=300, tier_bytes={"dram": 10, "ssd": 5},
                  prefetch_blocks={"promoted": 2}),
           Sample(t_s=2.0, retained_bytes=100, tier_bytes={"dram": 10, "ssd": 7},
                  prefetch_blocks={"promoted": 4, "present": 3, "no_room": 1},
                  tier_evictions={"dram": 0, "ssd": 9}, retention_denied=2)]


def test_node_summary() -> None:
    assert node_summary(SAMPLES) == {
        "retained_peak_bytes": 300, "retained_last_bytes": 100,
        "tier_evictions": {"dram": 0, "ssd": 9}, "retention_denied": 2,
        "prefetch_blocks": {"promoted": 4, "present": 3, "no_room": 1}, "promoted_ahead": 4}
    assert node_summary([])["promoted_ahead"] is None


def test_tables_and_plot(tmp_path: Path) -> None:
    runs = {"on": run_result(RECORDS, SAMPLES), "off": run_result(RECORDS[:2], [])}
    lines = turn_table(runs).splitlines()
    assert [ln.split()[:2] for ln in lines[2:]] == [["on", "0"], ["on", "1"], ["on", "2"],
                                                   ["off", "0"]]
    assert "75.0%" in lines[3]
    summary = summary_table(runs).splitlines()
    assert [ln.split()[0] for ln in summary[2:]] == ["on", "off"]
    pytest.importorskip("matplotlib")
    assert plot(tmp_path / "s.png", runs, "t").stat().st_size > 0
