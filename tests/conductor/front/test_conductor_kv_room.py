"""``conductor.front.kv_room``: a request waits until the requests in flight leave room for
its blocks, and a prefix they share counts once."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.front.kv_room import KvRoom
from kvstore import block_keys

BT = 32


def doc(n_tokens: int, seed: int) -> Sequence[bytes]:
    """The full blocks' keys of a prompt of ``n_tokens`` (``seed`` picks the tokens)."""
    return block_keys([(seed * 1000 + i) % 50_000 for i in range(n_tokens)], BT, "ns")


def room(capacity_tokens: int = 2200) -> KvRoom:
    return KvRoom(capacity_tokens=capacity_tokens, block_tokens=BT)


def test_blocks_held_are_full_prompt_blocks_once_plus_the_rest_and_the_output() -> None:
    r = room()
    a = doc(1224, seed=1)  # 38 full blocks, 8 tokens over
    assert len(a) == 38
    r.add(a, prompt_tokens=1224, out_tokens=16, ends_at=5.0)
    assert r.held_blocks() == 38 + 1  # 8 + 16 tokens: one more block
    r.add(a[:37], prompt_tokens=37 * BT + 24, out_tokens=40, ends_at=6.0)  # shares 37
    assert r.held_blocks() == 38 + 1 + 2  # 24 + 40 tokens: two blocks


def test_another_document_waits_for_the_request_whose_end_makes_room() -> None:
    """68 blocks of room. One question of document A holds 39; a question of document B
    needs 39: it waits for A's question to end. A question of A itself needs one block
    beside the 38 it shares: no wait."""
    r = room()
    a, b = doc(1224, seed=1), doc(1224, seed=2)
    r.add(a, prompt_tokens=1224, out_tokens=16, ends_at=10.8)
    assert r.wait_s(b, prompt_tokens=1224, out_tokens=16, now=10.0) == pytest.approx(0.8)
    assert r.wait_s(a, prompt_tokens=1224, out_tokens=16, now=10.0) == 0.0
    small = doc(640, seed=3)  # 20 blocks + 1: fits beside A's 39
    assert r.wait_s(small, prompt_tokens=640, out_tokens=16, now=10.0) == 0.0


def test_requests_end_in_expected_order_until_enough_is_freed() -> None:
    r = room(capacity_tokens=100 * BT)
    first = r.add(doc(30 * BT, seed=1), prompt_tokens=30 * BT, out_tokens=BT, ends_at=3.0)
    r.add(doc(30 * BT, seed=2), prompt_tokens=30 * BT, out_tokens=BT, ends_at=1.0)
    r.add(doc(30 * BT, seed=3), prompt_tokens=30 * BT, out_tokens=BT, ends_at=2.0)
    assert r.held_blocks() == 93
    need = doc(40 * BT, seed=4)  # 41 blocks with its output: two must end (ends 1.0, 2.0)
    assert r.wait_s(need, prompt_tokens=40 * BT, out_tokens=BT, now=0.5) == pytest.approx(1.5)
    need = doc(7 * BT, seed=5)  # 8 blocks: one must end, the earliest
    assert r.wait_s(need, prompt_tokens=7 * BT, out_tokens=BT, now=0.5) == pytest.approx(0.5)
    r.expect_end(first, 0.7)  # its first token came: it ends sooner than thought
    assert r.wait_s(need, prompt_tokens=7 * BT, out_tokens=BT, now=0.5) == pytest.approx(0.2)
    assert r.wait_s(need, prompt_tokens=7 * BT, out_tokens=BT, now=0.9) == 0.0  # overdue
    r.remove(first)
    r.remove(first)  # twice: nothing
    r.expect_end(first, 9.0)  # after removal: nothing
    assert len(r) == 2 and r.held_blocks() == 62
    assert r.wait_s(need, prompt_tokens=7 * BT, out_tokens=BT, now=0.5) == 0.0


def test_a_request_larger_than_the_cache_never_waits_here() -> None:
    r = room(capacity_tokens=10 * BT)
    r.add(doc(5 * BT, seed=1), prompt_tokens=5 * BT, out_tokens=0, ends_at=100.0)
    assert r.wait_s(doc(11 * BT, seed=2), prompt_tokens=11 * BT, out_tokens=0, now=0.0) == 0.0


@pytest.mark.parametrize(("capacity", "block"), [(0, BT), (100, 0), (-1, BT)])
def test_a_room_needs_a_capacity_and_a_block_size(capacity: int, block: int) -> None:
    with pytest.raises(ValueError, match="both must be >= 1"):
        KvRoom(capacity_tokens=capacity, block_tokens=block)


def _reference_wait(residents: list[tuple[frozenset[bytes], int, float]], keys: Sequence[bytes],
                    extra: int, capacity: int, now: float) -> float:
    """The rule by brute force: residents end in expected order (ties in arrival order)
    until the request's blocks fit beside the rest."""
    if len(set(keys)) + extra > capacity:
        return 0.0
    left = sorted(residents, key=lambda r: r[2])
    freed_by = now
    while True:
        held = set().union(*(r[0] for r in left)) if left else set()
        if len(held) + sum(r[1] for r in left) + len(set(keys) - held) + extra <= capacity:
            return max(0.0, freed_by - now)
        freed_by = left.pop(0)[2]


@settings(max_examples=300, deadline=None)
@given(residents=st.lists(st.tuples(st.sets(st.integers(0, 40), max_size=25),
                                    st.integers(0, 6), st.integers(0, 20)), max_size=8),
       mine=st.sets(st.integers(0, 40), max_size=30), out=st.integers(0, 100),
       capacity_blocks=st.integers(1, 80), ended=st.sets(st.integers(0, 7)))
def test_the_wait_is_the_brute_force_rule_whatever_the_residents(
        residents: list[tuple[set[int], int, int]], mine: set[int], out: int,
        capacity_blocks: int, ended: set[int]) -> None:
    """Residents sharing blocks in any pattern, some already over: the room's incremental
    counts give the brute-force answer, and its held blocks are the distinct blocks plus
    the extras."""
    def key(i: int) -> bytes:
        return i.to_bytes(16, "big")

    r = room(capacity_tokens=capacity_blocks * BT)
    ids, kept = [], []
    for blocks, extra, end in residents:
        ks = [key(i) for i in sorted(blocks)]
        ids.append(r.add(ks, prompt_tokens=len(ks) * BT + extra * BT, out_tokens=0,
                         ends_at=float(end)))
        kept.append((frozenset(ks), extra, float(end)))
    for i in sorted(ended):
        if i < len(ids):
            r.remove(ids[i])
            kept[i] = (frozenset(), 0, -1.0)
    live = [k for k in kept if k[2] >= 0]
    assert r.held_blocks() == (len(set().union(*(k[0] for k in live))) if live else 0) + \
        sum(k[1] for k in live)
    ks = [key(i) for i in sorted(mine)]
    want = _reference_wait(live, ks, -(-out // BT), capacity_blocks, now=3.0)
    assert r.wait_s(ks, prompt_tokens=len(ks) * BT, out_tokens=out, now=3.0) == want
