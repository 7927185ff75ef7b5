"""The native live table (``tiers.live_table.NativeLiveTable``) against the dict it stands
in for, operation by operation (Hypothesis), while it grows too; its refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.index_kind import native_available
from tiers.live_table import NativeLiveTable, PyLiveTable

pytestmark = pytest.mark.skipif(not native_available(), reason="native index not built")


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["set", "del", "get", "fill"]),
                              st.integers(0, 3000) | st.integers(0, 1 << 62),
                              st.integers(0, 1 << 40)), max_size=300))
def test_native_live_table_answers_as_a_dict(ops: list[tuple[str, int, int]]) -> None:
    """Also while it grows: ``fill`` sets hundreds of offsets at once to reach a growth, so
    later operations run while the old table is still being drained."""
    native, ref = NativeLiveTable(), PyLiveTable()
    next_fill = 1 << 50
    for op, offset, length in ops:
        if op == "fill":
            for i in range(offset % 700):
                native[next_fill + i] = length
                ref[next_fill + i] = length
            next_fill += 700
        elif op == "set":
            native[offset] = length
            ref[offset] = length
        elif op == "del":
            if offset in ref:
                del native[offset]
                del ref[offset]
            else:
                with pytest.raises(KeyError):
                    del native[offset]
        assert native.get(offset) == ref.get(offset)
        assert len(native) == len(ref)
    assert sorted(native.items()) == sorted(ref.items())
    native.clear()
    assert len(native) == 0 and list(native.items()) == []


def test_native_live_table_grows_and_refuses_negative_values() -> None:
    t = NativeLiveTable()
    for i in range(50_000):
        t[i * 64] = 64
    for i in range(0, 50_000, 2):
        del t[i * 64]
    assert len(t) == 25_000 and t.get(64) == 64 and t.get(0) is None and t.get(-1) is None
    with pytest.raises(ValueError, match=">= 0"):
        t[-64] = 1
