"""The project's own code silences the type checker only where a third-party stub forces it,
and says so: every ``# type: ignore`` names its error code and gives its reason after it
(``# type: ignore[code]  # reason``). Read from the source with ``tokenize`` (comments only,
so a string that mentions the phrase is no hit); generated protobuf modules are skipped."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvstore", "tiers", "replication", "conductor", "workers", "benchmarks", "scripts",
            "cffi_build")
GENERATED = ("kvstore/proto/",)
IGNORE = re.compile(r"type:\s*ignore")
WITH_REASON = re.compile(r"#\s*type:\s*ignore\[[a-z0-9-]+(,\s*[a-z0-9-]+)*\]\s+#\s*\S.*")


def ignores(source: str) -> list[tuple[int, str]]:
    """(line, comment) of every comment that holds a ``type: ignore``."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(t.start[0], t.string) for t in tokens
            if t.type == tokenize.COMMENT and IGNORE.search(t.string)]


def unexplained(source: str) -> list[tuple[int, str]]:
    return [(line, c) for line, c in ignores(source) if not WITH_REASON.fullmatch(c)]


@pytest.mark.parametrize(("comment", "ok"), [
    ("# type: ignore[arg-type]  # typeshed's stub takes no None here", True),
    ("# type: ignore[attr-defined, union-attr]  # the stub lacks it", True),
    ("# type: ignore", False),
    ("# type: ignore[arg-type]", False),
    ("# type: ignore  # why", False),
    ("# type: ignore[arg-type] #", False),
])
def test_the_rule_itself(comment: str, ok: bool) -> None:
    source = f"x = f()  {comment}\ny = 'type: ignore in a string is no comment'\n"
    assert ignores(source) == [(1, comment)]
    assert unexplained(source) == ([] if ok else [(1, comment)])


def test_every_type_ignore_in_the_project_names_its_code_and_reason() -> None:
    found: dict[str, list[tuple[int, str]]] = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            if rel.startswith(GENERATED):
                continue
            bad = unexplained(f.read_text(encoding="utf-8"))
            if bad:
                found[rel] = bad
    assert found == {}
