"""The shape of ``src/memplan``: no import cycles, no private names across modules, unique class names.

Read from the source with :mod:`ast` (only the ``__all__`` check imports the packages). Imports at
module level and inside functions both count; imports under ``if TYPE_CHECKING:`` do not (they
never run), nor do ``importlib.import_module`` calls built from variables or f-strings: the CLI
registers its command modules with ``import_module(f"memplan.commands.{name}")`` over a literal
tuple after ``app`` exists, so their ``from memplan.cli import app`` is not a cycle. (A literal
``import_module("memplan.x")`` is an import like any other and counts.)

The command modules share the app through ``memplan.commands.common``, which imports no command,
so ``memplan.cli`` (which imports every command) is in no cycle. Every check is strict.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
CLI = "memplan.cli"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


#: Every module of the package: dotted name -> parsed source.
MODULES: dict[str, ast.Module] = {
    _module_name(path): ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for path in sorted((SRC / "memplan").rglob("*.py"))
}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node`` (functions included) except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield child
        yield from _runtime_nodes(child)


def _package_of(module: str) -> str:
    is_package = module == "memplan" or any(name.startswith(module + ".") for name in MODULES)
    return module if is_package else module.rpartition(".")[0]


def _import_module_target(node: ast.AST) -> str | None:
    """``"memplan.x"`` of ``importlib.import_module("memplan.x")`` (a literal string only)."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module")
    arg = node.args[0]
    if named and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value if arg.value.startswith("memplan") else None
    return None


def _imports(module: str, tree: ast.Module | None = None) -> Iterator[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for each runtime import of a memplan module."""
    for node in _runtime_nodes(MODULES[module] if tree is None else tree):
        dynamic = _import_module_target(node)
        if dynamic is not None:
            yield dynamic, "", node.lineno  # type: ignore[attr-defined]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "memplan":
                    yield alias.name, "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module).split(".")
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            if base.split(".")[0] == "memplan":
                for alias in node.names:
                    yield base, alias.name, node.lineno


def _graph() -> dict[str, set[str]]:
    """module -> the memplan modules it imports.

    ``from a import b`` imports module ``a.b`` when there is one (package ``a`` is then only its
    parent, as for every import, and not counted), else ``a``.
    """
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for module in MODULES:
        for target, name, _ in _imports(module):
            candidate = f"{target}.{name}" if f"{target}.{name}" in MODULES else target
            if candidate in MODULES and candidate != module:
                graph[module].add(candidate)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _private_imports() -> list[tuple[str, int, str, str]]:
    """(importing module, line, source module, name) of every ``_name`` imported from another module."""
    out = []
    for module in MODULES:
        for target, name, line in _imports(module):
            private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
            if private and target != module:
                out.append((module, line, target, name))
    return out


def test_the_walk_sees_the_package() -> None:
    """Guards the checks below against passing vacuously."""
    assert {"memplan", CLI, "memplan.fit.search", "memplan.fit.nofit", "memplan.fit.context"} <= set(MODULES)
    graph = _graph()
    assert "memplan.fit.context" in graph["memplan.fit.nofit"]
    assert "memplan.fit.nofit" in graph["memplan.fit.search"]
    assert "memplan.commands.common" in graph["memplan.commands.fit"]
    # A function-level import is an edge too.
    assert "memplan.report.text" in graph["memplan.commands.estimate"]


def test_imports_are_read_in_every_form() -> None:
    tree = ast.parse(
        "import memplan.a.b\n"
        "from . import c\n"
        "from ..d import e\n"
        "if TYPE_CHECKING:\n"
        "    from memplan.f import G\n"
        "def h():\n"
        "    from memplan.i import _j\n"
        "    importlib.import_module('memplan.k')\n"
        "    for name in ('l', 'm'):\n"
        "        importlib.import_module(f'memplan.{name}')\n"
    )
    assert sorted(_imports("memplan.fit.search", tree)) == [
        ("memplan.a.b", "", 1), ("memplan.d", "e", 3), ("memplan.fit", "c", 2), ("memplan.i", "_j", 7),
        ("memplan.k", "", 8),
    ]


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_no_private_name_imported_across_modules() -> None:
    assert _private_imports() == []


def _top_level_classes(tree: ast.Module) -> Iterator[str]:
    """Classes defined at module level (also inside a module-level ``if``/``try``), not nested ones."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        stmt = pending.pop()
        if isinstance(stmt, ast.ClassDef):
            yield stmt.name
        elif isinstance(stmt, (ast.If, ast.Try)):
            pending += stmt.body + stmt.orelse + getattr(stmt, "finalbody", [])
            pending += [s for handler in getattr(stmt, "handlers", []) for s in handler.body]


def test_public_class_names_are_unique() -> None:
    defined: dict[str, list[str]] = {}
    for module, tree in MODULES.items():
        for name in _top_level_classes(tree):
            if not name.startswith("_"):
                defined.setdefault(name, []).append(module)
    assert {name: where for name, where in defined.items() if len(where) > 1} == {}


@pytest.mark.parametrize("package", ["memplan.alloc", "memplan.ckpt", "memplan.fit", "memplan.report",
                                     "memplan.trace", "memplan.diff", "memplan.watch"])
def test_package_all_names_exist(package: str) -> None:
    """Each subsystem's curated ``__all__`` names what it really exports, once each."""
    if package == "memplan.ckpt":
        pytest.importorskip("torch")
    module = importlib.import_module(package)
    assert len(module.__all__) == len(set(module.__all__))
    assert [name for name in module.__all__ if not hasattr(module, name)] == []
