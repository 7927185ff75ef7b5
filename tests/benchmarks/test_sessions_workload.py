from __future__ import annotations

import dataclasses

import pytest

from benchmarks.sessions_workload import (
    FIRST_ID,
    WorkloadSpec,
    background,
    next_prompt,
    nominal_duration_s,
    sessions,
)

SPEC = WorkloadSpec(sessions=3, turns=4, first_tokens=10, user_tokens=4, output_tokens=2,
                    pause_s=(1.0, 2.0), stagger_s=0.5, vocab=50, seed=7)


def test_next_prompt_is_previous_prompt_answer_then_user_text() -> None:
    assert next_prompt([1, 2], [3], [4, 5]) == [1, 2, 3, 4, 5]
    assert next_prompt([], [], [9]) == [9]


def test_sessions_follow_the_spec() -> None:
    plans = sessions(SPEC)
    assert [p.id for p in plans] == ["s7-0", "s7-1", "s7-2"]
    assert [p.start_s for p in plans] == [0.0, 0.5, 1.0]
    for p in plans:
        assert [len(t.user) for t in p.turns] == [10, 4, 4, 4]
        assert p.turns[0].pause_s == 0.0
        assert all(1.0 <= t.pause_s <= 2.0 for t in p.turns[1:])
        assert all(FIRST_ID <= i < 50 for t in p.turns for i in t.user)


def test_sessions_are_decided_by_the_seed() -> None:
    assert sessions(SPEC) == sessions(SPEC)
    other = sessions(dataclasses.replace(SPEC, seed=8))
    assert [t.user for t in other[0].turns] != [t.user for t in sessions(SPEC)[0].turns]
    # no prefix shared between two sessions of one run
    a, b = sessions(SPEC)[:2]
    assert a.turns[0].user != b.turns[0].user


def test_context_tokens_is_the_last_prompt_length() -> None:
    assert SPEC.context_tokens() == 10 + 3 * 4 + 3 * 2
    prompt: list[int] = []
    answer: list[int] = []
    for t in sessions(SPEC)[0].turns:
        prompt = next_prompt(prompt, answer, t.user)
        answer = [0] * SPEC.output_tokens
    assert len(prompt) == SPEC.context_tokens()


def test_background_arrives_at_its_rate_with_fresh_ids() -> None:
    spec = dataclasses.replace(SPEC, background_per_s=2.0, background_tokens=6)
    got = background(spec, 3.0)
    assert [r.arrival_s for r in got] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert [len(r.tokens) for r in got] == [6] * 6
    assert len({r.tokens for r in got}) == 6
    assert background(spec, 3.0) == got
    assert background(SPEC, 3.0) == []
    assert background(spec, 0.0) == []


def test_nominal_duration() -> None:
    assert nominal_duration_s(SPEC) == 2 * 0.5 + 3 * 2.0


@pytest.mark.parametrize("change", [
    {"turns": 0}, {"sessions": 0}, {"first_tokens": 0}, {"output_tokens": 0},
    {"pause_s": (2.0, 1.0)}, {"pause_s": (-1.0, 1.0)}, {"stagger_s": -1.0}, {"vocab": 3},
    {"background_per_s": 1.0, "background_tokens": 0},
])
def test_bad_specs_are_refused(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(SPEC, **change)  # type: ignore[arg-type]  # each case's types differ
