"""ExtentAllocator: exact behaviour and property tests of its invariants."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiers import allocator
from tiers.allocator import AllocatorError, Extent, ExtentAllocator


def test_allocates_aligned_extents_from_the_start() -> None:
    a = ExtentAllocator(1024, alignment=64)
    assert a.allocate(1) == Extent(0, 64)
    assert a.allocate(65) == Extent(64, 128)
    assert a.used == 192
    assert a.free_extents() == [Extent(192, 832)]


def test_freed_neighbours_coalesce() -> None:
    a = ExtentAllocator(1024, alignment=64)
    x, y, z = (a.allocate(64) for _ in range(3))
    assert x and y and z
    a.free(x)
    a.free(z)
    assert a.free_extents() == [Extent(0, 64), Extent(128, 896)]
    a.free(y)
    assert a.free_extents() == [Extent(0, 1024)]
    assert a.used == 0


def test_exact_size_hole_is_reused() -> None:
    a = ExtentAllocator(4096, alignment=64)
    blocks = [a.allocate(256) for _ in range(16)]
    assert a.allocate(1) is None
    a.free(blocks[5])
    assert a.allocate(256) == blocks[5]


def test_returns_none_when_nothing_fits_despite_free_bytes() -> None:
    a = ExtentAllocator(512, alignment=64)
    blocks = [a.allocate(64) for _ in range(8)]
    for b in blocks[::2]:
        a.free(b)  # type: ignore[arg-type]
    assert a.free_bytes == 256
    assert a.largest_free() == 64
    assert a.allocate(128) is None


def test_rejects_double_free_and_foreign_extents() -> None:
    a = ExtentAllocator(1024, alignment=64)
    x = a.allocate(64)
    assert x is not None
    a.free(x)
    with pytest.raises(AllocatorError):
        a.free(x)
    with pytest.raises(AllocatorError):
        a.free(Extent(512, 64))
    y = a.allocate(128)
    assert y is not None
    with pytest.raises(AllocatorError):
        a.free(Extent(y.offset, 64))  # wrong length


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ExtentAllocator(1024, alignment=48)
    a = ExtentAllocator(1024)
    with pytest.raises(ValueError):
        a.allocate(0)
    assert a.allocate(2048) is None


def test_capacity_rounds_down_to_alignment() -> None:
    a = ExtentAllocator(1000, alignment=64)
    assert a.capacity == 960
    assert a.allocate(960) == Extent(0, 960)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model of the live extents."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = ExtentAllocator(64 * 1024, alignment=64)
        self.live: list[Extent] = []

    @rule(size=st.integers(1, 9000))
    def allocate(self, size: int) -> None:
        got = self.alloc.allocate(size)
        if got is None:
            # Only allowed when no single free extent is large enough.
            assert self.alloc.largest_free() < self.alloc.rounded(size)
            return
        assert got.length == self.alloc.rounded(size)
        assert got.offset % 64 == 0
        self.live.append(got)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10**6))
    def free(self, index: int) -> None:
        self.alloc.free(self.live.pop(index % len(self.live)))

    @invariant()
    def no_overlap_and_within_capacity(self) -> None:
        spans = sorted((e.offset, e.end) for e in self.live)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        assert all(s >= 0 and e <= self.alloc.capacity for s, e in spans)

    @invariant()
    def accounting_adds_up(self) -> None:
        used = sum(e.length for e in self.live)
        assert self.alloc.used == used
        free = self.alloc.free_extents()
        assert sum(e.length for e in free) == self.alloc.capacity - used
        # Free extents never touch each other (coalescing is eager) nor any live extent.
        for a, b in itertools.pairwise(free):
            assert a.end < b.offset
        live_spans = {(e.offset, e.end) for e in self.live}
        for f in free:
            assert all(f.end <= s or f.offset >= e for s, e in live_spans)

    def teardown(self) -> None:
        for e in self.live:
            self.alloc.free(e)
        assert self.alloc.used == 0
        assert self.alloc.free_extents() == [Extent(0, self.alloc.capacity)]


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_rebuild_takes_exactly_the_given_extents() -> None:
    a = ExtentAllocator(1024, alignment=64)
    a.rebuild([Extent(128, 64), Extent(512, 128)])
    assert a.used == 192
    assert a.free_extents() == [Extent(0, 128), Extent(192, 320), Extent(640, 384)]
    assert a.allocate(320) == Extent(192, 320)
    a.free(Extent(128, 64))
    with pytest.raises(RuntimeError):
        a.rebuild([])
    for bad in ([Extent(0, 64), Extent(32, 64)], [Extent(0, 100)], [Extent(1000, 64)]):
        with pytest.raises(ValueError):
            ExtentAllocator(1024, alignment=64).rebuild(bad)


def test_live_extents_of_one_length_share_one_length_object() -> None:
    a = ExtentAllocator(1 << 20, alignment=64)
    x, y = a.allocate(4050), a.allocate(4090)
    assert x is not None and y is not None
    assert x.length == y.length == 4096 and x.length is y.length
    a.free(x)
    with pytest.raises(AllocatorError):
        a.free(x)


def test_a_freed_extent_is_reused_first_by_its_length() -> None:
    a = ExtentAllocator(4096, alignment=64)
    x, y, z = (a.allocate(256) for _ in range(3))
    assert x is not None and y is not None and z is not None
    a.free(x)
    a.free(z)
    # Last freed first, before the free space past ``z``; other lengths go elsewhere.
    assert a.allocate(64) == Extent(768, 64)
    assert a.allocate(256) == z
    assert a.allocate(256) == x
    assert a.used == 3 * 256 + 64


def test_recent_extents_coalesce_before_an_allocation_fails() -> None:
    a = ExtentAllocator(512, alignment=64)
    blocks = [a.allocate(64) for _ in range(8)]
    for b in blocks[2:6]:
        a.free(b)  # type: ignore[arg-type]
    # Four adjacent 64-byte holes wait uncoalesced; a 256-byte request still fits there.
    assert a.allocate(256) == Extent(128, 256)
    assert a.free_extents() == []


def test_frees_past_the_recent_bound_coalesce_at_once() -> None:
    n = allocator.MAX_RECENT + 4
    a = ExtentAllocator(64 * n, alignment=64)
    blocks = [a.allocate(64) for _ in range(n)]
    for b in blocks:
        a.free(b)  # type: ignore[arg-type]
    assert a._recent_count == allocator.MAX_RECENT  # the bound holds
    assert a.free_extents() == [Extent(0, 64 * n)]
    assert a._recent_count == 0

