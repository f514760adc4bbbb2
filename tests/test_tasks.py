"""Synthetic tasks: determinism, disjoint splits, benchmark formats, canonical solutions pass."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from moelab.errors import MoelabError
from moelab.tasks import DEFAULT_SIZES, TASKS, generate, prompt_and_target, split_of
from moelab.tasks.arith import final_answer
from moelab.tasks.pycode import program

KEY = {"arith": "question", "pycode": "prompt"}


def test_tasks_registry_lists_both_tasks():
    assert set(TASKS) == {"arith", "pycode"}


@pytest.mark.parametrize("name", ["arith", "pycode"])
def test_generation_is_deterministic_under_a_seed(name):
    a = generate(name, "train", n=300, seed=7)
    b = generate(name, "train", n=300, seed=7)
    c = generate(name, "train", n=300, seed=8)
    assert a == b
    assert a != c
    assert generate(name, "train", n=100, seed=7) == a[:100]


@pytest.mark.parametrize("name", ["arith", "pycode"])
def test_default_sizes_per_split(name):
    for split in ("validation", "test"):
        assert len(generate(name, split)) == DEFAULT_SIZES[name][split]


@pytest.mark.parametrize("name", ["arith", "pycode"])
def test_splits_never_share_a_question_or_prompt(name):
    keys = {
        split: {ex[KEY[name]] for ex in generate(name, split, n=n, seed=s)}
        for split, n in (("train", 5000), ("validation", 300), ("test", 300))
        for s in (0,)
    }
    for split, ks in keys.items():
        assert all(split_of(k) == split for k in ks)
    assert not keys["train"] & keys["validation"]
    assert not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]
    # other seeds draw new examples of the same split, still disjoint from the others
    other_test = {ex[KEY[name]] for ex in generate(name, "test", n=300, seed=3)}
    assert not other_test & keys["train"]


def test_arith_has_gsm8k_fields_and_correct_annotations():
    for ex in generate("arith", "test"):
        assert set(ex) == {"question", "answer"}
        lines = ex["answer"].split("\n")
        assert re.fullmatch(r"#### \d+", lines[-1])
        assert 2 <= len(lines) - 1 <= 4
        value = None
        for line in lines[:-1]:
            m = re.search(r"<<(\d+)([-+*/])(\d+)=(\d+)>>(\d+)", line)
            assert m, line
            a, op, b, c, shown = m.groups()
            assert int(c) == int(shown) == int(eval(f"{a}{op}{b}"))  # noqa: S307 - our own digits
            assert 0 <= int(c) <= 99
            value = int(c)
        assert final_answer(ex["answer"]) == str(value)
        ctx, target = prompt_and_target("arith", ex)
        assert ctx.startswith("Question: ") and ctx.endswith("\nAnswer:") and target[0] == " "


def test_pycode_has_humaneval_fields():
    exs = generate("pycode", "test")
    assert len({ex["task_id"] for ex in exs}) == len(exs)
    for ex in exs:
        assert list(ex) == ["task_id", "prompt", "canonical_solution", "test", "entry_point"]
        assert f"def {ex['entry_point']}(" in ex["prompt"]
        assert ex["prompt"].endswith('"""\n')
        assert ex["canonical_solution"].startswith("    ")
        assert "def check(candidate):" in ex["test"] and "assert candidate(" in ex["test"]


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_canonical_solution_passes_its_check(split):
    exs = generate("pycode", split, n=400 if split == "train" else None)
    script = "\n".join(f"exec({program(ex)!r}, {{}})" for ex in exs) + "\nprint('ALL_PASSED')\n"
    proc = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ALL_PASSED" in proc.stdout


def test_wrong_solution_fails_its_check():
    ex = generate("pycode", "test", n=1)[0]
    src = program(ex, completion="    return None\n")
    proc = subprocess.run([sys.executable, "-c", src], capture_output=True, timeout=30)
    assert proc.returncode != 0


def test_unknown_task_suggests_a_name():
    with pytest.raises(MoelabError, match="arith"):
        generate("arit", "test")
    with pytest.raises(MoelabError, match="validation"):
        generate("arith", "valid")  # type: ignore[arg-type]
