"""tiers.ssd.staging: the one O_DIRECT rule (what moves in place, what is bounced)."""

from __future__ import annotations

import mmap

import pytest

from tiers.ssd.buffers import address_of
from tiers.ssd.staging import _split, _stage, bounces, transfer_bytes
from tiers.ssd.types import ALIGNMENT

A = ALIGNMENT


@pytest.fixture
def aligned() -> memoryview:
    mv = memoryview(mmap.mmap(-1, 4 * A))
    assert address_of(mv) % A == 0
    return mv


@pytest.mark.parametrize(("start", "n", "split"), [
    (0, 0, (0, 0)),  # empty: nothing moves
    (0, 2 * A, (2 * A, 0)),  # aligned, whole pages: all in place
    (0, 2 * A + 5, (2 * A, A)),  # aligned, partial last page: that page bounced
    (0, 5, (0, A)),  # aligned, less than a page: one bounced page
    (1, 2 * A, (0, 2 * A)),  # unaligned: bounced whole
    (1, 2 * A + 5, (0, 3 * A)),  # ... its length padded to the alignment
])
def test_the_rule_under_o_direct(aligned: memoryview, start: int, n: int,
                                 split: tuple[int, int]) -> None:
    mv = aligned[start:start + n]
    assert _split(mv, True) == split
    assert transfer_bytes(mv, True) == sum(split)
    assert bounces(mv, True) is (split[1] > 0)
    assert _split(mv, False) == (n, 0) and transfer_bytes(mv, False) == n
    assert not bounces(mv, False)


def test_stage_carves_bounce_slots_back_to_back(aligned: memoryview) -> None:
    scratch = memoryview(bytearray(8 * A))
    bufs, head, bounce, pos = _stage(aligned[: A + 3], True, scratch, 0)
    assert (head, pos, [len(b) for b in bufs]) == (A, A, [A, A])
    assert bounce is not None and bufs[1] is bounce
    bufs, head, bounce, pos = _stage(aligned[1:11], True, scratch, pos)
    assert (head, pos, [len(b) for b in bufs]) == (0, 2 * A, [A])
    whole = aligned[: 2 * A]
    bufs, head, bounce, pos = _stage(whole, True, scratch, pos)
    assert (head, bounce, pos, bufs) == (2 * A, None, 2 * A, [whole])
