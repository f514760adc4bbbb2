"""Arrows point downward only: components never import the CLI, evaluation or reports.

The import graph of ``moelab/**/*.py`` is read with ``ast`` (no module is imported):
module-level and function-level imports both count, except under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "moelab"

#: Lowest first. A package may import its own layer and the ones below, never one above.
#: ``<pkg>`` is ``moelab/__init__.py`` (``__version__``, lazy re-exports).
LAYERS: list[set[str]] = [
    # foundation: no moelab imports beyond each other
    {"errors", "registry", "stats", "events", "routing", "measure", "static_view", "_lazy", "_output", "_resources",
     "<pkg>"},
    # components: the model view, kernels, tasks and everything that acts on a forward pass
    {"adapters", "compat", "kernels", "backends", "models", "tasks", "prompts", "loading", "forward", "timing",
     "trace", "caches", "policies", "predictors"},
    # the hybrid runtime composed from the components: one planner, its executors
    {"hybrid"},
    # the simulator: plans of the hybrid planner on hardware profiles (its online executor is a
    # lazy entry of the hybrid executors registry, a string, so the hybrid package never imports it)
    {"simulate"},
    # what is built on the components: evaluation, plots, reports, training, the demo
    {"evals", "viz", "timeline", "report", "training", "demo", "attribution"},
    # experiments over evaluations (sweeps run evals over models, policies and tasks)
    {"sweeps"},
    # entry points
    {"cli", "__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _unit(parts: tuple[str, ...]) -> str:
    """The package (``caches``) or top-level module (``errors``) a dotted moelab path names."""
    if len(parts) < 2:
        return "<pkg>"
    return parts[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """(line, dotted target) of every moelab import outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "moelab":  # from moelab import evals / __version__
                for a in node.names:
                    yield node.lineno, f"moelab.{a.name}"
            else:
                yield node.lineno, node.module
        stack.extend(ast.iter_child_nodes(node))


def _graph() -> list[tuple[str, int, str, str]]:
    """(file, line, importing unit, imported unit) for every cross-unit moelab import."""
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("").parts
        src = _unit(rel) if rel[-1] != "__init__" or len(rel) > 2 else "<pkg>"
        for line, target in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            parts = tuple(target.split("."))
            if parts[0] != "moelab":
                continue
            dst = _unit(parts)
            if dst not in RANK and len(parts) == 2:  # from moelab import __version__, load, ...
                dst = "<pkg>"
            if dst != src:
                edges.append((str(path.relative_to(ROOT.parent)), line, src, dst))
    return edges


def test_every_unit_has_a_layer():
    units = {_unit(p.relative_to(ROOT.parent).with_suffix("").parts) for p in ROOT.rglob("*.py")}
    units.discard("__init__")
    missing = sorted(u for u in units if u not in RANK)
    assert not missing, f"add these moelab packages/modules to a layer in LAYERS: {missing}"


def test_imports_point_downward_only():
    upward = [
        f"{file}:{line}: {src} (layer {RANK[src]}) imports moelab.{dst} (layer {RANK[dst]})"
        for file, line, src, dst in _graph()
        if RANK.get(dst, 0) > RANK[src]
    ]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def _cycles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_package_imports_another_that_imports_it_back():
    """No cycle between moelab's packages and top-level modules, at any depth: every import,
    module- or function-level, counts (the package root ``<pkg>`` aside: it re-exports lazily)."""
    graph = _graph()
    edges = [(src, dst) for _, _, src, dst in graph if "<pkg>" not in (src, dst)]
    cycles = _cycles(edges)
    where = {(s, d): f"{f}:{line}" for f, line, s, d in graph}
    detail = [
        f"{' <-> '.join(c)}: " + "; ".join(f"{a} -> {b} ({where[(a, b)]})" for a in c for b in c if (a, b) in where)
        for c in cycles
    ]
    assert not cycles, "package cycles:\n" + "\n".join(detail)


def test_the_cycle_finder_finds_cycles_of_any_length():
    assert _cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert _cycles([("a", "b"), ("b", "a"), ("x", "y")]) == [["a", "b"]]
    assert _cycles([("a", "b"), ("b", "c")]) == []


def test_the_checker_sees_function_level_imports_and_skips_type_checking(tmp_path):
    code = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from moelab.cli import main\n"
        "def f():\n    from moelab.evals import evaluate\n    import moelab.report\n"
    )
    found = sorted(t for _, t in _imports(ast.parse(code)))
    assert found == ["moelab.evals", "moelab.report", "typing"]


@pytest.mark.parametrize("top", ["cli", "evals", "report", "demo"])
def test_components_import_no_top_layer(top):
    components = LAYERS[0] | LAYERS[1]
    bad = [f"{f}:{line}" for f, line, src, dst in _graph() if src in components and dst == top]
    assert not bad, f"components import moelab.{top}: {bad}"
