"""``kvstore bench clients`` on a real node and a real redis-server, two client processes,
one short round: every cell runs and each ratio is present; sizes parse; bad flags are
usage errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import clients_bench


def test_sizes_parse() -> None:
    assert clients_bench._parse_sizes("64KiB,1MiB,4096") == (64 << 10, 1 << 20, 4096)


@pytest.mark.parametrize("argv", [["--clients", "0"], ["--sizes", "64XiB"], ["--clients", ""]])
def test_bad_flags_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        clients_bench.main(argv)
    assert exc.value.code == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
def test_a_small_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert clients_bench.main(["--rounds", "1", "--sizes", "4KiB", "--clients", "1,2",
                               "--quick", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "clients.json").read_text())
    assert [(r["size"], r["clients"]) for r in res["rows"]] == [(4096, 1), (4096, 2)]
    for r in res["rows"]:
        assert r["kvstore_gbs"] > 0 and r["redis_gbs"] > 0 and r["x_redis"] > 0
        assert r["server_cpu_ms_per_mib"] >= 0 and r["x_base"] is None
    assert res["rows"][0]["x_1_client"] == 1.0
    assert "x redis" in capsys.readouterr().out
