"""EngineActivity: what the vLLM connector's scheduler side knows of the engine's work."""

from __future__ import annotations

from kvstore.integrations.vllm.load_mode import EngineActivity


def test_idle_until_a_request_runs_and_again_once_it_finished() -> None:
    a = EngineActivity()
    assert a.idle()
    a.scheduled(["r1", "r2"])
    assert not a.idle()
    a.finished("r1")
    assert not a.idle()
    a.finished("r2")
    assert a.idle()


def test_an_asynchronous_load_keeps_it_busy_until_it_landed_or_its_request_ended() -> None:
    a = EngineActivity()
    a.load_started("r1")
    assert not a.idle()
    a.load_done("r1")
    assert a.idle()
    a.load_started("r2")
    a.finished("r2")  # aborted while loading
    assert a.idle()


def test_unknown_ids_are_no_op() -> None:
    a = EngineActivity()
    a.finished("never-seen")
    a.load_done("never-seen")
    assert a.idle() and a.running == set() and a.loading == set()


def test_inline_when_idle_or_small_and_never_when_switched_off() -> None:
    from kvstore.integrations.vllm.load_mode import InlineLoads

    idle, busy = EngineActivity(), EngineActivity()
    busy.scheduled(["r1"])
    rule = InlineLoads(busy_max_bytes=100)
    assert rule.inline(idle, planned=0, planned_inline_bytes=0, load_bytes=10**9)
    assert rule.inline(busy, planned=0, planned_inline_bytes=0, load_bytes=100)
    assert not rule.inline(busy, planned=0, planned_inline_bytes=0, load_bytes=101)
    # A load planned this pass already: the step's inline loads share the bound.
    assert rule.inline(idle, planned=1, planned_inline_bytes=60, load_bytes=40)
    assert not rule.inline(idle, planned=1, planned_inline_bytes=60, load_bytes=41)
    assert not rule.inline(idle, planned=1, planned_inline_bytes=10**9, load_bytes=1)
    only_idle = InlineLoads(busy_max_bytes=0)
    assert only_idle.inline(idle, planned=0, planned_inline_bytes=0, load_bytes=10**9)
    assert not only_idle.inline(busy, planned=0, planned_inline_bytes=0, load_bytes=1)
    off = InlineLoads(when_idle=False)
    assert not off.inline(idle, planned=0, planned_inline_bytes=0, load_bytes=1)


def test_a_negative_bound_is_refused() -> None:
    import pytest

    from kvstore.integrations.vllm.load_mode import InlineLoads

    with pytest.raises(ValueError, match="busy_max_bytes must be >= 0"):
        InlineLoads(busy_max_bytes=-1)


def test_from_config_reads_both_keys_and_names_a_bad_one() -> None:
    import pytest

    from kvstore.integrations.vllm.load_mode import DEFAULT_BUSY_MAX_BYTES, InlineLoads

    assert InlineLoads.from_config({}.get, hybrid=False) == InlineLoads(
        when_idle=True, busy_max_bytes=DEFAULT_BUSY_MAX_BYTES)
    got = InlineLoads.from_config({"load_inline_busy_max_bytes": 0}.get, hybrid=False)
    assert got == InlineLoads(when_idle=True, busy_max_bytes=0)
    assert not InlineLoads.from_config({}.get, hybrid=True).when_idle  # async only
    with pytest.raises(ValueError, match="load_inline_busy_max_bytes must be an integer"):
        InlineLoads.from_config({"load_inline_busy_max_bytes": "16"}.get, hybrid=False)
    with pytest.raises(ValueError, match="load_inline_when_idle must be true or false"):
        InlineLoads.from_config({"load_inline_when_idle": "false"}.get, hybrid=False)
