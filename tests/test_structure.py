"""The shape of ``src/memplan``: no import cycles, no private names across modules, unique class names.

Read from the source with :mod:`ast` (only the ``__all__`` check imports the packages). Imports at
module level and inside functions both count; for the module-level cycle check imports under ``if
TYPE_CHECKING:`` do not (they never run), nor do ``importlib.import_module`` calls built from
variables or f-strings: the CLI registers its command modules with
``import_module(f"memplan.commands.{name}")`` over a literal tuple after ``app`` exists, so their
``from memplan.cli import app`` is not a cycle. (A literal ``import_module("memplan.x")``, or any call
given a module's literal name, such as ``memplan.inputs``' lazy loader, is an import like any other
and counts.)

Between packages the rule is stricter (docs/architecture.md, "Layers"): every import counts, those
under ``TYPE_CHECKING`` too, so a knot cannot hide behind a type annotation or a function-level
import. The top-level packages and modules of memplan form no cycle, and the core ones keep their
layer order: each imports only from layers below its own (``memplan.model`` nothing of the job).

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


def _runtime_nodes(node: ast.AST, *, typing: bool = False) -> Iterator[ast.AST]:
    """Every node below ``node`` (functions included) except the bodies of ``if TYPE_CHECKING:``
    (with ``typing``: every node, those too)."""
    for child in ast.iter_child_nodes(node):
        if not typing and isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield child
        yield from _runtime_nodes(child, typing=typing)


def _package_of(module: str) -> str:
    is_package = module == "memplan" or any(name.startswith(module + ".") for name in MODULES)
    return module if is_package else module.rpartition(".")[0]


#: Calls that take a module's name without importing it: ``importlib.resources`` (a package anchors
#: its data files) and ``logging.getLogger`` (a logger named after its module).
_NOT_IMPORTS = frozenset({"files", "as_file", "read_text", "read_binary", "open_text", "open_binary",
                          "is_resource", "contents", "path", "getLogger"})


def _import_module_target(node: ast.AST) -> str | None:
    """``"memplan.x"`` of ``importlib.import_module("memplan.x")`` or of any call whose first argument
    is the literal name of a memplan module (a lazy loader's ``_lazy("memplan.x", ...)``)."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module")
    arg = node.args[0]
    callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("memplan"):
        lazy = arg.value in MODULES and callee not in _NOT_IMPORTS
        return arg.value if named or lazy else None
    return None


def _imports(module: str, tree: ast.Module | None = None, *, typing: bool = False) -> Iterator[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for each runtime import of a memplan module
    (with ``typing``: also those under ``if TYPE_CHECKING:``)."""
    for node in _runtime_nodes(MODULES[module] if tree is None else tree, typing=typing):
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


def _unit(module: str) -> str:
    """The top-level package or module of memplan that ``module`` belongs to (``memplan.estimate``)."""
    return ".".join(module.split(".")[:2])


def _package_graph(modules: dict[str, ast.Module] | None = None) -> dict[str, dict[str, str]]:
    """Top-level unit -> {unit it imports: where, as ``module:line`` of the first such import}.

    Every import counts: module level, inside functions, under ``TYPE_CHECKING``, lazy by literal name.
    """
    trees = MODULES if modules is None else modules
    graph: dict[str, dict[str, str]] = {_unit(name): {} for name in trees if name != "memplan"}
    for module, tree in trees.items():
        if module == "memplan":
            continue  # the package's face re-exports its parts; it is no layer of its own
        for target, _, line in _imports(module, tree, typing=True):
            if target != "memplan" and _unit(target) != _unit(module):
                graph[_unit(module)].setdefault(_unit(target), f"{module}:{line}")
    return graph


#: The core of memplan, bottom up (docs/architecture.md, "Layers"): a unit imports only from the
#: layers below its own, never from its own layer's other units, a higher layer or a unit not listed.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("memplan.errors",),
    ("memplan.bounds",),
    ("memplan.units", "memplan.categories", "memplan.textfile", "memplan.settings", "memplan.events_binary",
     "memplan.frozen"),
    ("memplan.gpus", "memplan.model", "memplan.events"),
    ("memplan.optimizers", "memplan.tuning", "memplan.alloc"),
    ("memplan.profiles",),
    ("memplan.job",),
    ("memplan.policies", "memplan.peft", "memplan.jobflags"),
    ("memplan.jobcheck", "memplan.jobfile"),
    ("memplan.frameworks",),
    ("memplan.inputs", "memplan.estimate"),
)


def _layer_violations(graph: dict[str, dict[str, str]],
                      layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[tuple[str, str, str]]:
    """(unit, unit it imports, where) for each import of a layered unit that is not from a lower layer."""
    rank = {unit: i for i, layer in enumerate(layers) for unit in layer}
    out = []
    for unit, targets in sorted(graph.items()):
        if unit not in rank:
            continue
        for target, where in sorted(targets.items()):
            if rank.get(target, len(layers)) >= rank[unit]:
                out.append((unit, target, where))
    return out


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


def _synthetic(sources: dict[str, str]) -> dict[str, ast.Module]:
    return {name: ast.parse(text) for name, text in sources.items()}


def test_the_package_graph_sees_hidden_imports() -> None:
    """A knot hidden behind TYPE_CHECKING, a function-level import or a relative import is an edge."""
    graph = _package_graph(_synthetic({
        "memplan.low.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from memplan.high import H\n",
        "memplan.low.b": "def f():\n    from ..mid.c import g\n",
        "memplan.mid.c": "from memplan.low import a\n",
        "memplan.high": "import memplan.low.b\n",
    }))
    assert graph == {"memplan.low": {"memplan.high": "memplan.low.a:3", "memplan.mid": "memplan.low.b:2"},
                     "memplan.mid": {"memplan.low": "memplan.mid.c:1"}, "memplan.high": {"memplan.low": "memplan.high:1"}}
    cycles = _cycles({unit: set(targets) for unit, targets in graph.items()})
    assert cycles == [["memplan.high", "memplan.low", "memplan.mid"]]


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {"memplan.model": {"memplan.errors": "m:1", "memplan.job": "memplan.model.x:7"},
             "memplan.job": {"memplan.model": "j:1"}, "memplan.errors": {}}
    layers = (("memplan.errors",), ("memplan.model",), ("memplan.job",))
    assert _layer_violations(graph, layers) == [("memplan.model", "memplan.job", "memplan.model.x:7")]
    # a unit outside the layers counts as above them all; one of the same layer is refused too
    assert _layer_violations({"memplan.errors": {"memplan.fit": "e:1", "memplan.units": "e:2"}},
                             (("memplan.errors", "memplan.units"),)) == [
        ("memplan.errors", "memplan.fit", "e:1"), ("memplan.errors", "memplan.units", "e:2")]


def test_the_real_package_graph_has_the_known_edges() -> None:
    """Guards the two checks below against passing vacuously."""
    graph = _package_graph()
    assert {"memplan.estimate", "memplan.job", "memplan.profiles", "memplan.frameworks"} <= set(graph)
    assert "memplan.profiles" in graph["memplan.job"]
    assert "memplan.job" in graph["memplan.frameworks"]
    assert "memplan.frameworks" in graph["memplan.inputs"]  # only by lazy loading (by literal name)
    assert "memplan.job" in graph["memplan.peft"]  # only under TYPE_CHECKING


def test_no_package_cycle() -> None:
    """No cycle between memplan's top-level packages and modules, every import counted."""
    assert _cycles({unit: set(targets) for unit, targets in _package_graph().items()}) == []


def test_core_packages_keep_their_layers() -> None:
    """estimate/, frameworks/, job, policies, profiles, model/ ... import only from the layers below;
    model/ imports nothing of the job."""
    graph = _package_graph()
    assert set(LAYERS[-1]) | {unit for layer in LAYERS for unit in layer} <= set(graph)
    assert _layer_violations(graph) == []
    assert "memplan.job" not in graph["memplan.model"]


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


#: ``<x>.name`` compared (``==``, ``in``, ``startswith`` ...) in ``memplan.estimate`` where ``x`` is not an
#: activation term: why (module, ``x`` as written) is allowed. A :class:`~memplan.estimate.terms.Term`'s
#: name is the label the breakdown prints; code that treats a term apart reads its
#: :class:`~memplan.estimate.terms.TermRole` (issue 24: no dispatch on human labels).
NAME_COMPARISONS_ALLOWED = {
    "a model parameter's or linear's name (LoRA targets' .weight, norms, lm_head, the MLP's linears)": {
        ("memplan.estimate.adapter_acts", "adapter.module"),
        ("memplan.estimate.adapter_acts", "a.module"),
        ("memplan.estimate.reserved_tp", "tensor"), ("memplan.estimate.reserved_autocast", "m")},
    "the activation policy's name (none, full, ...)": {("memplan.estimate.compiled", "run.policy")},
    "the precision's name (*-mixed)": {("memplan.estimate.extras", "job.precision")},
    "a dataclass field's name (the *_bytes figures of a stage)": {("memplan.estimate.invariants", "field")},
}
_ALLOWED = frozenset().union(*NAME_COMPARISONS_ALLOWED.values())


def _name_comparisons(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, ``x``) of each comparison of an ``<x>.name`` attribute: an operand of ``==``/``!=``/``in``/
    ``not in``/``is``, or the string that ``startswith``/``endswith`` is called on."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith")):
            operands = [node.func.value]
        else:
            continue
        yield from ((node.lineno, ast.unparse(op.value)) for op in operands
                    if isinstance(op, ast.Attribute) and op.attr == "name")


def test_the_name_rule_sees_every_form() -> None:
    source = ('a = t.name == X\nb = "x" in term.name\nc = t.name not in names\nd = t.name.startswith("r")\n'
              'e = u.name.endswith("n")\nf = {t.name: t}\ng = t.role is R\nh = name.startswith("x")\n')
    assert [x for _, x in _name_comparisons(ast.parse(source))] == ["t", "term", "t", "t", "u"]


def test_estimate_dispatches_terms_by_role_not_name() -> None:
    found = [f"{module}:{line}: {x}.name" for module, tree in MODULES.items() if module.startswith("memplan.estimate")
             for line, x in _name_comparisons(tree) if (module, x) not in _ALLOWED]
    assert not found, ("compare a Term's role (memplan.estimate.terms.TermRole), not its printed name:\n"
                       + "\n".join(found))


def test_every_allowed_name_comparison_exists() -> None:
    seen = {(module, x) for module, tree in MODULES.items() for _, x in _name_comparisons(tree)}
    assert _ALLOWED <= seen
