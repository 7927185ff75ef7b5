"""``kvstore.core.retention``'s checks of a ``retain`` call and the cluster's merge of
outcomes over copies."""

from __future__ import annotations

import math
import os

import pytest

from kvstore import InvalidArgument, RetainOutcome
from kvstore.core.retention import MAX_RETAIN_KEYS, MAX_RETAIN_S, check_retain, merged_outcome


def test_check_retain_answers_the_keys_and_seconds() -> None:
    k = os.urandom(16)
    assert check_retain([k, bytearray(k)], 30) == ([k, k], 30.0)
    assert check_retain([], 0) == ([], 0.0)  # 0: a release
    assert check_retain([k] * MAX_RETAIN_KEYS, MAX_RETAIN_S)[1] == MAX_RETAIN_S


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, MAX_RETAIN_S + 1, None, "30", True])
def test_check_retain_refuses_a_bad_retain_s(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="retain_s"):
        check_retain([os.urandom(16)], bad)  # type: ignore[arg-type]  # bad on purpose


def test_check_retain_refuses_too_many_or_malformed_keys() -> None:
    with pytest.raises(InvalidArgument, match=f"at most {MAX_RETAIN_KEYS} keys per retain, "
                                              f"got {MAX_RETAIN_KEYS + 1}"):
        check_retain([os.urandom(16)] * (MAX_RETAIN_KEYS + 1), 5)
    with pytest.raises(InvalidArgument):
        check_retain([b"short"], 5)


def test_merged_outcome_is_the_best_answer_of_any_copy() -> None:
    r, d, rel, m = (RetainOutcome.RETAINED, RetainOutcome.DENIED, RetainOutcome.RELEASED,
                    RetainOutcome.MISSING)
    assert merged_outcome([m, d, r]) is r
    assert merged_outcome([m, d]) is d
    assert merged_outcome([m, rel]) is rel
    assert merged_outcome([m, m]) is m
    assert merged_outcome([]) is m
    assert r == "retained" and rel.value == "released"
