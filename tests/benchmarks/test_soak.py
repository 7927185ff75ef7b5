"""``python -m benchmarks.soak`` for a few seconds: a real cluster (etcd and three nodes
with tenants), load, at least one fault, the final check, and the JSON and plot it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import soak

pytestmark = pytest.mark.slow  # about 30-60 s here: the cluster's start dominates


def test_a_short_soak_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    code = soak.main(["--minutes", "0.15", "--seed", "3", "--rate", "30", "--dram-mib", "32",
                      "--sample-s", "0.5", "--fault-gap-s", "1,2", "--node-down-s", "0.5,1",
                      "--etcd-down-s", "0.5,1", "--dir", str(tmp_path / "cluster"),
                      "--out", str(tmp_path / "out")])
    r = json.loads((tmp_path / "out" / "soak.json").read_text())
    assert (tmp_path / "out" / "soak.png").stat().st_size > 0
    assert set(r) == {"config", "run_s", "settle_s", "classes", "faults", "evictions", "memory",
                      "stale_regions", "samples", "ops_per_s", "verdict"}
    assert r["config"]["minutes"] == 0.15 and r["config"]["seed"] == 3
    assert set(r["classes"]) == {"tenant-a", "tenant-b", "cluster"}
    for c in r["classes"].values():
        assert c["ops"]["fill"] > 0 and sum(c["ops"].values()) > c["ops"]["fill"]
        assert set(c["check"]) == {"live", "lost", "wrong_bytes", "maybe_found", "gone_found",
                                   "lost_keys", "wrong_keys", "states"}
        assert c["check"]["live"] == c["check"]["states"]["live"] > 0
    assert r["faults"], "the chaos thread never acted"
    assert all("node-1" not in f["what"] for f in r["faults"])  # spared: the witness
    assert set(r["faults"][0]) == {"t", "what", "down_s", "recovered_s", "settle_s", "skipped"}
    assert set(r["memory"]) == {"node-1", "node-2", "node-3", "etcd"}
    for m in r["memory"].values():
        assert {"flat", "slope_mib_per_min", "judged_samples", "processes",
                "VmRSS_slope_mib_per_min", "RssShmem_slope_mib_per_min"} <= set(m)
        assert m["VmRSS"]["first"] > 0 and m["RssAnon"]["max"] > 0
    samples = r["samples"]
    n = len(samples["t_s"])
    assert n >= 5
    for series in ("VmRSS_mib", "RssAnon_mib", "RssShmem_mib"):
        assert set(samples[series]) == {"node-1", "node-2", "node-3", "etcd"}
        assert all(len(v) == n for v in samples[series].values())
    for series in ("regions_mapped", "dram_used_mib"):
        assert set(samples[series]) == {"node-1", "node-2", "node-3"}
        assert all(len(v) == n for v in samples[series].values())
    assert len(samples["stale_regions"]) == n and r["stale_regions"]["end"] >= 0
    assert r["evictions"] == 0
    v = r["verdict"]
    assert v["nothing_lost"] is True and v["no_wrong_byte"] is True, v
    assert v["no_stale_regions"] is (r["stale_regions"]["end"] == 0)
    # Seconds of samples cannot show a trend: memory is not judged, so the run cannot pass.
    assert v["memory_flat"] is None and v["pass"] is False and code == 1
    out = capsys.readouterr().out
    assert "verdict: FAIL" in out and "no judged node process lived long enough" in out


def test_tracemalloc_dumps_node_1_and_compares_its_dumps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    soak.main(["--minutes", "0.1", "--seed", "4", "--rate", "30", "--dram-mib", "32",
               "--sample-s", "0.5", "--no-faults", "--tracemalloc", "--tracemalloc-frames", "4",
               "--tracemalloc-every-s", "2", "--tracemalloc-from-s", "0",
               "--dir", str(tmp_path / "cluster"), "--out", str(tmp_path / "out")])
    r = json.loads((tmp_path / "out" / "soak.json").read_text())
    t = r["tracemalloc"]
    assert t["node"] == "node-1" and t["failures"] == []
    assert r["config"]["tracemalloc"] is True and r["config"]["tracemalloc_frames"] == 4
    pids = {p.name.split("-")[0] for p in (tmp_path / "cluster" / "tracemalloc").glob("*.json")}
    assert pids == {str(t["pid"])}  # node-1's only: the other nodes are not dumped
    dumps = t["dumps"]
    assert len(dumps) >= 2 and [d["t_s"] for d in dumps] == sorted(d["t_s"] for d in dumps)
    assert all(d["traced_mib"] > 0 and d["gc_objects"] > 0 and d["node_restarts"] == 0
               for d in dumps)
    assert all(d["rss_anon_after_trim_mib"] is None for d in dumps[:-1])
    assert dumps[-1]["rss_anon_after_trim_mib"] > 0  # the last dump trims the heap
    assert (t["from_t_s"], t["to_t_s"]) == (dumps[0]["t_s"], dumps[-1]["t_s"])
    assert t["sites_by_traceback"] and t["sites_by_line"] and t["gc_type_growth"]
    out = capsys.readouterr().out
    assert f"tracemalloc: pid {t['pid']}, " in out and "allocation sites that grew most" in out
