"""The tests mirror the source tree: ``tests/<package>/<subpackage>/test_<module>.py``.

Engine tests stay in ``tests/engines/`` (each engine's own environment runs them). Test
files have no ``__init__.py`` beside them (pytest's default import mode puts each file's
folder on ``sys.path`` and imports it by its base name), so two test files may not share
a base name.
"""

from __future__ import annotations

from collections import Counter

from conftest import REPO

TESTS = REPO / "tests"
PROJECT_WIDE = {"test_import_graph.py", "test_type_ignores.py", "test_reference_docs.py",
                "test_documented_paths.py", "test_layout.py", "test_docs.py",
                "test_private_access.py"}
"""Tests of the whole tree, not of one package: they stay at the top of tests/."""
OWN_FOLDERS = {"engines", "vectors", "__pycache__"}


def _test_files() -> list[str]:
    return sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                  if p.relative_to(TESTS).parts[0] not in OWN_FOLDERS)


def test_every_test_folder_is_a_source_folder() -> None:
    folders = {p.relative_to(TESTS) for p in TESTS.rglob("*") if p.is_dir()
               and p.relative_to(TESTS).parts[0] not in OWN_FOLDERS
               and p.name != "__pycache__"}
    assert sorted(str(f) for f in folders if not (REPO / f).is_dir()) == []


def test_only_project_wide_tests_sit_at_the_top() -> None:
    top = {f for f in _test_files() if "/" not in f}
    assert top == PROJECT_WIDE


def test_test_file_names_are_unique() -> None:
    names = Counter(f.rsplit("/", 1)[-1] for f in _test_files())
    assert [n for n, c in names.items() if c > 1] == []
