"""kvstore.core.prefetch: the checks a prefetch passes on both sides, and its outcomes."""

from __future__ import annotations

import json

import pytest

from kvstore.core.errors import InvalidArgument
from kvstore.core.prefetch import (
    MAX_PREFETCH_KEYS,
    MAX_TIER_NAME,
    PrefetchOutcome,
    check_prefetch,
)

KEY = b"k" * 16


def test_the_key_bound_is_exact() -> None:
    keys, tier = check_prefetch([KEY] * MAX_PREFETCH_KEYS, None)
    assert len(keys) == MAX_PREFETCH_KEYS and tier == "dram"
    with pytest.raises(InvalidArgument, match=f"at most {MAX_PREFETCH_KEYS} keys per "
                                              f"prefetch, got {MAX_PREFETCH_KEYS + 1}"):
        check_prefetch([KEY] * (MAX_PREFETCH_KEYS + 1), "dram")


def test_tier_names() -> None:
    assert check_prefetch([], "")[1] == "dram"  # what an older writer of the message sends
    assert check_prefetch([], "hbm")[1] == "hbm"  # whether the node has it is its to say
    assert check_prefetch([], "x" * MAX_TIER_NAME)[1] == "x" * MAX_TIER_NAME
    with pytest.raises(InvalidArgument, match="a tier name of 33 characters") as err:
        check_prefetch([], "x" * (MAX_TIER_NAME + 1))
    assert "xx" not in str(err.value)  # never echoed
    with pytest.raises(InvalidArgument, match="tier must be a tier name"):
        check_prefetch([], 3)  # type: ignore[arg-type]


def test_malformed_keys() -> None:
    with pytest.raises(InvalidArgument):
        check_prefetch([KEY, b"short"], None)


def test_outcomes_are_strings() -> None:
    assert PrefetchOutcome("no_room") is PrefetchOutcome.NO_ROOM
    assert PrefetchOutcome.PROMOTED == "promoted"
    assert json.dumps([PrefetchOutcome.QUEUED]) == '["queued"]'
    assert [o.value for o in PrefetchOutcome] == ["present", "queued", "promoted", "missing",
                                                  "no_room", "busy", "undone"]
