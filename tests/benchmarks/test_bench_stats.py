"""Exact tests of the benchmarks' shared statistics, tables and result plumbing.

No timing is asserted anywhere: the figures a benchmark reports depend on the
machine; the definitions they are computed with must not.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from benchmarks import api_bench, peers
from benchmarks.stats import (
    CellStats,
    Panel,
    Round,
    format_number,
    format_table,
    median,
    paired_median_ratio,
    percentile,
    plot_panels,
    ratio,
    size_label,
    verdict,
    write_json,
)

# ---- percentiles and medians ---------------------------------------------------------------


def test_percentile_interpolates_between_closest_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 25) == 1.75
    assert percentile(xs, 75) == 3.25


def test_percentile_p99_of_one_to_hundred() -> None:
    xs = [float(i) for i in range(1, 101)]
    # rank 0.99 * 99 = 98.01: between 99 and 100
    assert percentile(xs, 99) == pytest.approx(99.01, abs=1e-12)
    assert percentile(xs, 50) == 50.5


def test_percentile_matches_numpy_linear() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_of_one_sample_is_that_sample() -> None:
    assert percentile([3.5], 0) == percentile([3.5], 99) == 3.5


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        percentile([1.0], -1)


def test_median_odd_and_even() -> None:
    assert median([5.0, 1.0, 3.0]) == 3.0
    assert median([1.0, 2.0, 3.0, 10.0]) == 2.5


# ---- ratios and verdicts -------------------------------------------------------------------


def test_ratio_known_and_unknown() -> None:
    assert ratio(6.0, 3.0) == 2.0
    assert ratio(None, 3.0) is None
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0.0) is None
    assert ratio(3.0, -1.0) is None
    assert ratio(math.nan, 1.0) is None
    assert ratio(0.0, 2.0) == 0.0


def test_paired_median_ratio_pairs_rounds() -> None:
    # per-round ratios 2, 2, 3 -> median 2 (a ratio of medians would be 4 / 2 = 2 too,
    # so also check a case where they differ)
    assert paired_median_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 2.0]) == 2.0
    # rounds: 10/1, 1/10, 5/5 -> ratios 10, 0.1, 1 -> median 1;
    # a ratio of medians would be 5 / 5 = 1 as well, but here: 10/1, 2/10, 3/1
    assert paired_median_ratio([10.0, 2.0, 3.0], [1.0, 10.0, 1.0]) == 3.0


def test_paired_median_ratio_skips_unknown_rounds() -> None:
    assert paired_median_ratio([1.0, None, 4.0], [1.0, 1.0, 2.0]) == 1.5
    assert paired_median_ratio([1.0, 2.0], [0.0, None]) is None
    assert paired_median_ratio([], []) is None


def test_paired_median_ratio_rejects_unpaired() -> None:
    with pytest.raises(ValueError):
        paired_median_ratio([1.0, 2.0], [1.0])


def test_verdict_threshold_is_inclusive() -> None:
    assert verdict(0.8, 0.8) == "pass"
    assert verdict(0.7999, 0.8) == "miss"
    assert verdict(None, 0.8) == "n/a"


# ---- rounds and cells ----------------------------------------------------------------------


def test_round_throughput() -> None:
    r = Round(ops=4, seconds=2.0, nbytes=1_000_000)
    assert r.ops_per_s == 2.0
    assert r.gbps == 0.002
    assert math.isnan(Round(ops=0, seconds=0.0, nbytes=1).ops_per_s)


def test_cell_stats_summary_is_median_over_rounds_and_pooled_latency() -> None:
    cs = CellStats(nbytes=500_000_000)
    cs.add_round([0.25, 0.25])  # 2 ops in 0.5 s: 4 ops/s
    cs.add_round([0.5, 0.5])  # 2 ops/s
    cs.add_round([0.125] * 4)  # 8 ops/s
    s = cs.summary()
    assert cs.round_ops_per_s() == [4.0, 2.0, 8.0]
    assert s["ops_per_s"] == 4.0
    assert s["gbps"] == 2.0
    assert s["n"] == 8 and s["rounds"] == 3
    # pooled latencies: 0.125 x4, 0.25 x2, 0.5 x2 -> p50 between ranks 3 and 4
    assert s["p50_ms"] == pytest.approx(187.5)
    assert s["p99_ms"] == pytest.approx(500.0)


def test_cell_stats_empty_summary_is_unknown() -> None:
    s = CellStats(nbytes=10).summary()
    assert s["ops_per_s"] is None and s["gbps"] is None and s["n"] == 0


# ---- formatting ----------------------------------------------------------------------------


def test_size_label() -> None:
    assert size_label(100) == "100 B"
    assert size_label(64 << 10) == "64 KiB"
    assert size_label(1 << 20) == "1 MiB"
    assert size_label(1536 << 10) == "1.5 MiB"
    assert size_label(16 << 20) == "16 MiB"
    assert size_label(1 << 30) == "1 GiB"


def test_format_number() -> None:
    assert format_number(None) == "-"
    assert format_number(math.nan) == "-"
    assert format_number(2.5) == "2.50"
    assert format_number(0.1234) == "0.12"
    assert format_number(0.1234, 3) == "0.123"
    assert format_number(12345.0) == "12,345"
    assert format_number(999.994) == "999.99"


def test_format_table_exact() -> None:
    out = format_table(["a", "bb"], [["x", 1.5], ["yyy", None]])
    assert out == "a      bb\n---  ----\nx    1.50\nyyy     -"


def test_format_table_custom_alignment_strips_trailing_space() -> None:
    out = format_table(["name", "v", "note"], [["k", 3, "ok"], ["long", 12, ""]],
                       align="lrl")
    assert out.splitlines() == [
        "name   v  note",
        "----  --  ----",
        "k      3  ok",
        "long  12",
    ]


def test_format_table_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError):
        format_table(["a", "b"], [["x"]])
    with pytest.raises(ValueError):
        format_table(["a", "b"], [["x", "y"]], align="l")


# ---- output --------------------------------------------------------------------------------


def test_write_json_replaces_non_finite_with_null(tmp_path) -> None:
    p = write_json(tmp_path / "sub" / "r.json",
                   {"a": math.nan, "b": (1.0, math.inf), "c": {"d": 2}, 3: "k"})
    assert json.loads(p.read_text()) == {"a": None, "b": [1.0, None], "c": {"d": 2}, "3": "k"}
    assert [f.name for f in p.parent.iterdir()] == ["r.json"]  # no temporary left


def test_write_json_numpy_scalars(tmp_path) -> None:
    np = pytest.importorskip("numpy")
    p = write_json(tmp_path / "r.json", {"i": np.int64(3), "f": np.float32(0.5)})
    assert json.loads(p.read_text()) == {"i": 3, "f": 0.5}


def test_plot_panels_writes_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    panels = [
        Panel("lines", [64, 1024], {"a": [1.0, 2.0], "b": [None, 3.0]}, logx=True, logy=True,
              xticklabels=["64 KiB", "1 MiB"]),
        Panel("bars", [0, 1], {"r": [0.5, 1.5]}, kind="bars", horizontal=True,
              xticklabels=["x", "y"], hlines={"needed": 1.0}),
        Panel("vbars", [0, 1], {"r": [0.5, None]}, kind="bars", hlines={"t": 1.0}),
    ]
    p = plot_panels(tmp_path / "p.png", panels, title="t")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        plot_panels(tmp_path / "q.png", [Panel("?", [0], {"a": [1.0]}, kind="pie")])


# ---- api bench plumbing (no peers, no timing) ----------------------------------------------


def _cell(system: str, op: str, group: str, rounds: list[float]) -> api_bench.Cell:
    c = api_bench.Cell(system, op, group, 1 << 20, lambda i: None)
    for ops_per_s in rounds:
        c.stats.add_round([1.0 / ops_per_s])  # one op per round: ops/s exactly as given
    return c


def test_run_round_bounds_and_untimed_hooks() -> None:
    calls: list[tuple[str, int]] = []
    cell = api_bench.Cell("s", "put", "1", 1 << 20, lambda i: calls.append(("run", i)),
                          begin=lambda n: calls.append(("begin", n)),
                          end=lambda n: calls.append(("end", n)))
    # A time bound already passed stops at min_ops.
    s = api_bench.Settings(rounds=1, cell_seconds=0.0, min_ops=3, max_ops=100,
                           max_round_bytes=10 << 20, warmup_ops=1)
    lat = api_bench.run_round(cell, s)
    assert len(lat) == 3
    assert calls == [("begin", 10), ("run", 0), ("run", 1), ("run", 2), ("end", 3)]
    # A time bound far away stops at the op limit (here the byte bound: 10 MiB / 1 MiB).
    calls.clear()
    s = api_bench.Settings(rounds=1, cell_seconds=3600.0, min_ops=1, max_ops=100,
                           max_round_bytes=10 << 20, warmup_ops=1)
    assert len(api_bench.run_round(cell, s)) == 10
    assert calls[0] == ("begin", 10) and calls[-1] == ("end", 10)
    assert len(cell.stats.rounds) == 2
    api_bench.run_round(cell, s, record=False, ops=2)
    assert len(cell.stats.rounds) == 2  # warm-up rounds are not recorded


def test_run_round_calls_end_after_a_failing_op() -> None:
    ended: list[int] = []

    def run(i: int) -> None:
        if i == 2:
            raise api_bench.BenchError("wrong answer")

    cell = api_bench.Cell("s", "put", "1", 1, run, end=ended.append)
    with pytest.raises(api_bench.BenchError):
        api_bench.run_round(cell, api_bench.QUICK)
    assert ended == [2]  # the keys put so far are still cleaned up


def test_op_limit() -> None:
    s = api_bench.Settings(rounds=1, cell_seconds=1.0, min_ops=3, max_ops=1000,
                           max_round_bytes=64 << 20, warmup_ops=1)
    assert s.op_limit(64 << 10) == 1000
    assert s.op_limit(1 << 20) == 64
    assert s.op_limit(64 << 20) == 3  # never below min_ops


def test_targets_cover_the_issue() -> None:
    ts = {t.label: t for t in api_bench.targets_for(api_bench.SIZES)}
    t = ts["remote put 1 MiB vs raw TCP"]
    assert (t.num, t.den, t.need) == ("kvstore-tcp/put/1048576", "raw-tcp/put/1048576", 0.8)
    t = ts["remote get 16 MiB vs Redis"]
    assert (t.num, t.den, t.need) == ("kvstore-tcp/get/16777216", "redis/get/16777216", 1.5)
    t = ts["remote get 64 KiB vs Redis GET"]
    assert (t.den, t.need) == ("redis/get/65536", 1.0)
    t = ts["remote get_batch 64 x 64 KiB vs Redis pipelined GETs"]
    assert (t.num, t.den, t.need) == ("kvstore-tcp/get_batch/batch", "redis/pipeline_get/batch",
                                      1.0)
    t = ts["same-host get_into 4 MiB vs memcpy"]
    assert (t.num, t.den, t.need) == ("kvstore-shm/get_into/4194304", "memcpy/copy/4194304", 0.5)
    assert not any("64 KiB vs raw" in label for label in ts)  # >= 1 MiB only
    assert len(ts) == 3 * 6 + 2 + 4 + 1
    assert len(api_bench.targets_for(api_bench.SIZES, batch=False)) == 3 * 6 + 2 + 1


def test_build_and_format_results() -> None:
    g = str(1 << 20)
    cells = [
        _cell("kvstore-tcp", "get", g, [90.0, 100.0, 200.0]),
        _cell("redis", "get", g, [50.0, 50.0, 50.0]),
        _cell("raw-tcp", "get_into", g, [100.0, 100.0, 100.0]),
        _cell("memcpy", "copy", g, [1000.0, 1000.0, 1000.0]),
    ]
    res = api_bench.build_results([(g, cells)], [1 << 20], api_bench.QUICK, quick=True,
                                  info={}, errors={"kvstore-grpc": "off"}, elapsed=1.0)
    rows = {r["id"]: r for r in res["cells"]}
    kv = rows[f"kvstore-tcp/get/{g}"]
    assert kv["ops_per_s"] == 100.0
    assert kv["x_redis"] == 2.0  # per-round 1.8, 2, 4
    assert kv["x_raw"] == 1.0  # per-round 0.9, 1, 2
    assert kv["x_memcpy"] == 0.1
    assert rows[f"redis/get/{g}"]["x_redis"] is None  # not against itself
    assert rows[f"redis/get/{g}"]["x_raw"] == 0.5
    verdicts = {t["target"]: (t["ratio"], t["verdict"]) for t in res["targets"]}
    assert verdicts["remote get 1 MiB vs raw TCP"] == (1.0, "pass")
    assert verdicts["remote get 1 MiB vs Redis"] == (2.0, "pass")
    assert verdicts["remote put 1 MiB vs Redis"] == (None, "n/a")  # no put cells
    text = api_bench.format_results(res)
    assert "left out: kvstore-grpc: off" in text
    line = next(x for x in text.splitlines() if "kvstore-tcp" in x)
    # p50 of 1/90, 1/100, 1/200 s is 10 ms; p99 is 98% of the way from 10 to 11.1 ms
    # The CPU columns read "-": these cells measured no CPU time.
    assert line.split() == ["1", "MiB", "kvstore-tcp", "get", "100.00", "0.10", "10.00",
                            "11.09", "2.00", "1.00", "0.10", "-", "-"]
    assert json.dumps(res)  # plain JSON types only


def test_parse_sizes() -> None:
    assert api_bench._parse_sizes("64KiB, 1MiB,4m") == (64 << 10, 1 << 20, 4 << 20)
    with pytest.raises(Exception, match="size"):
        api_bench._parse_sizes("lots")


# ---- the raw TCP peer: bytes, not speed ----------------------------------------------------


def test_raw_tcp_peer_round_trips_slots() -> None:
    with peers.start_raw_tcp_peer() as peer, peers.RawTcpClient(peer.host, peer.port) as cl:
        a, b = bytes(range(256)) * 16, bytes(reversed(range(256))) * 16
        cl.put(memoryview(a), 0)
        cl.put(memoryview(b), 1)
        out = bytearray(len(a))
        assert cl.get_into(memoryview(out), len(a), 1) == len(a)
        assert out == b
        bufs = [bytearray(len(a)) for _ in range(2)]
        cl.get_many_into([memoryview(x) for x in bufs], len(a))
        assert bufs == [bytearray(a), bytearray(b)]
        pid = peer.pid
    assert peer.proc.returncode == 0  # stopped by SIGTERM to its own PID, cleanly
    assert pid > 0


def test_measure_group_drops_a_failing_cell_and_keeps_the_others(capsys) -> None:
    def boom(i: int) -> None:
        if i == 1:
            raise api_bench.BenchError("wrong answer")

    bad = api_bench.Cell("kvstore-tcp", "get", "1", 1, boom)
    good = api_bench.Cell("memcpy", "copy", "1", 1, lambda i: None)
    s = api_bench.Settings(rounds=3, cell_seconds=0.0, min_ops=2, max_ops=2,
                           max_round_bytes=1 << 20, warmup_ops=1)
    api_bench.measure_group([bad, good], s, random.Random(0), "t")
    assert bad.error == "BenchError: wrong answer"
    assert bad.stats.rounds == [] and len(good.stats.rounds) == 3
    assert "kvstore-tcp/get/1 failed" in capsys.readouterr().err


def test_progress_draws_nothing_when_stderr_is_not_a_terminal(capsys) -> None:
    from benchmarks.stats import progress

    bar = progress(3, "cells", unit="cell")
    for _ in range(3):
        bar.update()
    bar.close()
    assert capsys.readouterr().err == ""
