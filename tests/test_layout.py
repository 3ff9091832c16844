"""The package's rooms: every in-package import, type-only and deferred ones
included, points one way (no import circle), and few modules sit beside the rooms.

A circle through a type annotation is still a circle: the two modules can't be
read, tested or moved apart. Where one side calls back into the other, the caller
declares a small ``Protocol`` for what it uses (``engine.leaks.Engine``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import otel_kvcache

pytestmark = pytest.mark.vllm_independent  # the same on every vLLM: tested in the default environment

PACKAGE = Path(otel_kvcache.__file__).parent
ROOMS = {"engine", "export", "wiring", "commands", "vllm_compat", "gpu"}
SHARED = {"__init__", "names", "config", "errors", "version", "package"}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("otel_kvcache", *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every in-package module ``name`` imports, anywhere in its source (``ast.walk``
    finds those under ``if TYPE_CHECKING:`` and inside functions too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name in a module: the module
                target = target.rpartition(".")[0]
            if target.startswith("otel_kvcache") and target != name:
                imported.add(target)
    return imported


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_through_others():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert graph["otel_kvcache.engine.telemetry"] >= {"otel_kvcache.engine.pool", "otel_kvcache.export.spans"}
    assert "otel_kvcache.export.exporter_process" in graph["otel_kvcache.wiring.instrumentor"]  # deferred, inside a function
    assert "otel_kvcache.export.exporter_process" in graph["otel_kvcache.engine.telemetry"]  # under TYPE_CHECKING
    assert circles(graph) == []


def test_a_circle_is_found_when_there_is_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_rooms_and_few_modules_beside_them():
    top = {path.stem for path in PACKAGE.glob("*.py")}
    rooms = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert top == SHARED
    assert rooms == ROOMS
    for room in rooms:  # each says what may be done there
        assert ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text()))
