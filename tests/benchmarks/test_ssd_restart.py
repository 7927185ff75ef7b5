"""The SSD restart benchmark: its disk arithmetic, and a small run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import ssd_restart as sr


def test_a_small_block_takes_a_header_page_and_a_value_page() -> None:
    assert sr.block_disk_bytes(64) == 8192
    assert sr.block_disk_bytes(4096) == 8192
    assert sr.block_disk_bytes(4097) == 12288
    assert sr.capacity_for(1000, 64) == 9637888  # 1000 * 8 KiB / 0.85, page-aligned


@pytest.mark.slow
def test_a_small_tier_restarts_whole(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert sr.main(["--path", str(tmp_path / "kv.img"), "--blocks", "600", "--verify", "100",
                    "--batch", "64", "--rebuild", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["fill"]["acked"] == 600 and r["parts"]["records"] == 600
    node = r["node"]
    assert (node["recovered_blocks"], node["acked_missing"]) == (600, 0)
    assert node["verified_equal"] == node["verified"] > 0
    assert node["damaged_block_refused"] and node["checksum_failures"] == 1
    rebuilt = r["rebuild"]
    assert rebuilt["rebuilt_blocks"] == 599 and rebuilt["missing_besides_damaged"] == 0
    assert not (tmp_path / "kv.img").exists()
