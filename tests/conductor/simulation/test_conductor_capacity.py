"""conductor.simulation.capacity: the bisection, the capacity search on a tiny trace whose answer is
worked out by hand, and the ``conductor capacity --json`` contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conductor.cli import main
from conductor.scheduling.costs import PolyCostModel
from conductor.simulation.capacity import (
    CapacitySettings,
    base_rate,
    bisect_speed,
    default_splits,
    measure_capacity,
    parse_split,
    threshold_key,
)
from conductor.simulation.trace import TraceRequest

# Every prefill takes exactly 1 s (no per-token cost), transfers and decode are ~free.
ONE_SECOND = PolyCostModel(kv_bytes_per_token=1, p_fixed=1.0, p_token=0.0,
                           net_bytes_per_s=1e12, d_fixed=0.001)


def test_bisect_speed_on_a_known_step() -> None:
    # Attainment 1 up to 1.2307..., 0 above: the midpoints from [0.5, 8] are 4.25, 2.375,
    # 1.4375, 0.96875, 1.203125, 1.3203125, 1.26171875, 1.232421875; the interval is then
    # 0.029 wide (< 0.05) and its low end is the answer.
    asked: list[float] = []

    def attain(s: float) -> float:
        asked.append(s)
        return 1.0 if s <= 1.0 / 0.8125 else 0.0

    assert bisect_speed(attain, 0.9, 0.5, 8.0, 0.05) == 1.203125

    def attain_below(s: float) -> float:
        asked.append(s)
        return 1.0 if s <= 0.2 else 0.0

    assert asked == [0.5, 8.0, 4.25, 2.375, 1.4375, 0.96875, 1.203125, 1.3203125,
                     1.26171875, 1.232421875]
    assert bisect_speed(lambda s: 0.0, 0.9, 0.5, 8.0, 0.05) == 0.0
    # Below the range: 0.5 misses, 0.25 misses, 0.125 meets; then bisect [0.125, 0.25]:
    # 0.1875 meets, 0.21875 misses (0.03 wide) -> 0.1875.
    asked.clear()
    assert bisect_speed(attain_below, 0.9, 0.5, 8.0, 0.05) == 0.1875
    assert asked == [0.5, 0.25, 0.125, 0.1875, 0.21875]
    assert bisect_speed(lambda s: 1.0, 0.9, 0.5, 8.0, 0.05) == 8.0
    with pytest.raises(ValueError):
        bisect_speed(attain, 0.9, 2.0, 1.0, 0.05)


def test_splits_keys_and_rate() -> None:
    assert default_splits(16) == [8, 10, 12, 14]
    assert default_splits(2) == [1]
    assert parse_split(" 12P+4D ") == (12, 4) and parse_split("1p+1d") == (1, 1)
    for bad in ("12+4", "0P+4D", "P+D"):
        with pytest.raises(ValueError):
            parse_split(bad)
    assert [threshold_key(t) for t in (0.1, 0.2, 0.3, 0.05, 1.0)] == [
        "100ms", "200ms", "300ms", "50ms", "1000ms"]
    with pytest.raises(ValueError, match="at least 2 requests"):
        base_rate([TraceRequest(timestamp_ms=0, input_length=1, output_length=1, hash_ids=())])


def tiny_trace() -> list[TraceRequest]:
    """10 one-token requests, one per second, no shared prefix: 10 / 9 req/s at 1x."""
    return [TraceRequest(timestamp_ms=1000 * i, input_length=512, output_length=1,
                         hash_ids=(i,)) for i in range(10)]


def test_capacity_search_on_a_tiny_trace_is_the_hand_computed_answer() -> None:
    # TTFT SLO 2.5 s, 90% must meet it: at most one of the 10 requests may miss.
    # At speed s (arrivals a = 1/s apart), with 1 s prefills:
    # * disaggregated 1P+1D: one prefill queue; request i's TTFT = 1 + i (1 - a), so
    #   request 8 misses once a < 0.8125, s > 1.2307...: bisection gives 1.203125 (above);
    # * colocated, 2 instances: requests alternate; requests 8 and 9 both wait 4 s of
    #   prefills and arrive at 8a / 9a - a on their instance: TTFT 5 - 8a, two misses
    #   once a < 0.3125 (s > 3.2). Bisection: 4.25 no, 2.375 yes, 3.3125 no, 2.84375 yes,
    #   3.078125 yes, 3.1953125 yes, 3.25390625 no, 3.224609375 no -> 3.1953125.
    #   Chunked prefill (chunk 2048 >= the prompt) is the same schedule.
    settings = CapacitySettings(instances=2, tbt_slos_s=(0.1,), ttft_slo_s=2.5,
                                kv_capacity_tokens=10**6, cache_blocks=16,
                                colocated_cache_blocks=16)
    result = measure_capacity(tiny_trace(), ONE_SECOND, settings)
    assert result.base_rps == 10 / 9.0
    assert result.speeds == {"colocated": {"100ms": 3.1953125},
                             "colocated_chunked": {"100ms": 3.1953125},
                             "1P+1D": {"100ms": 1.203125}}
    c = result.contract()
    assert c == {"tbt_definition": "tail-mean: mean of the longest max(1, ceil(n/10)) of a "
                 "request's n token intervals (FAST'25 section 5.1)",
                 "thresholds": {"100ms": {
                     "colocated_req_s": 3.1953125 * 10 / 9.0,
                     "colocated_chunked_req_s": 3.1953125 * 10 / 9.0,
                     "disaggregated_req_s": 1.203125 * 10 / 9.0,
                     "best_split": "1P+1D",
                     "gain": (1.203125 * 10 / 9.0) / (3.1953125 * 10 / 9.0) - 1}}}


def test_capacity_judges_tbt_by_the_chosen_statistic_and_the_kv_overlap() -> None:
    # Two lone requests 20 s apart (2.5 s at 8x: they never meet), 11 output tokens, 1 ms
    # decode steps; the 512-byte KV takes 0.5 s to move. Disaggregated without overlap
    # (1 layer): intervals 0.501 then 9 x 0.001 -> tail 0.501 (misses 100 ms), mean 0.051
    # (meets). Over 80 layers the KV lands 6.25 ms after the prefill: tail 7.25 ms, meets.
    # Colocated has no transfer: 1 ms intervals. Meeting everywhere is the ceiling 8x,
    # meeting at no speed is 0.
    slow = PolyCostModel(kv_bytes_per_token=1, p_fixed=1.0, p_token=0.0,
                         net_bytes_per_s=1024, d_fixed=0.001)
    trace = [TraceRequest(timestamp_ms=0, input_length=512, output_length=11, hash_ids=(0,)),
             TraceRequest(timestamp_ms=20_000, input_length=512, output_length=11,
                          hash_ids=(1,))]
    want = {("tail-mean", 1): 0.0, ("mean", 1): 8.0, ("tail-mean", 80): 8.0, ("mean", 80): 8.0}
    for (stat, layers), disagg in want.items():
        got = measure_capacity(trace, slow, CapacitySettings(
            instances=2, tbt_slos_s=(0.1,), kv_capacity_tokens=10**6, cache_blocks=16,
            colocated_cache_blocks=16, tbt_statistic=stat, kv_stream_layers=layers))
        assert got.speeds == {"colocated": {"100ms": 8.0}, "colocated_chunked": {"100ms": 8.0},
                              "1P+1D": {"100ms": disagg}}, (stat, layers)


def write_trace(path: Path, rows: list[TraceRequest]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length":
                                        r.input_length, "output_length": r.output_length,
                                        "hash_ids": list(r.hash_ids)}) + "\n" for r in rows))
    return path


def test_cli_json_last_line_is_the_contract(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rows = [TraceRequest(timestamp_ms=250 * i, input_length=2_000 + 700 * (i % 5),
                         output_length=2 + 7 * (i % 4), hash_ids=tuple(range(i % 3 * 10,
                                                                             i % 3 * 10 + 5)))
            for i in range(30)]
    path = write_trace(tmp_path / "t.jsonl", rows)
    rc = main(["capacity", "--trace", str(path), "--tbt-slo", "100ms,300ms", "--instances",
               "4", "--splits", "2P+2D,3P+1D", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out) == ["tbt_definition", "thresholds"]
    assert out["tbt_definition"].startswith("tail-mean: ")
    assert list(out["thresholds"]) == ["100ms", "300ms"]
    for v in out["thresholds"].values():
        assert list(v) == ["colocated_req_s", "colocated_chunked_req_s",
                           "disaggregated_req_s", "best_split", "gain"]
        assert v["best_split"] in ("2P+2D", "3P+1D")
        assert v["gain"] == v["disaggregated_req_s"] / max(
            v["colocated_req_s"], v["colocated_chunked_req_s"]) - 1
    # The same search through the library gives the same figures.
    from conductor.simulation.capacity import CapacitySettings as S
    again = measure_capacity(rows, PolyCostModel.a800_llama2_70b(), S(
        instances=4, tbt_slos_s=(0.1, 0.3), splits=(2, 3))).contract()
    assert again == out


@pytest.mark.parametrize(("args", "msg"), [
    (["--splits", "3P+3D"], "split 3P+3D is not 4 instances"),
    (["--splits", "4+0"], "invalid split"),
    (["--attainment", "1.5"], "--attainment must be <= 1"),
])
def test_cli_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   args: list[str], msg: str) -> None:
    path = write_trace(tmp_path / "t.jsonl", tiny_trace())
    assert main(["capacity", "--trace", str(path), "--instances", "4", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("conductor capacity: error: ") and msg in err[0]
