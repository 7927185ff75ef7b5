"""``replication.copies.quorum``: copies to a write quorum, bounded waits and cancellation."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.core.errors import Unavailable
from replication.copies import quorum


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=4) as p:
        yield p


def test_a_failed_target_is_replaced_by_the_next_candidate_in_order(pool) -> None:
    tried: list[str] = []

    def push(addr: str) -> None:
        tried.append(addr)
        if addr == "b":
            raise Unavailable("b is down")

    out = quorum.run(pool, [(["b", "c", "d"], push)], copies=2, write_quorum=2)
    assert (out.copies, out.stored_on, out.failed, tried) == (2, ["c"], ["b: b is down"],
                                                              ["b", "c"])


def test_a_push_failing_after_cancel_says_the_node_is_stopping_and_is_not_replaced(
        pool) -> None:
    """The node stops: ``Cancel.set`` marks the round before the node closes the push's
    connection, so the failure that follows carries the reason and starts no
    replacement, whichever of the two the waiting caller sees first."""
    cancel = quorum.Cancel()
    started, fail = threading.Event(), threading.Event()
    tried: list[str] = []

    def push(addr: str) -> None:
        tried.append(addr)
        started.set()
        fail.wait(10)
        raise Unavailable("Channel closed!")

    result: list[quorum.QuorumResult] = []
    caller = threading.Thread(target=lambda: result.append(quorum.run(
        pool, [(["a", "b"], push)], copies=2, write_quorum=2, wait_s=60, cancel=cancel)))
    caller.start()
    assert started.wait(10)
    cancel.set()
    fail.set()  # the node closes its peer connections after cancelling
    caller.join(10)
    out = result[0]
    assert out.copies == 1 and tried == ["a"]
    assert all("node is stopping" in f for f in out.failed), out.failed
    assert any(f.startswith("b: ") for f in out.failed)  # never started, reported


def test_a_bounded_wait_reports_the_pushes_still_sending(pool) -> None:
    release = threading.Event()

    def push(addr: str) -> None:
        release.wait(10)

    out = quorum.run(pool, [(["a"], push)], copies=2, write_quorum=2, wait_s=0.05)
    release.set()
    assert (out.copies, out.failed) == (1, ["a: still sending, timed out"])


class _Lent:
    """``run_lent``'s ``start``: logs each half of each push, failing where told."""

    def __init__(self, *, fail_start: set[str] = frozenset(),
                 fail_finish: dict[str, Exception] | None = None) -> None:
        self.log: list[str] = []
        self.fail_start = fail_start
        self.fail_finish = fail_finish or {}

    def start(self, addr: str, items: list[str]):
        self.log.append(f"start {addr} {''.join(items)}")
        if addr in self.fail_start:
            raise Unavailable(f"{addr} refused")

        def finish() -> None:
            self.log.append(f"finish {addr}")
            if addr in self.fail_finish:
                raise self.fail_finish[addr]
        return finish


def test_lent_pushes_are_all_started_before_any_answer_is_read_one_per_target() -> None:
    lent = _Lent()
    out = quorum.run_lent([(["b", "c"], ["1"]), (["c", "a"], ["2", "3"])], lent.start,
                          copies=3)
    assert lent.log == ["start b 1", "start c 123", "start a 23",
                        "finish b", "finish c", "finish a"]
    assert (out.copies, out.stored_on, out.failed) == (3, ["c"], [])


def test_a_lent_push_failing_is_replaced_by_the_next_candidate_in_order() -> None:
    lent = _Lent(fail_start={"b"}, fail_finish={"c": Unavailable("c is down")})
    out = quorum.run_lent([(["b", "c", "d", "e"], ["1"])], lent.start, copies=2)
    assert lent.log == ["start b 1", "start c 1", "finish c", "start d 1", "finish d"]
    assert (out.copies, out.stored_on, out.failed) == (
        2, ["d"], ["b: b refused", "c: c is down"])


def test_a_dead_target_is_tried_once_however_many_groups_rank_it() -> None:
    """Three groups push to ``x`` in the first wave: one push carries all three, its
    failure fails all three, and the replacements (one wave later) skip ``x``."""
    lent = _Lent(fail_finish={"x": Unavailable("x timed out")})
    out = quorum.run_lent([(["x", "b"], ["1"]), (["c", "x", "d", "x2"], ["2"]),
                           (["x", "d", "e"], ["3"])], lent.start, copies=3)
    assert lent.log == ["start x 123", "start b 1", "start c 2", "start d 3",
                        "finish x", "finish b", "finish c", "finish d",
                        "start d 2", "start e 3", "finish d", "finish e"]
    assert (out.copies, out.stored_on) == (2, [])  # the first group had no candidate left
    assert out.failed == ["x: x timed out"] * 3


def test_lent_copies_are_the_fewest_any_group_reached() -> None:
    lent = _Lent(fail_finish={"b": Unavailable("b is down")})
    out = quorum.run_lent([(["a"], ["1"]), (["b"], ["2"])], lent.start, copies=2)
    assert (out.copies, out.stored_on, out.failed) == (1, [], ["b: b is down"])


def test_a_bug_in_a_lent_push_is_reported_and_replaced(caplog) -> None:
    lent = _Lent(fail_finish={"a": RuntimeError("oops")})
    out = quorum.run_lent([(["a", "b"], ["1"])], lent.start, copies=2)
    assert (out.copies, out.stored_on, out.failed) == (2, ["b"], ["a: internal error: oops"])
    assert "replicating to a failed" in caplog.text


def test_one_copy_pushes_nothing() -> None:
    lent = _Lent()
    assert quorum.run_lent([(["a"], ["1"])], lent.start, copies=1).copies == 1
    assert lent.log == []
