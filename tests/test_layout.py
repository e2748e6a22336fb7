"""The package's layout, checked from the source: the torch line is the folder line
(``minisgl/device/`` holds every module that may import torch; the rest never imports it, nor
``minisgl.device``), and no two modules import each other, directly or around a circle
(imports inside functions counted, ``TYPE_CHECKING`` ones not)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minisgl"
TORCH_TREE = "minisgl.device"
TORCH_PACKAGES = ("torch", "triton", "flashinfer", "tvm_ffi")
# Modules outside the torch tree that join both sides: the offline API holds a worker in-process,
# and a worker process's entry point imports its side once it runs (in the child).
JOINS = {"minisgl.llm": "the offline API", "minisgl.serve.workers": "a worker process's entry point"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import outside ``if TYPE_CHECKING``; a name
    imported from a package counts as its submodule when it is one."""
    tree = ast.parse(path.read_text())
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden |= {id(n) for n in ast.walk(node)}
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in top))
            found += [(f"{node.module}.{a.name}", id(node) in top) for a in node.names]
    return found


def _torch_free() -> list[str]:
    return sorted(m for m in MODULES if not (m == TORCH_TREE or m.startswith(TORCH_TREE + ".")))


def test_the_torch_free_tree_never_imports_the_torch_tree():
    crossings = []
    for mod in _torch_free():
        for name, at_top in _imports(MODULES[mod]):
            into_device = name == TORCH_TREE or name.startswith(TORCH_TREE + ".")
            if into_device and (mod not in JOINS or (at_top and mod != "minisgl.llm")):
                crossings.append(f"{mod} imports {name}")
    assert not crossings, "\n".join(crossings)


def test_the_torch_free_tree_imports_no_torch_at_module_level():
    found = [
        f"{mod} imports {name}"
        for mod in _torch_free()
        if mod != "minisgl.llm"
        for name, at_top in _imports(MODULES[mod])
        if at_top and name.split(".")[0] in TORCH_PACKAGES
    ]
    assert not found, "\n".join(found)


def _graph() -> dict[str, set[str]]:
    return {m: {n for n, _ in _imports(p) if n in MODULES and n != m} for m, p in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    circles.append(sorted(comp))
    return circles


def test_no_import_circles():
    assert _circles(_graph()) == []


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_circle_finder_finds_circles(graph, expected):
    assert _circles(graph) == expected
