"""Every ``from minisgl... import name`` (and from tests and benchmarks) names something its
module defines, and so does every ``module.name`` read or set through a module imported that
way, checked from the source: imports inside functions on GPU-only paths never run on a CPU
machine, so a helper moved or renamed breaks them unseen (a CUDA test of fp8 attention imported
a test helper that had moved, and failed only on the GPU; two benchmarks set a constant of the
speculation rule that had become a flag)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("minisgl", "tests", "benchmarks")


def _module_file(root: Path, module: str) -> Path | None:
    path = root.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


@functools.cache
def _names(path: Path) -> frozenset[str]:
    """Names bound at a module's top level (under ``if`` and ``try`` too), and those a lazy
    module-level ``__getattr__`` serves (its ``__all__``)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for stmt in tree.body:
        for node in [stmt] if not isinstance(stmt, (ast.If, ast.Try)) else ast.walk(stmt):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    if "__getattr__" in names:
        for stmt in tree.body:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                names.update(ast.literal_eval(stmt.value))
    return frozenset(names)


def missing_imports(root: Path) -> list[str]:
    """``path:line: module has no name`` for every such import, or attribute of a module
    imported by name, in the sources under ``root``."""
    missing = []
    for path in sorted(p for pkg in (*PACKAGES, "scripts") for p in (root / pkg).rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules: dict[str, tuple[str, Path]] = {}  # local name -> (dotted name, file) of our modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module = _module_file(root, alias.name) if alias.name.split(".")[0] in PACKAGES else None
                    if module is not None and alias.asname:
                        modules[alias.asname] = (alias.name, module)
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if node.module.split(".")[0] not in PACKAGES:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            module = _module_file(root, node.module)
            if module is None:
                missing.append(f"{where}: no module {node.module}")
                continue
            for alias in node.names:
                sub = _module_file(root, f"{node.module}.{alias.name}")
                if alias.name not in _names(module) and sub is None:
                    missing.append(f"{where}: {node.module} has no {alias.name}")
                elif sub is not None and sub.name != "__init__.py":
                    modules[alias.asname or alias.name] = (f"{node.module}.{alias.name}", sub)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                name, module = modules[node.value.id]
                if node.attr not in _names(module):
                    missing.append(f"{path.relative_to(root)}:{node.lineno}: {name} has no {node.attr}")
    return missing


def test_every_import_of_our_modules_names_what_they_define():
    missing = missing_imports(ROOT)
    assert not missing, "\n".join(missing)


def test_the_check_reports_a_moved_helper(tmp_path):
    """An import inside a function of a name its module lacks is reported; bound names (under
    ``if`` too) and submodules are not."""
    (tmp_path / "minisgl" / "sub").mkdir(parents=True)
    for package in ("minisgl", "minisgl/sub"):
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "minisgl" / "helpers.py").write_text("X: int = 1\nif True:\n    def f(): ...\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "from minisgl import sub, helpers\nfrom minisgl.helpers import X, f\n\n\n"
        "def test():\n    from minisgl.helpers import g\n    helpers.X = helpers.Y\n"
    )
    assert missing_imports(tmp_path) == [
        "tests/test_a.py:6: minisgl.helpers has no g",
        "tests/test_a.py:7: minisgl.helpers has no Y",
    ]
