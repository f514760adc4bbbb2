"""``arith``: multi-step arithmetic word problems in GSM8K's format.

Each example is ``{"question": str, "answer": str}``; the answer is a worked solution,
one line per step with calculator annotations (``12 + 5 = <<12+5=17>>17``), and a
final line ``#### N``. Numbers are small (every operand and intermediate value is an
integer in 0..99) so a tiny model with digit-level tokens can learn them. Four story
templates (collection, groups, shopping, comparison) with 2–4 steps of + - * /.
"""

from __future__ import annotations

import random
from typing import Any

NAMES = (
    "Ava", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jamal",
    "Kira", "Leo", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tara",
    "Umar", "Vera", "Wes", "Yuki", "Zoe",
)  # fmt: skip
ITEMS = (
    "apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "stamps",
    "cards", "coins", "eggs", "flowers", "crayons", "beads", "buttons", "candies",
)  # fmt: skip
CONTAINERS = ("boxes", "bags", "jars", "baskets", "packs", "crates")
GOODS = (
    ("notebook", "notebooks"), ("pen", "pens"), ("toy", "toys"), ("cake", "cakes"),
    ("ticket", "tickets"), ("ball", "balls"), ("shirt", "shirts"), ("plant", "plants"),
)  # fmt: skip

MAX_VALUE = 99


def _fmt(x: int, op: str, y: int, z: int) -> str:
    """``x op y = <<x op y=z>>z`` in GSM8K's annotation style."""
    return f"{x} {op} {y} = <<{x}{op}{y}={z}>>{z}"


def _step(rng: random.Random, x: int, name: str, item: str) -> tuple[str, str, int] | None:
    """One follow-up step on a running count ``x``: (question sentence, answer line, new x)."""
    op = rng.choice("++--*/")
    if op == "+":
        b = rng.randint(1, 30)
        y = x + b
        q = rng.choice(
            (
                f"{name} finds {b} more {item}.",
                f"{name} buys {b} more {item} at the store.",
                f"A friend gives {name} {b} {item}.",
                f"Then {name} gets {b} more {item}.",
            )
        )
        a = f"After getting more, {name} has {_fmt(x, '+', b, y)} {item}."
    elif op == "-":
        if x < 2:
            return None
        b = rng.randint(1, min(30, x - 1))
        y = x - b
        friend = rng.choice(NAMES)
        q = rng.choice(
            (
                f"{name} gives {b} {item} to {friend}.",
                f"{name} loses {b} {item}.",
                f"{name} uses {b} of the {item}.",
                f"Then {name} sells {b} {item}.",
            )
        )
        a = f"After that, {name} has {_fmt(x, '-', b, y)} {item} left."
    elif op == "*":
        k = rng.randint(2, 4)
        y = x * k
        word = {2: "twice", 3: "three times", 4: "four times"}[k]
        q = rng.choice(
            (
                f"Then {name} ends up with {word} as many {item}.",
                f"The number of {item} grows to {word} as many.",
            )
        )
        a = f"Now {name} has {_fmt(x, '*', k, y)} {item}."
    else:
        divisors = [k for k in (2, 3, 4, 5) if x % k == 0 and x // k >= 1]
        if not divisors:
            return None
        k = rng.choice(divisors)
        y = x // k
        q = rng.choice(
            (
                f"{name} splits the {item} equally into {k} piles and keeps one pile.",
                f"{name} shares the {item} equally with friends so that {k} people get the same amount, and keeps one share.",
            )
        )
        a = f"{name} keeps {_fmt(x, '/', k, y)} {item}."
    if y > MAX_VALUE:
        return None
    return q, a, y


def _collection(rng: random.Random) -> dict[str, Any] | None:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    x = rng.randint(5, 40)
    qs, ans = [f"{name} has {x} {item}."], []
    for _ in range(rng.randint(2, 4)):
        s = _step(rng, x, name, item)
        if s is None:
            return None
        qs.append(s[0])
        ans.append(s[1])
        x = s[2]
    qs.append(f"How many {item} does {name} have now?")
    return _pack(qs, ans, x)


def _groups(rng: random.Random) -> dict[str, Any] | None:
    name, item, box = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(CONTAINERS)
    g, p = rng.randint(2, 9), rng.randint(2, 12)
    x = g * p
    if x > MAX_VALUE:
        return None
    qs = [f"{name} has {g} {box} with {p} {item} in each."]
    ans = [f"{name} has {_fmt(g, '*', p, x)} {item} in the {box}."]
    for _ in range(rng.randint(1, 3)):
        s = _step(rng, x, name, item)
        if s is None:
            return None
        qs.append(s[0])
        ans.append(s[1])
        x = s[2]
    qs.append(f"How many {item} does {name} have now?")
    return _pack(qs, ans, x)


def _shopping(rng: random.Random) -> dict[str, Any] | None:
    name = rng.choice(NAMES)
    one, many = rng.choice(GOODS)
    q_, p = rng.randint(2, 6), rng.randint(2, 12)
    cost = q_ * p
    if cost > MAX_VALUE:
        return None
    qs = [f"{name} buys {q_} {many} that cost ${p} each."]
    ans = [f"The {many} cost {_fmt(q_, '*', p, cost)} dollars."]
    total = cost
    steps = rng.randint(2, 4)
    if steps >= 3:
        other_one, _ = rng.choice(GOODS)
        d = rng.randint(1, 20)
        qs.append(f"{name} also buys a {other_one} for ${d}.")
        ans.append(f"In total {name} spends {_fmt(total, '+', d, total + d)} dollars.")
        total += d
    if steps >= 4:
        off = rng.randint(1, min(10, total - 1))
        qs.append(f"The shop gives {name} a discount of ${off}.")
        ans.append(f"After the discount {name} pays {_fmt(total, '-', off, total - off)} dollars.")
        total -= off
    bill = rng.choice([b for b in (20, 40, 50, 60, 80, 90, 99) if b >= total] or [0])
    if bill == 0 or total > MAX_VALUE:
        return None
    qs.append(f"{name} pays with ${bill}. How much change does {name} get?")
    ans.append(f"The change is {_fmt(bill, '-', total, bill - total)} dollars.")
    return _pack(qs, ans, bill - total)


def _comparison(rng: random.Random) -> dict[str, Any] | None:
    a_name, b_name, c_name = rng.sample(NAMES, 3)
    item = rng.choice(ITEMS)
    a = rng.randint(3, 30)
    if rng.random() < 0.5:
        d = rng.randint(1, 20)
        b = a + d
        qs = [f"{a_name} has {a} {item}.", f"{b_name} has {d} more {item} than {a_name}."]
        ans = [f"{b_name} has {_fmt(a, '+', d, b)} {item}."]
    else:
        d = rng.randint(1, a - 1) if a > 1 else 0
        if d == 0:
            return None
        b = a - d
        qs = [f"{a_name} has {a} {item}.", f"{b_name} has {d} fewer {item} than {a_name}."]
        ans = [f"{b_name} has {_fmt(a, '-', d, b)} {item}."]
    steps = rng.randint(2, 3)
    if steps == 3:
        k = rng.randint(2, 4)
        c = b * k
        if c > MAX_VALUE:
            return None
        word = {2: "twice", 3: "three times", 4: "four times"}[k]
        qs.append(f"{c_name} has {word} as many {item} as {b_name}.")
        ans.append(f"{c_name} has {_fmt(b, '*', k, c)} {item}.")
        last, last_name = c, c_name
    else:
        last, last_name = b, b_name
    total = a + last
    if total > MAX_VALUE:
        return None
    qs.append(f"How many {item} do {a_name} and {last_name} have together?")
    ans.append(f"Together they have {_fmt(a, '+', last, total)} {item}.")
    return _pack(qs, ans, total)


def _pack(question_sentences: list[str], answer_lines: list[str], result: int) -> dict[str, Any]:
    return {
        "question": " ".join(question_sentences),
        "answer": "\n".join([*answer_lines, f"#### {result}"]),
    }


TEMPLATES = (_collection, _groups, _shopping, _comparison)


def sample(rng: random.Random) -> dict[str, Any]:
    """One random ``arith`` example (GSM8K fields ``question`` and ``answer``)."""
    while True:
        ex = rng.choice(TEMPLATES)(rng)
        if ex is not None:
            return ex


def final_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K-style answer ('' if there is none)."""
    _, sep, tail = answer.rpartition("####")
    return tail.strip().replace(",", "") if sep else ""
