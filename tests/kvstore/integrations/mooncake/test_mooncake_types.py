"""Mooncake 0.3.13's value types (``mooncake_types``): ReplicateConfig, SoftPinAction and the
one mapping from soft pins to kvstore retention, exactly."""

from __future__ import annotations

import pytest

from kvstore.core.errors import InvalidArgument
from kvstore.integrations.mooncake.types import (
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
    check_placement,
    retain_seconds,
)


def _config(action: SoftPinAction, ttl: object = None) -> ReplicateConfig:
    c = ReplicateConfig()
    c.soft_pin_action = action
    c.soft_pin_ttl_ms = ttl  # type: ignore[assignment]
    return c


def test_defaults_match_the_wheel() -> None:
    c = ReplicateConfig()
    assert (c.replica_num, c.nof_replica_num, c.dfs_replica_num, c.soft_pin_action,
            c.soft_pin_ttl_ms, c.with_hard_pin, c.preferred_segment, c.preferred_segments,
            c.preferred_nof_segments, c.prefer_alloc_in_same_node, c.data_type,
            c.group_ids) == (1, 0, 0, SoftPinAction.PRESERVE, None, False, "", [], [], False,
                             ObjectDataType.UNKNOWN, None)
    assert [(a.name, a.value) for a in SoftPinAction] == [
        ("PRESERVE", 0), ("ENABLE", 1), ("DISABLE", 2)]
    assert repr(c) == ("ReplicateConfig(replica_num=1, dfs_replica_num=0, "
                       "soft_pin_action=PRESERVE, soft_pin_ttl_ms=default, with_hard_pin=False)")


def test_with_soft_pin_is_gone_as_in_0_3_13() -> None:
    with pytest.raises(AttributeError):
        ReplicateConfig().with_soft_pin = True  # type: ignore[attr-defined]


@pytest.mark.parametrize(("config", "want"), [
    (None, None),
    (ReplicateConfig(), None),
    (_config(SoftPinAction.DISABLE), None),
    (_config(SoftPinAction.ENABLE), 1800.0),  # Mooncake's master default: 30 minutes
    (_config(SoftPinAction.ENABLE, 60_000), 60.0),
    (_config(SoftPinAction.ENABLE, 1), 0.001),
    (_config(SoftPinAction.ENABLE, 0), None),  # zero: ordinary cache
    (_config(SoftPinAction.ENABLE, 24 * 3600 * 1000), 86400.0),
])
def test_retain_seconds(config: ReplicateConfig | None, want: float | None) -> None:
    assert retain_seconds(config) == want


@pytest.mark.parametrize(("config", "message"), [
    (_config(SoftPinAction.PRESERVE, 1000), "soft_pin_ttl_ms=1000 needs soft_pin_action=ENABLE"),
    (_config(SoftPinAction.DISABLE, 0), "needs soft_pin_action=ENABLE, not DISABLE"),
    (_config(SoftPinAction.ENABLE, 24 * 3600 * 1000 + 1), "from 0 to 86400000"),
    (_config(7), "must be a SoftPinAction, got 7"),  # type: ignore[arg-type]
])
def test_retain_seconds_refuses(config: ReplicateConfig, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        retain_seconds(config)


class _Index:
    """An integer by ``__index__`` (as numpy's integers are): the wheel takes it."""

    def __index__(self) -> int:
        return 5


# What the 0.3.13 wheel's pybind11 setter (``std::optional<uint64_t>``) does with each value,
# checked against the wheel itself (tests/mooncake_scenario.py, ``ttl_types``).
@pytest.mark.parametrize(("value", "stored"), [
    (None, None), (0, 0), (60_000, 60_000), (True, 1), (False, 0), (2**64 - 1, 2**64 - 1),
    (_Index(), 5),
])
def test_soft_pin_ttl_takes_none_or_a_uint64_as_the_wheel_does(value: object,
                                                               stored: int | None) -> None:
    c = ReplicateConfig()
    c.soft_pin_ttl_ms = value  # type: ignore[assignment]
    assert c.soft_pin_ttl_ms == stored and type(c.soft_pin_ttl_ms) is type(stored)


@pytest.mark.parametrize("value", [1.0, 1.5, float("nan"), "5", b"5", -1, 2**64, [], object()])
def test_soft_pin_ttl_of_another_type_is_a_type_error_and_changes_nothing(value: object) -> None:
    c = ReplicateConfig()
    c.soft_pin_ttl_ms = 1000
    with pytest.raises(TypeError, match="soft_pin_ttl_ms"):
        c.soft_pin_ttl_ms = value  # type: ignore[assignment]
    assert c.soft_pin_ttl_ms == 1000


def test_placement_refuses_replica_kinds_kvstore_lacks() -> None:
    check_placement(None)
    check_placement(ReplicateConfig())
    for name in ("nof_replica_num", "dfs_replica_num"):
        c = ReplicateConfig()
        setattr(c, name, 1)
        with pytest.raises(InvalidArgument, match=f"{name}=1: kvstore has no such replica"):
            check_placement(c)
