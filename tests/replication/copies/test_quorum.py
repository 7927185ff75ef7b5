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


def test_wait_all_lends_the_bytes_so_it_takes_no_bound(pool) -> None:
    with pytest.raises(ValueError, match="wait_all"):
        quorum.run(pool, [(["a"], lambda _: None)], copies=2, write_quorum=2, wait_all=True,
                   wait_s=1.0)
    with pytest.raises(ValueError, match="wait_all"):
        quorum.run(pool, [(["a"], lambda _: None)], copies=2, write_quorum=2, wait_all=True,
                   cancel=quorum.Cancel())
