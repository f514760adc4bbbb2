"""Arrows point downward only: components never import the CLI, evaluation or reports.

The import graph of ``moelab/**/*.py`` is read with ``ast`` (no module is imported):
module-level and function-level imports both count, except under ``if TYPE_CHECKING:``.
Which moelab imports may sit inside a function (only those of heavy modules): the last part,
test_function_level_imports_only_defer_heavy_modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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


# --- where a moelab import may stay inside a function --------------------------------------

#: Third-party packages whose import costs a fresh interpreter 0.25 to 4 s (the figures: the
#: docstring of test_function_level_imports_only_defer_heavy_modules).
HEAVY_ROOTS = {"torch", "transformers", "plotly", "numba", "sklearn", "lm_eval", "ray", "perfetto", "ipywidgets",
               "pandas"}

#: Files owned by another change right now: their function-level imports are not checked yet.
#: The owner moves their light imports to module level and removes the file from this set.
#: (moelab/caches/{_fast,base,policies,simulation}.py and moelab/simulate/bench.py were owned
#: when the rule came in; none of them had a light function-level import, so none is listed.)
PENDING: set[str] = set()

#: (file, moelab.target) -> why the import stays inside a function although its target is light:
#: moving it to module level raises at import time (the two modules import each other).
CYCLE_GUARD: dict[tuple[str, str], str] = {}

#: (file, moelab.target) -> why the import stays inside a function although its target is light:
#: it runs only after the function has checked that an optional capability is in the build.
OPTIONAL: dict[tuple[str, str], str] = {
    ("moelab/report/simulate.py", "moelab.simulate.whatif"): "the section checks that moelab.simulate is in the build first and is drawn 'not available' "
        "otherwise (tests/test_demo.py); at module level its module would fail to import and the "
        "section would vanish from the report",
}


def _scoped_imports(tree: ast.AST):
    """(import node, inside a function?) for every import outside ``if TYPE_CHECKING:`` blocks.

    Imports nested in module-level ``if``/``try``/``with`` blocks and class bodies run when the
    module is imported: they are module level. Only a ``def`` (or ``lambda``) body defers one.
    """
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, in_function = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((n, in_function) for n in node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function
            continue
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _module_files() -> dict[str, Path]:
    """Dotted name -> file of every moelab module (a package is its ``__init__.py``)."""
    files = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _lazy_table(tree: ast.AST) -> dict[str, str]:
    """A package's ``_LAZY`` table (name -> module that defines it), read from its source."""
    for node in getattr(tree, "body", []):
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "_LAZY" and isinstance(node.value, ast.Dict):
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values, strict=True)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


def _with_parents(dotted: str) -> list[str]:
    """``a.b.c`` -> ``[a, a.b, a.b.c]``: importing a module runs every enclosing package first."""
    parts = dotted.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _runs(node: ast.Import | ast.ImportFrom, modules: dict[str, Path], lazy: dict[str, dict[str, str]]):
    """(what the statement names as ``moelab.X``, the modules it runs) for each imported name.

    ``from P import n`` runs ``P``, then ``P.n`` if that is a module, or the module ``P``'s
    ``_LAZY`` table maps ``n`` to. Third-party modules appear as their root (``torch``).
    """
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, set(_with_parents(alias.name))
        return
    if node.level or not node.module:  # moelab has no relative imports
        return
    for alias in node.names:
        ran = set(_with_parents(node.module))
        named = node.module
        if f"{node.module}.{alias.name}" in modules:
            named = f"{node.module}.{alias.name}"
            ran.add(named)
        if alias.name in lazy.get(node.module, {}):
            ran.update(_with_parents(lazy[node.module][alias.name]))
        yield named, ran


def _reachable(edges: dict[str, set[str]], starts: set[str]) -> set[str]:
    """Every node that importing ``starts`` runs (``starts`` included), third-party roots too."""
    seen, todo = set(starts), list(starts)
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _heavy(edges: dict[str, set[str]], ran: set[str]) -> bool:
    """Whether running the modules ``ran`` imports, transitively, one of ``HEAVY_ROOTS``."""
    return any(n.split(".")[0] in HEAVY_ROOTS for n in _reachable(edges, ran))


def _function_level_imports():
    """(file, line, importing module, ``moelab.X`` as named, the modules it runs) of every
    cross-unit moelab import inside a function, and the module-level import graph."""
    modules = _module_files()
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in modules.items()}
    lazy = {name: _lazy_table(tree) for name, tree in trees.items()}
    edges: dict[str, set[str]] = {name: set(_with_parents(name)[:-1]) for name in modules}
    found = []
    for name, tree in trees.items():
        rel = modules[name].relative_to(ROOT.parent)
        src = _unit(tuple(name.split(".")))
        for node, in_function in _scoped_imports(tree):
            for named, ran in _runs(node, modules, lazy):
                if not in_function:
                    edges[name].update(m if m.startswith("moelab") else m.split(".")[0] for m in ran)
                    continue
                parts = tuple(named.split("."))
                if parts[0] != "moelab" or _unit(parts) == src:
                    continue
                found.append((str(rel), node.lineno, name, named, ran))
    return found, edges


def _help_modules() -> set[str]:
    """The moelab modules ``moelab --help`` imports (a fresh interpreter builds the parser)."""
    code = ("import sys, moelab.cli; moelab.cli.build_parser(); "
            "print(' '.join(m for m in sys.modules if m == 'moelab' or m.startswith('moelab.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def _deferrable(edges: dict[str, set[str]], help_path: set[str], module: str, ran: set[str]) -> bool:
    """Whether an import (running the modules ``ran``) may stay inside a function of ``module``:
    its target is heavy, or ``module`` is one that ``moelab --help`` imports (``help_path``) and
    the import would add to what ``moelab --help`` imports."""
    return _heavy(edges, ran) or (module in help_path and not _reachable(edges, ran) <= help_path)


def test_function_level_imports_only_defer_heavy_modules():
    """A moelab import sits at module level, where it shows the dependency graph; it moves
    inside a function only when its target is *heavy*, to keep ``import moelab.<light thing>``
    and ``moelab --help`` fast. This test is the one place that rule lives.

    Heavy: the module imports at module level, transitively (following moelab modules by their
    files; a package import runs its ``__init__.py``, a lazy name its ``_LAZY`` module), one of
    ``HEAVY_ROOTS``. Measured here, ``python -X importtime -c "import X"`` (cumulative):
    ray 3.6 s, torch 2.6 s, sklearn 2.2 s, lm_eval.evaluator 1.4 s, transformers 1.4 s,
    perfetto.trace_processor 0.9 s, pandas 0.79 s (so pandas is heavy), numba 0.42 s,
    ipywidgets 0.24 s, plotly 0.05 s (0.07 s for plotly.graph_objects, but a figure module
    costs 1.1 s); against numpy 0.20 s, tqdm 0.06 s, yaml 0.03 s. A fresh
    ``python -c "import moelab.X"`` (0.04 s for ``pass``) costs 2.7 s for moelab.loading (torch,
    transformers), 2.8 s for moelab.adapters, 0.8 s for moelab.timeline.figure (plotly), 0.6 s for
    moelab.caches.simulation (numba), against 0.05 s for moelab.errors, 0.19 s for moelab.stats
    (numpy) and 0.1–0.4 s for the other light modules (moelab.sweeps.spec, moelab.simulate.whatif).

    ``moelab --help`` (0.26 s) imports every ``moelab.cli`` module, what building the parser
    imports, and what those import at module level (no third-party package at all:
    tests/test_cli_startup.py). In those modules an import also stays in its function when it
    would add a module to that set: numpy alone adds 0.2 s,
    and the dozen light moelab modules the commands use (moelab.demo, moelab.report,
    moelab.prompts, moelab.tasks, moelab.timing.shapes, moelab.measure, ...) added 0.2 s
    (0.30 -> 0.50 s) when the command modules imported them at module level.
    """
    found, edges = _function_level_imports()
    help_path = _reachable(edges, _help_modules())
    bad = []
    for file, line, module, named, ran in found:
        if file in PENDING or (file, named) in CYCLE_GUARD or (file, named) in OPTIONAL:
            continue
        if _deferrable(edges, help_path, module, ran):
            continue
        bad.append(f"{file}:{line}: imports {named} inside a function, but {named} is light (no heavy root): "
                   "import it at module level")
    bad = sorted(set(bad))
    assert not bad, f"{len(bad)} light function-level imports:\n" + "\n".join(bad)


def test_heaviness_follows_module_level_imports_transitively():
    edges = {
        "moelab": {"moelab._lazy"},
        "moelab._lazy": set(),
        "moelab.a": {"moelab", "moelab.b"},  # a -> b -> c -> torch: all three heavy
        "moelab.b": {"moelab", "moelab.c"},
        "moelab.c": {"moelab", "torch", "numpy"},
        "moelab.d": {"moelab", "numpy", "moelab.e"},  # d <-> e: a cycle, no heavy root
        "moelab.e": {"moelab", "moelab.d", "yaml"},
        "moelab.f": {"moelab"},
        "moelab.cli": {"moelab", "moelab.f"},
        "moelab.cli.x": {"moelab", "moelab.cli"},
    }
    assert [m for m in sorted(edges) if _heavy(edges, {m})] == ["moelab.a", "moelab.b", "moelab.c"]
    assert _heavy(edges, {"moelab", "moelab.a"}) and not _heavy(edges, {"moelab", "moelab.d"})
    help_path = _reachable(edges, {"moelab.cli", "moelab.cli.x"})
    assert help_path == {"moelab", "moelab._lazy", "moelab.cli", "moelab.cli.x", "moelab.f"}
    # outside what `moelab --help` imports only a heavy target may be deferred
    deferred = [m for m in sorted(edges) if _deferrable(edges, help_path, "moelab.d", {m})]
    assert deferred == ["moelab.a", "moelab.b", "moelab.c"]
    # inside it also any target that `moelab --help` does not import yet
    assert not _deferrable(edges, help_path, "moelab.cli.x", {"moelab", "moelab.f"})
    assert _deferrable(edges, help_path, "moelab.cli.x", {"moelab", "moelab.e"})
    assert _deferrable(edges, help_path, "moelab.f", {"moelab", "moelab.e"})


def test_the_import_scope_and_lazy_names_are_read_from_the_source():
    code = (
        "from typing import TYPE_CHECKING\n"
        "import moelab.errors\n"
        "try:\n    import torch\nexcept ImportError:\n    torch = None\n"
        "if TYPE_CHECKING:\n    from moelab.cli import main\n"
        "class C:\n    from moelab.stats import mean\n"
        "    def m(self):\n        from moelab.caches import simulate, make_cache\n"
        "def f():\n    from moelab import evals\n"
    )
    tree = ast.parse(code)
    scoped = sorted((n.lineno, inner) for n, inner in _scoped_imports(tree))
    assert scoped == [(1, False), (2, False), (4, False), (10, False), (12, True), (14, True)]
    modules = {"moelab": None, "moelab.caches": None, "moelab.caches.policies": None, "moelab.evals": None}
    lazy = {"moelab.caches": {"simulate": "moelab.caches.simulation", "make_cache": "moelab.caches.policies"}}
    runs = [(named, sorted(ran)) for n, inner in _scoped_imports(tree) if inner for named, ran in _runs(n, modules, lazy)]
    assert sorted(runs) == [
        ("moelab.caches", ["moelab", "moelab.caches", "moelab.caches.policies"]),
        ("moelab.caches", ["moelab", "moelab.caches", "moelab.caches.simulation"]),
        ("moelab.evals", ["moelab", "moelab.evals"]),
    ]
