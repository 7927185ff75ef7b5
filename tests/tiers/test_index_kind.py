"""Which tier index runs: the caller's kind, else KVSTORE_NATIVE_INDEX, else the default;
the native one only where it is built."""

from __future__ import annotations

import pytest

from tiers import index_kind
from tiers.block_table import PyBlockTable, make_table
from tiers.index_kind import ENV, IndexUnavailable, requested_kind, resolve
from tiers.live_table import PyLiveTable, make_live_table


@pytest.mark.parametrize(("value", "kind"), [("", None), ("1", "native"), ("native", "native"),
                                             ("0", "python"), ("python", "python")])
def test_the_environment_names_a_kind(monkeypatch: pytest.MonkeyPatch, value: str,
                                      kind: str | None) -> None:
    monkeypatch.setenv(ENV, value)
    assert requested_kind() == kind


def test_a_bad_environment_value_or_kind_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=ENV):
        requested_kind()
    with pytest.raises(ValueError, match="index must be one of"):
        resolve("rust")


def test_a_named_kind_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    assert resolve("python") == "python"
    assert isinstance(make_table("python"), PyBlockTable)
    assert isinstance(make_live_table("python"), PyLiveTable)


def test_without_the_extension_native_falls_back_unless_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_kind, "native_available", lambda: False)
    monkeypatch.setenv(ENV, "1")
    assert resolve(None) == "python"
    assert isinstance(make_table(), PyBlockTable)
    with pytest.raises(IndexUnavailable):
        resolve("native")


def test_unset_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(index_kind, "native_available", lambda: True)
    assert resolve(None) == index_kind.DEFAULT_INDEX


@pytest.mark.parametrize(("env", "built", "blocks", "kind"), [
    (None, True, index_kind.AUTO_NATIVE_BLOCKS - 1, "python"),
    (None, True, index_kind.AUTO_NATIVE_BLOCKS, "native"),
    (None, True, 50_000_000, "native"),
    (None, False, 50_000_000, "python"),  # not built: the Python index, whatever the size
    ("0", True, 50_000_000, "python"),    # the environment wins both ways
    ("1", True, 1, "native"),
    ("1", False, 1, "python"),
])
def test_a_node_of_a_million_planned_blocks_or_more_runs_the_native_index(
        monkeypatch: pytest.MonkeyPatch, env: str | None, built: bool, blocks: int,
        kind: str) -> None:
    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    monkeypatch.setattr(index_kind, "native_available", lambda: built)
    assert index_kind.for_planned_blocks(blocks) == kind
