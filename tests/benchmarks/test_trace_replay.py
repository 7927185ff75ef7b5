"""benchmarks.trace_replay: exact hits per policy on handcrafted traces, both modes, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import trace_replay as tr
from conductor.simulation.trace import TraceRequest, load_trace
from kvstore.cli import main as cli_main


def req(ids: list[int], input_length: int | None = None) -> TraceRequest:
    n = len(ids) * 512 if input_length is None else input_length
    return TraceRequest(timestamp_ms=0, input_length=n, output_length=1, hash_ids=tuple(ids))


# Capacity 4 blocks. Worked by hand (oldest first):
#  R1 [1,2]  miss, insert 1,2             R2, R3 [1,2]  2 hits each (1 and 2 now read twice)
#  R4 [3,4]  insert 3,4: cache full       R5 [5]  insert 5 evicts one block:
#     lru: 1 (least recent)   lfu: 3 (0 hits, pushed before 4)   prefix: 2 (oldest leaf)
#  R6 [1,2]  lru: 0 hits (1 gone; inserting 1,2 evicts 2,3)   lfu: 2 hits
#            prefix: 1 hit (2 gone; inserting 2 evicts 4, the oldest leaf)
#  R7 [3,4]  lru: 0 (3 gone; inserting 3,4 evicts 4,5)   lfu: 0 (3 gone; evicts 4,5)
#            prefix: 1 (3 kept, 4 gone; inserting 4 evicts 5)
# With infinite capacity R2, R3, R6 and R7 hit fully: 8 hits.
POLICY_TRACE = [req([1, 2]), req([1, 2]), req([1, 2]), req([3, 4]), req([5]), req([1, 2]),
                req([3, 4])]
EXPECTED_HITS = {"lru": 4, "lfu": 6, "prefix": 6}
EXPECTED_EVICTIONS = {"lru": 5, "lfu": 3, "prefix": 3}
LOOKUPS = 13


@pytest.mark.parametrize("policy", ["lru", "lfu", "prefix"])
@pytest.mark.parametrize("with_data", [False, True])
def test_replay_exact_hits_per_policy(policy: str, with_data: bool) -> None:
    r = tr.replay(tr.prepare(POLICY_TRACE), policy=policy, capacity_blocks=4,
                  with_data=with_data, block_bytes=1000)
    assert r["lookups"] == LOOKUPS
    assert r["hits"] == EXPECTED_HITS[policy]
    assert r["hit_ratio"] == EXPECTED_HITS[policy] / LOOKUPS
    assert r["prefill_tokens_saved"] == EXPECTED_HITS[policy] * 512
    assert r["evictions"] == EXPECTED_EVICTIONS[policy]
    assert r["inserted"] == 4 + EXPECTED_EVICTIONS[policy]  # the cache ends full
    assert r["mode"] == ("data" if with_data else "metadata")
    assert r["insert_failures"] == 0
    assert r["content_mismatches"] == 0
    assert r["verified_blocks"] == (EXPECTED_HITS[policy] if with_data else 0)
    assert r["lookups_per_s"] > 0


def test_lru_matches_a_plain_ordered_dict_lru() -> None:
    from collections import OrderedDict

    trace = [req([i % 7, 100 + i % 5, 200 + i % 3], input_length=1400) for i in range(60)]
    trace += [req([0, 100 + k, 200 + k]) for k in range(3)]
    for cap in (2, 3, 5, 8):
        od: OrderedDict[int, None] = OrderedDict()
        hits = 0
        for r in trace:
            ids, n = r.hash_ids, r.full_blocks
            h = 0
            while h < n and ids[h] in od:
                h += 1
            for i in ids[:h]:
                od.move_to_end(i)
            hits += h
            for i in ids[h:]:
                if i not in od:
                    od[i] = None
                    if len(od) > cap:
                        od.popitem(last=False)
        got = tr.replay(tr.prepare(trace), policy="lru", capacity_blocks=cap)
        assert got["hits"] == hits, cap


def test_partial_last_block_is_inserted_unless_full_blocks_only() -> None:
    # R1: 1000 tokens: one full block (7) and a partial one (8). R2: both full.
    trace = [req([7, 8], input_length=1000), req([7, 8], input_length=1024)]
    default = tr.replay(tr.prepare(trace), policy="lru", capacity_blocks=10)
    full = tr.replay(tr.prepare(trace, full_blocks_only=True), policy="lru", capacity_blocks=10)
    assert (default["lookups"], default["hits"], default["inserted"]) == (3, 2, 2)
    assert (full["lookups"], full["hits"], full["inserted"]) == (3, 1, 2)
    assert tr.ceiling(tr.prepare(trace)) == (2, 3)
    assert tr.ceiling(tr.prepare(trace, full_blocks_only=True)) == (1, 3)


def test_hits_are_the_leading_run_only() -> None:
    # Block 2 is cached, block 1 is not: a gap ends the prefix, so 0 hits.
    trace = [req([1, 2]), req([3]), req([1, 2])]
    r = tr.replay(tr.prepare(trace), policy="lru", capacity_blocks=2)
    # R2 evicts 1 (least recent); R3 finds 1 missing though 2 is cached.
    assert (r["lookups"], r["hits"]) == (5, 0)


def test_request_longer_than_the_cache_keeps_what_fits() -> None:
    # With the parent protected, a chain longer than capacity cannot be stored whole.
    r = tr.replay(tr.prepare([req([1, 2, 3]), req([1, 2, 3])]), policy="lru", capacity_blocks=1)
    assert r["insert_failures"] == 2
    assert r["hits"] == 1


def test_data_mode_detects_wrong_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = tr._content

    def content(key: bytes, nbytes: int) -> bytes:
        calls["n"] += 1
        out = real(key, nbytes)
        # Calls 1-2 write blocks 1 and 2 (R1); calls 3-4 check the two hits (R2): the
        # second check expects other bytes than those stored.
        return bytes(nbytes) if calls["n"] == 4 else out

    monkeypatch.setattr(tr, "_content", content)
    r = tr.replay(tr.prepare([req([1, 2]), req([1, 2])]), policy="lru", capacity_blocks=4,
                  with_data=True, block_bytes=256)
    assert calls["n"] == 4
    assert (r["hits"], r["verified_blocks"], r["content_mismatches"]) == (2, 1, 1)


def write_trace(path: Path, reqs: list[TraceRequest]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms,
                                        "input_length": r.input_length,
                                        "output_length": r.output_length,
                                        "hash_ids": list(r.hash_ids)}) + "\n" for r in reqs))
    return path


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_cli_json_single_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write_trace(tmp_path / "tiny.jsonl", POLICY_TRACE)
    assert load_trace(p) == POLICY_TRACE
    rc = cli_main(["bench", "trace", "--trace", str(p), "--capacity-blocks", "4", "--policy",
                   "lfu", "--json", "--no-files", "--rounds", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    obj = last_json(out)
    assert obj["hit_ratio"] == EXPECTED_HITS["lfu"] / LOOKUPS
    assert obj["lookups_per_s"] > 0
    assert (obj["policy"], obj["capacity_blocks"], obj["hits"]) == ("lfu", 4, 6)
    assert "runs" not in obj
    assert "prefill tokens saved" in out
    assert not (tmp_path / "trace_replay.json").exists()


def test_cli_json_several_cells_and_files(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    p = write_trace(tmp_path / "tiny.jsonl", POLICY_TRACE)
    out_dir = tmp_path / "results"
    rc = tr.main(["--trace", str(p), "--capacity-blocks", "4,100", "--policy", "lru,lfu,prefix",
                  "--json", "--rounds", "2", "--with-data", "--block-bytes", "512",
                  "--results-dir", str(out_dir)])
    assert rc == 0
    obj = last_json(capsys.readouterr().out)
    assert obj["hit_ratio"] == EXPECTED_HITS["lru"] / LOOKUPS  # the first cell: lru at 4
    assert obj["lookups_per_s"] > 0
    cells = {(r["policy"], r["capacity_blocks"]): r["hits"] for r in obj["runs"]}
    assert cells == {("lru", 4): 4, ("lfu", 4): 6, ("prefix", 4): 6,
                     ("lru", 100): 8, ("lfu", 100): 8, ("prefix", 100): 8}
    assert all(r["mode"] == "data" and r["rounds"] == 2 for r in obj["runs"])
    assert obj["traces"]["tiny"]["ceiling_hit_ratio"] == 8 / LOOKUPS
    saved = json.loads((out_dir / "trace_replay.json").read_text())
    assert len(saved["runs"]) == 6
    assert (out_dir / "trace_replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []}\n'
                   "oops\n")
    assert tr.main(["--trace", str(bad), "--no-files"]) == 1
    assert f"{bad}:2:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tr.main(["--trace", str(bad), "--policy", "fifo"])
    with pytest.raises(SystemExit):
        tr.main(["--trace", str(bad), "--capacity-blocks", "0"])
