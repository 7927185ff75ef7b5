"""``python -m benchmarks.identity_cost`` on a tiny checkpoint: it writes, measures warm
and cold, prints one JSON line with the fingerprint's reads, and removes what it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import identity_cost


def test_a_small_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    assert identity_cost.main(["--dir", str(ckpt), "--files", "3", "--tensors", "10",
                               "--gib", "0.001", "--runs", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["cache"] for r in out["runs"]] == ["warm", "cold"]
    for r in out["runs"]:
        assert (r["files"], r["tensors"], r["reads"]) == (4, 10, 30)  # 3 + config.json
        assert r["bytes_read"] > 30 * 256 and r["median_s"] > 0
    assert not ckpt.exists()
