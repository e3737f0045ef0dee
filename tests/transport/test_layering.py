"""transport/ keeps its rooms: every import of every module — at module level, inside functions and under
`TYPE_CHECKING` — goes down the layers, never around a circle, and the protocol never imports a backend.

The layers, lowest first (a room may import its own modules and any room below it):

    auth         transport.auth       who may open a link: the secret's exchange, frame MACs, TLS
    vocabulary   transport.config, transport.errors, transport.faults
    memory       transport.memory     blocks, storage, host memory
    bulk         transport.bulk       runs, frames, packing, device copies
    protocol     transport.protocol   the Link interface and the transfer's rules
    links        transport.links      the backends (inproc, tcp, ucx, cuda_ipc)
    top          transport.endpoint, transport.kinds

A backend does not import another backend, except cuda-ipc, whose control connection is a tcp link.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "transport"

LAYERS = ("auth", "vocabulary", "memory", "bulk", "protocol", "links", "top")
VOCABULARY = {"transport.config", "transport.errors", "transport.faults"}
TOP = {"transport.endpoint", "transport.kinds"}
BACKENDS = ("inproc", "tcp", "ucx", "cuda_ipc")
BACKEND_IMPORTS_ALLOWED = {("cuda_ipc", "tcp")}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str:
    """The transport module `name` names: a module, or else the package it is in (`from transport.bulk
    import gpu_copy` names `transport.bulk.gpu_copy`)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str) -> Iterator[tuple[str, int]]:
    """Every transport module `module` imports, with the line, wherever the import statement is."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "transport":
                    yield resolve(alias.name), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "transport":
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield (candidate if candidate in MODULES else resolve(base)), node.lineno


GRAPH = {
    module: sorted({(target, line) for target, line in imports_of(module) if target != module})
    for module in MODULES
}


def layer_of(module: str) -> str:
    if module == "transport" or module in VOCABULARY:
        return "vocabulary"
    if module in TOP:
        return "top"
    room = module.split(".")[1]
    assert room in LAYERS, f"{module} is in no room: add it to a room or to this test's layers"
    return room


def backend_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "links" and parts[2] in BACKENDS else None


def test_every_module_is_in_a_room() -> None:
    assert {layer_of(module) for module in MODULES} == set(LAYERS)


def test_no_module_imports_a_room_above_its_own() -> None:
    wrong = [
        f"{MODULES[module].relative_to(ROOT)}:{line} ({layer_of(module)}) imports {target} ({layer_of(target)})"
        for module, targets in GRAPH.items()
        for target, line in targets
        if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(module))
    ]
    assert wrong == []


def test_the_protocol_never_imports_a_backend() -> None:
    wrong = [
        f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}"
        for module, targets in GRAPH.items()
        if layer_of(module) != "links" and layer_of(module) != "top"
        for target, line in targets
        if target.startswith("transport.links")
    ]
    assert wrong == []


def test_a_backend_imports_no_other_backend() -> None:
    wrong = [
        f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}"
        for module, targets in GRAPH.items()
        for target, line in targets
        if (mine := backend_of(module)) is not None
        and (theirs := backend_of(target)) not in (None, mine)
        and (mine, theirs) not in BACKEND_IMPORTS_ALLOWED
    ]
    assert wrong == []


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import circle of `graph` (as the modules on it, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in graph[module]:
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in graph:
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_no_import_circles() -> None:
    graph = {module: [target for target, _line in targets] for module, targets in GRAPH.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        ({"a": ["b"], "b": ["c"], "c": []}, None),
        ({"a": ["b"], "b": ["c"], "c": ["a"]}, ["a", "b", "c", "a"]),
        ({"a": ["a"]}, ["a", "a"]),
        ({"a": ["b", "c"], "b": [], "c": ["d"], "d": ["c"]}, ["c", "d", "c"]),
    ],
)
def test_the_cycle_finder_finds_circles(graph: dict[str, list[str]], cycle: list[str] | None) -> None:
    assert find_cycle(graph) == cycle


def test_function_level_and_type_checking_imports_are_seen() -> None:
    """The walk sees an import inside a function (dial's lazy backends) as well as at the top."""
    targets = {target for target, _line in GRAPH["transport.links.dial"]}
    assert {"transport.links.ucx.connect", "transport.links.cuda_ipc.link"} <= targets
