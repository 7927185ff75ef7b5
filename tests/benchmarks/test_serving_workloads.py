"""The serving benchmark's workloads: which prompts share a prefix is exactly as designed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.serving_workloads import conversation, prefix_groups, pure_miss


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_prefix_groups_share_exactly_the_document() -> None:
    w = prefix_groups(documents=3, questions=2, doc_tokens=100, question_tokens=10, output=4,
                      interval_s=0.5)
    assert [r.arrival_s for r in w.requests] == [0.5 * i for i in range(6)]
    assert all(len(r.tokens) == 110 and r.output == 4 for r in w.requests)
    # every round asks every document once
    assert sorted(r.group for r in w.requests[:3]) == ["doc0", "doc1", "doc2"]
    assert sorted(r.group for r in w.requests[3:]) == ["doc0", "doc1", "doc2"]
    for a in w.requests:
        for b in w.requests:
            if a is b:
                continue
            n = shared_prefix(a.tokens, b.tokens)
            if a.group == b.group:
                assert 100 <= n < 110  # the document, then different questions
            else:
                assert n < 100
    assert w.prompt_tokens == 660


def test_prefix_groups_are_deterministic_and_seeded() -> None:
    def groups(seed: int) -> list[list[int]]:
        return [r.tokens for r in prefix_groups(documents=4, questions=3, doc_tokens=64,
                                                question_tokens=8, output=1, interval_s=1.0,
                                                seed=seed).requests]

    a, b, c = groups(0), groups(0), groups(1)
    assert a == b
    assert all(x != y for x, y in zip(a, c, strict=True))


def test_prefix_groups_refuse_empty_counts() -> None:
    with pytest.raises(ValueError):
        prefix_groups(documents=0, questions=1, doc_tokens=1, question_tokens=1, output=1,
                      interval_s=1)


def test_pure_miss_shares_nothing_with_anything() -> None:
    miss = pure_miss(requests=5, prompt_tokens=64, output=2, interval_s=1.5)
    groups = prefix_groups(documents=2, questions=1, doc_tokens=64, question_tokens=4,
                           output=1, interval_s=1)
    assert [r.arrival_s for r in miss.requests] == [0.0, 1.5, 3.0, 4.5, 6.0]
    everything = miss.requests + groups.requests
    for i, a in enumerate(miss.requests):
        for b in everything:
            if a is not b:
                assert shared_prefix(a.tokens, b.tokens) < 32, (i, b.group)


def test_conversation_keeps_the_trace_prefix_structure(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 80, "hash_ids": [1, 2]},
            {"timestamp": 500, "input_length": 1500, "output_length": 8000,
             "hash_ids": [1, 2, 3]},
            {"timestamp": 900, "input_length": 512, "output_length": 8, "hash_ids": [4]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = conversation(path, requests=3, token_scale=8, max_prompt=150, max_output=32,
                     speed=2.0)
    a, b, c = w.requests
    assert [r.arrival_s for r in w.requests] == [0.0, 0.25, 0.45]
    assert [len(r.tokens) for r in w.requests] == [128, 150, 64]  # 1500/8=187 cut to 150
    assert [r.output for r in w.requests] == [10, 32, 1]
    assert b.tokens[:128] == a.tokens  # hash ids 1, 2 shared
    assert shared_prefix(c.tokens, a.tokens) < 32
    with pytest.raises(ValueError):
        conversation(path, requests=1, token_scale=7, max_prompt=10, max_output=1, speed=1)


def test_another_conversation_seed_keeps_the_structure_and_shares_nothing(
        tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
            {"timestamp": 10, "input_length": 1024, "output_length": 8, "hash_ids": [1, 3]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def prompts(seed: int) -> list[list[int]]:
        return [r.tokens for r in conversation(path, requests=2, token_scale=8,
                                               max_prompt=512, max_output=4, speed=1,
                                               seed=seed).requests]

    a, b = prompts(0), prompts(1)
    assert shared_prefix(a[0], a[1]) == shared_prefix(b[0], b[1]) == 64 + shared_prefix(
        a[0][64:], a[1][64:])
    assert all(shared_prefix(x, y) < 32 for x in a for y in b)
