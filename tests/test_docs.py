"""The documentation: the site builds with ``mkdocs build --strict`` and the README's links
and example hold.

MkDocs validates every link between pages and every anchor at build time, but only as
warnings, at the levels ``mkdocs.yml`` sets under ``validation:``; ``--strict`` turns
each warning into a failed build. So a page renamed, a heading reworded or a link
mistyped fails here, in the main test stage. The README is not part of the site (it is
the repository's front page), so its relative links are checked against the tree.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO, NodeProcess
from mkdocs.config import load_config

README = REPO / "README.md"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
"""A Markdown inline link's target (images excluded)."""


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict``. Never with ``-q``: a quiet build drops warnings before
    they are counted, and strict mode then passes."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site)],
        capture_output=True, text=True, cwd=config.parent, env=env, timeout=120)


def test_every_broken_link_is_a_warning() -> None:
    """What --strict fails on: a missing page, a missing anchor, a link to a file outside
    the docs, an absolute link, a page left out of the navigation."""
    cfg = load_config(str(REPO / "mkdocs.yml"))
    assert dict(cfg.validation.links) == dict.fromkeys(
        ("not_found", "anchors", "absolute_links", "unrecognized_links"), logging.WARNING)
    assert dict(cfg.validation.nav) == dict.fromkeys(
        ("omitted_files", "not_found", "absolute_links"), logging.WARNING)
    assert cfg.strict


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    run = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert run.returncode == 0, run.stderr
    results = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert 'id="security-what-tls-costs"' in results  # benchmarks/RESULTS.md, included


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    """The same site with one link to a heading that does not exist."""
    for part in ("mkdocs.yml", "docs", "benchmarks/RESULTS.md"):
        src, dst = REPO / part, tmp_path / part
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    page = tmp_path / "docs" / "limits.md"
    page.write_text(page.read_text() + "\nSee [Tiers](node.md#no-such-heading).\n")
    run = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert run.returncode != 0
    assert "does not contain an anchor '#no-such-heading'" in run.stderr


def test_readme_links_point_at_files() -> None:
    text = README.read_text()
    targets = LINK.findall(text)
    assert len(targets) > 10
    missing = []
    for target in targets:
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or a place in the README itself
        path = target.split("#", 1)[0]
        if not (REPO / path).exists():
            missing.append(target)
    assert missing == []


def test_readme_stays_short() -> None:
    """The README says what kvstore is and where to read on; the rest lives in docs/."""
    assert len(README.read_bytes()) < 10_000


def test_the_readme_example_runs(node: NodeProcess) -> None:
    """The README's Python example against a real node prints what its comments say."""
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    code = code.replace('Client("127.0.0.1:7600")', f'Client("{node.addr}")')
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "3\nb'KV of block 0'\n"
