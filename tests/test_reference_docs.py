"""README.md's generated references (``make docs``) must match the code they describe."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from conftest import REPO

from kvstore.node.config import NodeConfig
from kvstore.node.metrics import METRICS

SCRIPT = REPO / "scripts" / "gen_reference.py"


def gen_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_what_the_script_generates() -> None:
    readme = (REPO / "README.md").read_text()
    assert gen_reference().render(readme) == readme, (
        "README.md is out of date: run `make docs` (scripts/gen_reference.py)")


def test_check_mode_exit_codes(tmp_path: Path) -> None:
    stale = tmp_path / "README.md"
    stale.write_text("intro\n<!-- BEGIN GENERATED: config -->\nSTALE-ROW\n"
                     "<!-- END GENERATED: config -->\nmiddle\n"
                     "<!-- BEGIN GENERATED: metrics -->\n<!-- END GENERATED: metrics -->\nend\n")
    run = [sys.executable, str(SCRIPT), "--readme", str(stale)]
    check = subprocess.run([*run, "--check"], capture_output=True, text=True, cwd=tmp_path)
    assert check.returncode == 1 and "run `make docs`" in check.stderr
    assert subprocess.run(run, capture_output=True, cwd=tmp_path).returncode == 0
    text = stale.read_text()
    assert text.startswith("intro\n") and "\nmiddle\n" in text and text.endswith("\nend\n")
    assert "STALE-ROW" not in text
    assert subprocess.run([*run, "--check"], capture_output=True, cwd=tmp_path).returncode == 0


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
