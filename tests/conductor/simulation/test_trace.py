"""conductor.simulation.trace: exact parsing of Mooncake JSONL traces and line-numbered errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from conductor.simulation.trace import BLOCK_TOKENS, TraceFormatError, TraceRequest, load_trace


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_trace_parses_every_field_exactly(tmp_path: Path) -> None:
    p = write(tmp_path / "t.jsonl", [
        json.dumps({"timestamp": 0, "input_length": 1100, "output_length": 7,
                    "hash_ids": [0, 1, 2]}),
        "",  # blank lines are skipped
        json.dumps({"timestamp": 27482, "input_length": 1024, "output_length": 52,
                    "hash_ids": [0, 1], "extra": "ignored"}),
        json.dumps({"timestamp": 30535, "input_length": 100, "output_length": 0,
                    "hash_ids": [9]}),
    ])
    reqs = load_trace(p)
    assert reqs == [
        TraceRequest(timestamp_ms=0, input_length=1100, output_length=7, hash_ids=(0, 1, 2)),
        TraceRequest(timestamp_ms=27482, input_length=1024, output_length=52, hash_ids=(0, 1)),
        TraceRequest(timestamp_ms=30535, input_length=100, output_length=0, hash_ids=(9,)),
    ]
    assert BLOCK_TOKENS == 512
    assert [r.full_blocks for r in reqs] == [2, 2, 0]
    assert load_trace(str(p)) == reqs  # str paths too


def test_trace_request_is_frozen_and_keyword_only() -> None:
    r = TraceRequest(timestamp_ms=1, input_length=2048, output_length=3, hash_ids=(4, 5, 6, 7))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.input_length = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        TraceRequest(1, 2048, 3, (4,))  # type: ignore[misc]
    assert r.full_blocks == 4
    # More full blocks than ids (a malformed or truncated trace): capped at the ids.
    short = TraceRequest(timestamp_ms=0, input_length=4096, output_length=0, hash_ids=(1,))
    assert short.full_blocks == 1


GOOD = json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]})


@pytest.mark.parametrize(("bad", "reason"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"input_length": 1, "output_length": 1, "hash_ids": []}', "missing field 'timestamp'"),
    ('{"timestamp": 1, "output_length": 1, "hash_ids": []}', "missing field 'input_length'"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1}', "missing field 'hash_ids'"),
    ('{"timestamp": "1", "input_length": 1, "output_length": 1, "hash_ids": []}',
     "field 'timestamp' must be an integer"),
    ('{"timestamp": 1, "input_length": 1.5, "output_length": 1, "hash_ids": []}',
     "field 'input_length' must be an integer"),
    ('{"timestamp": 1, "input_length": true, "output_length": 1, "hash_ids": []}',
     "field 'input_length' must be an integer"),
    ('{"timestamp": 1, "input_length": 1, "output_length": -1, "hash_ids": []}',
     "field 'output_length' must be >= 0"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": 3}',
     "field 'hash_ids' must be a list"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1, "2"]}',
     r"hash_ids\[1\] must be a non-negative integer"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [-4]}',
     r"hash_ids\[0\] must be a non-negative integer"),
])
def test_malformed_line_names_its_line_number(tmp_path: Path, bad: str, reason: str) -> None:
    p = write(tmp_path / "bad.jsonl", [GOOD, "", GOOD, bad, GOOD])
    with pytest.raises(TraceFormatError, match=reason) as info:
        load_trace(p)
    assert info.value.lineno == 4
    assert str(info.value).startswith(f"{p}:4: ")
    assert isinstance(info.value, ValueError)


def test_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.jsonl")
