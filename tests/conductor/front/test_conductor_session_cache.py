"""``conductor.front.session_cache``: exact, on one clock shared with a real in-process
node (DRAM only), through a recorder that passes every call on to the node and keeps its
order."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest

from conductor.front.session_cache import (
    MAX_SESSION_KEYS,
    SessionCache,
    check_session_ttl,
    session_of_request,
)
from kvstore.core.keys import BlockKey
from kvstore.core.retention import MAX_RETAIN_KEYS, RetainOutcome
from kvstore.node.semantics import Node, NodeSettings

BLOCK = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """The node's ``retain`` and ``prefetch``, with a log of (call, seconds, n keys)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.log: list[tuple[str, float, int]] = []
        self.fail = False

    def retain(self, keys: Sequence[bytes], retain_s: float) -> list[RetainOutcome]:
        self.log.append(("retain", retain_s, len(keys)))
        if self.fail:
            raise ConnectionError("the store is down")
        return self.node.retain([BlockKey(k) for k in keys], retain_s)

    def prefetch(self, keys: Sequence[bytes], tier: str = "dram", *, wait: bool = False
                 ) -> list[Any]:
        self.log.append(("prefetch", 0.0, len(keys)))
        return self.node.prefetch([BlockKey(k) for k in keys], tier, wait=wait)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> Any:
    node = Node(NodeSettings(dram_bytes=256 * BLOCK, prefault=False), clock=clock)
    yield Recorder(node)
    node.close()


def stored(store: Recorder, n: int) -> list[bytes]:
    keys = [os.urandom(16) for _ in range(n)]
    for k in keys:
        assert store.node.put(BlockKey(k), memoryview(b"x" * BLOCK))
    return keys


def retained(store: Recorder) -> int:
    return int(store.node.stats()["node"]["retained_blocks"])


def test_a_turn_is_retained_for_the_ttl_and_refreshed_by_the_next(clock: Clock,
                                                                  store: Recorder) -> None:
    cache = SessionCache(store, ttl_s=60, clock=clock)
    turn1 = stored(store, 3)
    assert cache.arrive("s", turn1) == 0  # unknown session: nothing to prefetch
    cache.end_turn("s", turn1)
    assert store.log == [("retain", 60, 3)]
    assert retained(store) == 3
    clock.now += 50
    turn2 = [*turn1, *stored(store, 2)]
    assert cache.arrive("s", turn2) == 3  # the last turn's blocks, to DRAM
    cache.end_turn("s", turn2)
    assert store.log[1:] == [("prefetch", 0, 3), ("retain", 60, 5)]
    clock.now += 59.999  # 60 s after the second turn ended, less a hair: all kept
    assert retained(store) == 5
    assert cache.sweep() == 0
    clock.now += 0.001
    assert cache.sweep() == 1  # idle past its TTL: released
    assert store.log[3:] == [("retain", 0, 5)]
    assert "s" not in cache and cache.keys_of("s") is None
    assert cache.snapshot() | {"ttl_s": 60.0} == {
        "ttl_s": 60.0, "sessions": 0, "keys_held": 0, "turns": 2, "prefetch_calls": 1,
        "prefetched_keys": 3, "retain_calls": 2, "retained_keys": 8, "denied_keys": 0,
        "missing_keys": 0, "released_keys": 5, "deleted": 0, "expired": 1, "evicted": 0,
        "store_errors": 0}


def test_blocks_the_next_prompt_drops_are_released_and_only_the_shared_prefix_prefetched(
        clock: Clock, store: Recorder) -> None:
    cache = SessionCache(store, ttl_s=60, clock=clock)
    a, b, c, d = stored(store, 4)
    cache.end_turn("s", [a, b, c])
    assert cache.arrive("s", [a, d]) == 1  # the prompt diverged after a
    cache.end_turn("s", [a, d])
    assert store.log == [("retain", 60, 3), ("prefetch", 0, 1), ("retain", 60, 2),
                         ("retain", 0, 2)]
    assert store.node.retain([BlockKey(b), BlockKey(c)], 0) == ["released"] * 2
    assert retained(store) == 2  # a and d


def test_a_block_two_sessions_hold_is_released_only_when_both_let_go(
        clock: Clock, store: Recorder) -> None:
    cache = SessionCache(store, ttl_s=60, clock=clock)
    system, x, y = stored(store, 3)
    cache.end_turn("one", [system, x])
    cache.end_turn("two", [system, y])
    assert cache.delete("one") is True
    assert store.log[-1] == ("retain", 0, 1)  # x only: "two" still holds the system prompt
    assert retained(store) == 2
    assert cache.delete("one") is False  # unknown now
    assert cache.delete("two") is True
    assert store.log[-1] == ("retain", 0, 2)
    assert retained(store) == 0
    assert cache.snapshot()["deleted"] == 2


def test_the_table_is_bounded_and_the_least_recent_session_is_released(
        clock: Clock, store: Recorder) -> None:
    cache = SessionCache(store, ttl_s=60, max_sessions=2, clock=clock)
    keys = stored(store, 3)
    for i, k in enumerate(keys):
        clock.now += 1
        cache.end_turn(f"s{i}", [k])
    assert len(cache) == 2 and "s0" not in cache
    assert store.log[-1] == ("retain", 0, 1)
    assert cache.snapshot()["evicted"] == 1
    assert retained(store) == 2


def test_ttl_zero_is_off_and_asks_nothing_of_the_store(clock: Clock, store: Recorder) -> None:
    cache = SessionCache(store, ttl_s=0, clock=clock)
    keys = stored(store, 2)
    assert cache.arrive("s", keys) == 0
    cache.end_turn("s", keys)
    assert cache.sweep() == 0
    assert cache.delete("s") is False
    assert store.log == [] and len(cache) == 0 and not cache.enabled


def test_store_failures_are_counted_and_the_turn_goes_on(clock: Clock, store: Recorder
                                                          ) -> None:
    cache = SessionCache(store, ttl_s=60, clock=clock)
    store.fail = True
    keys = stored(store, 2)
    cache.end_turn("s", keys)
    assert cache.keys_of("s") == tuple(keys)
    assert cache.snapshot()["store_errors"] == 1


def test_long_prompts_are_kept_up_to_the_bound_in_bounded_calls(clock: Clock,
                                                                store: Recorder) -> None:
    cache = SessionCache(store, ttl_s=60, clock=clock)
    keys = [os.urandom(16) for _ in range(MAX_SESSION_KEYS + 5)]
    cache.end_turn("s", keys)
    assert store.log == [("retain", 60, MAX_RETAIN_KEYS)] * (MAX_SESSION_KEYS // MAX_RETAIN_KEYS)
    assert cache.snapshot()["missing_keys"] == MAX_SESSION_KEYS  # never stored here


def test_the_session_is_named_by_header_or_field() -> None:
    assert session_of_request(" h ", {"session_id": "f"}) == "h"
    assert session_of_request(None, {"session_id": "f"}) == "f"
    assert session_of_request("", {"session_id": "f"}) == "f"
    assert session_of_request(None, {"session_id": 7}) is None
    assert session_of_request(None, {"session_id": "x" * 257}) is None
    assert session_of_request(None, {}) is None


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), 8 * 24 * 3600.0])
def test_a_bad_ttl_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="session TTL"):
        check_session_ttl(bad)
    assert check_session_ttl(0) == 0.0


def test_a_turn_is_counted_only_once_its_retain_has_answered(clock: Clock,
                                                             store: Recorder) -> None:
    """Whoever reads the counts (a test, a stats scrape) and sees the turn sees what its
    retain found: the retain answers first, the turn is counted after."""
    cache = SessionCache(store, ttl_s=60, clock=clock)
    keys = stored(store, 2)
    seen: list[tuple[int, int]] = []
    plain = store.retain

    def retain(ks: Sequence[bytes], retain_s: float) -> list[RetainOutcome]:
        out = plain(ks, retain_s)
        snap = cache.snapshot()
        seen.append((snap["turns"], snap["retained_keys"]))  # while the retain answers
        return out

    store.retain = retain  # type: ignore[method-assign]
    cache.end_turn("s", keys)
    snap = cache.snapshot()
    assert seen == [(0, 0)]
    assert (snap["turns"], snap["retained_keys"]) == (1, 2)
