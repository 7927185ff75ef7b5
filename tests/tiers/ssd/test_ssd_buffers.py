"""tiers.ssd.buffers: the descriptor guard and the scratch arenas."""

from __future__ import annotations

import threading

import pytest

from tiers.ssd.buffers import ArenaPool, InlineIO, address_of


def test_close_waits_for_transfers_in_callers_threads() -> None:
    gate = InlineIO()
    inside, leave, closed = threading.Event(), threading.Event(), threading.Event()

    def transfer() -> None:
        with gate.running():
            inside.set()
            leave.wait(5)

    def close() -> None:
        gate.close()
        closed.set()

    t = threading.Thread(target=transfer)
    t.start()
    assert inside.wait(5)
    c = threading.Thread(target=close)
    c.start()
    assert not closed.wait(0.2)  # the transfer still runs: close must not return
    leave.set()
    assert closed.wait(5)
    t.join()
    c.join()
    with pytest.raises(ValueError, match="closed"), gate.running():  # refused once closed
        pass


def test_arenas_are_page_aligned_and_reused() -> None:
    pool = ArenaPool(1 << 20)
    a = pool.acquire(5000)
    assert len(a) == 64 << 10 and address_of(memoryview(a)) % 4096 == 0
    pool.release(a)
    assert pool.acquire(10_000) is a  # the cached arena, its pages already faulted in
    pool.close()
