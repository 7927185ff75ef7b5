"""``kvstore.integrations.vllm.versions``: the one list of vLLM versions the connector runs
under, the check against it, and the docs' table that must say the same (no vLLM needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstore.integrations.vllm.versions import (
    SUPPORTED,
    UnsupportedVLLMVersion,
    check_vllm_version,
    minor_of,
)

DOCS = Path(__file__).resolve().parents[4] / "docs" / "engines" / "vllm.md"


@pytest.mark.parametrize(("version", "minor"), [
    ("0.32.0", "0.32"), ("0.32.0+cpu", "0.32"), ("0.33.1rc1", "0.33"), ("1.0", "1.0"),
    ("0.033.0", "0.33"), ("dev", None), ("", None), ("0", None),
])
def test_minor_of(version: str, minor: str | None) -> None:
    assert minor_of(version) == minor


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.5", "0.33.0", "0.33.2"])
def test_listed_versions_pass(version: str) -> None:
    assert check_vllm_version(version).minor == minor_of(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "dev", "0.3.32"])
def test_others_are_refused_by_name(version: str) -> None:
    with pytest.raises(UnsupportedVLLMVersion) as caught:
        check_vllm_version(version)
    assert isinstance(caught.value, ImportError)  # vLLM reports it as a failed import
    message = str(caught.value)
    assert f"found vLLM {version}" in message
    assert "supports vLLM 0.32.x, 0.33.x" in message


def test_the_list_is_ordered_and_unique() -> None:
    minors = [tuple(int(p) for p in e.minor.split(".")) for e in SUPPORTED]
    assert minors == sorted(set(minors))


def test_the_docs_table_lists_the_same_versions() -> None:
    """docs/engines/vllm.md's "Supported shapes" table has one "vLLM X.Y" row per entry."""
    rows = re.findall(r"^\| vLLM (\d+\.\d+) \|", DOCS.read_text(), flags=re.M)
    assert rows == [e.minor for e in SUPPORTED]
