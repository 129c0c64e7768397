"""The import graph of ``fxflops`` follows its data flow (issue 16): no import cycles, and the lower
stages never import the higher ones.

Every ``import`` of an ``fxflops`` module counts, also one inside a function (a real dependency at
run time), except those under ``if TYPE_CHECKING:`` (annotations only). Stages, lowest first:

- ``errors``, ``conventions``: imported by anyone;
- ``rules/``: per-op FLOPs rules, pure functions of shapes: rules and errors only;
- ``capture/``: model + call -> symbolic graph: capture, errors and nothing above it (no rules, no
  program, no meter, not the package root);
- ``analysis/``: the rules applied to a capture's nodes: analysis, capture, rules;
- ``program.py``: the compiled polynomials: the analysis, the binder and what says which calls a
  program serves (``call_keys``, ``situation``), and the views it hands itself to (``report``,
  ``plot``, ``scaling``, which import it only for type annotations);
- the rest builds on them (build, meter, instrument, adapters, integrations, CLI).
"""

from __future__ import annotations

import ast
from pathlib import Path

import fxflops

ROOT = Path(fxflops.__file__).parent
ANYONE = {"fxflops.errors", "fxflops.conventions"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST) -> list[ast.AST]:
    """Import statements outside ``if TYPE_CHECKING:`` blocks."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_there_are_no_import_cycles():
    assert _cycles(import_graph()) == []


def _violations(stage: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    graph = import_graph()
    return {
        name: sorted(t for t in targets if t not in ANYONE and not t.startswith(allowed))
        for name, targets in graph.items()
        if name.startswith(stage) and any(t not in ANYONE and not t.startswith(allowed) for t in targets)
    }


def test_rules_import_only_rules():
    assert _violations("fxflops.rules", ("fxflops.rules",)) == {}


def test_capture_imports_nothing_above_it():
    assert _violations("fxflops.capture", ("fxflops.capture",)) == {}


def test_analysis_imports_only_capture_and_rules():
    assert _violations("fxflops.analysis", ("fxflops.analysis", "fxflops.capture", "fxflops.rules")) == {}


PROGRAM_MAY_IMPORT = (
    "fxflops.analysis", "fxflops.capture", "fxflops.rules", "fxflops.binder", "fxflops.call_keys",
    "fxflops.situation", "fxflops.report", "fxflops.plot", "fxflops.scaling", "fxflops.guards",
)


def test_program_imports_nothing_above_it():
    assert _violations("fxflops.program", PROGRAM_MAY_IMPORT) == {}
    for view in ("fxflops.report", "fxflops.plot", "fxflops.scaling", "fxflops.binder", "fxflops.situation", "fxflops.guards"):
        assert _violations(view, PROGRAM_MAY_IMPORT) == {}, view


def test_the_package_root_exports_only_public_names():
    """``fxflops.<name>`` is a name of ``__all__`` or a submodule, never an import that leaked."""
    import types

    leaked = {
        name for name, value in vars(fxflops).items()
        if not name.startswith("__") and name not in fxflops.__all__ and not isinstance(value, types.ModuleType)
    }
    assert leaked == set()
    assert all(hasattr(fxflops, name) for name in fxflops.__all__)


def _function_lengths(package: Path) -> dict[str, int]:
    found = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[f"{path.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return found


def test_the_analysis_stage_is_small_pieces():
    """No function of the analysis stage over 40 lines; ``program.py`` at most 470 (issue 16)."""
    assert {name: n for name, n in _function_lengths(ROOT / "analysis").items() if n > 40} == {}
    assert len((ROOT / "program.py").read_text().splitlines()) <= 470


def test_the_graph_sees_imports_inside_functions_and_skips_type_only_ones():
    """The walker itself: a lazy import counts, a TYPE_CHECKING one does not."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fxflops.program import Program\n"
        "def f():\n    from fxflops.meter import Meter\n"
    )
    assert sorted(n.module for n in _runtime_imports(tree) if isinstance(n, ast.ImportFrom)) == ["fxflops.meter", "typing"]
