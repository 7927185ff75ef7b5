from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sessions import (
    BACKGROUND_BLOCKS,
    MIB,
    VLLM_BYTES_PER_TOKEN,
    main,
    node_size,
    parse_args,
    spec_of,
    toy_bytes_per_token,
    vllm_bytes_per_token,
    with_background,
)
from benchmarks.sessions_workload import nominal_duration_s


def test_quick_defaults_and_explicit_flags() -> None:
    a = parse_args(["--quick"])
    assert (a.sessions, a.turns, a.backends, a.pause) == (4, 5, "toy", "1,3")
    b = parse_args(["--quick", "--turns", "3", "--backends", "toy,vllm"])
    assert (b.turns, b.backends) == (3, "toy,vllm")
    assert parse_args([]).backends == "toy,vllm"
    spec = spec_of(a)
    assert spec.pause_s == (1.0, 3.0) and spec.context_tokens() == 384 + 4 * (96 + 8)


def test_the_vllm_model_shape_flag() -> None:
    assert parse_args([]).vllm_model == (128, 2)
    assert vllm_bytes_per_token((128, 2)) == VLLM_BYTES_PER_TOKEN == 1024
    a = parse_args(["--backends", "vllm", "--vllm-model", "512,4"])
    assert a.vllm_model == (512, 4)
    assert vllm_bytes_per_token(a.vllm_model) == 2 * 4 * 8 * 32 * 4  # 8 KV heads of 32
    for bad in ("512", "500,4", "512,0", "x,y"):
        with pytest.raises(SystemExit):
            parse_args(["--vllm-model", bad])


def test_node_and_background_are_sized_from_the_contexts() -> None:
    args = parse_args(["--quick", "--dram-fraction", "0.5", "--ssd-fraction", "2"])
    spec = spec_of(args)
    per_token = 64 * 1024  # 800 tokens x 4 sessions x 64 KiB = 200 MiB of contexts
    size = node_size(spec, per_token, args)
    assert (size.dram_bytes, size.ssd_bytes) == (100 * MIB, 400 * MIB)
    assert size.max_retained_fraction == 0.9
    bg = with_background(spec, 16, per_token, 2.0)
    per_request = BACKGROUND_BLOCKS * 16 * per_token
    assert bg.background_tokens == BACKGROUND_BLOCKS * 16
    assert bg.background_per_s * per_request * nominal_duration_s(spec) == pytest.approx(
        2.0 * 200 * MIB)
    assert with_background(spec, 16, per_token, 0.0) == spec


def test_toy_bytes_per_token() -> None:
    cfg = {"n_layers": 8, "n_kv_heads": 4, "head_dim": 64, "dtype": "float32"}
    assert toy_bytes_per_token(cfg) == 2 * 8 * 4 * 64 * 4
    assert toy_bytes_per_token({**cfg, "dtype": "bfloat16"}) == 2 * 8 * 4 * 64 * 2


@pytest.mark.slow
def test_smoke_with_toy_workers(tmp_path: Path) -> None:
    """Real node, workers and conductor serve, both modes at once; what the run wrote."""
    assert main(["--quick", "--sessions", "2", "--turns", "2", "--pause", "0.2,0.4",
                 "--first-tokens", "64", "--user-tokens", "32", "--toy-model", "tiny",
                 "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "sessions.json").read_text())
    runs = out["results"]["toy"]["runs"]
    assert sorted(runs) == ["off", "on"]
    for r in runs.values():
        assert (r["overall"]["requests"], r["overall"]["ok"]) == (4, 4)
        assert [t["turn"] for t in r["turns"]] == [0, 1]
        assert [x["prev_context"] for x in r["records"]] == [0, 0, 72, 72]
        assert r["samples"] and r["exit_codes"] == {"conductor": 0, "prefill": 0,
                                                    "decode": 0, "node": 0}
    assert set(out["results"]["toy"]["ratios"]) >= {"ttft_p90_off_over_on", "p90_target_met"}
    assert (tmp_path / "sessions_toy.png").stat().st_size > 0
