"""kvstore.core.toml_files: one mapping of an unreadable or malformed operator file to
ValueError."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.core.toml_files import load_toml


def test_a_document_loads_as_its_table(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text('listen = "127.0.0.1:7600"\n[[tenant]]\nname = "a"\n')
    assert load_toml(f, "config") == {"listen": "127.0.0.1:7600", "tenant": [{"name": "a"}]}


def test_unreadable_files_name_the_file_and_the_reason(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ValueError) as info:
        load_toml(missing, "auth file")
    assert str(info.value) == f"cannot read auth file {missing}: No such file or directory"
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(ValueError) as info:
        load_toml(tmp_path, "config")
    assert str(info.value) == f"cannot read config {tmp_path}: Is a directory"


def test_malformed_text_names_the_file_and_where(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("listen = \n")
    with pytest.raises(ValueError) as info:
        load_toml(f, "config")
    assert str(info.value) == (f"config {f} is not valid TOML: "
                               "Invalid value (at line 1, column 10)")
