"""The house's floors hold: no import circle between files, no import from a lower floor to a higher one.

Every import statement of ``pckernels/`` counts, lazy and type-checking ones too (a lazy import
still makes the two files one unit to read). Floors, low to high, as ``docs/architecture.md``
draws them; a package face (``__init__.py``) only re-exports and is skipped as an edge source.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pckernels"

FLOORS = {
    "errors": 0, "typed": 0, "kernels": 1, "ops": 2, "generation": 2, "integration": 3, "pml": 3,
    "program": 4, "store": 4, "prefix": 5, "engine": 6, "server": 7, "cli": 8, "__main__": 8, "extras": 9,
}
"""Top-level module or package of ``pckernels`` -> floor (``cli*.py`` files are the CLI's). ``extras``
(kernels off the product path) stands above everything: nothing else may import it."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    top = parts[1]
    return FLOORS["cli"] if top.startswith("cli") else FLOORS.get(top)


def import_graph() -> tuple[dict[str, set[str]], set[str]]:
    """``module -> modules of pckernels it imports`` and the package faces."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    faces = {m for m, p in files.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if module in faces else module.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        resolved = set()
        for target in targets:
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != module and not (target in faces and module.startswith(target + ".")):
                resolved.add(target)
        graph[module] = resolved
    return graph, faces


def circles(graph: dict[str, set[str]], faces: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan), faces skipped."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w in faces:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in faces and v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_top_level_part_has_a_floor(graph):
    edges, _ = graph
    tops = {m.split(".")[1] for m in edges if m.count(".") >= 1}
    unplaced = sorted(t for t in tops if not t.startswith("cli") and t not in FLOORS and t != "data")
    assert not unplaced, f"give these a floor in FLOORS and docs/architecture.md: {unplaced}"


def test_no_import_circle(graph):
    edges, faces = graph
    assert circles(edges, faces) == []


def test_no_import_runs_up_a_floor(graph):
    edges, faces = graph
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() if a not in faces for b in targets
                    if floor(a) is not None and floor(b) is not None and floor(b) > floor(a))
    assert upward == []


def test_the_check_sees_a_circle_and_an_upward_import():
    """The checks themselves: a made-up graph with both faults is caught."""
    made_up = {"pckernels.prefix.a": {"pckernels.engine.b"}, "pckernels.engine.b": {"pckernels.prefix.a"}}
    assert circles(made_up, set()) == [["pckernels.engine.b", "pckernels.prefix.a"]]
    assert floor("pckernels.engine.b") > floor("pckernels.prefix.a")


def test_the_architecture_page_names_files_that_exist():
    """docs/architecture.md walks a request file by file: every ``floor/file.py`` it names exists."""
    import re

    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b((?:[a-z_]+/)+[a-z_]+\.py)\b", page))
    assert len(named) > 30
    missing = sorted(path for path in named if not (ROOT / path).exists() and not (ROOT.parent / path).exists())
    assert missing == []
