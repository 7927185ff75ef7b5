"""``conductor`` CLI: the --json contract, output files, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conductor.cli import build_parser, main, parse_duration

REPO = Path(__file__).resolve().parents[2]
CONTRACT = {"avg_ttft_s", "p90_ttft_s", "p90_tbt_s", "tail_tbt_s", "slo_attainment",
            "rejected"}
POLICY_NAMES = ["random", "load-balancing", "local-cache-aware", "global-cache-aware"]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    lines = []
    for i in range(40):
        head = i % 3
        n = 1_200 + 300 * (i % 7)
        ids = [head * 100 + j for j in range(n // 512 + 1)]
        lines.append(json.dumps({"timestamp": 500 * i, "input_length": n,
                                 "output_length": 5 + i % 11, "hash_ids": ids}))
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_parse_duration() -> None:
    assert parse_duration("2s") == 2.0
    assert parse_duration("100ms") == pytest.approx(0.1)
    assert parse_duration("250us") == pytest.approx(250e-6)
    assert parse_duration("1.5m") == 90.0
    assert parse_duration("30") == 30.0
    for bad in ("", "fast", "10 h", "-1s", "0ms"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_json_last_line_is_keyed_by_policy(trace: Path, capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    rc = main(["simulate", "--trace", str(trace), "--prefill", "2", "--decode", "2",
               "--compare", "--json", "--out", str(tmp_path / "out"), "--tbt-slo", "200ms",
               "--ttft-slo", "2s"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert list(result) == POLICY_NAMES
    for name in POLICY_NAMES:
        assert set(result[name]) >= CONTRACT, name
        assert result[name]["requests"] == 40
        assert result[name]["tbt_slo_s"] == pytest.approx(0.2)
        assert result[name]["ttft_slo_s"] == 2.0
    for ext in ("md", "json", "png"):
        assert (tmp_path / "out" / f"conductor_compare.{ext}").stat().st_size > 0
    saved = json.loads((tmp_path / "out" / "conductor_compare.json").read_text())
    assert saved["results"] == result


def test_single_policy_with_rejection_and_limit(trace: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--trace", str(trace), "--policy", "load-balancing",
               "--rejection", "predictive", "--limit", "10", "--speed", "4", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(result) == ["load-balancing"]
    assert result["load-balancing"]["requests"] == 10


def test_simulate_help_says_which_tbt_the_slo_uses(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # no line wrap inside the phrases below
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "tail-mean TBT: the mean of the longest 10% (at least one) of its token" in text
    assert "--tbt-statistic mean: its mean interval" in text


def test_tbt_statistic_picks_the_slo_check(trace: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    got = {}
    for stat in ("tail-mean", "mean"):
        assert main(["simulate", "--trace", str(trace), "--tbt-statistic", stat,
                     "--kv-stream-layers", "1", "--json"]) == 0
        got[stat] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])[
            "global-cache-aware"]
    tail, mean = got["tail-mean"], got["mean"]
    assert (tail["tbt_slo_statistic"], mean["tbt_slo_statistic"]) == ("tail-mean", "mean")
    # Same run, same per-request figures; only the SLO check differs.
    assert tail["avg_tbt_s"] == mean["avg_tbt_s"] and tail["tail_tbt_s"] == mean["tail_tbt_s"]
    assert tail["tail_tbt_s"] > tail["avg_tbt_s"]
    assert tail["effective_requests"] <= mean["effective_requests"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "conductor", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60)


@pytest.mark.parametrize("args", [
    ["simulate"],                                             # --trace missing
    ["simulate", "--trace", "x", "--policy", "fastest"],
    ["simulate", "--trace", "x", "--tbt-slo", "soon"],
    ["simulate", "--trace", "x", "--prefill", "0"],
    ["simulate", "--trace", "x", "--speed", "-2"],
    ["simulate", "--trace", "x", "--tbt-statistic", "median"],
    ["simulate", "--trace", "x", "--kv-stream-layers", "0"],
    ["capacity"],
    ["capacity", "--trace", "x", "--tbt-slo", "100ms,soon"],
    ["capacity", "--trace", "x", "--instances", "0"],
    ["teleport"],
    ["serve", "--session-ttl", "-5s"],
    ["serve", "--session-ttl", "8d"],
    ["serve", "--session-ttl", "700000"],                     # past 7 days
])
def test_bad_flags_exit_2_without_traceback(args: list[str]) -> None:
    p = run_cli(*args)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and "error:" in p.stderr


def test_session_ttl_is_a_duration_or_zero_for_off() -> None:
    def ttl(*args: str) -> float:
        return build_parser().parse_args(["serve", *args]).session_ttl

    assert ttl() == 300.0
    assert [ttl("--session-ttl", t) for t in ("0", "0s", "0.0", "90s", "2m", "45")] == [
        0.0, 0.0, 0.0, 90.0, 120.0, 45.0]


def test_missing_trace_is_one_line_exit_1(tmp_path: Path) -> None:
    p = run_cli("simulate", "--trace", str(tmp_path / "nope.jsonl"))
    assert p.returncode == 1
    assert p.stderr.splitlines() == [
        f"conductor simulate: error: No such file or directory: {tmp_path / 'nope.jsonl'}"]


def test_malformed_trace_is_one_line_exit_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
                   "{oops\n")
    p = run_cli("simulate", "--trace", str(bad))
    assert p.returncode == 1
    assert len(p.stderr.splitlines()) == 1
    assert p.stderr.startswith(f"conductor simulate: error: {bad}:2: not valid JSON")
