"""The connector's loader and saver threads run on every CPU even when the thread that
starts them is pinned to one (as vLLM's CPU worker pins its main thread)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from kvstore.integrations.vllm.threads import GIL_SWITCH_MS, io_executor, shorten_gil_switch

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs thread affinity and two CPUs")


def masks_from_a_pinned_thread() -> tuple[set[int], set[int]]:
    """(the pinned thread's mask, the mask of an ``io_executor`` thread it started)."""
    out: dict[str, set[int]] = {}

    def pinned() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        out["pinned"] = os.sched_getaffinity(0)
        ex = io_executor("test-io")
        try:
            out["io"] = ex.submit(os.sched_getaffinity, 0).result()
        finally:
            ex.shutdown()

    t = threading.Thread(target=pinned)
    t.start()
    t.join()
    return out["pinned"], out["io"]


def test_an_io_thread_is_not_confined_to_its_creators_cpu() -> None:
    everywhere = os.sched_getaffinity(0)
    pinned, io = masks_from_a_pinned_thread()
    assert len(pinned) == 1
    assert io >= everywhere  # every CPU this process may use, not just the creator's


def test_shorten_gil_switch_only_ever_shortens() -> None:
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert shorten_gil_switch(GIL_SWITCH_MS / 1000) == GIL_SWITCH_MS / 1000
        assert shorten_gil_switch(0.002) == GIL_SWITCH_MS / 1000  # longer: kept
        assert shorten_gil_switch(0) == GIL_SWITCH_MS / 1000  # 0: leave it
        assert sys.getswitchinterval() == GIL_SWITCH_MS / 1000
    finally:
        sys.setswitchinterval(before)
