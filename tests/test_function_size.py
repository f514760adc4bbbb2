"""No function grows past ~100 lines or ~8 parameters without saying why.

A function over the limits states its reason in its docstring, in a paragraph starting
``Size:`` (a public entry point's keyword settings, a table read top to bottom, a hot path
where a parameter object per call costs time). ``self``/``cls`` do not count as parameters.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "moelab"
MAX_LINES = 100
MAX_PARAMS = 8


def _oversized(tree: ast.AST):
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            if a.args and a.args[0].arg in ("self", "cls"):
                params -= 1
            lines = n.end_lineno - n.lineno + 1
            if lines > MAX_LINES or params > MAX_PARAMS:
                yield n, lines, params


def test_every_oversized_function_states_why():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        for n, lines, params in _oversized(ast.parse(path.read_text(encoding="utf-8"))):
            doc = ast.get_docstring(n) or ""
            if not any(line.strip().startswith("Size:") for line in doc.splitlines()):
                bad.append(f"{path.relative_to(ROOT.parent)}:{n.lineno} {n.name}: {lines} lines, {params} parameters")
    assert not bad, ("split these functions, or state in their docstring (a paragraph starting 'Size:') why "
                     "they are this long or take this many parameters:\n" + "\n".join(bad))


def test_the_checker_counts_lines_and_parameters_without_self():
    code = ("class A:\n    def m(self, a, b, c, d, e, f, g, h):\n        pass\n"
            "def f(a, b, c, d, e, f, g, h, i):\n    pass\n"
            "def g(*args, **kw):\n" + "    x = 1\n" * 101)
    found = {n.name: (lines, params) for n, lines, params in _oversized(ast.parse(code))}
    assert found == {"f": (2, 9), "g": (102, 2)}
