"""No private access across packages.

A package is a folder: ``kvstore/node`` and ``kvstore/remote`` are two, and the modules
directly in ``kvstore/`` are a third. A name that starts with ``_`` (dunders aside) belongs
to the package that defines it; another package reaches it only through a public name.
Within ``tests/`` private access is allowed, so ``tests/`` is not read.

Read from the source with ``ast``:

* ``from M import _x`` (absolute or relative) where ``M`` is a project module or package
  in another folder.
* ``R._x``, and ``getattr(R, "_x")`` (``setattr``, ``hasattr``), where ``_x`` is defined
  in another folder (a function, class or assignment at module or class level, an
  attribute assigned anywhere, ``obj._x = ...``, or an import alias). ``R`` is usually a
  value, whose class a reading of the source cannot know, so the name decides: the access
  is allowed if the accessing module defines ``_x`` itself (its own class's attribute,
  met on another instance), or, for ``self._x``/``cls._x``, if its folder does (a class
  of the same package, or an inherited attribute of one). What this cannot see: a private
  name of another package that the accessing module also happens to define.

Python's own private names (``os._exit``, ``argparse._SubParsersAction``) are not the
project's, so they are not read.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvstore", "tiers", "replication", "conductor", "workers", "benchmarks",
            "cffi_build", "scripts")
"""The top-level folders of project source (not tests)."""

ALLOWED: dict[tuple[str, str], str] = {}
"""``(module path, private name) -> why it must stay``; each entry must still be needed
(``test_allowed_entries_are_still_needed``), so the list only shrinks. Empty: every
access across packages went through a public name."""

ACCESSORS = frozenset({"getattr", "setattr", "hasattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _files() -> dict[Path, ast.Module]:
    return {f: ast.parse(f.read_text(), filename=str(f))
            for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))}


TREES = _files()


def _folder(path: Path) -> str:
    return str(path.parent.relative_to(ROOT))


def _defined(tree: ast.Module) -> set[str]:
    """The names a module defines: at module and class level, attributes it assigns
    (``obj._x = ...``) and import aliases."""
    names: set[str] = set()

    def body(stmts: list[ast.stmt]) -> None:
        for n in stmts:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(n.name)
                if isinstance(n, ast.ClassDef):
                    body(n.body)
            elif isinstance(n, ast.Assign):
                names.update(x.id for t in n.targets for x in ast.walk(t)
                             if isinstance(x, ast.Name))
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
            elif isinstance(n, ast.If | ast.Try | ast.With):
                body(n.body)
                for h in getattr(n, "handlers", ()):
                    body(h.body)
                body(getattr(n, "orelse", []))

    body(tree.body)
    for x in ast.walk(tree):
        if isinstance(x, ast.Attribute) and isinstance(x.ctx, ast.Store):
            names.add(x.attr)
        elif isinstance(x, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in x.names)
    return {n for n in names if _private(n)}


DEFINED_IN_MODULE = {path: _defined(tree) for path, tree in TREES.items()}
DEFINED_IN_FOLDER: dict[str, set[str]] = defaultdict(set)
for _path, _names in DEFINED_IN_MODULE.items():
    DEFINED_IN_FOLDER[_folder(_path)] |= _names
FOLDERS_DEFINING: dict[str, set[str]] = defaultdict(set)
for _f, _names in DEFINED_IN_FOLDER.items():
    for _n in _names:
        FOLDERS_DEFINING[_n].add(_f)


def _module_folder(module: str) -> str | None:
    """The folder of project module (or package) ``module``; None outside the project."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file():
        return str(base.parent.relative_to(ROOT))
    if (base / "__init__.py").is_file():
        return str(base.relative_to(ROOT))
    return None


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = parts[: len(parts) - node.level]  # the package the dots name
    return ".".join([*parts, *([node.module] if node.module else [])])


@dataclass(frozen=True, slots=True, kw_only=True)
class Access:
    path: str
    line: int
    name: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _accesses(path: Path, tree: ast.Module) -> list[Access]:
    rel, folder = str(path.relative_to(ROOT)), _folder(path)
    own_module, own_folder = DEFINED_IN_MODULE[path], DEFINED_IN_FOLDER[folder]
    found: list[Access] = []
    for x in ast.walk(tree):
        if isinstance(x, ast.ImportFrom):
            module = _absolute(path, x)
            where = _module_folder(module)
            if where is not None and where != folder:
                found += [Access(path=rel, line=x.lineno, name=a.name,
                                 what=f"from {module} import {a.name}")
                          for a in x.names if _private(a.name)]
            continue
        receiver: ast.expr | None = None
        if isinstance(x, ast.Attribute) and _private(x.attr):
            name, receiver = x.attr, x.value
        elif (isinstance(x, ast.Call) and isinstance(x.func, ast.Name)
              and x.func.id in ACCESSORS and len(x.args) >= 2
              and isinstance(x.args[1], ast.Constant) and isinstance(x.args[1].value, str)
              and _private(x.args[1].value)):
            name, receiver = x.args[1].value, x.args[0]
        else:
            continue
        elsewhere = FOLDERS_DEFINING.get(name, set()) - {folder}
        if not elsewhere:
            continue  # this package's own name, or not the project's
        selfish = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
        if name in (own_folder if selfish else own_module):
            continue
        found.append(Access(path=rel, line=x.lineno, name=name,
                            what=f"{ast.unparse(receiver)}.{name} (defined in "
                                 f"{', '.join(sorted(elsewhere))})"))
    return found


ACCESSES = [a for path, tree in TREES.items() for a in _accesses(path, tree)]


def test_no_private_access_across_packages() -> None:
    bad = [str(a) for a in ACCESSES if (a.path, a.name) not in ALLOWED]
    assert bad == [], "use (or add) a public name instead:\n" + "\n".join(bad)


def test_allowed_entries_are_still_needed() -> None:
    seen = {(a.path, a.name) for a in ACCESSES}
    assert [k for k in ALLOWED if k not in seen] == []


def _scan(source: str, path: str) -> list[str]:
    """What the rules find in ``source`` as if it were the module at ``path``."""
    p = ROOT / path
    tree = ast.parse(source)
    saved = DEFINED_IN_MODULE.get(p)
    DEFINED_IN_MODULE[p] = _defined(tree)
    try:
        return [a.what for a in _accesses(p, tree)]
    finally:
        if saved is None:
            del DEFINED_IN_MODULE[p]
        else:
            DEFINED_IN_MODULE[p] = saved


def test_the_rules_find_each_kind_of_access() -> None:
    # The kinds this change removed, written afresh in a module of another package.
    found = _scan(
        "from kvstore.node.config import SIZE_FIELDS\n"
        "from kvstore.remote.node_client import _chunks\n"
        "from .placement.candidates import _hidden\n"
        "def f(client, c, server):\n"
        "    client._grpc('Replicate', None)\n"
        "    getattr(c, '_prefill_by_id')\n"
        "    super()._resolve()\n"
        "    return SIZE_FIELDS, server._stub\n",
        "replication/new_module.py")
    assert sorted(found) == [
        "c._prefill_by_id (defined in conductor/scheduling)",
        "client._grpc (defined in kvstore, kvstore/remote)",
        "from kvstore.remote.node_client import _chunks",
        "from replication.placement.candidates import _hidden",
        "server._stub (defined in kvstore/remote)",
        "super()._resolve (defined in kvstore/remote, tiers/ssd)",
    ]


def test_the_rules_allow_a_packages_own_names() -> None:
    assert _scan(
        "import os\n"
        "class A:\n"
        "    def __init__(self):\n"
        "        self._grpc = None\n"
        "    def same(self, other: 'A'):\n"
        "        return other._grpc, self._grpc, os._exit, self.__class__\n",
        "kvstore/remote/new_module.py") == []
