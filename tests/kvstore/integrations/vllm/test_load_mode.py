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
