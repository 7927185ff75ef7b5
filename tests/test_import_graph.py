"""The project's import graph: no cycles, and no import from a lower layer to a higher one.

``LAYERS`` is the one statement of the layer order (the architecture page,
``docs/architecture.md`` "How it works", mirrors it, and
``test_the_architecture_page_mirrors_the_layer_table`` keeps the two the same). A module may import
modules of its own layer and of lower ones. The graph is read from the source with
``ast``: every ``import`` and ``from ... import`` that names a module of the project's
packages, at module level, inside a function (a deferred import is still a dependency) or
under ``if TYPE_CHECKING:`` (a type named is a dependency too). A package's ``__init__`` is
the exception: its TYPE_CHECKING imports declare the names it hands on lazily, and an
import of such a name counts as an import of the module that defines it. ``importlib``
calls are not read (``kvstore/__init__.py``'s lazy names, declared as above, and
``benchmarks/cli.py``'s table of benchmark modules beside it).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvstore", "tiers", "replication", "conductor", "workers", "benchmarks",
            "cffi_build")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layer:
    name: str
    places: tuple[str, ...]
    """Folders (``kvstore/core/``: every module under it) and single files (``kvstore/cli.py``),
    relative to the repository root. A file named here wins over the folder holding it."""


LAYERS: tuple[Layer, ...] = (  # lowest first
    Layer(name="build", places=("cffi_build/",)),
    Layer(name="core", places=("kvstore/__init__.py", "kvstore/core/")),
    Layer(name="protocol", places=("kvstore/protocol/", "kvstore/proto/")),
    Layer(name="auth", places=("kvstore/auth/",)),
    Layer(name="tiers", places=("tiers/",)),
    Layer(name="node", places=("kvstore/node/",)),
    Layer(name="remote", places=("kvstore/remote/", "kvstore/kv_event_subscriber.py")),
    Layer(name="cluster", places=("replication/",)),
    Layer(name="facade", places=("kvstore/client.py",)),
    Layer(name="server", places=("kvstore/server.py",)),
    Layer(name="integrations", places=("kvstore/integrations/",)),
    Layer(name="workers", places=("workers/",)),
    Layer(name="conductor", places=("conductor/",)),
    Layer(name="benchmarks", places=("benchmarks/",)),
    Layer(name="commands", places=(
        "kvstore/cli.py", "kvstore/__main__.py", "kvstore/demo.py", "workers/cli.py",
        "workers/__main__.py", "conductor/cli.py", "conductor/__main__.py")),
)

KNOWN_UPWARD: dict[tuple[str, str], str] = {}
"""Edges that still break the rules, each with why and what removes it; each must still
exist (``test_known_exceptions_are_still_needed``), so the list only shrinks."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Edge:
    importer: str
    imported: str
    path: str
    line: int
    deferred: bool = False
    """Not run as the module loads: inside a function (runs when called) or under
    TYPE_CHECKING (never runs)."""


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = f
    return found


MODULES = _modules()


def _faces() -> dict[tuple[str, str], str]:
    """``(package, name) -> module`` for the names a package's ``__init__`` hands on from
    its modules (lazily ones too: they are declared under TYPE_CHECKING), so that
    ``from kvstore import Client`` counts as an import of ``kvstore.client``."""
    faces: dict[tuple[str, str], str] = {}
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in MODULES:
                for alias in node.names:
                    faces[(module, alias.asname or alias.name)] = node.module
    return faces


FACES = _faces()


def _resolve(name: str) -> str | None:
    """The project module ``name`` lives in (``a.b.C`` -> ``a.b``), or None if outside."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path) -> list[Edge]:
    tree = ast.parse(path.read_text(), filename=str(path))
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    rel = str(path.relative_to(ROOT))
    edges: list[Edge] = []

    def add(target: str | None, node: ast.Import | ast.ImportFrom, deferred: bool) -> None:
        if target is not None and target != module:
            edges.append(Edge(importer=module, imported=target, path=rel, line=node.lineno,
                              deferred=deferred))

    def visit(node: ast.AST, deferred: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name), node, deferred)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[:len(base) - (node.level - 1)]
                origin = ".".join(up + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:  # ``from pkg import module`` names that module
                target = FACES.get((origin, alias.name)) if module != origin else None
                add(target or _resolve(f"{origin}.{alias.name}") or _resolve(origin), node,
                    deferred)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            if path.name != "__init__.py":  # a face's are its lazy names (see FACES)
                for stmt in node.body:
                    visit(stmt, True)
            for stmt in node.orelse:
                visit(stmt, deferred)
            return
        inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                              ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return edges


EDGES = [e for m, p in MODULES.items() for e in _imports(m, p)]


def _place_of(module: str) -> str:
    path = MODULES.get(module)
    if path is None:  # a made-up module (the checker's own tests): where it would live
        return module.replace(".", "/") + ".py"
    return str(path.relative_to(ROOT))


def layer_of(module: str) -> int | None:
    """The index in LAYERS of ``module``: a file named in a layer wins over a folder, a
    deeper folder over a shallower one."""
    where = _place_of(module)
    best: tuple[int, int] | None = None  # (specificity, layer index)
    for i, layer in enumerate(LAYERS):
        for place in layer.places:
            if place == where:
                score = 10_000
            elif place.endswith("/") and where.startswith(place):
                score = len(place)
            else:
                continue
            if best is None or score > best[0]:
                best = (score, i)
    return None if best is None else best[1]


def _where(module: str) -> str:
    return str(MODULES[module].relative_to(ROOT))


def test_every_module_has_a_layer() -> None:
    missing = [f"{m} ({_where(m)}) is in no layer: put it in a layer's folder, or name it in "
               f"the layer table (LAYERS in tests/test_import_graph.py)"
               for m in MODULES if layer_of(m) is None]
    assert missing == []


def test_every_layer_entry_names_a_place() -> None:
    stale = [f"layer {layer.name!r} names {place!r}, which holds no module: remove it"
             for layer in LAYERS for place in layer.places
             if not any(_place_of(m) == place or (place.endswith("/") and _place_of(m)
                        .startswith(place) and layer_of(m) == LAYERS.index(layer))
                        for m in MODULES)]
    assert stale == []


def test_folders_are_the_layers() -> None:
    """A layer is folders: a single file is named only at the top of a top-level package
    (the facade, the server, the commands, a documented old path), never inside a
    subpackage, so ``ls`` shows every layer below the top."""
    files = [place for layer in LAYERS for place in layer.places if place.endswith(".py")]
    assert [f for f in files if f.count("/") != 1] == []


def _ruled_edges() -> list[Edge]:
    return [e for e in EDGES if (e.importer, e.imported) not in KNOWN_UPWARD]


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    broken = []
    for e in _ruled_edges():
        src, dst = layer_of(e.importer), layer_of(e.imported)
        if src is None or dst is None or dst <= src:
            continue  # an unplaced module fails test_every_module_has_a_layer
        broken.append(f"{e.path}:{e.line}: {e.importer} imports {e.imported}: layer "
                      f"{LAYERS[src].name!r} (#{src}) may not import the higher layer "
                      f"{LAYERS[dst].name!r} (#{dst})")
    assert broken == []


def _cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, list[str]] = defaultdict(list)
    for e in edges:
        graph[e.importer].append(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles() -> None:
    edges = _ruled_edges()
    report = []
    for comp in _cycles(edges):
        ties = [f"  {e.path}:{e.line}: {e.importer} -> {e.imported}" for e in edges
                if e.importer in comp and e.imported in comp]
        report.append("cycle " + " <-> ".join(comp) + ":\n" + "\n".join(ties))
    assert report == []


def test_known_exceptions_are_still_needed() -> None:
    present = {(e.importer, e.imported) for e in EDGES}
    assert [k for k in KNOWN_UPWARD if k not in present] == []
    # ...and each is an exception: it breaks the layer rule or closes a cycle.
    for importer, imported in KNOWN_UPWARD:
        src, dst = layer_of(importer), layer_of(imported)
        assert src is not None and dst is not None and dst > src, (importer, imported)


def test_the_checker_sees_what_it_must_refuse() -> None:
    """The rules fire on a made-up upward edge and a made-up cycle (so a passing run means
    the real graph is clean, not that the checks see nothing)."""
    up = Edge(importer="tiers.manager", imported="kvstore.node.semantics", path="x.py", line=1)
    src, dst = layer_of(up.importer), layer_of(up.imported)
    assert src is not None and dst is not None and dst > src
    back = Edge(importer="kvstore.node.semantics", imported="tiers.manager", path="x.py", line=2)
    assert _cycles([up, back]) == [["kvstore.node.semantics", "tiers.manager"]]
    assert layer_of("kvstore.kv_events_new_module") is None
    assert layer_of("tiers.some_new_tier") == [layer.name for layer in LAYERS].index("tiers")


def test_the_graph_is_read() -> None:
    """Spot checks that the reader finds module-level, deferred and ``from pkg import mod``
    imports, and skips TYPE_CHECKING ones."""
    pairs = {(e.importer, e.imported) for e in EDGES}
    assert ("kvstore.node.semantics", "tiers.manager") in pairs  # module level
    assert Edge(importer="kvstore.node.semantics", imported="tiers.ssd.tier",
                path="kvstore/node/semantics.py",
                line=next(e.line for e in EDGES if (e.importer, e.imported)
                          == ("kvstore.node.semantics", "tiers.ssd.tier")), deferred=True) in EDGES
    assert ("kvstore.server", "kvstore.auth.tenancy") in pairs  # from kvstore import tenancy
    assert ("workers.kv_blocks", "kvstore.core.errors") in pairs  # a name the package hands on
    assert ("kvstore.integrations.vllm.connector", "kvstore.client") in pairs
    assert ("kvstore.server", "replication.copies.replicator") in pairs  # under TYPE_CHECKING too
    assert ("kvstore", "kvstore.client") not in pairs  # a package's lazily handed-on name


def test_the_conductor_loads_no_torch() -> None:
    """The Conductor schedules without torch: loading a conductor module (all but the serving
    demo, which runs the workers' model) loads no module that imports torch as it loads."""
    torch_users = {m for m, p in MODULES.items()
                   if re.search(r"^(import torch|from torch)", p.read_text(), re.M)}
    graph: dict[str, set[str]] = defaultdict(set)
    for e in EDGES:
        if not e.deferred:
            graph[e.importer].add(e.imported)
    for start in (m for m in MODULES if m.startswith("conductor") and m != "conductor.demo"):
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert seen & torch_users == set(), start


def test_the_architecture_page_mirrors_the_layer_table() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## How it works\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^(\d+)\. \*\*([\w-]+)\*\* \(([^)]*)\)", section, re.M)
    assert [(int(n), name) for n, name, _ in rows] == [
        (i + 1, layer.name) for i, layer in enumerate(LAYERS)]
    for (_, name, mods), layer in zip(rows, LAYERS, strict=True):
        assert re.findall(r"`([^`]+)`", mods) == list(layer.places), name
