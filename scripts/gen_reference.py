"""Writes the configuration and metrics references into the docs site (``make docs``).

Why generated: a hand-written table drifts from the code. The configuration
table is read from the ``kvstore serve`` argument parser and the ``NodeConfig``
dataclass, the metrics table from the exporter's own declaration
(``kvstore.node.metrics.METRICS``), and ``tests/test_reference_docs.py`` fails when
a page differs from what this script writes.

Each table replaces what lies between ``<!-- BEGIN GENERATED: NAME -->`` and
``<!-- END GENERATED: NAME -->`` in its page (``config`` in ``docs/configuration.md``,
``metrics`` in ``docs/metrics.md``); nothing else in the pages changes, so their prose
stays hand-written beside the tables. ``--check`` writes nothing and exits 1 if a page
is stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from kvstore.cli import build_parser  # noqa: E402
from kvstore.node.config import SIZE_FIELDS, NodeConfig  # noqa: E402
from kvstore.node.metrics import METRICS  # noqa: E402

DOCS = ROOT / "docs"
BEGIN = "<!-- BEGIN GENERATED: {} -->"
END = "<!-- END GENERATED: {} -->"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _size(n: int) -> str:
    """``n`` bytes as the largest binary unit that divides it exactly (``1GiB``, ``0``)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _toml(name: str, value: object) -> str:
    """A default as it would be written in the TOML config file."""
    if name in SIZE_FIELDS:
        if not value:
            return "`0`"
        assert isinstance(value, int), f"{name}: a size field's default is an int (NodeConfig)"
        return f'`"{_size(value)}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


def serve_parser() -> argparse.ArgumentParser:
    """The ``kvstore serve`` subparser of ``kvstore.cli.build_parser()``."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise LookupError("kvstore.cli.build_parser() has no serve command")


def config_table() -> str:
    """One row per ``kvstore serve`` flag (in the parser's order), then any config key
    without a flag. Defaults come from ``NodeConfig``, never from the help text."""
    fields = {f.name: f for f in dataclasses.fields(NodeConfig)}
    defaults = NodeConfig()
    rows = ["| flag | config key | default | meaning |", "|---|---|---|---|"]
    seen: set[str] = set()
    for action in serve_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.metavar:
            flag += f" `{action.metavar}`"
        if action.choices:
            flag += " (" + " \\| ".join(f"`{c}`" for c in action.choices) + ")"
        key = action.dest if action.dest in fields else ""
        default = _toml(key, getattr(defaults, key)) if key else ""
        seen.add(key)
        rows.append(f"| {flag} | {f'`{key}`' if key else ''} | {default} | "
                    f"{_cell(action.help or '')} |")
    for name in fields:
        if name not in seen:
            rows.append(f"| | `{name}` | {_toml(name, getattr(defaults, name))} | "
                        f"(config file only) |")
    return "\n".join(rows)


def metrics_table() -> str:
    """One row per family the exporter declares, in its order."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for m in METRICS:
        labels = ", ".join(f"`{label}`" for label in m.labels)
        suffix = "_bucket, _sum, _count" if m.type == "histogram" else ""
        name = f"`{m.name}`" + (f" ({suffix})" if suffix else "")
        rows.append(f"| {name} | {m.type} | {labels} | {_cell(m.help)} |")
    return "\n".join(rows)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Section:
    page: str
    """The page holding the section's markers, relative to the docs folder."""
    make: Callable[[], str]


SECTIONS: dict[str, Section] = {
    "config": Section(page="configuration.md", make=config_table),
    "metrics": Section(page="metrics.md", make=metrics_table),
}


def render(text: str, names: Sequence[str]) -> str:
    """``text`` (a page) with the generated sections ``names`` rewritten."""
    for name in names:
        begin, end = BEGIN.format(name), END.format(name)
        head, found, rest = text.partition(begin)
        _, found_end, tail = rest.partition(end)
        if not found or not found_end:
            raise ValueError(f"{SECTIONS[name].page} lacks the markers {begin} ... {end}")
        text = f"{head}{begin}\n{SECTIONS[name].make()}\n{end}{tail}"
    return text


def pages(docs: Path) -> dict[Path, list[str]]:
    """Each page under ``docs`` that holds generated sections, and their names."""
    found: dict[Path, list[str]] = {}
    for name, section in SECTIONS.items():
        found.setdefault(docs / section.page, []).append(name)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Regenerate the reference tables in docs/.")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if a page is out of date")
    p.add_argument("--docs", type=Path, default=DOCS, help="the docs folder (default: docs/)")
    args = p.parse_args(argv)
    stale = 0
    for path, names in pages(args.docs).items():
        current = path.read_text()
        wanted = render(current, names)
        if wanted == current:
            continue
        if args.check:
            print(f"{path} is out of date: run `make docs`", file=sys.stderr)
            stale = 1
        else:
            path.write_text(wanted)
            print(f"updated {path}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
