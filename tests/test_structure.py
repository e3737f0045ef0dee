"""The house's structure: no import circle, and every import goes down the floors.

Every import counts — at the top of a module, under `TYPE_CHECKING`, and inside a function: a circle
that only type checking or a late import closes is still two modules that cannot be read alone.

Floors, from the bottom: `messages` → `transport` → `replicas` → `engine`; a module imports only from
its own floor or the ones below. Within `replicas`, the model (`replicas.model`) knows no replica.
Within `engine`, the node core (router, generation, control, controller, scaling, config, logs, …) sits
below the parts the entry point composes — `engine.cluster`, `engine.http`, `engine.planner`,
`engine.demo` — which sit below the entry point `engine.node`, which sits below what runs whole nodes
and clusters: the benchmarks (`engine.bench`), the test hosts (`engine.hosts`: a node per network
namespace) and the chaos run (`engine.chaos`).

Parts of one floor do not import each other: the cluster, the HTTP API, the planner and the demo share
only what lies below them, and among what runs whole nodes the benchmarks may use the chaos run and the
test hosts, the chaos run the test hosts. A part that needs a little of a higher one takes a small
protocol it owns; the composition happens in the entry point. Folders side by side (the children of one
folder: `replicas.prefill` and `replicas.decode`, `engine.config` and `engine.control`, …) import each
other in one order only — no circle between them, even where every module-level import goes down —
so each folder can be read with what lies below it. A folder is a room: at most `ROOM` modules, split by concept, whatever their length.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("messages", "transport", "replicas", "engine")
ENGINE_PARTS = ("engine.cluster", "engine.http", "engine.planner", "engine.demo")
NODE_RUNNERS = ("engine.bench", "engine.hosts", "engine.chaos")
ROOM = 15


# ---------------------------------------------------------------------------------------------- the graph
def modules() -> dict[str, pathlib.Path]:
    """Dotted module name → file, for every module of the four packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> Iterator[tuple[str, int]]:
    """(module, line) for every import in the module `name` of one of `known`, wherever it is written.

    `from a.b import c` imports `a.b.c` when that is a module, else `a.b`; a name resolves to the
    longest known module it starts with."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, node.lineno


def graph() -> dict[str, dict[str, int]]:
    """Module → {imported module: first line}. A package importing its own children is no edge
    (`__init__` re-exports), and neither is a module importing a package it lives in."""
    known = modules()
    edges: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        out: dict[str, int] = {}
        for target, line in imported(name, path, known):
            if not name.startswith(target + "."):
                out.setdefault(target, line)
        edges[name] = out
    return edges


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in edges[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for module in sorted(edges):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def describe(circle: list[str], edges: dict[str, dict[str, int]]) -> str:
    members = set(circle)
    lines = [f"circle of {len(circle)} modules:"]
    for module in circle:
        inside = sorted(other for other in edges[module] if other in members)
        lines.append(f"  {module} -> {', '.join(inside)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the floors
def floor(module: str) -> tuple[int, int]:
    """(package floor, floor within the package); an import may go to an equal or lower pair only
    where the first numbers differ or the second does not rise."""
    top = module.split(".")[0]
    level = PACKAGES.index(top)
    if top == "replicas":
        return level, 0 if _within(module, "replicas.model") else 1
    if top == "engine":
        if any(_within(module, tool) for tool in NODE_RUNNERS):
            return level, 3
        if module == "engine.node" or _within(module, "engine.node"):
            return level, 2
        if any(_within(module, part) for part in ENGINE_PARTS):
            return level, 1
        return level, 0
    return level, 0


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward(edges: dict[str, dict[str, int]]) -> list[str]:
    """Every import that goes up a floor, as `module:line -> imported`."""
    found = []
    for module, targets in sorted(edges.items()):
        here = floor(module)
        for target, line in sorted(targets.items()):
            if floor(target) > here:
                found.append(f"{module}:{line} -> {target}")
    return found


# ---------------------------------------------------------------------------------------------- the tests
def test_no_import_circle() -> None:
    edges = graph()
    found = circles(edges)
    assert not found, "\n".join(describe(circle, edges) for circle in found)


def test_imports_go_down_the_floors() -> None:
    found = upward(graph())
    assert not found, "imports that go up a floor:\n  " + "\n  ".join(found)


# What runs whole nodes, from the bottom: the test hosts, the chaos run on them, the benchmarks on both.
RUNNER_ORDER = ("engine.hosts", "engine.chaos", "engine.bench")


def sideways(edges: dict[str, dict[str, int]]) -> list[str]:
    """Every import between two parts of one floor, as `module:line -> imported`: the parts the entry
    point composes (`ENGINE_PARTS`) know none of each other — what two of them share lives below them —
    and what runs whole nodes imports only down `RUNNER_ORDER`."""

    def part(module: str, parts: tuple[str, ...]) -> str | None:
        return next((p for p in parts if _within(module, p)), None)

    found = []
    for module, targets in sorted(edges.items()):
        for target, line in sorted(targets.items()):
            here, there = part(module, ENGINE_PARTS), part(target, ENGINE_PARTS)
            if here and there and here != there:
                found.append(f"{module}:{line} -> {target}")
            here, there = part(module, RUNNER_ORDER), part(target, RUNNER_ORDER)
            if here and there and RUNNER_ORDER.index(there) > RUNNER_ORDER.index(here):
                found.append(f"{module}:{line} -> {target}")
    return found


def test_parts_of_one_floor_do_not_import_each_other() -> None:
    assert set(RUNNER_ORDER) == set(NODE_RUNNERS)
    found = sideways(graph())
    assert not found, "imports between parts of one floor:\n  " + "\n  ".join(found)


def sibling_circles(edges: dict[str, dict[str, int]]) -> list[str]:
    """Circles between folders side by side: for every folder, its child folders (each with everything
    under it) as nodes, an edge where a module of one imports a module of another; each circle with one
    import per edge, as `module:line -> imported`. The folder's own modules are ground shared by all."""
    known = modules()

    def parts(module: str) -> tuple[str, ...]:
        return known[module].relative_to(ROOT).parts[:-1]

    parents: dict[tuple[str, ...], set[str]] = {}
    for module in known:
        folder = parts(module)
        for depth in range(len(folder)):
            parents.setdefault(folder[:depth], set()).add(folder[depth])
    found = []
    for parent, children in sorted(parents.items()):

        def child(module: str, parent: tuple[str, ...] = parent) -> str | None:
            folder = parts(module)
            return (
                folder[len(parent)] if len(folder) > len(parent) and folder[: len(parent)] == parent else None
            )

        between: dict[str, dict[str, int]] = {name: {} for name in children}
        witness: dict[tuple[str, str], str] = {}
        for module, targets in sorted(edges.items()):
            here = child(module)
            for target, line in sorted(targets.items()):
                there = child(target)
                if here is not None and there is not None and here != there:
                    between[here].setdefault(there, line)
                    witness.setdefault((here, there), f"{module}:{line} -> {target}")
        for circle in circles(between):
            where = ".".join(parent) or "(top)"
            inside = [witness[(a, b)] for a in circle for b in circle if (a, b) in witness]
            found.append(f"folders {', '.join(circle)} of {where}:\n    " + "\n    ".join(inside))
    return found


def test_folders_side_by_side_form_no_circle() -> None:
    found = sibling_circles(graph())
    assert not found, "circles between folders of one folder:\n  " + "\n  ".join(found)


def test_a_folder_is_a_room() -> None:
    """At most `ROOM` modules per folder (`__init__` counted): a folder that grows is split by concept."""
    crowded = {
        str(folder.relative_to(ROOT)): count
        for package in (*PACKAGES, "tests")
        for folder in [ROOT / package, *sorted((ROOT / package).rglob("*/"))]
        if folder.is_dir() and (count := len(list(folder.glob("*.py")))) > ROOM
    }
    assert not crowded, f"folders over {ROOM} modules: {crowded}"


def test_the_graph_sees_every_kind_of_import(tmp_path: pathlib.Path) -> None:
    """The parser finds imports under `TYPE_CHECKING`, inside functions, and relative ones."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (package / "b.py").write_text("def f():\n    from . import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    known = {name: package / f"{name.rpartition('.')[2]}.py" for name in ("pkg.a", "pkg.b", "pkg.c")} | {
        "pkg": package / "__init__.py"
    }
    edges = {name: dict(imported(name, path, known)) for name, path in known.items()}
    assert set(edges["pkg.a"]) == {"pkg.b"}
    assert set(edges["pkg.b"]) == {"pkg.c"}
    assert set(edges["pkg.c"]) == {"pkg.a"}
    assert circles(edges) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_floors_are_ordered() -> None:
    assert floor("messages.commands") < floor("transport.endpoint") < floor("replicas.model.llama")
    assert floor("replicas.model.llama") < floor("replicas.actor") < floor("engine.router")
    assert floor("engine.router") < floor("engine.cluster.member") < floor("engine.node")
    assert floor("engine.node") < floor("engine.bench.e2e")
    assert floor("engine.demo") == floor("engine.http.app")
