"""``pycode``: short Python function-completion problems in HumanEval's format.

Each example has ``task_id``, ``prompt`` (signature + docstring with one example),
``canonical_solution`` (the indented body), ``test`` (``def check(candidate)`` with
asserts) and ``entry_point``. Problems come from templated families — arithmetic on
arguments, predicates, string operations, list operations and small loops — with
varied function names, argument names, constants and docstring phrasings. Expected
values in the asserts are computed by a Python reference of each template, and the
test suite executes every canonical solution against its ``check`` in a subprocess.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

INT_ARGS = ("x", "n", "num", "value", "a")
PAIR_ARGS = (("a", "b"), ("x", "y"), ("m", "n"), ("first", "second"))
STR_ARGS = ("s", "text", "word", "string")
LIST_ARGS = ("nums", "numbers", "xs", "values", "items")
WORDS = ("apple", "hello", "python", "banana", "moelab", "expert", "router", "token", "cat", "data")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass
class _Problem:
    name: str
    params: str
    returns: str
    doc: str
    body: str
    fn: Callable[..., Any]
    inputs: list[tuple[Any, ...]]
    imports: str = ""


def _rand_word(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(WORDS)
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 7)))


def _rand_list(rng: random.Random) -> list[int]:
    return [rng.randint(0, 20) for _ in range(rng.randint(1, 6))]


# --- families: each returns a _Problem --------------------------------------------------


def _int_const(rng: random.Random) -> _Problem:
    v = rng.choice(INT_ARGS)
    c = rng.randint(2, 9)
    kind = rng.choice(("add", "sub", "mul", "mod", "floordiv", "affine"))
    if kind == "add":
        name = rng.choice((f"add_{c}", f"plus_{c}", f"increase_by_{c}"))
        doc = rng.choice((f"Return {v} plus {c}.", f"Add {c} to {v} and return the result."))
        body, fn = f"return {v} + {c}", (lambda x: x + c)
    elif kind == "sub":
        name = rng.choice((f"subtract_{c}", f"minus_{c}", f"decrease_by_{c}"))
        doc = rng.choice(
            (f"Return {v} minus {c}.", f"Subtract {c} from {v} and return the result.")
        )
        body, fn = f"return {v} - {c}", (lambda x: x - c)
    elif kind == "mul":
        name = rng.choice((f"times_{c}", f"multiply_by_{c}", f"scale_by_{c}"))
        doc = rng.choice(
            (f"Return {v} multiplied by {c}.", f"Multiply {v} by {c} and return the product.")
        )
        body, fn = f"return {v} * {c}", (lambda x: x * c)
    elif kind == "mod":
        name = rng.choice((f"mod_{c}", f"remainder_{c}"))
        doc = rng.choice(
            (f"Return the remainder of {v} divided by {c}.", f"Return {v} modulo {c}.")
        )
        body, fn = f"return {v} % {c}", (lambda x: x % c)
    elif kind == "floordiv":
        name = rng.choice((f"div_{c}", f"floor_divide_{c}"))
        doc = rng.choice(
            (
                f"Return {v} divided by {c}, rounded down.",
                f"Return the integer division of {v} by {c}.",
            )
        )
        body, fn = f"return {v} // {c}", (lambda x: x // c)
    else:
        b = rng.randint(1, 9)
        name = rng.choice((f"scale_{c}_shift_{b}", f"affine_{c}_{b}"))
        doc = rng.choice((f"Return {v} times {c} plus {b}.", f"Multiply {v} by {c}, then add {b}."))
        body, fn = f"return {v} * {c} + {b}", (lambda x: x * c + b)
    inputs = [(rng.randint(0, 50),) for _ in range(4)]
    return _Problem(name, f"{v}: int", "int", doc, body, fn, inputs)


def _int_pair(rng: random.Random) -> _Problem:
    a, b = rng.choice(PAIR_ARGS)
    kind = rng.choice(("add", "sub", "mul", "max", "min", "absdiff"))
    table = {
        "add": (("add", "sum_two", "add_numbers"), f"Return the sum of {a} and {b}.", f"return {a} + {b}", lambda x, y: x + y),
        "sub": (("subtract", "difference", "sub_numbers"), f"Return {a} minus {b}.", f"return {a} - {b}", lambda x, y: x - y),
        "mul": (("multiply", "product", "mul_numbers"), f"Return the product of {a} and {b}.", f"return {a} * {b}", lambda x, y: x * y),
        "max": (("larger", "max_of_two", "bigger"), f"Return the larger of {a} and {b}.", f"return max({a}, {b})", max),
        "min": (("smaller", "min_of_two", "lesser"), f"Return the smaller of {a} and {b}.", f"return min({a}, {b})", min),
        "absdiff": (("distance", "abs_difference", "gap"), f"Return the absolute difference between {a} and {b}.", f"return abs({a} - {b})", lambda x, y: abs(x - y)),
    }  # fmt: skip
    names, doc, body, fn = table[kind]
    inputs = [(rng.randint(0, 30), rng.randint(0, 30)) for _ in range(4)]
    return _Problem(rng.choice(names), f"{a}: int, {b}: int", "int", doc, body, fn, inputs)


def _predicate(rng: random.Random) -> _Problem:
    v = rng.choice(INT_ARGS)
    c = rng.randint(2, 9)
    kind = rng.choice(("even", "odd", "divisible", "greater", "less"))
    if kind == "even":
        name, doc, body, fn = (
            "is_even",
            f"Return True if {v} is even, else False.",
            f"return {v} % 2 == 0",
            (lambda x: x % 2 == 0),
        )
    elif kind == "odd":
        name, doc, body, fn = (
            "is_odd",
            f"Return True if {v} is odd, else False.",
            f"return {v} % 2 == 1",
            (lambda x: x % 2 == 1),
        )
    elif kind == "divisible":
        name, doc, body, fn = (
            f"divisible_by_{c}",
            f"Return True if {v} is divisible by {c}.",
            f"return {v} % {c} == 0",
            (lambda x: x % c == 0),
        )
    elif kind == "greater":
        name, doc, body, fn = (
            f"greater_than_{c}",
            f"Return True if {v} is greater than {c}.",
            f"return {v} > {c}",
            (lambda x: x > c),
        )
    else:
        name, doc, body, fn = (
            f"less_than_{c}",
            f"Return True if {v} is less than {c}.",
            f"return {v} < {c}",
            (lambda x: x < c),
        )
    inputs = [(rng.randint(0, 20),) for _ in range(5)]
    while len({fn(*args) for args in inputs}) < 2:  # asserts must see both outcomes
        inputs = [(rng.randint(0, 20),) for _ in range(5)]
    return _Problem(name, f"{v}: int", "bool", doc, body, fn, inputs)


def _string(rng: random.Random) -> _Problem:
    v = rng.choice(STR_ARGS)
    c = rng.randint(1, 3)
    ch = rng.choice("aeiost")
    suffix = rng.choice(("ing", "ed", "s", "er", "!", "_x"))
    kind = rng.choice(
        (
            "upper",
            "lower",
            "reverse",
            "suffix",
            "prefix",
            "count",
            "len",
            "head",
            "tail",
            "repeat",
            "first",
        )
    )
    table = {
        "upper": ("to_upper", f"Return {v} in upper case.", f"return {v}.upper()", str.upper, "str"),
        "lower": ("to_lower", f"Return {v} in lower case.", f"return {v}.lower()", str.lower, "str"),
        "reverse": ("reverse_string", f"Return {v} reversed.", f"return {v}[::-1]", lambda s: s[::-1], "str"),
        "suffix": ("add_suffix", f"Return {v} with {suffix!r} appended.", f"return {v} + {suffix!r}", lambda s: s + suffix, "str"),
        "prefix": ("add_prefix", f"Return {v} with {suffix!r} put in front.", f"return {suffix!r} + {v}", lambda s: suffix + s, "str"),
        "count": (f"count_{ch}", f"Return how many times {ch!r} occurs in {v}.", f"return {v}.count({ch!r})", lambda s: s.count(ch), "int"),
        "len": ("string_length", f"Return the number of characters in {v}.", f"return len({v})", len, "int"),
        "head": (f"first_{c}_chars", f"Return the first {c} characters of {v}.", f"return {v}[:{c}]", lambda s: s[:c], "str"),
        "tail": (f"last_{c}_chars", f"Return the last {c} characters of {v}.", f"return {v}[-{c}:]", lambda s: s[-c:], "str"),
        "repeat": (f"repeat_{c + 1}", f"Return {v} repeated {c + 1} times.", f"return {v} * {c + 1}", lambda s: s * (c + 1), "str"),
        "first": ("first_char", f"Return the first character of {v}.", f"return {v}[0]", lambda s: s[0], "str"),
    }  # fmt: skip
    name, doc, body, fn, ret = table[kind]
    inputs = [(_rand_word(rng),) for _ in range(4)]
    if kind in ("upper", "lower"):
        inputs = [
            (w.capitalize() if i % 2 else w.upper() if kind == "lower" else w,)
            for i, (w,) in enumerate(inputs)
        ]
    return _Problem(name, f"{v}: str", ret, doc, body, fn, inputs)


def _list(rng: random.Random) -> _Problem:
    v = rng.choice(LIST_ARGS)
    c = rng.randint(1, 9)
    kind = rng.choice(
        (
            "sum",
            "max",
            "min",
            "len",
            "sorted",
            "rsorted",
            "scale",
            "shift",
            "filter_gt",
            "evens",
            "reverse",
            "last",
        )
    )
    table = {
        "sum": ("list_sum", f"Return the sum of the numbers in {v}.", f"return sum({v})", sum, "int"),
        "max": ("list_max", f"Return the largest number in {v}.", f"return max({v})", max, "int"),
        "min": ("list_min", f"Return the smallest number in {v}.", f"return min({v})", min, "int"),
        "len": ("list_length", f"Return how many numbers are in {v}.", f"return len({v})", len, "int"),
        "sorted": ("sort_ascending", f"Return {v} sorted in increasing order.", f"return sorted({v})", sorted, "List[int]"),
        "rsorted": ("sort_descending", f"Return {v} sorted in decreasing order.", f"return sorted({v}, reverse=True)", lambda xs: sorted(xs, reverse=True), "List[int]"),
        "scale": (f"multiply_all_by_{c}", f"Return a list with every number in {v} multiplied by {c}.", f"return [v * {c} for v in {v}]", lambda xs: [t * c for t in xs], "List[int]"),
        "shift": (f"add_{c}_to_all", f"Return a list with {c} added to every number in {v}.", f"return [v + {c} for v in {v}]", lambda xs: [t + c for t in xs], "List[int]"),
        "filter_gt": (f"keep_greater_than_{c}", f"Return the numbers in {v} that are greater than {c}.", f"return [v for v in {v} if v > {c}]", lambda xs: [t for t in xs if t > c], "List[int]"),
        "evens": ("keep_even", f"Return the even numbers in {v}.", f"return [v for v in {v} if v % 2 == 0]", lambda xs: [t for t in xs if t % 2 == 0], "List[int]"),
        "reverse": ("reverse_list", f"Return {v} in reverse order.", f"return {v}[::-1]", lambda xs: xs[::-1], "List[int]"),
        "last": ("last_item", f"Return the last number in {v}.", f"return {v}[-1]", lambda xs: xs[-1], "int"),
    }  # fmt: skip
    name, doc, body, fn, ret = table[kind]
    body = body.replace("[v ", "[t ").replace(" v in", " t in").replace("if v ", "if t ")
    inputs = [(_rand_list(rng),) for _ in range(4)]
    return _Problem(
        name, f"{v}: List[int]", ret, doc, body, fn, inputs, imports="from typing import List\n\n\n"
    )


def _loop(rng: random.Random) -> _Problem:
    v = rng.choice(LIST_ARGS)
    c = rng.randint(1, 9)
    kind = rng.choice(("sum_gt", "count_gt", "count_even", "sum_squares"))
    if kind == "sum_gt":
        name, doc = (
            f"sum_greater_than_{c}",
            f"Return the sum of the numbers in {v} that are greater than {c}.",
        )
        body = f"total = 0\n    for t in {v}:\n        if t > {c}:\n            total += t\n    return total"
        fn = lambda xs: sum(t for t in xs if t > c)  # noqa: E731
    elif kind == "count_gt":
        name, doc = (
            f"count_greater_than_{c}",
            f"Return how many numbers in {v} are greater than {c}.",
        )
        body = f"count = 0\n    for t in {v}:\n        if t > {c}:\n            count += 1\n    return count"
        fn = lambda xs: sum(1 for t in xs if t > c)  # noqa: E731
    elif kind == "count_even":
        name, doc = "count_even", f"Return how many numbers in {v} are even."
        body = f"count = 0\n    for t in {v}:\n        if t % 2 == 0:\n            count += 1\n    return count"
        fn = lambda xs: sum(1 for t in xs if t % 2 == 0)  # noqa: E731
    else:
        name, doc = "sum_of_squares", f"Return the sum of the squares of the numbers in {v}."
        body = f"total = 0\n    for t in {v}:\n        total += t * t\n    return total"
        fn = lambda xs: sum(t * t for t in xs)  # noqa: E731
    inputs = [(_rand_list(rng),) for _ in range(4)]
    return _Problem(
        name,
        f"{v}: List[int]",
        "int",
        doc,
        body,
        fn,
        inputs,
        imports="from typing import List\n\n\n",
    )


FAMILIES: tuple[Callable[[random.Random], _Problem], ...] = (
    _int_const, _int_pair, _predicate, _string, _list, _loop,
)  # fmt: skip


def _render(p: _Problem) -> dict[str, Any]:
    example_args = p.inputs[0]
    call = f"{p.name}({', '.join(repr(a) for a in example_args)})"
    prompt = (
        f"{p.imports}def {p.name}({p.params}) -> {p.returns}:\n"
        f'    """{p.doc}\n'
        f"    >>> {call}\n"
        f"    {p.fn(*example_args)!r}\n"
        f'    """\n'
    )
    asserts = "".join(
        f"    assert candidate({', '.join(repr(a) for a in args)}) == {p.fn(*args)!r}\n"
        for args in p.inputs
    )
    return {
        "prompt": prompt,
        "canonical_solution": f"    {p.body}\n",
        "test": f"\n\ndef check(candidate):\n{asserts}",
        "entry_point": p.name,
    }


def sample(rng: random.Random) -> dict[str, Any]:
    """One random ``pycode`` problem (HumanEval fields, ``task_id`` added by ``finalize``)."""
    return _render(rng.choice(FAMILIES)(rng))


def finalize(ex: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    """Number the problem: ``task_id = "PyCode/<split>/<index>"`` first, as in HumanEval."""
    return {"task_id": f"PyCode/{split}/{index}", **ex}


def program(ex: dict[str, Any], completion: str | None = None) -> str:
    """The full program HumanEval runs: prompt + completion + test + ``check(entry_point)``.

    ``completion=None`` uses the canonical solution.
    """
    body = ex["canonical_solution"] if completion is None else completion
    return f"{ex['prompt']}{body}\n{ex['test']}\n\ncheck({ex['entry_point']})\n"
