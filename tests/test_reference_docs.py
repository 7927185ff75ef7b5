"""The docs' generated references (``make docs``: ``docs/configuration.md``,
``docs/metrics.md``) must match the code they describe."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO

from kvstore.node.config import NodeConfig
from kvstore.node.metrics import METRICS

SCRIPT = REPO / "scripts" / "gen_reference.py"


def gen_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_pages_are_what_the_script_generates() -> None:
    g = gen_reference()
    pages = g.pages(REPO / "docs")
    assert sorted(p.name for p in pages) == ["configuration.md", "metrics.md"]
    for page, names in pages.items():
        text = page.read_text()
        assert g.render(text, names) == text, (
            f"{page} is out of date: run `make docs` (scripts/gen_reference.py)")


def test_check_mode_exit_codes(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for page, name in (("configuration.md", "config"), ("metrics.md", "metrics")):
        (docs / page).write_text(f"intro\n<!-- BEGIN GENERATED: {name} -->\nSTALE-ROW\n"
                                 f"<!-- END GENERATED: {name} -->\nend\n")
    run = [sys.executable, str(SCRIPT), "--docs", str(docs)]
    check = subprocess.run([*run, "--check"], capture_output=True, text=True, cwd=tmp_path)
    assert check.returncode == 1 and "run `make docs`" in check.stderr
    assert "configuration.md" in check.stderr and "metrics.md" in check.stderr
    assert subprocess.run(run, capture_output=True, cwd=tmp_path).returncode == 0
    for page, header in (("configuration.md", "| flag |"), ("metrics.md", "| metric |")):
        text = (docs / page).read_text()
        assert text.startswith("intro\n") and text.endswith("\nend\n")
        assert "STALE-ROW" not in text and header in text
    assert subprocess.run([*run, "--check"], capture_output=True, cwd=tmp_path).returncode == 0


def test_a_page_without_its_markers_is_an_error(tmp_path: Path) -> None:
    g = gen_reference()
    with pytest.raises(ValueError, match="BEGIN GENERATED: metrics"):
        g.render("no markers here\n", ["metrics"])


def test_tables_cover_every_flag_key_and_metric() -> None:
    g = gen_reference()
    config = g.config_table()
    for field in dataclasses.fields(NodeConfig):
        assert f"| `{field.name}` |" in config, field.name
    for action in g.serve_parser()._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help"):
                assert f"`{option}`" in config, option
    assert '| `--dram-bytes` | `dram_bytes` | `"1GiB"` |' in config
    assert '| `--no-prefault` | `prefault` | `true` |' in config
    metrics = g.metrics_table()
    for m in METRICS:
        assert f"| `{m.name}`" in metrics, m.name
