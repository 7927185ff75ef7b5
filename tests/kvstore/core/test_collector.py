"""``collector_paused``: no automatic collection inside, the collector as it was after."""

from __future__ import annotations

import gc

import pytest

from kvstore.core.collector import collector_paused


@pytest.fixture(autouse=True)
def _collector_restored() -> object:
    was = gc.isenabled()
    yield None
    if was:
        gc.enable()
    else:
        gc.disable()


def test_the_collector_is_paused_inside_and_enabled_again_after() -> None:
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_error_inside_still_enables_it_again() -> None:
    gc.enable()
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("x")
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled() -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
